"""Dev R² of per-layer maps reading a source basis (adapters.fit.source_basis) of each rank, from the statistics
source_features_r2.py wrote (as run 2026-12-02).

  python experiments/adapter-training/source_basis_r2.py 128,192,256
"""

import argparse
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("ranks", help="comma-separated basis ranks")
parser.add_argument("--stats", type=Path,
                    default=Path(__file__).resolve().parents[1] / "out" / "source-basis" / "stats.safetensors",
                    help="source_features_r2.py's statistics "
                         "(default: experiments/out/source-basis/stats.safetensors)")
args = parser.parse_args()

import torch
from kvbridge.adapters.fit import JointStats, source_basis
from safetensors.torch import load_file

torch.set_num_threads(2)
t0 = time.time()
S = load_file(str(args.stats))
S["n"] = int(S["n"])
js = JointStats.__new__(JointStats)
js.ls, js.d_s, js.lt, js.d_t, js.d_tok = 18, 256, 30, 192, 576
js.n_src = 9216
js.gram = S["G"]
js.cross = S["C"]
js.count = S["n"]
js.yy = S["n"] * (S["Yd"].var(0) + (S["C"][-1] / S["n"]) ** 2)
Xd, Yd = S["Xd"], S["Yd"]
n = S["n"]
LT, HD = 30, 192
sst = ((Yd - Yd.mean(0)) ** 2).sum(0)


def r2(sse):
    """Mean K and V R² over the target layers."""
    return [sum(1 - float(sse[(m * LT + j) * HD:(m * LT + j + 1) * HD].sum()
                          / sst[(m * LT + j) * HD:(m * LT + j + 1) * HD].sum()) for j in range(LT)) / LT
            for m in range(2)]


for r in [int(a) for a in args.ranks.split(",")]:
    B = source_basis(js, r)
    print(f"basis {r} {time.time() - t0:.0f}s", flush=True)
    F = js.gram.shape[0]
    T = torch.zeros(F, r + 577, dtype=torch.float64)
    T[:9216, :r] = B
    T[9216:, r:] = torch.eye(577, dtype=torch.float64)
    g = T.T @ js.gram @ T
    c = T.T @ js.cross
    mu = g[-1, :-1] / n
    ymu = c[-1] / n
    gc = g[:-1, :-1] - n * torch.outer(mu, mu)
    cc = c[:-1] - n * torch.outer(mu, ymu)
    s = gc.diagonal().div(n).clamp_min(1e-12).sqrt()
    gc = gc / s[:, None] / s[None]
    cc = cc / s[:, None]
    x = ((Xd @ T)[:, :-1] - mu) / s
    y = Yd - ymu
    best = None
    for l2 in (1e-4, 1e-3, 1e-2, 1e-1):
        W = torch.linalg.solve(gc + l2 * n * torch.eye(gc.shape[0], dtype=gc.dtype), cc)
        e = ((x @ W - y) ** 2).sum(0)
        best = e if best is None else torch.minimum(best, e)
    k, v = r2(best)
    print(f"rank {r} basis + full emb: K {k:.4f} V {v:.4f} ({time.time() - t0:.0f}s)", flush=True)
