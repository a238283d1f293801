"""The store's Redis tier against redis-py on the same Redis, on one server and on a Redis Cluster: ratios measured in
one run on the machine named in the header (STYLE rule 9), medians of interleaved rounds.

    .venv/bin/python bench/bench_store_redis.py [--quick]

`RedisTier.put_many` / `get_many` in batches of 64 blocks of the small preset's source layout vs raw redis-py
pipelined SET / MGET of byte strings of the same sizes (MB/s of block bytes). The put sends blocks whose sum64 the
CPU tier took as it copied them, and also blocks without one; it also times the tier's sends alone, tags taken
beforehand. Then the same on a local Redis Cluster (3 primaries, a replica each: tests/redis_cluster.py) through
`redis+cluster://`, against redis-py's RedisCluster pipelined SET / `mget_nonatomic`: the tier's puts wait for a
replica (WAIT), and again without (wait_replicas=0), which prints what the wait costs a batch; and how long a replica
takes to acknowledge a SET (the window WAIT closes). bench_store.py runs this as its `redis` lines; it needs a
redis-server (and redis-cli for the cluster) on PATH and starts its own.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_store import (
    DTYPE,
    FULL,
    QUICK,
    SMALL_SOURCE,
    KVLayout,
    Sizes,
    interleaved,
    machine_line,
    pool_layout,
    small_layout,
    verdict,
)
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.tiers import CpuTier, RedisTier, block_parts, block_sums

REDIS_BATCH = 64  # blocks per put_many / get_many call, and per raw pipeline


@dataclass
class RedisBlocks:
    """The blocks both Redis benchmarks send: n blocks of one layout, as the store holds them and as plain bytes."""

    layout: PoolLayout
    hashes: list[bytes]
    blocks: torch.Tensor  # [n, L, 2, H_kv, bs, D]
    carried: list[torch.Tensor]  # CPU tier copies, each carrying the sum64 taken as it was copied
    raw_keys: list[bytes]
    raw_values: list[bytes]  # the same sizes, as plain bytes
    batches: list[range]
    sum_at_copy_us: float  # what taking the sum added to each copy


def redis_blocks(layout: KVLayout, sizes: Sizes, device: torch.device) -> RedisBlocks:
    n = sizes.redis_blocks
    gen = torch.Generator().manual_seed(4)
    pl = pool_layout(layout)
    blocks = torch.randn(n, *pl.block_shape, generator=gen).to(DTYPE)
    hashes = [bytes(torch.randint(0, 256, (16,), dtype=torch.uint8, generator=gen).tolist()) for _ in range(n)]

    def cpu_tier_copies(checksums: bool) -> CpuTier:
        cpu = CpuTier(n * pl.block_bytes, checksums=checksums)
        for i in range(n):
            cpu.put(hashes[i], pl.key, blocks[i])
        return cpu

    # what the store sends: the CPU tier's copies, each with the sum64 taken as it was copied (in cache); the cost
    # of taking it there is timed here, apart from the put
    sum_t = interleaved({"summing": lambda: cpu_tier_copies(True), "plain": lambda: cpu_tier_copies(False)},
                        sizes.redis_rounds, 2, device)
    cpu = cpu_tier_copies(True)
    carried = [cpu.pop(h)[1] for h in hashes]  # [L, 2, H_kv, bs, D] each
    del cpu
    gc.collect()
    if any(block_sums.get(b) is None for b in carried):
        raise AssertionError("a CPU tier copy carries no sum64: the put would read it again")
    return RedisBlocks(pl, hashes, blocks, carried, [b"bench:raw:" + h.hex().encode() for h in hashes],
                       [b.view(torch.uint8).numpy().tobytes() for b in blocks],
                       [range(i, min(i + REDIS_BATCH, n)) for i in range(0, n, REDIS_BATCH)],
                       (sum_t["summing"] - sum_t["plain"]) / n * 1e6)


def redis_rows(data: RedisBlocks, layout: KVLayout, sizes: Sizes, device: torch.device, where: str,
               tiers: dict[str, RedisTier], client, raw_mget: str) -> list[dict]:
    """Put and get lines: `tiers["tier"]` (and any other tier in `tiers`, put only) against redis-py's pipelined SET
    and `raw_mget` of the same sizes through `client`, in one run."""
    pl, hashes, batches, tier = data.layout, data.hashes, data.batches, tiers["tier"]

    def tier_put(target: RedisTier, source: list[torch.Tensor]):
        for batch in batches:
            if not target.put_many([(hashes[i], pl.key, source[i]) for i in batch]):
                raise AssertionError(f"RedisTier.put_many failed: {target.stats.last_error or target.stats}")

    def tier_get():
        for batch in batches:
            found = tier.get_many([hashes[i] for i in batch], pl.key)
            if len(found) != len(batch):
                raise AssertionError(f"RedisTier.get_many found {len(found)} of {len(batch)} blocks")

    def raw_put():
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.set(data.raw_keys[i], data.raw_values[i], ex=3600)
            pipe.execute()

    def raw_get():
        for batch in batches:
            if any(v is None for v in getattr(client, raw_mget)([data.raw_keys[i] for i in batch])):
                raise AssertionError(f"raw {raw_mget} missed a key")

    views = list(data.blocks)  # the same bytes without a sum64 kept: summed in the put
    for source in (views, data.carried):
        tier_put(tier, source)
        back = tier.get_many([hashes[0], hashes[-1]], pl.key)
        if not (torch.equal(back[hashes[0]], data.blocks[0]) and torch.equal(back[hashes[-1]], data.blocks[-1])):
            raise AssertionError("RedisTier round trip changed a block")
    # puts first (each round overwrites the same keys), then gets of what is there
    def sealed(i: int) -> tuple[bytes, bytes, memoryview]:
        key, (head, body) = tier._key(hashes[i]), block_parts(pl.key, data.carried[i])
        return key, tier.auth.seal_block(key, head, body), body

    presealed = [[sealed(i) for i in batch] for batch in batches]

    def sends_only():  # the tier's SETs (and WAITs) of blobs whose tags were taken beforehand: the transport alone
        for batch in presealed:
            if tier.commands.send_sets(batch, tier.ttl_s, lambda key, head, body: head):
                raise AssertionError("the tier's sends were not confirmed")

    puts = {name: (lambda t=t: tier_put(t, data.carried)) for name, t in tiers.items()}
    put_t = interleaved({**puts, "summing": lambda: tier_put(tier, views), "sends only": sends_only, "raw": raw_put},
                        sizes.redis_rounds, 1, device)
    get_t = interleaved({"tier": tier_get, "raw": raw_get}, sizes.redis_rounds, 1, device)
    n, total = len(hashes), len(hashes) * pl.block_bytes
    results = []
    for op, t in (("put", put_t), ("get", get_t)):
        tier_mbs, raw_mbs = total / t["tier"] / 1e6, total / t["raw"] / 1e6
        raw_op = "pipelined SET ex=" if op == "put" else raw_mget.upper()
        result = {"op": op, "blocks": n, "tier_mbs": tier_mbs, "raw_mbs": raw_mbs,
                  "ratio_tier_over_raw": tier_mbs / raw_mbs, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        extra = ""
        if op == "put":
            result["summing_mbs"] = total / t["summing"] / 1e6
            result["ratio_summing_over_raw"] = result["summing_mbs"] / raw_mbs
            result["sum_at_copy_us"] = data.sum_at_copy_us
            for name in tiers.keys() - {"tier"}:
                result[f"{name}_mbs"] = total / t[name] / 1e6
                result[f"{name}_ms_per_batch_saved"] = (t["tier"] - t[name]) / len(batches) * 1e3
                extra += (f"; {name}: {result[f'{name}_mbs']:.0f} MB/s, ratio {result[f'{name}_mbs'] / raw_mbs:.2f}, "
                          f"so the wait costs {result[f'{name}_ms_per_batch_saved']:.2f} ms a batch")
            result["sends_only_mbs"] = total / t["sends only"] / 1e6
            extra += (f"; its sends alone, tags taken beforehand: {result['sends_only_mbs']:.0f} MB/s, ratio "
                      f"{result['sends_only_mbs'] / raw_mbs:.2f} (the rest is the keyed BLAKE3 tag of every block)")
            extra += (f"; the blocks carry the sum64 CpuTier.put took as it copied them (+{data.sum_at_copy_us:.0f}"
                      f" us a block there, not in the ratio); blocks without one, summed in the put: "
                      f"{result['summing_mbs']:.0f} MB/s, ratio {result['ratio_summing_over_raw']:.2f}")
        print(f"redis   {where}{op} {n} blocks of {layout.describe()} ({pl.block_bytes / 1e3:.0f} kB each) in batches "
              f"of {REDIS_BATCH}: RedisTier.{op}_many {tier_mbs:.0f} MB/s, raw {raw_op} {raw_mbs:.0f} MB/s -> "
              f"ratio tier/raw {tier_mbs / raw_mbs:.2f} (goal >= 0.8, {verdict(tier_mbs / raw_mbs >= 0.8)}: the "
              f"cost of tags, encoding and checksums; CPU capability {result['cpu_capability']}){extra}", flush=True)
        results.append(result)
    return results


def bench_redis(data: RedisBlocks, layout: KVLayout, sizes: Sizes, device: torch.device) -> list[dict]:
    """The tier on one redis-server on loopback."""
    import redis
    from redisproc import RedisProcess

    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-redis-") as tmp:
        server = RedisProcess(Path(tmp))
        server.start()
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=30.0)
            where = f"(redis-server {client.info('server').get('redis_version', '?')} on loopback) "
            return redis_rows(data, layout, sizes, device, where, {"tier": RedisTier(server.url, timeout_s=30.0)},
                              client, "mget")
        finally:
            server.stop()


def bench_redis_cluster(data: RedisBlocks, layout: KVLayout, sizes: Sizes, device: torch.device) -> list[dict]:
    """The tier on a local Redis Cluster of 3 primaries with a replica each (tests/redis_cluster.py): writes
    confirmed by a replica (WAIT, the default) and not (wait_replicas=0), against redis-py's RedisCluster."""
    from redis.cluster import RedisCluster
    from redis_cluster import PASSWORD, LocalCluster, cluster_available

    if not cluster_available():
        print("redis   cluster skipped: no redis-cli (or valkey-cli) on PATH; install it (apt-get install redis-tools)",
              flush=True)
        return []
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-cluster-") as tmp:
        with LocalCluster(Path(tmp)) as cluster:
            client = RedisCluster(host="127.0.0.1", port=cluster.primary_ports()[0], password=PASSWORD,
                                  socket_timeout=30.0)
            version = client.info("server", target_nodes=RedisCluster.RANDOM).get("redis_version", "?")
            tiers = {"tier": RedisTier(cluster.url(), timeout_s=30.0),
                     "without WAIT": RedisTier(cluster.url(wait_replicas=0), timeout_s=30.0)}
            where = (f"cluster (redis-server {version}, 3 primaries + 3 replicas on loopback, writes confirmed by 1 "
                     "replica) ")
            rows = redis_rows(data, layout, sizes, device, where, tiers, client, "mget_nonatomic")
            rows[0]["window_ms"] = replication_window(cluster, data.raw_values[:32])
            return rows


def replication_window(cluster, values: list[bytes]) -> dict:
    """How long after a primary answers a SET of one block its replica acknowledges it (WAIT 1 on the connection
    that sent it): the window in which a primary's crash loses a write it acknowledged, which wait_replicas=0 leaves
    open and the tier's WAIT closes. Median and largest of len(values) SETs, in ms."""
    port = cluster.primary_ports()[0]
    key = cluster.key_on(port, "bench:window")
    samples = []
    with cluster.node(port).client() as c:
        for value in values:
            c.set(key, value, ex=60)
            t0 = time.perf_counter()
            if c.execute_command("WAIT", 1, 1000) != 1:
                raise AssertionError("the replica did not acknowledge a SET within 1 s")
            samples.append((time.perf_counter() - t0) * 1e3)
    window = {"median_ms": statistics.median(samples), "max_ms": max(samples), "sets": len(samples)}
    print(f"redis   cluster replication window: a replica acknowledged a {len(values[0]) / 1e3:.0f} kB SET "
          f"{window['median_ms']:.2f} ms after its primary answered OK (median of {len(samples)}; largest "
          f"{window['max_ms']:.2f} ms): a write acknowledged on the primary's word alone (wait_replicas=0) is lost "
          "if the primary dies in that time; the tier's WAIT makes it wait that long instead (no goal)", flush=True)
    return window


def run_redis(layout: KVLayout, sizes: Sizes, device: torch.device) -> tuple[list[dict], list[dict]]:
    """The Redis lines, one server then a cluster, sending the same blocks (none without a redis-server)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's Redis processes
    from redisproc import redis_available

    if not redis_available():
        print("redis   skipped: no redis-server (or valkey-server) on PATH; install it (apt-get install redis-server)",
              flush=True)
        return [], []
    data = redis_blocks(layout, sizes, device)
    return bench_redis(data, layout, sizes, device), bench_redis_cluster(data, layout, sizes, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 blocks and 2 rounds instead of 512 and 7")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as bench_store.py's default (its --threads)
    device = resolve_device("auto")
    print(machine_line(device, "quick" if args.quick else "full"), flush=True)
    run_redis(small_layout("source", SMALL_SOURCE), QUICK if args.quick else FULL, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
