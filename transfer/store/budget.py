"""The device's one byte budget, shared by every layout's block pool: which pool takes room and which gives it up.

The device capacity is one count of bytes, not a share per layout: source KV and projections of any mix use all of
it. A pool is made with no block and gains slabs (runs of `slab_blocks` blocks of about `slab_bytes` each; the last
one cut to what is left) while the budget has bytes to spare; memory is reserved slab by slab as KV arrives, never
up front per layout. When a pool needs a block and the budget has none to spare, room comes from, in this order:
1. another pool holding a slab's worth of empty blocks: it moves its live blocks out of its smallest slab and gives
   the slab up (nothing is evicted);
2. eviction in LRU order across pools: the least recently used cached free block of any pool decides. If it is the
   asking pool's own, that block is taken (evicted), as within one pool. If it is another pool's, that pool gives
   up its smallest slab: it evicts its own least recently used blocks (chains' tails first) until the slab's live
   blocks fit in its other rows, moves them there and frees the slab. A pool yields a slab at a time, so a few
   of its blocks may go before a slightly older block of the asking pool.
Evicted KV is demoted (`Residency.demote`: to the CPU tier, then Redis) while still intact, before its rows are
written or freed. A request that cannot be met raises CapacityError before anything changes.

The CPU tier keeps its own capacity (`StoreConfig.cpu_capacity_bytes`) under the same scheme already: one byte
count over blocks of every layout, least recently used first (`tiers.CpuTier`; each block its own host tensor, so
it has no slabs to give up).

Invariants (checked by `check`): the pools' slabs add up to at most `capacity_bytes`; every pool's slabs hold at
most `slab_blocks` blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from kvbridge.transfer.errors import CapacityError
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout
from kvbridge.transfer.store.kv_blocks import Block, BlockHash

log = logging.getLogger(__name__)

__all__ = ["DeviceBudget"]

MIN_SLABS = 32  # a store of several layouts smaller than 32 slabs of slab_bytes gets slabs of capacity / 32, so that
#                layouts can still trade room

Demote = Callable[[BlockPool, list[tuple[BlockHash, int]]], list[BlockHash]]  # evicted -> hashes lost for good


class DeviceBudget:
    def __init__(self, capacity_bytes: int, slab_bytes: int, max_layouts: int, device: torch.device):
        self.capacity_bytes = capacity_bytes
        # one layout trades with nobody: its slabs may be as large as asked (fewer runs to copy per read)
        self.slab_bytes = min(slab_bytes, capacity_bytes if max_layouts == 1 else max(1, capacity_bytes // MIN_SLABS))
        self.max_layouts = max_layouts
        self.device = device
        self.pools: dict[str, BlockPool] = {}

    @property
    def reserved_bytes(self) -> int:
        """Bytes of every pool's slabs."""
        return sum(p.bytes_reserved for p in self.pools.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes

    def max_blocks(self, layout: PoolLayout) -> int:
        """The most blocks of this layout the device could hold: the whole capacity."""
        return self.capacity_bytes // layout.block_bytes

    def pool_for(self, layout: PoolLayout, create: bool) -> BlockPool | None:
        """The pool of this layout; a new one (no slab yet) when create. ValueError when the store holds another
        shape under the same model and dtype; CapacityError past max_layouts or when one block exceeds the store."""
        pool = self.pools.get(layout.key)
        if pool is not None:
            if pool.layout != layout:
                raise ValueError(
                    f"layout mismatch for {layout.key}: the store holds [L={pool.layout.num_layers}, "
                    f"H_kv={pool.layout.num_kv_heads}, D={pool.layout.head_dim}, block {pool.layout.block_size}], "
                    f"got [L={layout.num_layers}, H_kv={layout.num_kv_heads}, D={layout.head_dim}, "
                    f"block {layout.block_size}]"
                )
            return pool
        if not create:
            return None
        if len(self.pools) >= self.max_layouts:
            raise CapacityError(f"the store already holds {len(self.pools)} layouts (max_layouts); "
                                f"cannot add {layout.key}")
        if layout.block_bytes > self.capacity_bytes:
            raise CapacityError(f"{layout.key}: one block needs {layout.block_bytes} bytes, the store's device "
                                f"capacity is {self.capacity_bytes} bytes")
        slab_blocks = max(1, self.slab_bytes // layout.block_bytes)
        pool = BlockPool(layout, 0, self.device, slab_blocks=slab_blocks)
        self.pools[layout.key] = pool
        log.info("pool %s: slabs of %d blocks of %d tokens (%d bytes) on %s, out of %d bytes for every layout",
                 layout.key, slab_blocks, layout.block_size, slab_blocks * layout.block_bytes, self.device,
                 self.capacity_bytes)
        return pool

    def drop_if_unused(self, pool: BlockPool) -> None:
        """Forget a pool that holds no slab (one a refused put created): it no longer counts against max_layouts."""
        if pool.bytes_reserved == 0 and self.pools.get(pool.layout.key) is pool:
            del self.pools[pool.layout.key]

    def obtainable(self, pool: BlockPool) -> int:
        """Blocks `pool` could get now: its free ones, the spare bytes, and the slabs other pools could give up."""
        spare = self.free_bytes + sum(p.yieldable_bytes() for p in self.pools.values() if p is not pool)
        return pool.num_free + spare // pool.layout.block_bytes

    def allocate(self, pool: BlockPool, n: int, demote: Demote) -> tuple[list[Block], list[BlockHash]]:
        """n blocks of `pool` (one ref each, as BlockPool.allocate), making room as the module says. Returns them
        and the hashes demote() reported lost. CapacityError (nothing changed) when n cannot be had."""
        bb = pool.layout.block_bytes
        if n > pool.num_empty + self.free_bytes // bb and n > self.obtainable(pool):
            raise CapacityError(f"{pool.layout.key}: need {n} free blocks, {self.obtainable(pool)} of "
                                f"{self.max_blocks(pool.layout)} are free or can be freed (the rest are pinned or "
                                "in use)")
        lost: list[BlockHash] = []
        own = 0  # the pool's own cached blocks to evict (taken by pool.allocate after its empty ones)
        cursor: Block | None = None  # the next of them
        others: dict[str, tuple[bool, Block | None]] = {}  # key -> (can give up a slab unevicted, oldest cached)
        while pool.num_empty + own < n:
            room = self.free_bytes // bb
            if room:
                pool.add_slab(min(pool.slab_blocks, room))
                continue
            for key, p in self.pools.items():
                if p is not pool and key not in others:
                    others[key] = (p.can_yield(evicting=False), p.oldest_cached() if p.can_yield(True) else None)
            moving = next((k for k, (unevicted, _) in others.items() if unevicted), None)
            if moving is not None:
                self.pools[moving].give_up_slab(_no_eviction)
                del others[moving]
                continue
            if own == 0:
                cursor = pool.oldest_cached()
            candidates = [(b.stamp, k) for k, (_, b) in others.items() if b is not None]
            if cursor is not None:
                candidates.append((cursor.stamp, None))
            assert candidates, f"{pool.layout.key}: obtainable() promised {n} blocks"
            _, victim = min(candidates, key=lambda c: c[0])
            if victim is None:
                own += 1
                cursor = cursor.next_free if cursor.next_free.block_hash is not None else None
            else:
                giver = self.pools[victim]
                giver.give_up_slab(lambda evicted, p=giver: lost.extend(demote(p, evicted)))
                del others[victim]
        blocks, evicted = pool.allocate(n)
        lost += demote(pool, evicted)
        return blocks, lost

    def check(self) -> list[str]:
        problems = []
        if self.reserved_bytes > self.capacity_bytes:
            problems.append(f"the pools' slabs hold {self.reserved_bytes} bytes, over the device capacity "
                            f"{self.capacity_bytes}")
        for pool in self.pools.values():
            if any(s is not None and s.shape[0] > pool.slab_blocks for s in pool.slabs):
                problems.append(f"{pool.layout.key}: a slab holds more than {pool.slab_blocks} blocks")
        return problems


def _no_eviction(evicted: list) -> None:
    assert not evicted, "a slab given up without eviction evicted blocks"
