"""How well do the target's own hidden states after its first m layers (exact, cost m/L of a prefill) predict the
induction heads' keys? Ridge on 20 tuning pages (100-119 of build.py's), R² on the next 20 (120-139).

  python experiments/eval-blend/loss-location/hidden_keys.py
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder, pages 100-139 (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
_, target = load_pair("small")
rope = target.rope
MS = [1, 2, 3, 4, 6, 8]
HEADS = [(18, 2), (17, 1), (18, 0), (23, 0)]
docs = []
for _, d in pages(args.pages, 100, 140):
    ids = d["ids"]
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        out = target.model(input_ids=ids[None], output_hidden_states=True)
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    d["h"] = {m: out.hidden_states[m][0].float() for m in MS}
    d["y"] = {(la, h): rope.unrotate(own[la, 0, h][None], la, pos)[0] for la, h in HEADS}
    d["p"] = {(la, h): rope.unrotate(d["kv"][la, 0, h][None].float(), la, pos)[0] for la, h in HEADS}
    docs.append(d)
train, test = docs[:20], docs[20:]


def r2(Y, P):
    return float(1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum())


def X(d, m, key, proj):
    h = d["h"][m]
    h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    parts = [h] + ([d["p"][key]] if proj else []) + [torch.ones(h.shape[0], 1)]
    return torch.cat(parts, 1)[1:]


for key in HEADS:
    as_is = r2(torch.cat([d["y"][key][1:] for d in test]), torch.cat([d["p"][key][1:] for d in test]))
    print(f"L{key[0]}h{key[1]}: projection as is R2 {as_is:.3f}")
    for m in MS:
        for proj in (False, True):
            Xt = torch.cat([X(d, m, key, proj) for d in train]).double()
            Yt = torch.cat([d["y"][key][1:] for d in train]).double()
            G = Xt.T @ Xt
            W = torch.linalg.solve(G + 1e-3 * G.diagonal().mean() * torch.eye(G.shape[0], dtype=G.dtype), Xt.T @ Yt)
            Xe = torch.cat([X(d, m, key, proj) for d in test]).double()
            Ye = torch.cat([d["y"][key][1:] for d in test]).double()
            print(f"  h_{m}{' + proj' if proj else '       '} R2 train {r2(Yt, Xt @ W):.3f} test {r2(Ye, Xe @ W):.3f}",
                  flush=True)
