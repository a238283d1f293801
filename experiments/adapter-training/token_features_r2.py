"""Does the target's own token embedding, as an extra input of the per-layer ridge maps, explain more of the
target's K/V than the source features alone? Dev R² per layer, closed form, on the teacher cache of a
`train-adapter --trainer chain` run (its --work folder's teacher/: the shipped adapter's run), the shipped adapter's
layer mix; the R² also in OUT (JSON).

  python experiments/adapter-training/token_features_r2.py 120 --teacher WORK/teacher
"""

import argparse
import json
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("train_windows", type=int, nargs="?", default=120, help="training windows of the fit")
parser.add_argument("--teacher", type=Path, required=True, help="a teacher cache folder (train-adapter's WORK/teacher)")
parser.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "out" / "token-features" / "tok_feat.json",
                    help="R² per layer as JSON (default: experiments/out/token-features/tok_feat.json)")
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
print("emb", E.shape, "dev", len(dev), "train", len(train), flush=True)
lt = 30
variants = {"base": 0, "tok": 1, "tok+prev": 2}


def feats(w):
    ids = w["ids"]
    T = ids.numel()
    use = w["has_text"].nonzero()[:, 0]
    xs = {}
    for m, mix in (("k", ad.mix_k), ("v", ad.mix_v)):
        xs[m] = mix_layers(w["x" + m].float(), ad.layer_map, mix.float())[:, use]  # [L_t, n, 256]
    u = E[ids]
    u = u / u.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    prev = torch.cat([torch.zeros(1, u.shape[1]), u[:-1]])
    keys = target.rope.unrotate_all(w["k"].float(), torch.arange(T))
    ys = {"k": flatten_heads(keys)[:, use], "v": flatten_heads(w["v"].float())[:, use]}
    dup = (w["xk"][0, 1:].float() - w["xk"][0, :-1].float()).abs().sum(-1).eq(0).float().mean().item()
    return xs, u[use], prev[use], ys, dup


def acc(idx):
    S = {}
    dups = []
    for i in idx:
        xs, u, prev, ys, dup = feats(cache.load(i))
        dups.append(dup)
        for v, nv in variants.items():
            for m in "kv":
                parts = [xs[m]]
                if nv >= 1:
                    parts.append(u[None].expand(lt, -1, -1))
                if nv >= 2:
                    parts.append(prev[None].expand(lt, -1, -1))
                parts.append(torch.ones(lt, xs[m].shape[1], 1))
                X = torch.cat(parts, -1).double()
                Y = ys[m].double()
                g = X.transpose(1, 2) @ X
                c = X.transpose(1, 2) @ Y
                yy = (Y * Y).sum((1, 2))
                ys_ = Y.sum(1)
                n = Y.shape[1]
                key = (v, m)
                if key not in S:
                    S[key] = [g, c, yy, ys_, n]
                else:
                    s = S[key]
                    s[0] += g
                    s[1] += c
                    s[2] += yy
                    s[3] += ys_
                    s[4] += n
    return S, sum(dups) / len(dups)


t0 = time.time()
St, dupt = acc(train)
Sd, dupd = acc(dev)
print(f"stats {time.time() - t0:.0f}s; share of target tokens repeating the previous token's source features: "
      f"{dupd:.3f}", flush=True)
out = {}
for key in St:
    g, c, _, _, n = St[key]
    gd, cd, yyd, ysd, nd = Sd[key]
    best = []
    for j in range(lt):
        d = g.shape[1]
        bestr = -9
        for lam in (1e-3, 1e-2, 1e-1, 1, 10):
            reg = torch.eye(d, dtype=torch.float64) * lam * g[j].diagonal().mean()
            reg[-1, -1] = 0
            W = torch.linalg.solve(g[j] + reg, c[j])
            sse = yyd[j] - 2 * (W * cd[j]).sum() + (W * (gd[j] @ W)).sum()
            sst = yyd[j] - (ysd[j] ** 2).sum() / nd
            bestr = max(bestr, float(1 - sse / sst))
        best.append(bestr)
    out[key] = best
    print(key, f"mean dev R2 {sum(best) / lt:.4f}", " ".join(f"{b:.2f}" for b in best), flush=True)
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps({f"{a}/{b}": v for (a, b), v in out.items()}))
