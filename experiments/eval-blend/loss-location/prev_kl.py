"""KL fine-tune of previous-token key maps on top of the shipped adapter (the adapter itself frozen): in layers
LAYERS, keys += sigma_l * [tok_table[id_{t-1}], ..., tok_table[id_{t-NPREV}]] @ W_l (W zero at start), trained by
train-adapter's kl_loss on the teacher windows of exact-tail/tail.sh (exact tail of 19 tokens in every other step);
the maps saved to OUT every 10 steps, read by key_eval.py. LR (environment, default 1e-3): the peak rate.

  LR=5e-3 python experiments/eval-blend/loss-location/prev_kl.py prev.safetensors 200 15-25
"""

import argparse
import math
import os
import random
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", type=Path, help="the maps' file")
parser.add_argument("steps", type=int)
parser.add_argument("layers", nargs="?", default="0-30", help="target layers A-B (B excluded; default 0-30)")
parser.add_argument("maps", nargs="?", default="k", help="k, v or kv: which of the keys and values get maps")
parser.add_argument("nprev", nargs="?", type=int, default=2, help="previous tokens read")
parser.add_argument("--teacher", type=Path,
                    default=Path(__file__).resolve().parents[2] / "out" / "exact-tail" / "tail" / "teacher",
                    help="a teacher cache (default: exact-tail/tail.sh's, experiments/out/exact-tail/tail/teacher)")
args = parser.parse_args()

import torch
from kvbridge.adapters.adapter import map_tokens
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.losses import kl_loss
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.transfer.presets import load_pair
from safetensors.torch import save_file
from torch import nn

torch.set_num_threads(2)
out, steps = args.out, args.steps
lo, hi = map(int, args.layers.split("-"))
which = args.maps
nprev = args.nprev
LR = float(os.environ.get("LR", "1e-3"))
_, target = load_pair("small")
for p in target.model.parameters():
    p.requires_grad_(False)
adapter = load_adapter(next(SHIPPED_FOLDER.glob("*.safetensors"))).with_maps_dtype(torch.float32)
cache = TeacherCache(args.teacher)


class PrevMaps(nn.Module):
    def __init__(self, adapter, sigma):
        super().__init__()
        self.adapter = adapter
        tab = adapter.tok_table.float()
        self.register_buffer("tab", tab / tab.std(0, keepdim=True))
        r = tab.shape[1]
        lt, _, d_t = adapter.wk.shape
        self.layers = list(range(lo, hi))
        self.sigma = sigma  # {"k": [L], "v": [L]}
        self.w = nn.ParameterDict({m: nn.Parameter(torch.zeros(len(self.layers), nprev * r, d_t)) for m in which})

    def feats(self, ids):
        f = []
        for s in range(1, nprev + 1):
            prev = torch.cat((ids[:1].repeat(s), ids[:-s]))
            f.append(self.tab[prev])
        return torch.cat(f, 1)  # [T, nprev*r]

    def delta(self, m, ids):
        f = self.feats(ids)
        d = torch.einsum("tr,lrd->ltd", f, self.w[m]) / math.sqrt(f.shape[1])
        return d * self.sigma[m][self.layers][:, None, None]

    def forward(self, xk, xv, ids):
        with torch.no_grad():
            yk, yv = map_tokens(self.adapter, xk.float(), xv.float(), target_ids=ids)
        ys = {"k": yk, "v": yv}
        for m in which:
            y = ys[m].clone()
            y[self.layers] = y[self.layers] + self.delta(m, ids)
            ys[m] = y
        return ys["k"], ys["v"]


train_idx = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)]
# target K/V std per layer from 20 windows
ks, vs = [], []
for i in train_idx[:20]:
    w = cache.load(i)
    ks.append(w["k"].float())
    vs.append(w["v"].float())
sigma = {"k": torch.cat(ks, 2).std(dim=(1, 2, 3)), "v": torch.cat(vs, 2).std(dim=(1, 2, 3))}
maps = PrevMaps(adapter, sigma)
start_kv = adapter.start_kv.float()
opt = torch.optim.Adam(maps.w.parameters(), lr=1e-3)
rng = random.Random(0)
order = train_idx[:]
rng.shuffle(order)
C = 192
t0 = time.time()
run = 0.0
for it in range(steps):
    lr = LR / 10 + 0.5 * (1 + math.cos(math.pi * it / steps)) * (LR - LR / 10)
    for g in opt.param_groups:
        g["lr"] = lr
    batch = [cache.load(order[(it * 4 + j) % len(order)]) for j in range(4)]
    exact = 19 if it % 2 else 0
    loss = kl_loss(maps, start_kv, batch, target, C, exact)
    opt.zero_grad()
    loss.backward()
    opt.step()
    run = 0.9 * run + 0.1 * loss.item() if it else loss.item()
    if it % 10 == 0 or it == steps - 1:
        print(f"step {it} loss {float(loss):.4f} avg {run:.4f} |w| {sum(float(p.norm()) for p in maps.w.values()):.3f} "
              f"{time.time() - t0:.0f}s", flush=True)
        save_file({m: p.detach().contiguous() for m, p in maps.w.items()}
                  | {"layers": torch.tensor(maps.layers), "nprev": torch.tensor(nprev), "sigma_k": sigma["k"],
                     "sigma_v": sigma["v"]}, str(out))
