"""Does attention trust recomputed tokens more than projected ones, profitably? A constant bias added to the
attention scores of every key whose KV is still the projection (not recomputed, not the exact context), in every
layer, while the selected tokens are recomputed and while the continuation is scored.
python bias.py START END VARIANT[,VARIANT...] on the documents build.py cached. Variants: replace[@B],
recompute:r[@B] (the last r), blend:r[@B] (transfer.suffix.blend's default attention rule); @B the bias (0 if absent;
negative: less attention to projected keys); @B/L0-L1 applies it only in layers L0..L1-1."""
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

torch.set_num_threads(int(__import__("os").environ.get("THREADS", "2")))
from kvbridge.eval.summaries import continuation_scores  # noqa: E402
from kvbridge.transfer import models as kv_models  # noqa: E402
from kvbridge.transfer.presets import load_pair  # noqa: E402
from kvbridge.transfer.segment import KVSegment  # noqa: E402
from kvbridge.transfer.suffix.blend import BlendConfig, blend  # noqa: E402
from kvbridge.transfer.suffix.reuse import prefill_after  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

_, target = load_pair("small")
L = target.spec.num_layers
STATE = {"bias": 0.0, "projected": None, "layers": None}  # projected: [K] bool over key columns (False past it)
plain = kv_models._grouped_sdpa


def biased(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
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


ALL_ATTENTION_FUNCTIONS.register(kv_models.GROUPED_SDPA, biased)


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
    elif kind == "blend":
        ctx, placed = proj.slice(0, 1), proj.slice(1, n + 1)
        saved = STATE["bias"]
        STATE["bias"] = 0.0  # the selection pass as blend runs it
        config = BlendConfig(fraction=float(arg))
        from kvbridge.transfer.suffix import blend as blend_module
        t = placed.num_tokens
        count = round(config.fraction * t)
        score = blend_module.attention_received(target, ctx, placed, config.window,
                                                int(config.attention_from * L))
        sel = blend_module.select_tokens(score, count, config)
        STATE["bias"] = saved
        projected[1 + sel] = False
        seg = KVSegment.concat([ctx, blend_module.recompute_selected(target, ctx, placed, sel)])
    else:
        raise ValueError(name)
    nll, _ = continuation_scores(target, seg, cont)
    STATE["projected"] = None
    return nll


if __name__ == "__main__":
    assert blend  # the module's rule is what blend:r runs
    a, b = int(sys.argv[1]), int(sys.argv[2])
    names = sys.argv[3].split(",")
    files = [f for f in sorted(Path("/work/exp15/cache").glob("*.pt")) if a <= int(f.stem) < b]
    rows, t0 = [], time.time()
    for f in files:
        d = torch.load(f, weights_only=True)
        rows.append({"full": d["nll_full"], "none": d["nll_none"], **{nm: run_variant(nm, d) for nm in names}})

    def rec(rs, nm):
        none, full = sum(r["none"] for r in rs), sum(r["full"] for r in rs)
        return (none - sum(r[nm] for r in rs)) / (none - full)

    rng = random.Random(0)
    samples = [[rng.choice(rows) for _ in rows] for _ in range(300)]
    print(f"{len(rows)} docs [{a},{b}) {time.time() - t0:.0f}s")
    for nm in names:
        boot = sorted(rec(s, nm) for s in samples)
        diffs = sorted(rec(s, nm) - rec(s, names[0]) for s in samples)
        print(f"{nm:28s} recovery {rec(rows, nm):.3f} [{boot[7]:.3f}, {boot[292]:.3f}]  vs {names[0]}: "
              f"{rec(rows, nm) - rec(rows, names[0]):+.3f} [{diffs[7]:+.3f}, {diffs[292]:+.3f}]", flush=True)
