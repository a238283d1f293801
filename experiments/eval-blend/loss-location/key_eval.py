"""Recovery of replace / recompute:0.1 on the pages build.py cached, with key corrections added to the shipped
adapter's projected keys: previous-token key maps of prev_kl.py (tensors k / v, layers, nprev, sigma_k / sigma_v)
or induction-head corrections of ind_att.py (W, heads, sigma). Paired intervals against the shipped adapter alone.

  python experiments/eval-blend/loss-location/key_eval.py 100 140 prev.safetensors,heads.safetensors
"""

import argparse
import math
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("checkpoints", help="comma-separated files of prev_kl.py or ind_att.py")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages, recompute_tail, report, seg_of
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer.presets import load_pair
from safetensors.torch import load_file

torch.set_num_threads(2)
_, target = load_pair("small")
rope = target.rope
adapter = load_adapter(next(SHIPPED_FOLDER.glob("*.safetensors")))
tab = adapter.tok_table.float()
tab = tab / tab.std(0, keepdim=True)
H, D = target.spec.num_kv_heads, target.spec.head_dim


def previous(ids, s):
    return torch.cat((ids[:1].repeat(s), ids[:-s]))


def apply_prev(ck, kv, ids):
    T = ids.numel()
    pos = torch.arange(T)
    nprev = int(ck["nprev"])
    f = torch.cat([tab[previous(ids, s)] for s in range(1, nprev + 1)], 1)
    layers = ck["layers"].tolist()
    for m, idx in (("k", 0), ("v", 1)):
        if m not in ck:
            continue
        d = torch.einsum("tr,lrd->ltd", f, ck[m]) / math.sqrt(f.shape[1]) * ck[f"sigma_{m}"][layers][:, None, None]
        d = d.view(len(layers), T, H, D).transpose(1, 2)  # [l, H, T, D]
        for j, la in enumerate(layers):
            x = kv[la, idx].float()
            if idx == 0:
                u = rope.unrotate(x[None], la, pos)[0]
                u[:, 1:] += d[j, :, 1:]
                kv[la, 0] = rope.rotate(u[None], la, pos)[0]
            else:
                x[:, 1:] += d[j, :, 1:]
                kv[la, 1] = x
    return kv


def apply_heads(ck, kv, ids):
    pos = torch.arange(ids.numel())
    for n, (la, h) in enumerate(ck["heads"].tolist()):
        s = float(ck["sigma"][n])
        kp = rope.unrotate(kv[la, 0, h][None].float(), la, pos)[0]
        x = torch.cat((tab[previous(ids, 1)], tab[previous(ids, 2)], kp / s), 1)
        k2 = kp + s * (x @ ck["W"][n]) / math.sqrt(x.shape[1])
        kv[la, 0, h, 1:] = rope.rotate(k2[None], la, pos)[0][1:]
    return kv


cks = {Path(c).name: load_file(c) for c in args.checkpoints.split(",")}
rows = []
for stem, dd in pages(args.pages, args.start, args.end):
    ids, cont = dd["ids"], dd["cont"]
    k = max(1, round(0.1 * (ids.numel() - 1)))
    row = {"full": dd["nll_full"], "none": dd["nll_none"]}
    for name, ck in [("base", None)] + list(cks.items()):
        kv = dd["kv"] if ck is None else (apply_heads if "W" in ck else apply_prev)(ck, dd["kv"].clone(), ids)
        row[name + "/replace"] = continuation_scores(target, seg_of(target, kv, ids), cont)[0]
        row[name + "/rec"] = continuation_scores(target, seg_of(target, recompute_tail(target, kv, ids, k), ids),
                                                 cont)[0]
    rows.append(row)
    print(stem, " ".join(f"{a}={b:.1f}" for a, b in row.items()), flush=True)
report(rows, [x for x in rows[0] if x not in ("full", "none")], lambda nm: "base/" + nm.split("/")[-1])
