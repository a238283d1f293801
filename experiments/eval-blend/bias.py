"""Does attention trust recomputed tokens more than projected ones, profitably? A constant bias added to the
attention scores of every key whose KV is still the projection (not recomputed, not the exact context), in every
layer, while the selected tokens are recomputed and while the continuation is scored; on the pages build.py cached.

  python experiments/eval-blend/bias.py START END VARIANT[,VARIANT...]

Variants: replace[@B], recompute:r[@B] (the last r), blend:r[@B] (transfer.suffix.blend's default attention rule);
@B the bias (0 if absent; negative: less attention to projected keys); @B/L0-L1 applies it only in layers L0..L1-1.
Intervals of the difference are paired against the first variant.
"""

import argparse
import os
import random
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("variants", help="comma-separated variants (above)")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
import torch.nn.functional as F
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer.attention import GROUPED_SDPA, accepts_custom_masks, switched_attention
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.blend import BlendConfig, attention_received, select_tokens
from kvbridge.transfer.suffix.reuse import prefill_after, recompute_selected
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
_, target = load_pair("small")
L = target.spec.num_layers
STATE = {"bias": 0.0, "projected": None, "layers": None}  # projected: [K] bool over key columns (False past it)
BIASED = "kvb_projected_bias"
plain = ALL_ATTENTION_FUNCTIONS[GROUPED_SDPA]  # kvbridge's SDPA: what the model runs on a CPU otherwise


def biased(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """kvbridge's SDPA, plus STATE's bias on the scores of the keys STATE marks projected (in STATE's layers)."""
    proj, bias, layers = STATE["projected"], STATE["bias"], STATE["layers"]
    layer = getattr(module, "layer_idx", 0)
    if proj is None or bias == 0.0 or (layers is not None and layer not in layers):
        return plain(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q, k = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = torch.arange(k)[None, :] <= (k - q + torch.arange(q))[:, None]
        add = torch.zeros(q, k).masked_fill(~allowed, float("-inf"))[None, None]
    elif attention_mask.dtype == torch.bool:
        add = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, float("-inf"))
    else:
        add = attention_mask.float().clone()
    cols = torch.zeros(k, dtype=torch.bool)
    cols[:min(k, proj.numel())] = proj[:k]
    add = add + torch.where(cols, bias, 0.0)[None, None, None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=add.to(query.dtype), scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(BIASED, biased)
ALL_MASK_ATTENTION_FUNCTIONS.register(BIASED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
accepts_custom_masks(BIASED)  # selective recompute's forward passes its own mask through it


def seg_of(kv, ids):
    return KVSegment(kv=kv, token_ids=ids, positions=torch.arange(ids.numel()), model=target.spec.identity,
                     rotated=True)


def run_variant(name, d):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1
    proj = seg_of(kv, ids)
    spec, _, bias = name.partition("@")
    bias, _, lay = bias.partition("/")
    STATE["bias"] = float(bias or 0)
    STATE["layers"] = set(range(*map(int, lay.split("-")))) if lay else None
    kind, _, arg = spec.partition(":")
    projected = torch.ones(n + 1, dtype=torch.bool)
    projected[0] = False
    STATE["projected"] = projected
    if kind == "replace":
        seg = proj
    elif kind == "recompute":
        k = max(1, round(float(arg) * n))
        projected[n + 1 - k:] = False
        head = proj.slice(0, n + 1 - k)
        seg = KVSegment.concat([head, prefill_after(target, head, ids[n + 1 - k:]).to(dtype=head.dtype)])
    elif kind == "blend":  # transfer.suffix.blend's attention rule, its selection pass without the bias
        ctx, placed = proj.slice(0, 1), proj.slice(1, n + 1)
        saved = STATE["bias"]
        STATE["bias"] = 0.0
        config = BlendConfig(fraction=float(arg))
        count = round(config.fraction * placed.num_tokens)
        score = attention_received(target, ctx, placed, config.window, int(config.attention_from * L))
        sel = select_tokens(score, count, config)
        STATE["bias"] = saved
        projected[1 + sel] = False
        seg = KVSegment.concat([ctx, recompute_selected(target, ctx, placed, sel)])
    else:
        raise ValueError(name)
    nll, _ = continuation_scores(target, seg, cont)
    STATE["projected"] = None
    return nll


def rec(rs, nm):
    none, full = sum(r["none"] for r in rs), sum(r["full"] for r in rs)
    return (none - sum(r[nm] for r in rs)) / (none - full)


a, b = args.start, args.end
names = args.variants.split(",")
files = [f for f in sorted(args.pages.glob("*.pt")) if a <= int(f.stem) < b]
rows, t0 = [], time.time()
with switched_attention(target.model, BIASED):
    for f in files:
        d = torch.load(f, weights_only=True)
        rows.append({"full": d["nll_full"], "none": d["nll_none"], **{nm: run_variant(nm, d) for nm in names}})
rng = random.Random(0)
samples = [[rng.choice(rows) for _ in rows] for _ in range(300)]
print(f"{len(rows)} docs [{a},{b}) {time.time() - t0:.0f}s")
for nm in names:
    boot = sorted(rec(s, nm) for s in samples)
    diffs = sorted(rec(s, nm) - rec(s, names[0]) for s in samples)
    print(f"{nm:28s} recovery {rec(rows, nm):.3f} [{boot[7]:.3f}, {boot[292]:.3f}]  vs {names[0]}: "
          f"{rec(rows, nm) - rec(rows, names[0]):+.3f} [{diffs[7]:+.3f}, {diffs[292]:+.3f}]", flush=True)
