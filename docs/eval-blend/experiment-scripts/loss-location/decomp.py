"""Where recompute:0.1's loss lies, on the tuning pages build.py cached: the recomputed tail against the target's own
tail, the head's keys or values exact, twice the tail.  python decomp.py START END"""
import sys, torch
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from common import pages, recompute_tail, report, seg_of as _seg_of
from kvbridge.transfer import kvcache
from kvbridge.eval.summaries import continuation_scores
_, target = load_pair("small")
def seg_of(kv, ids): return _seg_of(target, kv, ids)
rows = []; a, b = int(sys.argv[1]), int(sys.argv[2])
V = ["replace", "rec", "projhead_owntail", "projhead_owntail_K", "projhead_owntail_V", "rec_headV_own", "rec_headK_own", "rec2x_tail", "projfar_ownmid_rec"]
for stem, d in pages(a, b):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1; T = n + 1; k = max(1, round(0.1 * n))
    row = {"full": d["nll_full"], "none": d["nll_none"], "replace": d["nll_replace"]}
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    def rec_over(headkv, kk=k): return recompute_tail(target, headkv, ids, kk)
    def sc(x): return continuation_scores(target, seg_of(x, ids), cont)[0]
    r = rec_over(kv); row["rec"] = sc(r)
    x = kv.clone(); x[:, :, :, T - k:] = own[:, :, :, T - k:]; row["projhead_owntail"] = sc(x)
    x = r.clone(); x[:, 0, :, T - k:] = own[:, 0, :, T - k:]; row["projhead_owntail_K"] = sc(x)
    x = r.clone(); x[:, 1, :, T - k:] = own[:, 1, :, T - k:]; row["projhead_owntail_V"] = sc(x)
    x = kv.clone(); x[:, 1] = own[:, 1]; row["rec_headV_own"] = sc(rec_over(x))
    x = kv.clone(); x[:, 0] = own[:, 0]; row["rec_headK_own"] = sc(rec_over(x))
    row["rec2x_tail"] = sc(rec_over(kv, 2 * k))
    x = kv.clone(); x[:, :, :, T - 2 * k:] = own[:, :, :, T - 2 * k:]; row["projfar_ownmid_rec"] = sc(rec_over(x))
    rows.append(row)
    print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + V), flush=True)
report(rows, V)
