"""Attention matching at the target's induction heads: keys of HEADS get a learned correction
  k' = k_proj + sigma_h * [tok(prev), tok(prev2), k_proj / sigma_h] @ W_h / sqrt(width)   (W zero at start)
trained so that the continuation's own queries (teacher windows of exact-tail/tail.sh, recomputed here) attend over
[projected context, own continuation] as they do over the target's own keys (KL of the attention weights); saved to
OUT every 10 steps, read by key_eval.py. LR (environment, default 5e-3): the peak rate.

  LR=5e-3 python experiments/eval-blend/loss-location/ind_att.py heads.safetensors 150 [17.1+18.2+23.0+23.2]
"""

import argparse
import math
import os
import random
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", type=Path, help="the corrections' file")
parser.add_argument("steps", type=int)
parser.add_argument("heads", nargs="?", default="17.1+18.2+23.0+23.2", help="LAYER.KV_HEAD joined by +")
parser.add_argument("--teacher", type=Path,
                    default=Path(__file__).resolve().parents[2] / "out" / "exact-tail" / "tail" / "teacher",
                    help="a teacher cache with queries (default: experiments/out/exact-tail/tail/teacher)")
args = parser.parse_args()

import torch
from kvbridge.adapters.adapter import map_tokens
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.teacher import TeacherCache, capture_attention, is_heldout
from kvbridge.transfer.presets import load_pair
from safetensors.torch import save_file
from torch import nn

torch.set_num_threads(2)
out, steps = args.out, args.steps
heads = [tuple(map(int, x.split("."))) for x in args.heads.split("+")]
LR = float(os.environ.get("LR", "5e-3"))
_, target = load_pair("small")
for p in target.model.parameters():
    p.requires_grad_(False)
rope = target.rope
adapter = load_adapter(next(SHIPPED_FOLDER.glob("*.safetensors"))).with_maps_dtype(torch.float32)
cache = TeacherCache(args.teacher)
H, D = target.spec.num_kv_heads, target.spec.head_dim
G = target.spec.num_attention_heads // H
tab = adapter.tok_table.float()
tab = tab / tab.std(0, keepdim=True)
r = tab.shape[1]
C = 192


def inputs(ids, kp):  # kp [T, D] projected un-rotated keys of one head
    prev = torch.cat((ids[:1], ids[:-1]))
    prev2 = torch.cat((ids[:2], ids[:-2]))
    return torch.cat((tab[prev], tab[prev2], kp), 1)


train_idx = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)]
ks = torch.cat([cache.load_tensor(i, "k").float() for i in train_idx[:20]], 2)  # [L, H, T, D] rotated
sigma = torch.tensor([float(ks[la, h].std()) for la, h in heads])
W = nn.Parameter(torch.zeros(len(heads), 2 * r + D, D))
opt = torch.optim.Adam([W], lr=LR)
rng = random.Random(1)
order = train_idx[:]
rng.shuffle(order)
scales = None
t0 = time.time()
run = None
for it in range(steps):
    lr = LR / 10 + 0.5 * (1 + math.cos(math.pi * it / steps)) * (LR - LR / 10)
    for g in opt.param_groups:
        g["lr"] = lr
    loss = 0.0
    for j in range(4):
        w = cache.load(order[(it * 4 + j) % len(order)])
        ids = w["ids"]
        T = ids.numel()
        pos = torch.arange(T)
        with torch.no_grad():
            yk, _ = map_tokens(adapter, w["xk"].float(), w["xv"].float(), target_ids=ids)  # [L, T, d_t]
            with capture_attention(target.model) as rec:
                target.model(input_ids=ids[None])
            if scales is None:
                scales = [float(rec[la][0].scaling) for la, _ in heads]
        for n, (la, h) in enumerate(heads):
            kp = yk[la, :, h * D:(h + 1) * D]
            x = inputs(ids, kp / sigma[n])
            k_un = kp + sigma[n] * (x @ W[n]) / math.sqrt(x.shape[1])
            k_rot = rope.rotate(k_un[None], la, pos)[0]  # [T, D]
            own_k = w["k"][la, h].float()
            ctx = torch.zeros(T, 1, dtype=torch.bool)
            ctx[1:1 + C] = True
            k_mix = torch.where(ctx, k_rot, own_k)
            q = rec[la][1][0, h * G:(h + 1) * G, 1 + C:].float()  # [G, N, D] continuation queries
            mask = torch.ones(q.shape[1], T, dtype=torch.bool).tril(diagonal=1 + C)
            lo = (q @ own_k.T * scales[n]).masked_fill(~mask, float("-inf")).log_softmax(-1)
            lm = (q @ k_mix.T * scales[n]).masked_fill(~mask, float("-inf")).log_softmax(-1)
            kl = (lo.exp() * (lo - lm)).masked_fill(~mask, 0).sum(-1).mean()
            loss = loss + kl / (4 * len(heads))
    opt.zero_grad()
    loss.backward()
    opt.step()
    run = loss.item() if run is None else 0.9 * run + 0.1 * loss.item()
    if it % 10 == 0 or it == steps - 1:
        print(f"step {it} loss {loss.item():.4f} avg {run:.4f} |W| {float(W.norm()):.3f} {time.time() - t0:.0f}s",
              flush=True)
        save_file({"W": W.detach().contiguous(), "heads": torch.tensor(heads), "sigma": sigma}, str(out))
