"""recompute:0.1 with the projected head's keys replaced by the target's own in some layers (or one KV head of them).
python klayers.py START END GROUPS   e.g. 0-5,5-10 (layers 0-4, 5-9) or 18-19h2 (layer 18, KV head 2), or
18-19h2e0.5 (that head's keys the target's own plus 0.5 x the projection's error); + joins groups: 18-19h2+17-18h1"""
import sys, torch
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from common import pages, recompute_tail, report, seg_of as _seg_of
from kvbridge.transfer import kvcache
from kvbridge.eval.summaries import continuation_scores
_, target = load_pair("small")
def seg_of(kv, ids): return _seg_of(target, kv, ids)
rows = []; a, b = int(sys.argv[1]), int(sys.argv[2])
groups = sys.argv[3].split(",")
V = ["rec"] + [f"K{g}" for g in groups] + [f"V{g}" for g in sys.argv[4].split(",")] if len(sys.argv) > 4 else ["rec"] + [f"K{g}" for g in groups]
for stem, d in pages(a, b):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1; T = n + 1; k = max(1, round(0.1 * n))
    row = {"full": d["nll_full"], "none": d["nll_none"]}
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    def rec_over(headkv, kk=k): return recompute_tail(target, headkv, ids, kk)
    def sc(x): return continuation_scores(target, seg_of(x, ids), cont)[0]
    row["rec"] = sc(rec_over(kv))
    for v in V[1:]:
        which = 0 if v[0] == "K" else 1
        x = kv.clone()
        for part in v[1:].split("+"):  # several groups at once: K18-19h2+17-18h1
            spec, _, hd = part.partition("h")
            hd, _, eps = hd.partition("e")
            lo, hi = map(int, spec.split("-"))
            if hd and eps:  # own + eps * (projected - own): the projection's error scaled by eps
                x[lo:hi, which, int(hd)] = own[lo:hi, which, int(hd)] + float(eps) * (kv[lo:hi, which, int(hd)] - own[lo:hi, which, int(hd)])
            elif hd: x[lo:hi, which, int(hd)] = own[lo:hi, which, int(hd)]
            else: x[lo:hi, which] = own[lo:hi, which]
        row[v] = sc(rec_over(x))
    rows.append(row)
    print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + V), flush=True)
report(rows, V)
