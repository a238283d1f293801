"""How well do the target's own hidden states after its first m layers (exact, cost m/L of a prefill) predict the
induction heads' keys?  Ridge on 20 tuning pages (100-119), R² on the next 20.  python hidden_keys.py"""
import torch
from pathlib import Path
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer import kvcache
_, target = load_pair("small"); rope = target.rope
MS = [1, 2, 3, 4, 6, 8]
HEADS = [(18, 2), (17, 1), (18, 0), (23, 0)]
docs = []
for f in sorted(Path("/work/exp15/cache").glob("*.pt")):
    if not 100 <= int(f.stem) < 140: continue
    d = torch.load(f, weights_only=True); ids = d["ids"]; T = ids.numel(); pos = torch.arange(T)
    with torch.no_grad():
        out = target.model(input_ids=ids[None], output_hidden_states=True)
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    d["h"] = {m: out.hidden_states[m][0].float() for m in MS}
    d["y"] = {(l, h): rope.unrotate(own[l, 0, h][None], l, pos)[0] for l, h in HEADS}
    d["p"] = {(l, h): rope.unrotate(d["kv"][l, 0, h][None].float(), l, pos)[0] for l, h in HEADS}
    docs.append(d)
train, test = docs[:20], docs[20:]
def r2(Y, P): return float(1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum())
def X(d, m, key, proj):
    h = d["h"][m]; h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    parts = [h] + ([d["p"][key]] if proj else []) + [torch.ones(h.shape[0], 1)]
    return torch.cat(parts, 1)[1:]
for key in HEADS:
    print(f"L{key[0]}h{key[1]}: projection as is R2 {r2(torch.cat([d['y'][key][1:] for d in test]), torch.cat([d['p'][key][1:] for d in test])):.3f}")
    for m in MS:
        for proj in (False, True):
            Xt = torch.cat([X(d, m, key, proj) for d in train]).double(); Yt = torch.cat([d["y"][key][1:] for d in train]).double()
            G = Xt.T @ Xt
            W = torch.linalg.solve(G + 1e-3 * G.diagonal().mean() * torch.eye(G.shape[0], dtype=G.dtype), Xt.T @ Yt)
            Xe = torch.cat([X(d, m, key, proj) for d in test]).double(); Ye = torch.cat([d["y"][key][1:] for d in test]).double()
            print(f"  h_{m}{' + proj' if proj else '       '} R2 train {r2(Yt, Xt @ W):.3f} test {r2(Ye, Xe @ W):.3f}", flush=True)
