"""Can the previous tokens' embeddings predict the keys of the induction heads (layer 18 KV head 2, layer 17 head 1)?
Ridge fits on 20 of the tuning pages build.py cached (100-119), R² on the next 20 (120-139); then recompute:0.1 and
replace on those 20 with ridge-predicted keys put in place of the projected ones (also scaled about their mean, s).
python prevtok.py 18.2,17.1,18.0   (layer.kv_head of the R² rows)"""
import sys, torch
from pathlib import Path
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from common import report
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer import kvcache
from kvbridge.transfer.suffix.reuse import prefill_after
from kvbridge.eval.summaries import continuation_scores
_, target = load_pair("small")
rope = target.rope
E = target.model.get_input_embeddings().weight.detach().float()
LAY = [(int(x.split(".")[0]), int(x.split(".")[1])) for x in (sys.argv[1] if len(sys.argv) > 1 else "18.2").split(",")]
def seg_of(kv, ids):
    return KVSegment(kv=kv, token_ids=ids, positions=torch.arange(ids.numel()), model=target.spec.identity, rotated=True)
docs = []
for f in sorted(Path("/work/exp15/cache").glob("*.pt")):
    if not 100 <= int(f.stem) < 140: continue
    d = torch.load(f, weights_only=True)
    ids, kv = d["ids"], d["kv"]; T = ids.numel(); pos = torch.arange(T)
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    d["own"] = own
    docs.append(d)
def feats(d, l, h, which):
    ids = d["ids"]; T = ids.numel(); pos = torch.arange(T)
    pk = rope.unrotate(d["kv"][l, 0, h][None].float(), l, pos)[0]  # [T, D]
    prev = torch.cat((ids[:1], ids[:-1]))
    prev2 = torch.cat((ids[:2], ids[:-2]))
    parts = {"proj": pk, "cur": E[ids], "prev": E[prev], "prev2": E[prev2]}
    X = torch.cat([parts[w] for w in which] + [torch.ones(T, 1)], 1)
    Y = rope.unrotate(d["own"][l, 0, h][None], l, pos)[0]
    return X[1:], Y[1:]
def r2(Y, P):
    return float(1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum())
sets = [["proj"], ["proj", "cur"], ["proj", "prev"], ["proj", "cur", "prev"], ["proj", "cur", "prev", "prev2"], ["cur", "prev"]]
train, test = docs[:20], docs[20:]
for l, h in LAY:
    base = torch.cat([feats(d, l, h, ["proj"])[1] for d in test]); bp = torch.cat([feats(d, l, h, ["proj"])[0][:, :-1] for d in test])
    print(f"L{l}h{h} projection as is R2 {r2(base, bp):.3f}")
    for w in sets:
        X = torch.cat([feats(d, l, h, w)[0] for d in train]).double(); Y = torch.cat([feats(d, l, h, w)[1] for d in train]).double()
        G = X.T @ X; lam = 1e-2 * G.diagonal().mean()
        W = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), X.T @ Y)
        Xt = torch.cat([feats(d, l, h, w)[0] for d in test]).double(); Yt = torch.cat([feats(d, l, h, w)[1] for d in test]).double()
        print(f"L{l}h{h} ridge on {'+'.join(w):24s} R2 train {r2(Y, X @ W):.3f} test {r2(Yt, Xt @ W):.3f}", flush=True)

# recovery with ridge-corrected heads on the test docs
def fitW(l, h, w, which=0):
    def fx(d):
        X, Y = feats(d, l, h, w)
        if which == 1:
            Y = d["own"][l, 1, h][1:]
            X = torch.cat((d["kv"][l, 1, h][1:].float(), X[:, 64:]), 1) if w[0] == "proj" else X
        return X, Y
    X = torch.cat([fx(d)[0] for d in train]).double(); Y = torch.cat([fx(d)[1] for d in train]).double()
    G = X.T @ X; lam = 1e-2 * G.diagonal().mean()
    W = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), X.T @ Y).float()
    return lambda d: fx(d)[0] @ W
variants = {"rec": [], "ridge_proj_18.2": [((18, 2, 0), ["proj"])], "s1.3_18.2+17.1": [((18, 2, 0), ["proj", "cur", "prev", "prev2"], 1.3), ((17, 1, 0), ["proj", "cur", "prev", "prev2"], 1.3)],
            "s1.6_18.2+17.1": [((18, 2, 0), ["proj", "cur", "prev", "prev2"], 1.6), ((17, 1, 0), ["proj", "cur", "prev", "prev2"], 1.6)],
            "s1.3proj_18.2+17.1": [((18, 2, 0), ["proj"], 1.3), ((17, 1, 0), ["proj"], 1.3)],
            "prev_18.2+17.1": [((18, 2, 0), ["proj", "cur", "prev", "prev2"]), ((17, 1, 0), ["proj", "cur", "prev", "prev2"])],
            "prev_allK_15-25": [((l, h, 0), ["proj", "cur", "prev", "prev2"]) for l in range(15, 25) for h in range(3)],
            "prev_allK": [((l, h, 0), ["proj", "cur", "prev", "prev2"]) for l in range(30) for h in range(3)],
            "prev_allKV": [((l, h, wh), ["proj", "cur", "prev", "prev2"]) for l in range(30) for h in range(3) for wh in (0, 1)]}
fits = {}
for nm, lst in variants.items():
    for key, w, *_ in lst:
        if (key, tuple(w)) not in fits:
            fits[(key, tuple(w))] = fitW(key[0], key[1], w, key[2])
mus = {(key[0], key[1], w): torch.cat([f(d) for d in train]).mean(0) for (key, w), f in fits.items() if key[2] == 0 and key in ((18, 2, 0), (17, 1, 0))}
print("fitted", len(fits), flush=True)
rows = []
for d in test:
    ids, cont = d["ids"], d["cont"]; T = ids.numel(); n = T - 1; k = max(1, round(0.1 * n)); pos = torch.arange(T)
    row = {"full": d["nll_full"], "none": d["nll_none"]}
    for nm, lst in variants.items():
        kv = d["kv"].clone()
        for (l, h, wh), w, *sc in lst:
            P = fits[((l, h, wh), tuple(w))](d)  # [T-1, D]
            if sc: P = mus[(l, h, tuple(w))] + sc[0] * (P - mus[(l, h, tuple(w))])
            if wh == 0:
                full = rope.unrotate(kv[l, 0, h][None].float(), l, pos)[0]; full[1:] = P
                kv[l, 0, h] = rope.rotate(full[None], l, pos)[0]
            else:
                kv[l, 1, h, 1:] = P
        hd = seg_of(kv, ids).slice(0, T - k)
        t = prefill_after(target, hd, ids[T - k:]).kv.float()
        row[nm] = continuation_scores(target, seg_of(torch.cat((kv[:, :, :, :T - k], t), 3), ids), cont)[0]
        row[nm + "/replace"] = continuation_scores(target, seg_of(kv, ids), cont)[0]
    rows.append(row); print(" ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
report(rows, [x for x in rows[0] if x not in ("full", "none")])
