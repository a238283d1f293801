"""The store's invariants, checked from outside its methods: `check_store(store)` lists every violation in words.

- every pool's own invariants (`BlockPool.check`), and the byte budget's (`DeviceBudget.check`: every pool's slabs
  together within the one device capacity);
- a device block's ref_cnt equals the number of pinned entries using it, and pinned entries are on the device;
- a hash is on the device or in the CPU tier, not both; the CPU tier's own accounting;
- the registry's indexes match the entries (block users, derived links);
- without Redis, every entry's blocks are all held locally.
The caller holds the store's lock.
"""

from __future__ import annotations

from kvbridge.transfer.store.budget import DeviceBudget
from kvbridge.transfer.store.registry import EntryRegistry
from kvbridge.transfer.store.residency import Residency


def check_store(budget: DeviceBudget, registry: EntryRegistry, residency: Residency) -> list[str]:
    """budget: the device pools (layout key -> pool) and their one byte budget."""
    pools = budget.pools
    problems = budget.check()
    entries = registry.entries.values()
    cpu = residency.cpu
    for pool in pools.values():
        problems += pool.check()
        expected = {b.block_id: 0 for b in pool.blocks}
        for entry in entries:
            if entry.pinned and entry.layout.key == pool.layout.key:
                for h in entry.hashes:
                    block = pool.lookup(h)
                    if block is None:
                        problems.append(f"pinned entry {entry.key} has block {h.hex()} off the device")
                    else:
                        expected[block.block_id] += 1
        for block in pool.blocks:
            if block.ref_cnt != expected[block.block_id]:
                problems.append(f"{pool.layout.key}: block {block.block_id} ref_cnt {block.ref_cnt}, "
                                f"{expected[block.block_id]} pinned entries use it")
        if cpu is not None:
            both = set(pool.hash_to_block).intersection(cpu.hashes())
            if both:
                problems.append(f"{len(both)} blocks are both on the device and in the CPU tier")
    if cpu is not None:
        problems += cpu.check()
    problems += registry.check()
    if residency.redis is None:
        for entry in entries:
            pool = pools.get(entry.layout.key)
            lost = [h for h in entry.hashes if residency.tier_of(pool, h) is None]
            if lost:
                problems.append(f"entry {entry.key} has {len(lost)} blocks in no tier")
    return problems
