"""Can the previous tokens' embeddings predict the keys of the induction heads (layer 18 KV head 2, layer 17 head 1)?
Ridge fits on 20 of the tuning pages build.py cached (100-119), R² on the next 20 (120-139); then recompute:0.1 and
replace on those 20 with ridge-predicted keys put in place of the projected ones (also scaled about their mean, s).

  python experiments/eval-blend/loss-location/prevtok.py 18.2,17.1,18.0
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("heads", nargs="?", default="18.2", help="LAYER.KV_HEAD of the R² rows, comma-separated")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder, pages 100-139 (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages, report, seg_of
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.suffix.reuse import prefill_after

torch.set_num_threads(2)
_, target = load_pair("small")
rope = target.rope
E = target.model.get_input_embeddings().weight.detach().float()
LAY = [(int(x.split(".")[0]), int(x.split(".")[1])) for x in args.heads.split(",")]
docs = []
for _, d in pages(args.pages, 100, 140):
    d["own"] = kvcache.extract(target.model, target.spec, d["ids"]).kv.float()
    docs.append(d)


def feats(d, la, h, which):
    ids = d["ids"]
    T = ids.numel()
    pos = torch.arange(T)
    pk = rope.unrotate(d["kv"][la, 0, h][None].float(), la, pos)[0]  # [T, D]
    prev = torch.cat((ids[:1], ids[:-1]))
    prev2 = torch.cat((ids[:2], ids[:-2]))
    parts = {"proj": pk, "cur": E[ids], "prev": E[prev], "prev2": E[prev2]}
    X = torch.cat([parts[w] for w in which] + [torch.ones(T, 1)], 1)
    Y = rope.unrotate(d["own"][la, 0, h][None], la, pos)[0]
    return X[1:], Y[1:]


def r2(Y, P):
    return float(1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum())


sets = [["proj"], ["proj", "cur"], ["proj", "prev"], ["proj", "cur", "prev"], ["proj", "cur", "prev", "prev2"],
        ["cur", "prev"]]
train, test = docs[:20], docs[20:]
for la, h in LAY:
    base = torch.cat([feats(d, la, h, ["proj"])[1] for d in test])
    bp = torch.cat([feats(d, la, h, ["proj"])[0][:, :-1] for d in test])
    print(f"L{la}h{h} projection as is R2 {r2(base, bp):.3f}")
    for w in sets:
        X = torch.cat([feats(d, la, h, w)[0] for d in train]).double()
        Y = torch.cat([feats(d, la, h, w)[1] for d in train]).double()
        G = X.T @ X
        lam = 1e-2 * G.diagonal().mean()
        W = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), X.T @ Y)
        Xt = torch.cat([feats(d, la, h, w)[0] for d in test]).double()
        Yt = torch.cat([feats(d, la, h, w)[1] for d in test]).double()
        print(f"L{la}h{h} ridge on {'+'.join(w):24s} R2 train {r2(Y, X @ W):.3f} test {r2(Yt, Xt @ W):.3f}", flush=True)


def fitW(la, h, w, which=0):
    """A ridge map of (layer la, KV head h)'s keys (which=0) or values (1) from the features w, fitted on train."""
    def fx(d):
        X, Y = feats(d, la, h, w)
        if which == 1:
            Y = d["own"][la, 1, h][1:]
            X = torch.cat((d["kv"][la, 1, h][1:].float(), X[:, 64:]), 1) if w[0] == "proj" else X
        return X, Y
    X = torch.cat([fx(d)[0] for d in train]).double()
    Y = torch.cat([fx(d)[1] for d in train]).double()
    G = X.T @ X
    lam = 1e-2 * G.diagonal().mean()
    W = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), X.T @ Y).float()
    return lambda d: fx(d)[0] @ W


# recovery with ridge-corrected heads on the test pages
ALL = ["proj", "cur", "prev", "prev2"]
variants = {"rec": [], "ridge_proj_18.2": [((18, 2, 0), ["proj"])],
            "s1.3_18.2+17.1": [((18, 2, 0), ALL, 1.3), ((17, 1, 0), ALL, 1.3)],
            "s1.6_18.2+17.1": [((18, 2, 0), ALL, 1.6), ((17, 1, 0), ALL, 1.6)],
            "s1.3proj_18.2+17.1": [((18, 2, 0), ["proj"], 1.3), ((17, 1, 0), ["proj"], 1.3)],
            "prev_18.2+17.1": [((18, 2, 0), ALL), ((17, 1, 0), ALL)],
            "prev_allK_15-25": [((la, h, 0), ALL) for la in range(15, 25) for h in range(3)],
            "prev_allK": [((la, h, 0), ALL) for la in range(30) for h in range(3)],
            "prev_allKV": [((la, h, wh), ALL) for la in range(30) for h in range(3) for wh in (0, 1)]}
fits = {}
for lst in variants.values():
    for key, w, *_ in lst:
        if (key, tuple(w)) not in fits:
            fits[(key, tuple(w))] = fitW(key[0], key[1], w, key[2])
mus = {(key[0], key[1], w): torch.cat([f(d) for d in train]).mean(0) for (key, w), f in fits.items()
       if key[2] == 0 and key in ((18, 2, 0), (17, 1, 0))}
print("fitted", len(fits), flush=True)
rows = []
for d in test:
    ids, cont = d["ids"], d["cont"]
    T = ids.numel()
    n = T - 1
    k = max(1, round(0.1 * n))
    pos = torch.arange(T)
    row = {"full": d["nll_full"], "none": d["nll_none"]}
    for nm, lst in variants.items():
        kv = d["kv"].clone()
        for (la, h, wh), w, *sc in lst:
            P = fits[((la, h, wh), tuple(w))](d)  # [T-1, D]
            if sc:
                P = mus[(la, h, tuple(w))] + sc[0] * (P - mus[(la, h, tuple(w))])
            if wh == 0:
                full = rope.unrotate(kv[la, 0, h][None].float(), la, pos)[0]
                full[1:] = P
                kv[la, 0, h] = rope.rotate(full[None], la, pos)[0]
            else:
                kv[la, 1, h, 1:] = P
        hd = seg_of(target, kv, ids).slice(0, T - k)
        t = prefill_after(target, hd, ids[T - k:]).kv.float()
        row[nm] = continuation_scores(target, seg_of(target, torch.cat((kv[:, :, :, :T - k], t), 3), ids), cont)[0]
        row[nm + "/replace"] = continuation_scores(target, seg_of(target, kv, ids), cont)[0]
    rows.append(row)
    print(" ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
report(rows, [x for x in rows[0] if x not in ("full", "none")])
