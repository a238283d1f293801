"""How much more of the target's K/V would maps explain that read more of the source's KV than one mixed source
layer of the same kind? Dev R² of ridge maps (standardised features, best lambda per layer), one big Gram over all
source layers' K and V plus the target's token embedding; the narrower variants are read from it. Teacher windows:
the cache of exact-tail/tail.sh (train-adapter's WORK/teacher; 22 dev windows). Writes OUT/stats.safetensors (read
by source_basis_r2.py) and OUT/r2_all.json.

  python experiments/adapter-training/source_features_r2.py 400
"""

import argparse
import json
import time
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1]
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("train_windows", type=int, nargs="?", default=400, help="training windows of the statistics")
parser.add_argument("--teacher", type=Path, default=EXPERIMENTS / "out" / "exact-tail" / "tail" / "teacher",
                    help="a teacher cache folder (default: ../eval-blend/exact-tail/tail.sh's, "
                         "experiments/out/exact-tail/tail/teacher)")
parser.add_argument("--out", type=Path, default=EXPERIMENTS / "out" / "source-basis",
                    help="folder of stats.safetensors and r2_all.json (default: experiments/out/source-basis)")
args = parser.parse_args()

import torch
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.pairs import flatten_heads
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.transfer.presets import load_pair
from safetensors.torch import save_file

torch.set_num_threads(2)
source, target = load_pair("small", device="cpu")
ad = load_adapter(SHIPPED_FOLDER / "gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors")
cache = TeacherCache(args.teacher)
dev = [i for i, e in enumerate(cache.entries) if is_heldout(e["doc_id"], 0.08)][:22]
train = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)][:args.train_windows]
E = target.model.get_input_embeddings().weight.detach().float()
LS, DS, LT = 18, 256, 30
F = 2 * LS * DS + E.shape[1] + 1
print("features", F, "dev", len(dev), "train", len(train), flush=True)


def rows(i):
    w = cache.load(i)
    ids = w["ids"]
    T = ids.numel()
    use = w["has_text"].nonzero()[:, 0]
    xk = w["xk"].float()[:, use].permute(1, 0, 2).reshape(len(use), -1)
    xv = w["xv"].float()[:, use].permute(1, 0, 2).reshape(len(use), -1)
    u = E[ids[use]]
    u = u / u.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    X = torch.cat([xk, xv, u, torch.ones(len(use), 1)], 1)
    keys = target.rope.unrotate_all(w["k"].float(), torch.arange(T))
    yk = flatten_heads(keys)[:, use].permute(1, 0, 2).reshape(len(use), -1)
    yv = flatten_heads(w["v"].float())[:, use].permute(1, 0, 2).reshape(len(use), -1)
    return X, torch.cat([yk, yv], 1)  # Y: [n, 2*LT*192], K layers first then V layers


t0 = time.time()
G = torch.zeros(F, F, dtype=torch.float64)
C = None
n = 0
buf = []


def flush():
    global C, n
    X = torch.cat([b[0] for b in buf])
    Y = torch.cat([b[1] for b in buf])
    buf.clear()
    G.add_((X.T @ X).double())
    c = (X.T @ Y).double()
    C = c if C is None else C.add_(c)
    n += X.shape[0]


for j, i in enumerate(train):
    buf.append(rows(i))
    if len(buf) == 8:
        flush()
    if j % 50 == 0:
        print(f"train {j} {time.time() - t0:.0f}s", flush=True)
if buf:
    flush()
Xd, Yd = zip(*[rows(i) for i in dev])
Xd = torch.cat(Xd).double()
Yd = torch.cat(Yd).double()
print(f"stats {time.time() - t0:.0f}s n={n} ndev={Xd.shape[0]}", flush=True)
args.out.mkdir(parents=True, exist_ok=True)
save_file({"G": G, "C": C, "n": torch.tensor(n), "Xd": Xd, "Yd": Yd}, str(args.out / "stats.safetensors"))
mu = G[-1, :-1] / n
ymu = C[-1] / n
Gc = G[:-1, :-1] - n * torch.outer(mu, mu)
Cc = C[:-1] - n * torch.outer(mu, ymu)
sd = Gc.diagonal().div(n).clamp_min(1e-12).sqrt()
keep = Gc.diagonal().div(n) > 1e-10
print("zero-variance features", int((~keep).sum()), flush=True)
Xd0 = Xd[:, :-1] - mu
Yd0 = Yd - ymu
sst = ((Yd - Yd.mean(0)) ** 2).sum(0)  # per output column
HD = 192


def r2_by_map(pred_err_sq):  # [cols] SSE -> (K R2 per layer, V R2 per layer)
    out = []
    for m in range(2):
        r = []
        for j in range(LT):
            sl = slice((m * LT + j) * HD, (m * LT + j + 1) * HD)
            r.append(1 - float(pred_err_sq[sl].sum() / sst[sl].sum()))
        out.append(r)
    return out


LAMS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]


def report(name, sse):
    rk, rv = r2_by_map(sse)
    print(f"{name}: K {sum(rk) / LT:.4f} V {sum(rv) / LT:.4f}  | K " + " ".join(f"{x:.2f}" for x in rk)
          + " | V " + " ".join(f"{x:.2f}" for x in rv), flush=True)
    return {"k": rk, "v": rv}


res = {}
NE = E.shape[1]
off_v = LS * DS
off_e = 2 * LS * DS
emb_idx = list(range(off_e, off_e + NE))
# per-layer variants: A (mixK for K maps, mixV for V maps, + emb), B (mixK + mixV + emb), C (the 3 mapped layers' K
# and V + emb)
sseA = torch.zeros(Yd.shape[1], dtype=torch.float64)
sseB = sseA.clone()
sseC = sseA.clone()
for j in range(LT):
    lm = ad.layer_map[j].tolist()
    mk = ad.mix_k[j].double()
    mv = ad.mix_v[j].double()
    mapped = sorted(set(lm))
    rows_k = sum([list(range(ls * DS, (ls + 1) * DS)) for ls in mapped], [])
    rows_v = sum([list(range(off_v + ls * DS, off_v + (ls + 1) * DS)) for ls in mapped], [])
    idx = torch.tensor(rows_k + rows_v + emb_idx)
    Gs = Gc[idx][:, idx]
    Cs = Cc[idx]
    Xs = Xd0[:, idx]
    nk = len(rows_k)
    Mk = torch.zeros(len(idx), DS, dtype=torch.float64)
    Mv = Mk.clone()
    Me = torch.zeros(len(idx), NE, dtype=torch.float64)
    Me[2 * nk:, :] = torch.eye(NE, dtype=torch.float64)
    for ls, a, b in zip(lm, mk, mv):
        p = mapped.index(ls)
        Mk[p * DS:(p + 1) * DS] += a * torch.eye(DS, dtype=torch.float64)
        Mv[nk + p * DS:nk + (p + 1) * DS] += b * torch.eye(DS, dtype=torch.float64)
    colk = torch.arange(j * HD, (j + 1) * HD)
    colv = torch.arange((LT + j) * HD, (LT + j + 1) * HD)
    for name, M, cols in (("A", torch.cat([Mk, Me], 1), colk), ("A", torch.cat([Mv, Me], 1), colv),
                          ("B", torch.cat([Mk, Mv, Me], 1), torch.cat([colk, colv])),
                          ("C", torch.eye(len(idx), dtype=torch.float64), torch.cat([colk, colv]))):
        g = M.T @ Gs @ M
        c = M.T @ Cs[:, cols]
        s_ = g.diagonal().div(n).clamp_min(1e-12).sqrt()
        g = g / s_[:, None] / s_[None]
        c = c / s_[:, None]
        xd = (Xs @ M) / s_
        best = None
        for lam in LAMS:
            W = torch.linalg.solve(g + lam * n * torch.eye(g.shape[0], dtype=g.dtype), c)
            e = ((xd @ W - Yd0[:, cols]) ** 2).sum(0)
            best = e if best is None else torch.minimum(best, e)
        {"A": sseA, "B": sseB, "C": sseC}[name][cols] = best
    if j % 10 == 0:
        print(f"layer {j} {time.time() - t0:.0f}s", flush=True)
res["A mixed same-kind layer + emb (today's inputs, full emb)"] = report("A", sseA)
res["B mixed K and V + emb"] = report("B", sseB)
res["C the mapped layers' K and V + emb"] = report("C", sseC)
# D: everything; one eigh shared by all outputs
gs = Gc / sd[:, None] / sd[None]
cs = Cc / sd[:, None]
lam_, Q = torch.linalg.eigh(gs)
print(f"eigh {time.time() - t0:.0f}s", flush=True)
QtC = Q.T @ cs
xdq = (Xd0 / sd) @ Q
best = None
for lam in LAMS:
    pred = (xdq / (lam_ + lam * n)) @ QtC
    e = ((pred - Yd0) ** 2).sum(0)
    best = e if best is None else torch.minimum(best, e)
res["D all source layers' K and V + emb"] = report("D", best)
(args.out / "r2_all.json").write_text(json.dumps(res))
print(f"done {time.time() - t0:.0f}s", flush=True)
