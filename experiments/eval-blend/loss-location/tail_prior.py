"""Does the induction prior help while the tail is recomputed too (not only while the continuation reads)?
recompute:0.1 on build.py's pages, the continuation read with the shipped (fitted) prior in both; the tail built
without the prior (as eval and blend build it) or with it. Also the probe's prior both ways, for reference.

  python experiments/eval-blend/loss-location/tail_prior.py 100 180
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages, recompute_tail, report
from fit_prior import R, nll
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.suffix.induction import InductionPrior

torch.set_num_threads(2)


def main(folder: Path, a: int, b: int) -> None:
    _, target = load_pair("small")
    priors = {"fitted": InductionPrior.for_model(target), "probe": InductionPrior.probed(target)}
    rows = []
    for stem, d in pages(folder, a, b):
        ids, kv, cont = d["ids"], d["kv"], d["cont"]
        t = ids.numel()
        k = max(1, round(R * (t - 1)))
        head = torch.zeros(t - k, dtype=torch.bool)
        head[1:] = True  # the start token is the target's own
        still = torch.zeros(t, dtype=torch.bool)
        still[1:t - k] = True
        row = {"full": d["nll_full"], "none": d["nll_none"]}
        plain = recompute_tail(target, kv, ids, k)
        for name, prior in priors.items():
            with torch.no_grad():
                with prior.reading(target, ids[:t - k], head):
                    biased = recompute_tail(target, kv, ids, k)
                row[f"rec/{name}"] = float(nll(target, plain, ids, cont, still, prior.terms))
                row[f"rec/{name}+tail"] = float(nll(target, biased, ids, cont, still, prior.terms))
        rows.append(row)
        print(stem, " ".join(f"{n}={v:.1f}" for n, v in row.items()), flush=True)
    report(rows, [n for n in rows[0] if n.startswith("rec/")], ref=lambda name: name.removesuffix("+tail"))


main(args.pages, args.start, args.end)
