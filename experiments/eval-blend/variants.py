"""NLL recovery of selective-recompute variants on the pages build.py cached (one run per row group of
docs/eval-blend/README.md; pages are indices in pydoc_summaries.jsonl, 100-226 the tuning pages), as a ratio of sums
over the pages (as eval's report), with a 95% bootstrap interval and the share of a prefill each variant costs.

  python experiments/eval-blend/variants.py START END VARIANT[,VARIANT...]

Variants: replace; recompute:r (the last r over the projected head); tail:r; blend:r[/m=M][/s=S][/t=T][/tf=F]
[/rule=R] (transfer.suffix.blend as it was before the attention rule: m exact layers, S sinks, T tail or a share F
of r as tail); attn:r[/w=W][/s=S][/t=T][/m=M][/lay=A-B][/hn=1][/dev=1] (the last W tokens' attention over the
projected KV in layers A..B-1 scores the rest; the attention rule of transfer.suffix.blend is
attn:r/w=16/s=4/m=0/lay=15-30); odev:r[/tf=F] and oatt:r[/tf=F]: oracles that choose by the true all-layer
deviation, or by the attention the held-out continuation itself gives each token in the target's own prefill.
attn and oatt take /hd=L.G[+L.G...]: only the attention of KV head G of layer L (its 3 query heads) counts.
draft:r[/w=W][/g=G][/s=S][/hd=...][/win=0][/true=1]: the last W tokens recomputed, then G tokens drafted greedily
(or the true continuation's first G, true=1) over the projected KV; their attention (and the window's, unless win=0)
at the heads hd (default 18.2+17.1, the target's two induction heads: loss-location/induction.py) chooses.
"""

import argparse
import os
import random
import time
from dataclasses import replace as dc_replace
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("variants", help="comma-separated variants (above)")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import eager_attention
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.blend import BlendConfig, blend, kv_deviation
from kvbridge.transfer.suffix.reuse import first_layers_kv, prefill_after, recompute_selected

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
_, target = load_pair("small")
L = target.spec.num_layers


def seg_of(kv, ids):
    return KVSegment(kv=kv, token_ids=ids, positions=torch.arange(ids.numel()), model=target.spec.identity,
                     rotated=True)


def parse_heads(spec: str) -> list[tuple[int, int]]:
    """'18.2+17.1' -> [(18, 2), (17, 1)]: (layer, KV head)."""
    return [tuple(map(int, x.split("."))) for x in spec.split("+")]


@torch.no_grad()
def tail_attention(ctx, placed, w, layers=None, hn=False, heads=None):
    """[T] attention mass from the last w placed tokens (recomputed over the rest) onto each placed token,
    summed over heads, queries and layers (eager attention on a throwaway forward)."""
    t = placed.num_tokens
    c = ctx.num_tokens
    head = KVSegment.concat([ctx, placed.slice(0, t - w)])
    cache = kvcache.build_cache(head.kv[:, :, None].to(torch.float32))
    with eager_attention(target.model):
        out = target.model(input_ids=placed.token_ids[t - w:][None], position_ids=torch.arange(c + t - w, c + t)[None],
                           cache=cache, use_cache=True, output_attentions=True, logits_to_keep=1)
    att = torch.stack([a[0].float() for a in out.attentions])  # [L, H, w, c + t]
    if heads is not None:
        att = torch.stack([att[layer, g * 3:(g + 1) * 3] for layer, g in heads])
    elif layers is not None:
        att = att[layers]
    att = att[..., c:c + t - w]
    if hn:
        att = att / att.sum(-1, keepdim=True).clamp(min=1e-9)
    mass = torch.cat((att.sum(dim=(0, 1, 2)), torch.full((w,), 1e9)))  # [t]
    return mass


@torch.no_grad()
def tail_attention_of(own, cont, heads=None):
    """[C] attention mass of the continuation's queries (full prefill cache) onto each context token."""
    c = own.num_tokens
    cache = kvcache.build_cache(own.kv[:, :, None].float())
    with eager_attention(target.model):
        out = target.model(input_ids=cont[None], position_ids=torch.arange(c, c + cont.numel())[None],
                           cache=cache, use_cache=True, output_attentions=True, logits_to_keep=1)
    att = torch.stack([a[0].float() for a in out.attentions])
    if heads is not None:
        att = torch.stack([att[layer, g * 3:(g + 1) * 3] for layer, g in heads])
    return att.sum(dim=(0, 1, 2))[:c]


@torch.no_grad()
def draft_attention(ctx, placed, w, g, heads, use_window=True, cont=None):
    """Attention mass at `heads` onto the placed tokens before the last w from: the last w tokens' queries (if
    use_window) and g greedily drafted continuation tokens' queries (or the true continuation's, cont)."""
    t = placed.num_tokens
    c = ctx.num_tokens
    head = KVSegment.concat([ctx, placed.slice(0, t - w)])
    cache = kvcache.build_cache(head.kv[:, :, None].to(torch.float32))
    mass = torch.zeros(t)

    def add(out):
        att = torch.stack([out.attentions[layer][0, gq * 3:(gq + 1) * 3].float()
                           for layer, gq in heads])  # [h, 3, q, keys]
        mass[:t - w] += att[..., c:c + t - w].sum(dim=(0, 1, 2))

    with eager_attention(target.model):
        pos = c + t - w
        out = target.model(input_ids=placed.token_ids[t - w:][None], position_ids=torch.arange(pos, pos + w)[None],
                           cache=cache, use_cache=True, output_attentions=True, logits_to_keep=1)
        if use_window:
            add(out)
        pos += w
        nxt = out.logits[0, -1].argmax()
        toks = cont[:g] if cont is not None else None
        for i in range(g):
            tok = toks[i] if toks is not None else nxt
            out = target.model(input_ids=tok.view(1, 1), position_ids=torch.tensor([[pos]]), cache=cache,
                               use_cache=True, output_attentions=True)
            add(out)
            pos += 1
            nxt = out.logits[0, -1].argmax()
    mass[t - w:] = 1e9
    return mass


def run_variant(name, d):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1  # document tokens
    proj = seg_of(kv, ids)
    ctx, placed = proj.slice(0, 1), proj.slice(1, n + 1)
    kind, _, arg = name.partition(":")
    parts = arg.split("/")
    r = float(parts[0] or 0)
    opts = dict(p.split("=") for p in parts[1:])
    k = max(1, round(r * n))
    share = 0.0
    if kind == "recompute":
        head = proj.slice(0, n + 1 - k)
        tail = prefill_after(target, head, ids[n + 1 - k:])
        seg = KVSegment.concat([head, tail.to(dtype=head.dtype)])
        share = k / n
    elif kind == "tail":
        seg = kvcache.extract(target.model, target.spec, torch.cat((ids[:1], ids[n + 1 - k:])))
        share = k / n
    elif kind == "blend":
        m = int(opts.get("m", 1))
        cfg = BlendConfig(fraction=k / n, layers=m, sinks=int(opts.get("s", 4)), tail=int(opts.get("t", 4)),
                          rule=opts.get("rule", "sinks+deviation"))
        if "tf" in opts:  # tail share of k
            cfg = dc_replace(cfg, tail=round(float(opts["tf"]) * k))
        b = blend(target, ctx, placed, cfg)
        seg = KVSegment.concat([ctx, b.segment])
        share = m / L + k / n
    elif kind == "attn":  # selection by attention mass of the last w tokens (and optional deviation weighting)
        m = int(opts.get("m", 1))
        w = int(opts.get("w", 16))
        sinks = int(opts.get("s", 4))
        t_forced = int(opts.get("t", w))
        exact_head = placed
        if m:
            own = first_layers_kv(target, ctx, placed.token_ids, m)
            kv2 = placed.kv.clone()
            kv2[:m] = own.to(kv2)
            exact_head = dc_replace(placed, kv=kv2)
        lay = opts.get("lay")
        layers = None if lay is None else list(range(int(lay.split("-")[0]), int(lay.split("-")[1])))
        heads = parse_heads(opts["hd"]) if "hd" in opts else None
        mass = tail_attention(ctx, exact_head, w, layers, opts.get("hn") == "1", heads)
        score = mass
        if opts.get("dev") == "1":
            score = mass * kv_deviation(placed.kv[:m], own)
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[:min(sinks, k)] = True
        tt = min(t_forced, k - int(chosen.sum()))
        if tt:
            chosen[n - tt:] = True
        room = k - int(chosen.sum())
        if room > 0:
            chosen[score.masked_fill(chosen, float("-inf")).topk(room).indices] = True
        sel = chosen.nonzero()[:, 0]
        seg = KVSegment.concat([ctx, recompute_selected(target, ctx, exact_head, sel)])
        share = m / L + k / n + w / n
    elif kind == "draft":
        w = int(opts.get("w", 16))
        g = int(opts.get("g", 8))
        sinks = int(opts.get("s", 4))
        heads = parse_heads(opts.get("hd", "18.2+17.1"))
        mass = draft_attention(ctx, placed, w, g, heads, opts.get("win", "1") == "1",
                               cont if opts.get("true") == "1" else None)
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[:min(sinks, k)] = True
        chosen[n - min(w, k - int(chosen.sum())):] = True
        room = k - int(chosen.sum())
        if room > 0:
            chosen[mass.masked_fill(chosen, float("-inf")).topk(room).indices] = True
        sel = chosen.nonzero()[:, 0]
        seg = KVSegment.concat([ctx, recompute_selected(target, ctx, placed, sel)])
        share = k / n + (w + g) / n
    elif kind in ("odev", "oatt"):  # oracles: true all-layer deviation / the continuation's own attention
        own = kvcache.extract(target.model, target.spec, ids)
        tf = float(opts.get("tf", 0))
        if kind == "odev":
            score = kv_deviation(placed.kv, own.kv[:, :, :, 1:])
        else:
            heads = parse_heads(opts["hd"]) if "hd" in opts else None
            score = tail_attention_of(own, cont, heads)[1:n + 1]
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[n - round(tf * k):] = bool(round(tf * k))
        room = k - int(chosen.sum())
        if room > 0:
            chosen[score.masked_fill(chosen, float("-inf")).topk(room).indices] = True
        sel = chosen.nonzero()[:, 0]
        seg = KVSegment.concat([ctx, recompute_selected(target, ctx, placed, sel)])
        share = k / n
    elif kind == "replace":
        seg = proj
    else:
        raise ValueError(name)
    nll, _ = continuation_scores(target, seg, cont)
    return nll, share


def rec(rs, nm):
    none = sum(r["none"] for r in rs)
    full = sum(r["full"] for r in rs)
    x = sum(r[nm][0] for r in rs)
    return (none - x) / (none - full)


a, b = args.start, args.end
names = args.variants.split(",")
files = [f for f in sorted(args.pages.glob("*.pt")) if a <= int(f.stem) < b]
rows = []
t0 = time.time()
for f in files:
    d = torch.load(f, weights_only=True)
    row = {"full": d["nll_full"], "none": d["nll_none"]}
    for nm in names:
        row[nm] = run_variant(nm, d)
    rows.append(row)
rng = random.Random(0)
samples = [[rng.choice(rows) for _ in rows] for _ in range(300)]
print(f"{len(rows)} docs [{a},{b}) {time.time() - t0:.0f}s")
for nm in names:
    boot = sorted(rec(s, nm) for s in samples)
    share = sum(r[nm][1] for r in rows) / len(rows)
    print(f"{nm:40s} recovery {rec(rows, nm):.3f} [{boot[7]:.3f}, {boot[292]:.3f}]  prefill share {share:.3f}",
          flush=True)
