"""recompute:0.1 with the projected head's keys (or values) replaced by the target's own in some layers (or one KV
head of them), on the pages build.py cached.

  python experiments/eval-blend/loss-location/klayers.py 100 140 18-19h2 [VALUE_GROUPS]

Groups: 0-5,5-10 (layers 0-4, 5-9) or 18-19h2 (layer 18, KV head 2), or 18-19h2e0.5 (that head's keys the target's
own plus 0.5 x the projection's error); + joins groups: 18-19h2+17-18h1. VALUE_GROUPS: the same for the values.
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("groups", help="comma-separated groups whose keys are made exact")
parser.add_argument("value_groups", nargs="?", help="comma-separated groups whose values are made exact")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages, recompute_tail, report, seg_of
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
_, target = load_pair("small")
rows = []
V = ["rec"] + [f"K{g}" for g in args.groups.split(",")]
if args.value_groups:
    V += [f"V{g}" for g in args.value_groups.split(",")]
for stem, d in pages(args.pages, args.start, args.end):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1
    k = max(1, round(0.1 * n))
    row = {"full": d["nll_full"], "none": d["nll_none"]}
    own = kvcache.extract(target.model, target.spec, ids).kv.float()

    def rec_over(headkv, kk=k, ids=ids):
        return recompute_tail(target, headkv, ids, kk)

    def sc(x, ids=ids, cont=cont):
        return continuation_scores(target, seg_of(target, x, ids), cont)[0]

    row["rec"] = sc(rec_over(kv))
    for v in V[1:]:
        which = 0 if v[0] == "K" else 1
        x = kv.clone()
        for part in v[1:].split("+"):  # several groups at once: K18-19h2+17-18h1
            spec, _, hd = part.partition("h")
            hd, _, eps = hd.partition("e")
            lo, hi = map(int, spec.split("-"))
            if hd and eps:  # own + eps * (projected - own): the projection's error scaled by eps
                h = int(hd)
                x[lo:hi, which, h] = own[lo:hi, which, h] + float(eps) * (kv[lo:hi, which, h] - own[lo:hi, which, h])
            elif hd:
                x[lo:hi, which, int(hd)] = own[lo:hi, which, int(hd)]
            else:
                x[lo:hi, which] = own[lo:hi, which]
        row[v] = sc(rec_over(x))
    rows.append(row)
    print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + V), flush=True)
report(rows, V)
