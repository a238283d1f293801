"""Where a block lives and how it moves: device pool, then the CPU tier, then Redis/Valkey.

Eviction from a device pool demotes the evicted blocks (still intact in the pool) down a tier before they are
overwritten; eviction from the CPU tier pushes down to Redis; a block that leaves the last local tier with no Redis
to take it is lost (the caller then drops the entries that use it). Reads promote blocks back onto the device.
Only blocks some entry uses (`registry.users`) are ever moved. No locking: the store's lock covers every call.

No Redis round trip happens here: the store's lock covers every call, and Redis I/O must not run under it.
Writes go to `outbox` (in order) and the store sends them after releasing its lock; until a put is sent its blocks
sit in `pending` and count as in Redis. A demoted block whose bytes Redis held when last seen (`in_redis`: sent there,
or read from there) is not sent again: a "keep" restarts its TTL, and only the blocks Redis no longer has go with it
(from `pending`, like a put). Nothing here deletes a block from Redis: other replicas' entries may use it there (blocks
are content-addressed); it expires by its TTL. Reads that need Redis raise `NeedRemote` naming the blocks; the store
fetches them without its lock and calls again with them `prefetched` (a hash mapped to None: Redis does not have it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout
from kvbridge.transfer.store.kv_blocks import Block, BlockHash
from kvbridge.transfer.store.registry import EntryRegistry
from kvbridge.transfer.store.tiers import CpuTier, RedisTier, block_sums

TIER_ORDER = ("device", "cpu", "redis")  # fastest first
_SUM_CHUNK_BYTES = 1 << 20  # blocks bound for Redis are read from the pool this much at a time: summed in cache


def lowest(tiers: set) -> str | None:
    """The slowest tier of a set (what a read touching all of them waits for)."""
    for tier in reversed(TIER_ORDER):
        if tier in tiers:
            return tier
    return None


def read_to_cpu(pool: BlockPool, block_ids: list[int], summed: list[bool]) -> list[torch.Tensor]:
    """CPU copies of pool blocks, [L, 2, H_kv, bs, D] each. Those marked `summed` (bound for a Redis put) have their
    sum64 taken while in cache (`block_sums`: the put then sends them without reading them again): the pool is
    then read 1 MiB at a time, else in one go."""
    step = max(1, _SUM_CHUNK_BYTES // pool.layout.block_bytes) if any(summed) else max(1, len(block_ids))
    out = []
    for at in range(0, len(block_ids), step):
        data = pool.read_blocks(torch.tensor(block_ids[at:at + step])).to("cpu")
        for block, take in zip(data, summed[at:at + step]):
            if take:
                block_sums.take(block)
            out.append(block)
    return out


class NeedRemote(Exception):
    """Blocks that only Redis may have: fetch them without the store's lock, then call again with them."""

    def __init__(self, hashes: list[BlockHash], layout: PoolLayout | None, entries: list[str] = ()):
        super().__init__(f"{len(hashes)} blocks and {len(entries)} entry records to fetch from Redis")
        self.hashes = hashes
        self.layout = layout  # of the blocks' pool: what each block read back must fit
        self.entries = list(entries)  # entry keys whose records (shared entries) to fetch


Prefetched = dict  # BlockHash -> torch.Tensor block from Redis, or None where Redis has none


class Residency:
    def __init__(self, registry: EntryRegistry, cpu: CpuTier | None, redis: RedisTier | None, evictions: dict):
        self.registry = registry
        self.cpu = cpu
        self.redis = redis
        self.evictions = evictions  # the store's counters: blocks pushed down from each tier
        # oldest first: ("put", [(hash, layout_key, block)]), ("keep", [(hash, layout_key, block)]),
        # ("entries", [sharing.RecordWrite]), ("forget", [key]), ("withdraw", [(key, tag)]), ("lost", [(key, tag,
        # hashes)]): sharing._send
        self.outbox: deque = deque()
        self.pending: dict[BlockHash, tuple[str, torch.Tensor]] = {}  # demoted blocks not yet sent to Redis
        # blocks some entry uses whose bytes Redis had when last seen (a put of them sent, a keep answered, a read
        # of them): a hint, never trusted alone, since Redis may have expired or evicted them since; a keep asks.
        # Any newer put of the same hash sits before the keep in the outbox.
        self.in_redis: set[BlockHash] = set()

    def tier_of(self, pool: BlockPool | None, h: BlockHash) -> str | None:
        """"device" or "cpu" where the block is held locally, else None (in Redis, or gone)."""
        if pool is not None and pool.lookup(h) is not None:
            return "device"
        if self.cpu is not None and h in self.cpu:
            return "cpu"
        return None

    def drop(self, pool: BlockPool | None, orphans: list[BlockHash]) -> None:
        """Drop blocks no entry uses from the local tiers. Not from Redis: another replica's entries may use them
        there (blocks are content-addressed); they expire by their TTL. (A put of them already queued still goes.)"""
        for h in orphans:
            self.in_redis.discard(h)
            block = pool.lookup(h) if pool is not None else None
            if block is not None:
                pool.drop(block)
            if self.cpu is not None:
                self.cpu.pop(h)

    def demote(self, pool: BlockPool, evicted: list[tuple[BlockHash, int]]) -> list[BlockHash]:
        """Move evicted device blocks down a tier; returns the hashes of the blocks that left the last tier."""
        if not evicted:
            return []
        self.evictions["device"] += len(evicted)
        users = self.registry.users
        live = [(h, i) for h, i in evicted if h in users]
        if not live:
            return []
        # straight down to Redis (no CPU tier, which sums its own copies): summed now, unless Redis holds it already
        straight = self.cpu is None and self.redis is not None and self.redis.usable()
        data = read_to_cpu(pool, [i for _, i in live], [straight and h not in self.in_redis for h, _ in live])
        below: list[tuple[BlockHash, str, torch.Tensor]] = []
        if self.cpu is not None:
            for (h, _), block in zip(live, data):
                below += self.cpu.put(h, pool.layout.key, block)
            self.evictions["cpu"] += len(below)
        else:
            below = [(h, pool.layout.key, block) for (h, _), block in zip(live, data)]
        return self.below_cpu(below)

    def give_back(self, pool: BlockPool, fresh: list[Block], popped: list[tuple[BlockHash, str, torch.Tensor]],
                  held: list[Block] = ()) -> list[BlockHash]:
        """Undo a write of blocks that failed (a device's out-of-memory error, say): the `fresh` blocks allocated for
        it unindexed and released with the `held` ones it took, and the CPU tier's copies it `popped` put back (the
        allocation may have taken the room they left, demoting what it evicted: what that pushes on goes below).
        Returns the hashes lost (below_cpu)."""
        for block in fresh:
            if block.block_hash is not None:
                del pool.hash_to_block[block.block_hash]
                block.block_hash = None
        pool.unref([*held, *fresh])
        below = []
        for block_hash, layout_key, data in popped:
            below += self.cpu.put(block_hash, layout_key, data)
        return self.below_cpu(below)

    def below_cpu(self, below: list[tuple[BlockHash, str, torch.Tensor]]) -> list[BlockHash]:
        """Blocks that left the CPU tier (or, without one, the device): to Redis when it is up (sent after the
        lock), else lost; returns the hashes of those lost (of blocks some entry still uses)."""
        users = self.registry.users
        below = [item for item in below if item[0] in users]
        if not below:
            return []
        if self.redis is not None and self.redis.usable():
            for h, key, block in below:
                self.pending[h] = (key, block)
            kept = [item for item in below if item[0] in self.in_redis]
            sent = [item for item in below if item[0] not in self.in_redis]
            for op, items in (("keep", kept), ("put", sent)):
                if items:
                    self.outbox.append((op, items))  # sent after the lock; a failed send loses them then
            return []  # Redis expires blocks itself (TTL); its own evictions are not seen from here
        return [h for h, _, _ in below]

    def make_resident(self, pool: BlockPool, hashes: list[BlockHash], keep_ref: bool,
                      allocate: Callable[[BlockPool, int], list[Block]], prefetched: Prefetched | None = None,
                      lose: Callable[[list[BlockHash]], None] = lambda hashes: None) -> list[Block]:
        """Bring every block of a chain onto the device (promoting from CPU / Redis). Returns the device blocks,
        each holding one extra ref (released here unless keep_ref). Raises NotFound if a block is gone, NeedRemote
        (before changing anything) when blocks must come from Redis and are not in `prefetched`.
        `allocate(pool, n)` takes n blocks, demoting what it evicts; it may lose entries, so the caller has the hashes
        claimed in the registry (an entry's, or `EntryRegistry.claim`): a held block must never be dropped."""
        present, missing = [], []
        for i, h in enumerate(hashes):
            block = pool.lookup(h)
            if block is not None:
                present.append(block)
            else:
                missing.append(i)
        if missing and self.redis is not None:
            prefetched = prefetched or {}
            remote = [hashes[i] for i in missing if hashes[i] not in prefetched and hashes[i] not in self.pending
                      and (self.cpu is None or hashes[i] not in self.cpu)]
            if remote:
                raise NeedRemote(remote, pool.layout)
        pool.ref(present)  # protect them while promotion allocates
        try:
            if missing:
                self._promote(pool, hashes, missing, allocate, prefetched or {}, lose)
        except Exception:
            pool.unref(present)
            raise
        blocks = [pool.lookup(h) for h in hashes]
        assert None not in blocks, "a block held across promotion was dropped (its hashes were not claimed)"
        # present ones hold our ref; new ones hold the allocation ref: one extra ref each, as documented
        if not keep_ref:
            pool.unref(blocks)
        return blocks

    def _promote(self, pool: BlockPool, hashes: list[BlockHash], missing: list[int],
                 allocate: Callable[[BlockPool, int], list[Block]], prefetched: Prefetched,
                 lose: Callable[[list[BlockHash]], None]) -> None:
        layout_key = pool.layout.key
        # Blocks leave the CPU tier before allocation can demote into it (so they cannot be evicted meanwhile);
        # on failure exactly those go back, into the room they left.
        data: dict[int, torch.Tensor] = {}
        from_cpu: list[int] = []
        redis_wanted = []
        for i in missing:
            item = self.cpu.pop(hashes[i]) if self.cpu is not None else None
            if item is not None:
                data[i] = item[1]
                from_cpu.append(i)
            else:
                redis_wanted.append(i)

        def restore() -> None:
            for i in from_cpu:
                evicted = self.cpu.put(hashes[i], layout_key, data[i])
                assert not evicted, "restoring popped blocks cannot overflow the CPU tier"

        if redis_wanted and self.redis is not None:
            for i in redis_wanted:
                waiting = self.pending.get(hashes[i])
                if waiting is not None and waiting[0] == layout_key:
                    data[i] = waiting[1]
                elif prefetched.get(hashes[i]) is not None:
                    data[i] = prefetched[hashes[i]]
                    if hashes[i] in self.registry.users:  # these very bytes are in Redis
                        self.in_redis.add(hashes[i])
        absent = [i for i in missing if i not in data]
        if absent:
            restore()
            raise NotFound(f"{len(absent)} of {len(hashes)} blocks are no longer stored")
        try:
            new_blocks = allocate(pool, len(missing))
        except CapacityError:  # raised before any eviction: the CPU tier is as we left it
            restore()
            raise
        try:  # a device's out-of-memory error, say: the blocks given back, the CPU tier's copies put back
            ids = torch.tensor([b.block_id for b in new_blocks])
            pool.write(ids, torch.stack([data[i] for i in missing]))
            for i, block in zip(missing, new_blocks):
                pool.set_hash(block, hashes[i])
        except BaseException:
            lose(self.give_back(pool, new_blocks, [(hashes[i], layout_key, data[i]) for i in from_cpu]))
            raise
