"""The store's one byte budget (issue 35, item 3): how much of one device capacity a mix of source entries and their
projections fills before the first eviction, in the production pair's byte ratio.

    .venv/bin/python bench/bench_store_budget.py [--quick]

Layouts come from the shipped production shapes (transfer/data/production_shapes.json, no weights): Qwen2-7B's
4 KV heads x 128 and Phi-3-mini's 32 x 96, in bf16, with a quarter of each model's layers (7 and 8) and of its KV
heads (1 and 8), so the bytes per token keep the production ratio (57,344 : 393,216 = 3,584 : 24,576). Each
document is stored as a source entry and its projection (another entry of the target's layout, as many tokens),
random lengths, until the store evicts a block for the first time. bench_store.py runs this as its `budget` line.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.shaped_pair import kv_bytes_per_token, production_shapes
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import PagedStore, StoreConfig
from machine import device_label, machine_line

TENANT = "bench"
LAYER_DIVISOR = 4  # 28 -> 7 and 32 -> 8 layers
HEAD_DIVISOR = 4  # 4 -> 1 and 32 -> 8 KV heads: the byte ratio of the pair is kept, the bytes are a sixteenth
DTYPE = torch.bfloat16
GOAL = 0.95


def shaped(role: str) -> tuple[ModelIdentity, int, int, int]:
    """(identity, layers, KV heads, head_dim) of one side of the production pair, its layers divided."""
    item = production_shapes()[role]
    c = item["config"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    layers = c["num_hidden_layers"] // LAYER_DIVISOR
    heads = c["num_key_value_heads"] // HEAD_DIVISOR
    return ModelIdentity(f"{item['name']}-shaped-L{layers}-H{heads}", "0" * 64), layers, heads, head_dim


def bench_budget(capacity_mb: int, device: torch.device, max_tokens: int = 1024, seed: int = 5) -> dict:
    """Fill a store of capacity_mb MiB with (source, projection) pairs until its first eviction; the share of its
    bytes held by blocks of KV then (and by the tokens themselves: partial tail blocks are padding)."""
    sides = {role: shaped(role) for role in ("source", "target")}
    capacity = capacity_mb << 20
    st = PagedStore(StoreConfig(capacity_bytes=capacity, max_layouts=2, device=str(device)))
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv = {role: torch.randn(layers, 2, heads, max_tokens, d, generator=gen).to(DTYPE)
          for role, (_, layers, heads, d) in sides.items()}
    per_token = {role: layers * 2 * heads * d * DTYPE.itemsize for role, (_, layers, heads, d) in sides.items()}
    held = {"bytes": 0.0, "token_bytes": 0, "documents": 0}
    t0 = time.perf_counter()
    while True:
        n = rng.randint(64, max_tokens)
        ids = torch.randint(0, 150_000, (n,), generator=gen)
        for role, (model, *_shape) in sides.items():
            adapter = "" if role == "source" else "bench@1"
            st.put(KVSegment(kv=kv[role][:, :, :, :n], token_ids=ids, positions=torch.arange(n), model=model,
                             rotated=True), TENANT, adapter=adapter)
            if st.stats().evictions["device"]:
                break
            held["bytes"] = st.stats().bytes_used["device"]
            held["token_bytes"] += n * per_token[role]
        else:
            held["documents"] += 1
            continue
        break
    fill_s = time.perf_counter() - t0
    problems = st.check()
    if problems:
        raise AssertionError(f"the store's invariants broke: {problems}")
    s, t = production_shapes()["source"]["config"], production_shapes()["target"]["config"]
    ratio = held["bytes"] / capacity
    # the fixed quarter per layout this replaces: the projections' quarter fills first, the source's is then at
    # 1/ratio of its own (computed, not measured)
    quarter = 0.25 * (1 + per_token["source"] / per_token["target"])
    out = {"capacity_bytes": capacity, "documents": held["documents"], "bytes_held": held["bytes"],
           "ratio_bytes_over_capacity": ratio, "ratio_token_bytes_over_capacity": held["token_bytes"] / capacity,
           "fill_s": fill_s, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "bytes_per_token": per_token, "fixed_quarter_ratio": quarter,
           "production_bytes_per_token": {"source": kv_bytes_per_token(s), "target": kv_bytes_per_token(t)}}
    print(f"budget  one {capacity_mb} MiB store, {held['documents']} documents of 64-{max_tokens} tokens stored as "
          f"source ({per_token['source']:,} B/token) + projection ({per_token['target']:,} B/token; the production "
          f"pair's ratio) before its first eviction: ratio bytes holding KV/capacity {ratio:.3f} (goal >= {GOAL}, "
          f"{'meets goal' if ratio >= GOAL else 'BELOW GOAL'}); tokens' own bytes "
          f"{out['ratio_token_bytes_over_capacity']:.3f} (the rest: partial tail blocks); a fixed quarter per layout "
          f"(before) would have evicted at {quarter:.3f} (computed); filled in {fill_s:.1f} s "
          f"(CPU capability {out['cpu_capability']})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 256 MiB store instead of 1 GiB")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = resolve_device("auto")
    print(machine_line("quick" if args.quick else "full", f"device {device_label(device)}"), flush=True)
    bench_budget(256 if args.quick else 1024, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
