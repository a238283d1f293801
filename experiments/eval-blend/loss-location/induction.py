"""Induction heads of the small pair's target: a random 64-token sequence repeated; a head's score is the attention a
token of the repeat gives the token after its first occurrence (averaged over 4 sequences and the KV head's
queries). Prints the top 8 KV heads.

  python experiments/eval-blend/loss-location/induction.py
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.parse_args()

import torch
from kvbridge.transfer.attention import eager_attention
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
_, target = load_pair("small")
g = torch.Generator().manual_seed(0)
n = 64
seq = torch.randint(100, 20000, (4, n), generator=g)
ids = torch.cat((seq, seq), 1)
with torch.no_grad(), eager_attention(target.model):
    out = target.model(input_ids=ids, output_attentions=True)
att = torch.stack([a.float() for a in out.attentions])  # [L, B, H, T, T]
# induction: query at n+i attends key at i+1 (token after the previous occurrence)
q = torch.arange(n, 2 * n - 1)
k = q - n + 1
score = att[:, :, :, q, k].mean(dim=(1, 3))  # [L, H]
hq = score.shape[1]
grp = hq // target.spec.num_kv_heads
kvscore = score.view(score.shape[0], target.spec.num_kv_heads, grp).mean(-1)
top = kvscore.flatten().topk(8)
for v, i in zip(top.values, top.indices):
    print(f"layer {int(i) // target.spec.num_kv_heads} kv head {int(i) % target.spec.num_kv_heads}: {float(v):.3f}")
