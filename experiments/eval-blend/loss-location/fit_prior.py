"""Compare induction priors on build.py's pages: recompute:0.1 and replace, each with no prior, the probed prior and
the given fitted ones (recovery with paired intervals against the probed prior).

The fit itself is library code now: `kvbridge prior fit` (kvbridge/eval/prior_fit.py), which made the shipped
transfer/suffix/priors/smollm2-135m-instruct-q4_1.safetensors (its metadata records the command and the dev NLL
that `kvbridge prior check` reproduces).

  fit_prior.py eval START END [PRIOR.safetensors ...] --pages DIR
"""

import argparse
from pathlib import Path

import torch
from common import pages, recompute_tail, report
from kvbridge.eval.prior_fit import RECOMPUTE as R
from kvbridge.eval.prior_fit import continuation_nll as nll
from kvbridge.eval.prior_fit import initial_terms
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.suffix.induction import InductionPrior

EXPERIMENTS = Path(__file__).resolve().parents[2]
__all__ = ["R", "nll"]  # tail_prior.py reads them from here


def evaluate(pages_folder: Path, a: int, b: int, priors: list[str]) -> None:
    _, target = load_pair("small")
    init = initial_terms(target)
    thetas = {"none": torch.zeros_like(init), "lib": init}
    thetas.update({Path(p).stem: InductionPrior.load(p).terms for p in priors})
    rows = []
    for stem, d in pages(pages_folder, a, b):
        ids, kv, cont = d["ids"], d["kv"], d["cont"]
        t = ids.numel()
        k = max(1, round(R * (t - 1)))
        case = {"rec": (recompute_tail(target, kv, ids, k), ids, cont), "replace": (kv, ids, cont)}
        row = {"full": d["nll_full"], "none": d["nll_none"]}
        for m, (x, i_, c_) in case.items():
            still = torch.zeros(t, dtype=torch.bool)
            still[1:t - k if m == "rec" else t] = True
            for name, th in thetas.items():
                with torch.no_grad():
                    row[f"{m}/{name}"] = float(nll(target, x, i_, c_, still, th))
        rows.append(row)
        print(stem, " ".join(f"{n}={v:.1f}" for n, v in row.items()), flush=True)
    names = [f"{m}/{n}" for m in ("rec", "replace") for n in thetas]
    report(rows, names, ref=lambda name: name.split("/")[0] + "/lib")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("eval", help="recompute:0.1 and replace on build.py's pages with each prior")
    p.add_argument("start", type=int)
    p.add_argument("end", type=int)
    p.add_argument("priors", nargs="*", help="prior files (`kvbridge prior fit`)")
    p.add_argument("--pages", type=Path, default=EXPERIMENTS / "out" / "pages",
                   help="build.py's folder (default: experiments/out/pages)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    evaluate(args.pages, args.start, args.end, args.priors)


if __name__ == "__main__":
    main()
