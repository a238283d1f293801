"""Paged-store benchmarks: each line is a ratio against a baseline measured in the same run, on the machine named
in the header (STYLE rule 9). The two sides of a ratio are interleaved over several rounds and each reported
time is a median, because other processes share the machine.

    .venv/bin/python bench/bench_store.py [--quick]

1. get: `PagedStore.get` of one entry vs `dst.copy_(src)` of the same bytes (GB/s), real small-preset layouts.
2. lookup: `PagedStore.lookup` of a long cached prefix with >= 1M blocks indexed (us per block), and the share
   of it spent in `hash_chain`.
3. capacity: tokens a fixed pool holds before its first eviction, by prefix-sharing pattern.
4. redis: `RedisTier.put_many` / `get_many` vs raw redis-py pipelined SET / MGET of the same sizes (MB/s), on one
   redis-server and on a local Redis Cluster (`bench_store_redis.py`, which also runs alone).
5. budget: the share of one capacity a mix of source entries and projections fills before the first eviction
   (`bench_store_budget.py`, which also runs alone).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_store_budget import bench_budget
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.models import prepare_gguf
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity, config_hash
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.kv_blocks import Namespace, chain_root, hash_chain
from machine import device_label
from machine import machine_line as _machine_line

TENANT = "bench"
BLOCK_SIZE = 16  # StoreConfig's default
DTYPE = torch.bfloat16  # the production KV dtype
SMALL_SOURCE = "gemma-3-270m-q4_k_m"
SMALL_TARGET = "smollm2-135m-instruct-q4_1"


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark is; --quick shrinks all of them (a smoke run in well under a minute)."""

    get_rounds: int
    get_inner: int
    lookup_entries: int
    lookup_blocks_per_entry: int
    lookup_rounds: int
    pool_blocks: int  # capacity: the fixed pool's size
    bytes_max_tokens: int
    shared_max_suffix: int
    redis_blocks: int
    redis_rounds: int


FULL = Sizes(get_rounds=15, get_inner=3, lookup_entries=250, lookup_blocks_per_entry=4096, lookup_rounds=15,
             pool_blocks=2048, bytes_max_tokens=3000, shared_max_suffix=2000,
             redis_blocks=512, redis_rounds=7)
QUICK = Sizes(get_rounds=5, get_inner=2, lookup_entries=16, lookup_blocks_per_entry=1024, lookup_rounds=5,
              pool_blocks=256, bytes_max_tokens=1000, shared_max_suffix=500,
              redis_blocks=128, redis_rounds=2)


# ---------------------------------------------------------------------------------------------------- helpers


def machine_line(device: torch.device, mode: str) -> str:
    return _machine_line(mode, f"device {device_label(device)}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, inner: int,
                device: torch.device) -> dict[str, float]:
    """Median seconds per call of each fn. Every round runs each fn `inner` times; the order alternates between
    rounds, so drift in the machine's load hits both sides of a ratio alike."""
    for fn in fns.values():  # warm-up: allocator, caches, lazy imports
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fn = fns[name]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def verdict(ok: bool) -> str:
    return "meets goal" if ok else "BELOW GOAL"


@dataclass(frozen=True)
class KVLayout:
    """One real model's KV layout, read from its converted config."""

    role: str  # "source" | "target" of the small preset
    identity: ModelIdentity
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE.itemsize

    def describe(self) -> str:
        return (f"{self.identity.name} ({self.role}) L={self.num_layers} H_kv={self.num_kv_heads} "
                f"D={self.head_dim} bf16")


def small_layout(role: str, name: str) -> KVLayout:
    from transformers import AutoConfig

    folder = prepare_gguf(name)  # converted once per machine; a few seconds when already there
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return KVLayout(role, ModelIdentity(name, config_hash(config)), text.num_hidden_layers,
                    text.num_key_value_heads, head_dim)


def segment(layout: KVLayout, kv: torch.Tensor, tokens: torch.Tensor) -> KVSegment:
    # kv: [L, 2, H_kv, T, D]; tokens: [T]
    return KVSegment(kv=kv, token_ids=tokens, positions=torch.arange(tokens.numel()), model=layout.identity,
                     rotated=True)


def store_for(blocks: int, block_bytes: int, device: torch.device) -> PagedStore:
    """A store whose one layout pool holds exactly `blocks` blocks (no evictions in these benchmarks)."""
    return PagedStore(StoreConfig(capacity_bytes=blocks * block_bytes, max_layouts=1, block_size=BLOCK_SIZE,
                                  device=str(device)))


def pool_layout(layout: KVLayout) -> PoolLayout:
    return PoolLayout(model=layout.identity.key, dtype="bfloat16", num_layers=layout.num_layers,
                      num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, block_size=BLOCK_SIZE)


# ---------------------------------------------------------------------------------------------------- 1. get


def bench_get(layout: KVLayout, num_tokens: int, sizes: Sizes, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(num_tokens)
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim, generator=gen).to(DTYPE)
    tokens = torch.randint(0, 200_000, (num_tokens,), generator=gen)
    blocks = -(-num_tokens // BLOCK_SIZE)
    st = store_for(blocks, pool_layout(layout).block_bytes, device)
    key = st.put(segment(layout, kv, tokens), TENANT).key
    if not torch.equal(st.get(key, TENANT).kv.cpu(), kv):
        raise AssertionError(f"get of {layout.identity.name} ({num_tokens} tokens) did not return what was put")
    src = kv.to(device)
    dst = torch.empty_like(src)
    out = torch.empty_like(src)
    times = interleaved({"get": lambda: st.get(key, TENANT, out=out), "copy": lambda: dst.copy_(src),
                         "get fresh": lambda: st.get(key, TENANT), "clone": lambda: src.clone()},
                        sizes.get_rounds, sizes.get_inner, device)
    nbytes = kv.numel() * kv.element_size()
    gbs = {name: nbytes / t / 1e9 for name, t in times.items()}
    ratio = times["copy"] / times["get"]
    fresh = times["clone"] / times["get fresh"]
    tail = "full blocks" if num_tokens % BLOCK_SIZE == 0 else f"partial tail of {num_tokens % BLOCK_SIZE}"
    print(f"get     {layout.describe()}, {num_tokens} tokens ({tail}, {nbytes / 1e6:.1f} MB): "
          f"get into a buffer {gbs['get']:.2f} GB/s, copy_ {gbs['copy']:.2f} GB/s -> ratio get/copy {ratio:.2f} "
          f"(goal >= 0.8, {verdict(ratio >= 0.8)}); into a fresh tensor: get {gbs['get fresh']:.2f} GB/s, "
          f"clone {gbs['clone']:.2f} GB/s -> ratio {fresh:.2f}", flush=True)
    return {"model": layout.identity.name, "role": layout.role, "tokens": num_tokens, "bytes": nbytes,
            "gbs": gbs, "ratio_get_over_copy": ratio, "ratio_fresh_get_over_clone": fresh}


# ---------------------------------------------------------------------------------------------------- 2. lookup


def bench_lookup(sizes: Sizes, device: torch.device) -> dict:
    # A tiny layout so a million blocks stay small: one block is 1 x 2 x 1 x 16 x 2 float16 = 128 bytes.
    model = ModelIdentity("bench-tiny", "0" * 64)
    layout = PoolLayout(model=model.key, dtype="float16", num_layers=1, num_kv_heads=1, head_dim=2,
                        block_size=BLOCK_SIZE)
    n_entries, per_entry = sizes.lookup_entries, sizes.lookup_blocks_per_entry
    num_tokens = per_entry * BLOCK_SIZE
    st = store_for(n_entries * per_entry, layout.block_bytes, device)
    kv = torch.zeros(1, 2, 1, num_tokens, 2, dtype=torch.float16)  # content does not matter to lookup
    positions = torch.arange(num_tokens)
    gen = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    for _ in range(n_entries):
        tokens = torch.randint(0, 2**31 - 1, (num_tokens,), generator=gen)
        st.put(KVSegment(kv=kv, token_ids=tokens, positions=positions, model=model, rotated=True), TENANT)
    fill_s = time.perf_counter() - t0
    pool = next(iter(st.pools.values()))
    t0 = time.perf_counter()
    stats = st.stats()
    stats_s = time.perf_counter() - t0
    indexed = len(pool.hash_to_block)
    if stats.entries != n_entries or stats.evictions["device"] or indexed != n_entries * per_entry:
        raise AssertionError(f"lookup store not filled as planned: {stats.entries} entries, {indexed} blocks "
                             f"indexed, {stats.evictions['device']} evictions")
    print(f"lookup  fill: {n_entries} entries x {per_entry} blocks = {indexed:,} blocks indexed "
          f"(pool {pool.num_blocks:,} blocks of {layout.block_bytes} B) in {fill_s:.1f} s "
          f"({fill_s / n_entries * 1e3:.1f} ms per put of {num_tokens} tokens); one stats() call "
          f"{stats_s * 1e3:.0f} ms", flush=True)

    exact = tokens  # the last entry stored
    prefix = torch.cat([tokens, torch.arange(BLOCK_SIZE // 2)])  # not an entry: walks the chain, all full blocks hit
    diverge = tokens.clone()
    diverge[-1] += 1  # the last block's hash differs: per_entry - 1 blocks hit
    expected = {"exact": num_tokens, "prefix": num_tokens, "diverge": num_tokens - BLOCK_SIZE}
    queries = {"exact": exact, "prefix": prefix, "diverge": diverge}
    for name, query in queries.items():
        found = st.lookup(query, TENANT, model, "float16").num_tokens
        if found != expected[name]:
            raise AssertionError(f"lookup ({name}) found {found} tokens, expected {expected[name]}")
    ns = Namespace(tenant=TENANT, model=model.key, dtype="float16")
    digest = ns.digest()
    root = chain_root(digest, "prefix")
    fns = {name: (lambda q=q: st.lookup(q, TENANT, model, "float16")) for name, q in queries.items()}
    fns["hash_chain"] = lambda: hash_chain(prefix, BLOCK_SIZE, root, digest, full_only=True)
    times = interleaved(fns, sizes.lookup_rounds, 3, device)
    us = {name: t / per_entry * 1e6 for name, t in times.items()}
    print(f"lookup  {per_entry}-block ({num_tokens}-token) cached prefix, {indexed:,} blocks indexed: "
          f"{us['prefix']:.2f} us/block (diverging in the last block {us['diverge']:.2f}, exact entry key "
          f"{us['exact']:.2f}) (goal <= 2 us/block, {verdict(max(us['prefix'], us['diverge']) <= 2)})", flush=True)
    share = times["hash_chain"] / times["prefix"]
    print(f"lookup  hashing share: hash_chain alone {us['hash_chain']:.2f} us/block -> ratio hash_chain/lookup "
          f"{share:.2f} (no goal: the rest is index probes and the content-key hash)", flush=True)
    return {"blocks_indexed": indexed, "blocks_per_query": per_entry, "fill_s": fill_s, "stats_s": stats_s,
            "us_per_block": us, "ratio_hash_chain_over_lookup": share}


# ---------------------------------------------------------------------------------------------------- 3. capacity


def fill_until_eviction(st: PagedStore, entries) -> tuple[int, int]:
    """Put entries (KVSegments) until one makes the pool evict; returns (entries held, tokens held) before it."""
    held_entries = held_tokens = 0
    for seg in entries:
        st.put(seg, TENANT)
        if st.stats().evictions["device"]:
            break
        held_entries += 1
        held_tokens += seg.num_tokens
    else:
        raise AssertionError("the pattern ran out before the pool filled: give it more entries")
    return held_entries, held_tokens


def bench_capacity(layout: KVLayout, sizes: Sizes, device: torch.device) -> list[dict]:
    """Tokens a fixed pool holds before its first eviction, by prefix-sharing pattern. The ratio is tokens held over
    the pool's size in tokens: below 1 from partial tail blocks, above 1 where entries share full blocks."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    pool_tokens = sizes.pool_blocks * BLOCK_SIZE
    longest = pool_tokens + 1024
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, longest, layout.head_dim, generator=gen).to(DTYPE)

    def random_ids(n: int) -> torch.Tensor:
        return torch.randint(0, 200_000, (n,), generator=gen)

    def distinct():  # random tokens of random lengths: no two entries share a block
        while True:
            n = rng.randint(1, sizes.bytes_max_tokens)
            yield segment(layout, kv[:, :, :, :n], random_ids(n))

    head = random_ids(1024)

    def shared_prefix():  # one 1024-token system prompt, then a distinct suffix each
        while True:
            n = rng.randint(1, sizes.shared_max_suffix)
            yield segment(layout, kv[:, :, :, :1024 + n], torch.cat((head, random_ids(n))))

    def conversation():  # one growing chat: each request is the whole conversation so far
        ids = random_ids(rng.randint(32, 256))
        while ids.numel() <= longest:
            yield segment(layout, kv[:, :, :, :ids.numel()], ids)
            ids = torch.cat((ids, random_ids(rng.randint(32, 128))))

    results = []
    block_bytes = pool_layout(layout).block_bytes
    for case, entries in (("distinct entries", distinct()), ("shared 1024-token prefix", shared_prefix()),
                          ("growing conversation", conversation())):
        st = store_for(sizes.pool_blocks, block_bytes, device)
        count, tokens = fill_until_eviction(st, entries)
        assert st.check() == [], st.check()
        ratio = tokens / pool_tokens
        print(f"capacity {case}: a pool of {sizes.pool_blocks:,} blocks ({pool_tokens:,} tokens of "
              f"{layout.describe()}) held {count:,} entries, {tokens:,} tokens before its first eviction: ratio "
              f"tokens held/pool tokens {ratio:.3f} (no goal: what sharing full blocks buys)", flush=True)
        results.append({"case": case, "pool_tokens": pool_tokens, "entries": count, "tokens": tokens,
                        "ratio_tokens_over_pool": ratio})
        del st
        gc.collect()
    return results


# ---------------------------------------------------------------------------------------------------- main


def run(argv: list[str] | None = None) -> dict:
    """Every benchmark, as on the command line; returns their numbers (the printed lines' figures)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run in well under a minute")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared machine, OpenMP threads waiting at a "
                             "barrier for a descheduled sibling turn millisecond copies into stalls of up to a second)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    device = resolve_device("auto")
    started = time.perf_counter()
    machine = machine_line(device, "quick" if args.quick else "full")
    print(machine, flush=True)
    source = small_layout("source", SMALL_SOURCE)
    target = small_layout("target", SMALL_TARGET)
    print(f"layouts: {source.describe()}, {source.bytes_per_token} B/token; {target.describe()}, "
          f"{target.bytes_per_token} B/token; blocks of {BLOCK_SIZE} tokens; times are medians of interleaved rounds",
          flush=True)
    get = [bench_get(layout, num_tokens, sizes, device) for layout in (source, target) for num_tokens in (2048, 2047)]
    gc.collect()
    lookup = bench_lookup(sizes, device)
    gc.collect()  # the million-block store
    capacity = bench_capacity(source, sizes, device)
    from bench_store_redis import run_redis  # here, not above: it takes its layouts and timing from this module

    redis, cluster = run_redis(source, sizes, device)
    budget = bench_budget(256 if args.quick else 1024, device)
    wall_s = time.perf_counter() - started
    print(f"done in {wall_s:.0f} s", flush=True)
    return {"machine": machine, "get": get, "lookup": lookup, "capacity": capacity, "redis": redis,
            "redis_cluster": cluster, "budget": budget, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
