"""Supervised (reduced-rank) token basis: from the joint [source, u(576)] ridge, compress the token maps of all
layers and maps to rank r with the input covariance, then refit on [source, u P] and score dev R² (teacher cache of
a `train-adapter --trainer chain` run, the shipped adapter's layer mix); the rank-64 and rank-128 bases in OUT.

  python experiments/adapter-training/token_basis_r2.py 120 --teacher WORK/teacher
"""

import argparse
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("train_windows", type=int, help="training windows of the fit")
parser.add_argument("--teacher", type=Path, required=True, help="a teacher cache folder (train-adapter's WORK/teacher)")
parser.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "out" / "token-features" / "rrr_basis.pt",
                    help="the bases, torch.save (default: experiments/out/token-features/rrr_basis.pt)")
args = parser.parse_args()

import torch
from kvbridge.adapters.adapter import mix_layers
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.pairs import flatten_heads
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
source, target = load_pair("small", device="cpu")
ad = load_adapter(SHIPPED_FOLDER / "gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors")
cache = TeacherCache(args.teacher)
dev = [i for i, e in enumerate(cache.entries) if is_heldout(e["doc_id"], 0.08)]
train = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)][:args.train_windows]
E = target.model.get_input_embeddings().weight.detach().float()
U = E / E.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
lt, ds, du = 30, 256, 576


def acc(idx):
    S = {}
    for i in idx:
        w = cache.load(i)
        ids = w["ids"]
        T = ids.numel()
        use = w["has_text"].nonzero()[:, 0]
        keys = target.rope.unrotate_all(w["k"].float(), torch.arange(T))
        ys = {"k": flatten_heads(keys)[:, use], "v": flatten_heads(w["v"].float())[:, use]}
        u = U[ids][use]
        for m, mix in (("k", ad.mix_k), ("v", ad.mix_v)):
            x = mix_layers(w["x" + m].float(), ad.layer_map, mix.float())[:, use]
            X = torch.cat([x, u[None].expand(lt, -1, -1), torch.ones(lt, x.shape[1], 1)], -1).double()
            Y = ys[m].double()
            st = [X.transpose(1, 2) @ X, X.transpose(1, 2) @ Y, (Y * Y).sum((1, 2)), Y.sum(1), Y.shape[1]]
            if m not in S:
                S[m] = st
            else:
                for q in range(4):
                    S[m][q] += st[q]
                S[m][4] += st[4]
    return S


t0 = time.time()
St = acc(train)
Sd = acc(dev)
print(f"stats {time.time() - t0:.0f}s", flush=True)


def solve(g, c, lam):
    d = g.shape[0]
    reg = torch.eye(d, dtype=torch.float64) * lam * g.diagonal()[:-1].mean()
    reg[-1, -1] = 0
    return torch.linalg.solve(g + reg, c)


def r2(W, gd, cd, yyd, ysd, nd):
    sse = yyd - 2 * (W * cd).sum() + (W * (gd @ W)).sum()
    sst = yyd - (ysd**2).sum() / nd
    return float(1 - sse / sst)


def score(M, name):
    res = {}
    for m in "kv":
        g, c, _, _, _ = St[m]
        gd, cd, yyd, ysd, nd = Sd[m]
        best = []
        for j in range(lt):
            gj, cj = M.T @ g[j] @ M, M.T @ c[j]
            gdj, cdj = M.T @ gd[j] @ M, M.T @ cd[j]
            best.append(max(r2(solve(gj, cj, lam), gdj, cdj, yyd[j], ysd[j], nd) for lam in (1e-3, 1e-2, 1e-1, 1)))
        res[m] = sum(best) / lt
    print(name, f"K {res['k']:.4f} V {res['v']:.4f}", flush=True)


# full fit, token maps W_tok per layer and map, lambda 1e-2
Wt = []
for m in "kv":
    for j in range(lt):
        W = solve(St[m][0][j], St[m][1][j], 1e-2)
        Wt.append(W[ds:ds + du])
Wall = torch.cat(Wt, 1)  # [576, 60*192]
g = St["k"][0][0]
n = St["k"][4]
mu = g[ds:ds + du, -1] / n
cov = g[ds:ds + du, ds:ds + du] / n - torch.outer(mu, mu)
ev, Q = torch.linalg.eigh(cov)
ev = ev.clamp(min=1e-9)
half, ihalf = Q @ torch.diag(ev.sqrt()) @ Q.T, Q @ torch.diag(ev.rsqrt()) @ Q.T
Uu, s, _ = torch.linalg.svd(half @ Wall, full_matrices=False)


def Mof(P):
    r = P.shape[1]
    M = torch.zeros(ds + du + 1, ds + r + 1, dtype=torch.float64)
    M[:ds, :ds] = torch.eye(ds)
    M[ds:ds + du, ds:ds + r] = P
    M[-1, -1] = 1
    return M


score(Mof(torch.zeros(du, 0, dtype=torch.float64)), "base")
score(Mof(torch.eye(du, dtype=torch.float64)), "u576")
for r in (32, 64, 96, 128, 192):
    score(Mof(ihalf @ Uu[:, :r]), f"rrr{r}")
args.out.parent.mkdir(parents=True, exist_ok=True)
torch.save({"P": {r: (ihalf @ Uu[:, :r]).float() for r in (64, 128)}, "mu": mu},
           args.out)
