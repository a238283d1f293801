"""KL fine-tune of previous-token key maps on top of the shipped adapter (the adapter itself frozen): in layers
LAYERS, keys += sigma_l * [tok_table[id_{t-1}], ..., tok_table[id_{t-NPREV}]] @ W_l (W zero at start), trained by
train-adapter's kl_loss on the teacher windows of /work/exp16 (exact tail of 19 tokens in every other step).
LR=5e-3 python prev_kl.py OUT.safetensors STEPS [LAYERS=0-30] [MAPS=k] [NPREV=2]"""
import sys, time, math, random, torch
from pathlib import Path
torch.set_num_threads(2)
from torch import nn
from safetensors.torch import save_file
from kvbridge.transfer.presets import load_pair
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.adapter import map_tokens
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.adapters.trainer import kl_loss
from kvbridge.adapters.shipped import SHIPPED_FOLDER

out, steps = Path(sys.argv[1]), int(sys.argv[2])
lo, hi = map(int, (sys.argv[3] if len(sys.argv) > 3 else "0-30").split("-"))
which = sys.argv[4] if len(sys.argv) > 4 else "k"
nprev = int(sys.argv[5]) if len(sys.argv) > 5 else 2
_, target = load_pair("small")
for p in target.model.parameters(): p.requires_grad_(False)
adapter = load_adapter(next(SHIPPED_FOLDER.glob("*.safetensors"))).with_maps_dtype(torch.float32)
cache = TeacherCache("/work/exp16/work/teacher")

class PrevMaps(nn.Module):
    def __init__(self, adapter, sigma):
        super().__init__()
        self.adapter = adapter
        tab = adapter.tok_table.float()
        self.register_buffer("tab", tab / tab.std(0, keepdim=True))
        r = tab.shape[1]; lt, _, d_t = adapter.wk.shape
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
            y = ys[m].clone(); y[self.layers] = y[self.layers] + self.delta(m, ids); ys[m] = y
        return ys["k"], ys["v"]

train_idx = [i for i, e in enumerate(cache.entries) if not is_heldout(e["doc_id"], 0.08)]
# target K/V std per layer from 20 windows
ks, vs = [], []
for i in train_idx[:20]:
    w = cache.load(i); ks.append(w["k"].float()); vs.append(w["v"].float())
sigma = {"k": torch.cat(ks, 2).std(dim=(1, 2, 3)), "v": torch.cat(vs, 2).std(dim=(1, 2, 3))}
maps = PrevMaps(adapter, sigma)
start_kv = adapter.start_kv.float()
opt = torch.optim.Adam(maps.w.parameters(), lr=1e-3)
rng = random.Random(0); order = train_idx[:]; rng.shuffle(order)
C = 192
t0 = time.time(); run = 0.0
for it in range(steps):
    LR = float(__import__("os").environ.get("LR", "1e-3")); lr = LR / 10 + 0.5 * (1 + math.cos(math.pi * it / steps)) * (LR - LR / 10)
    for g in opt.param_groups: g["lr"] = lr
    batch = [cache.load(order[(it * 4 + j) % len(order)]) for j in range(4)]
    exact = 19 if it % 2 else 0
    loss = kl_loss(maps, start_kv, batch, target, C, exact)
    opt.zero_grad(); loss.backward(); opt.step()
    run = 0.9 * run + 0.1 * loss.item() if it else loss.item()
    if it % 10 == 0 or it == steps - 1:
        print(f"step {it} loss {float(loss):.4f} avg {run:.4f} |w| {sum(float(p.norm()) for p in maps.w.values()):.3f} {time.time()-t0:.0f}s", flush=True)
        save_file({m: p.detach().contiguous() for m, p in maps.w.items()} | {"layers": torch.tensor(maps.layers), "nprev": torch.tensor(nprev), "sigma_k": sigma["k"], "sigma_v": sigma["v"]}, str(out))
