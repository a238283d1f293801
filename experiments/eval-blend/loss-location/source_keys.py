"""R² of the induction heads' keys (target layer 18 KV head 2, layer 17 head 1) from the source's keys and values of
every layer (teacher windows of exact-tail/tail.sh: 200 training windows fit, 40 held-out windows score).

  python experiments/eval-blend/loss-location/source_keys.py
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--teacher", type=Path,
                    default=Path(__file__).resolve().parents[2] / "out" / "exact-tail" / "tail" / "teacher",
                    help="a teacher cache (default: exact-tail/tail.sh's, experiments/out/exact-tail/tail/teacher)")
args = parser.parse_args()

import torch
from kvbridge.adapters.adapter import map_tokens
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
_, target = load_pair("small")
rope = target.rope
adapter = load_adapter(next(SHIPPED_FOLDER.glob("*.safetensors"))).with_maps_dtype(torch.float32)
cache = TeacherCache(args.teacher)
tr = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)][:200]
te = [i for i, e in enumerate(cache.entries) if is_heldout(e["doc_id"], 0.08)][:40]
HEADS = [(18, 2), (17, 1), (18, 0)]
D = target.spec.head_dim
tab = adapter.tok_table.float()
tab = tab / tab.std(0, keepdim=True)


def rows(i):
    w = cache.load(i)
    ids = w["ids"]
    T = ids.numel()
    pos = torch.arange(T)
    keep = w["has_text"] & ~w["start_mask"]
    xk, xv = w["xk"].float(), w["xv"].float()
    yk, _ = map_tokens(adapter, xk, xv, target_ids=ids)
    prev = torch.cat((ids[:1], ids[:-1]))
    prev2 = torch.cat((ids[:2], ids[:-2]))
    src = torch.cat((xk.transpose(0, 1).reshape(T, -1), xv.transpose(0, 1).reshape(T, -1)), 1)  # [T, 2 L_s d_s]
    out = {}
    for la, h in HEADS:
        y = rope.unrotate(w["k"][la, h][None].float(), la, pos)[0]
        out[(la, h)] = (src[keep], torch.cat((tab[ids], tab[prev], tab[prev2]), 1)[keep],
                        yk[la, :, h * D:(h + 1) * D][keep], y[keep])
    return out


def r2(Y, P):
    return float(1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum())


TR = [rows(i) for i in tr]
TE = [rows(i) for i in te]
print("rows", sum(r[HEADS[0]][3].shape[0] for r in TR), flush=True)


def full(R):  # X [N, 2 L_s d_s + 3 r + 3 D], standardised below; Y [N, 3 D]
    X = torch.cat([torch.cat([r[HEADS[0]][0], r[HEADS[0]][1]] + [r[k][2] for k in HEADS], 1) for r in R])
    Y = torch.cat([torch.cat([r[k][3] for k in HEADS], 1) for r in R])
    return X, Y


Xt, Yt = full(TR)
Xe, Ye = full(TE)
mu = Xt.mean(0)
sd = Xt.std(0).clamp(min=1e-6)
Xt = (Xt - mu) / sd
Xe = (Xe - mu) / sd
ym = Yt.mean(0)
G = (Xt.T @ Xt).double()
B = (Xt.T @ (Yt - ym)).double()
ns = TR[0][HEADS[0]][0].shape[1]
nt = TR[0][HEADS[0]][1].shape[1]
for j, key in enumerate(HEADS):
    cols = slice(j * D, (j + 1) * D)
    p0 = ns + nt + j * D
    shipped_r2 = r2(Ye[:, cols], Xe[:, p0:p0 + D] * sd[p0:p0 + D] + mu[p0:p0 + D])
    print(f"L{key[0]}h{key[1]} shipped projection R2 {shipped_r2:.3f}", flush=True)
    sets = {"source K of all layers": list(range(ns // 2)), "source K+V of all layers": list(range(ns)),
            "source K+V + tokens (cur, prev, prev2)": list(range(ns + nt)),
            "shipped projection + tokens (cur, prev, prev2)": list(range(ns, ns + nt)) + list(range(p0, p0 + D)),
            "source K+V + tokens + shipped projection": list(range(ns + nt)) + list(range(p0, p0 + D))}
    for name, idx in sets.items():
        idx = torch.tensor(idx)
        g = G[idx][:, idx]
        b = B[idx][:, cols]
        for lam in (1e-2,):
            W = torch.linalg.solve(g + lam * g.diagonal().mean() * torch.eye(len(idx), dtype=g.dtype), b).float()
            print(f"  {name:48s} lam {lam:g}: R2 train {r2(Yt[:, cols], Xt[:, idx] @ W + ym[cols]):.3f} "
                  f"test {r2(Ye[:, cols], Xe[:, idx] @ W + ym[cols]):.3f}", flush=True)
