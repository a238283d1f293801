"""Projection throughput vs the target's own prefill, on the same target tokens, measured in one run.

The source KV is already cached (the service keeps it); the question is what producing the target's cache costs
by projection (un-rotate, map, re-rotate: `project`) against by prefill (`extract` on the target model).
The FLOP ceiling of the ratio (the target's prefill FLOPs over the projection's, for this pair and this adapter's
shapes) is computed from the configs by `kvbridge.eval.cost.PairCost` and printed beside it.

    .venv/bin/python bench/bench_projection.py [--preset small|tiny] [--tokens 512] [--adapter FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from machine import device_label, machine_line


def random_adapter(source, target, device: torch.device):
    """Random maps of the plainest shape (one source layer per target layer, no token features or context branch),
    for a pair without a shipped adapter: the cost depends on the shape, not on the values."""
    from kvbridge.adapters.adapter import Adapter, AdapterMeta, model_record
    from kvbridge.adapters.layer_map import build_layer_map
    from kvbridge.adapters.pairs import start_kv, start_token_id

    s, t = source.spec, target.spec
    d_s, d_t = s.num_kv_heads * s.head_dim, t.num_kv_heads * t.head_dim
    gen = torch.Generator().manual_seed(0)
    ones = torch.ones(t.num_layers, 1)
    start = start_token_id(target.tokenizer)
    return Adapter(meta=AdapterMeta(model_record(s), model_record(t), "proportional", start),
                   layer_map=torch.tensor(build_layer_map("proportional", s.num_layers, t.num_layers)),
                   mix_k=ones, mix_v=ones.clone(),
                   wk=torch.randn(t.num_layers, d_s, d_t, generator=gen) * 0.05,
                   bk=torch.zeros(t.num_layers, d_t),
                   wv=torch.randn(t.num_layers, d_s, d_t, generator=gen) * 0.05,
                   bv=torch.zeros(t.num_layers, d_t), start_kv=start_kv(target, start)).to(device)


def measure(source, target, adapter, num_tokens: int, rounds: int, dtype: str) -> dict:
    """Median seconds of producing the target's cache of about num_tokens target tokens of the packaged sample
    text by projection of the source's (already computed) KV vs by the target's prefill, interleaved over `rounds`
    rounds; prints the `projection` line and returns its numbers."""
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.selfcheck import sample_text

    device = target.device
    text = sample_text()
    enc = target.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    text = text[: enc[min(num_tokens, len(enc)) - 1][1]]
    paired = pair_text(text, source.tokenizer, target.tokenizer)
    source_kv = kvcache.extract(source.model, source.spec, paired.source_ids)  # cached by the service already
    model_dtype = next(target.model.parameters()).dtype

    def by_projection():
        return project(adapter, source_kv, paired.alignment, paired.target_ids, source.rope, target.rope,
                       dtype=model_dtype)

    def by_prefill():
        return kvcache.extract(target.model, target.spec, paired.target_ids)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    by_projection(), by_prefill()  # warm up
    times = {"projection": [], "prefill": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in (("projection", by_projection), ("prefill", by_prefill)):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
    n = paired.target_ids.numel()
    from kvbridge.eval.cost import PairCost

    ceiling = PairCost.of(source.model.config, target.model.config, adapter).ceiling(n)
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: n / v for k, v in med.items()}
    ratio = med["prefill"] / med["projection"]
    print(f"projection {source.name} -> {target.name}, {n} target tokens ({paired.source_ids.numel()} source), "
          f"{dtype} on {device}: projection {tps['projection']:,.0f} tokens/s, target prefill "
          f"{tps['prefill']:,.0f} tokens/s -> ratio projection/prefill {ratio:.1f}x "
          f"(FLOP ceiling {ceiling:.0f}x for this pair and adapter; medians of {rounds} interleaved rounds)",
          flush=True)
    return {"pair": f"{source.name} -> {target.name}", "target_tokens": n, "source_tokens": paired.source_ids.numel(),
            "dtype": dtype, "device": str(device), "rounds": rounds, "projection_s": med["projection"],
            "prefill_s": med["prefill"], "projection_tokens_per_s": tps["projection"],
            "prefill_tokens_per_s": tps["prefill"], "ratio_projection_over_prefill": ratio, "flop_ceiling": ceiling}


def run(argv: list[str] | None = None) -> dict:
    """Parse the command line, load the pair and the adapter, and `measure`; returns its numbers."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["small", "tiny"])
    p.add_argument("--tokens", type=int, default=512, help="context length in target tokens (about)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--adapter", help="a trained adapter file (default: the pair's shipped adapter, what a server "
                                     "serves; random maps of its plainest shape for a pair without one)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    for name, value, low in (("--tokens", args.tokens, 2), ("--rounds", args.rounds, 1)):
        if value < low:  # --tokens 0 would cut nothing off the sample text; no round leaves no median
            p.error(f"{name} must be >= {low}, got {value}")

    from kvbridge.adapters.io import load_adapter
    from kvbridge.adapters.shipped import find_shipped
    from kvbridge.transfer.presets import load_pair

    source, target = load_pair(args.preset, dtype=args.dtype, device=args.device)
    device = target.device
    print(machine_line("full", f"device {device_label(device)}", f"dtype {args.dtype}"))
    # the shipped adapter by default: its shape (a mix of source layers, token features, a context branch) sets the
    # projection's cost, and random maps of the plainest shape cost half of it
    path = args.adapter or find_shipped(source.spec, target.spec)
    adapter = load_adapter(path, device) if path else random_adapter(source, target, device)
    print(f"adapter {path or 'random maps (the pair has no shipped adapter)'}")
    return measure(source, target, adapter, args.tokens, args.rounds, args.dtype)


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
