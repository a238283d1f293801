"""Where recompute:0.1's loss lies, on the pages build.py cached: the recomputed tail against the target's own
tail, the head's keys or values exact, twice the tail.

  python experiments/eval-blend/loss-location/decomp.py 100 140
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
from common import pages, recompute_tail, report, seg_of
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
_, target = load_pair("small")
rows = []
V = ["replace", "rec", "projhead_owntail", "projhead_owntail_K", "projhead_owntail_V", "rec_headV_own",
     "rec_headK_own", "rec2x_tail", "projfar_ownmid_rec"]
for stem, d in pages(args.pages, args.start, args.end):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1
    T = n + 1
    k = max(1, round(0.1 * n))
    row = {"full": d["nll_full"], "none": d["nll_none"], "replace": d["nll_replace"]}
    own = kvcache.extract(target.model, target.spec, ids).kv.float()

    def rec_over(headkv, kk=k, ids=ids):
        return recompute_tail(target, headkv, ids, kk)

    def sc(x, ids=ids, cont=cont):
        return continuation_scores(target, seg_of(target, x, ids), cont)[0]

    r = rec_over(kv)
    row["rec"] = sc(r)
    x = kv.clone()
    x[:, :, :, T - k:] = own[:, :, :, T - k:]
    row["projhead_owntail"] = sc(x)
    x = r.clone()
    x[:, 0, :, T - k:] = own[:, 0, :, T - k:]
    row["projhead_owntail_K"] = sc(x)
    x = r.clone()
    x[:, 1, :, T - k:] = own[:, 1, :, T - k:]
    row["projhead_owntail_V"] = sc(x)
    x = kv.clone()
    x[:, 1] = own[:, 1]
    row["rec_headV_own"] = sc(rec_over(x))
    x = kv.clone()
    x[:, 0] = own[:, 0]
    row["rec_headK_own"] = sc(rec_over(x))
    row["rec2x_tail"] = sc(rec_over(kv, 2 * k))
    x = kv.clone()
    x[:, :, :, T - 2 * k:] = own[:, :, :, T - 2 * k:]
    row["projfar_ownmid_rec"] = sc(rec_over(x))
    rows.append(row)
    print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + V), flush=True)
report(rows, V)
