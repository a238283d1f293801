"""BlockPool: the KV blocks of one layout in slabs (preallocated runs of blocks, added and released whole), with
ref counts, a hash index and LRU eviction.

Nothing here knows about entries, tenants, tiers or the store's byte budget: the store decides what a block holds
and when the pool gains or gives up a slab (`budget`), the pool keeps the bookkeeping right; moving KV into and out
of the slabs (write, gather): `pool_data`. A block's id is `slab * slab_blocks + row`. Invariants (checked by `check`):
- a block is in the free queue if and only if its ref_cnt is 0;
- `hash_to_block[h] is b` if and only if `b.block_hash == h`;
- free blocks without a hash ("empty") sit before every free block with one (they are taken first), and
  `num_empty` counts them;
- free blocks with a hash sit in the order of their stamps (least recently used first).
"""

from __future__ import annotations

import itertools
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvbridge.transfer.errors import CapacityError
from kvbridge.transfer.store.kv_blocks import Block, BlockHash, FreeBlockQueue
from kvbridge.transfer.store.pool_data import PoolData

__all__ = ["BlockPool", "PoolLayout", "CapacityError", "layout_key"]

_TICKS = itertools.count(1)  # stamps of every pool in the process: LRU order across pools


def layout_key(model: str, dtype: str) -> str:
    """The key of a pool: one per model identity and dtype."""
    return f"{model}/{dtype}"


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The shape of one model's KV in one dtype; one pool per layout."""

    model: str  # ModelIdentity.key
    dtype: str  # torch dtype name, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def key(self) -> str:
        return layout_key(self.model, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        return n * torch.empty(0, dtype=self.torch_dtype).element_size()



def _os_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS zero-fills on first touch: an anonymous mmap, not a memset."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class BlockPool(PoolData):
    def __init__(self, layout: PoolLayout, num_blocks: int, device: torch.device, slab_blocks: int | None = None):
        """num_blocks: blocks to start with (0: none until `add_slab`); slab_blocks: the most blocks one slab holds
        (default num_blocks: one slab)."""
        slab_blocks = slab_blocks or num_blocks
        if num_blocks < 0 or slab_blocks < 1:
            raise ValueError(f"{layout.key}: a pool needs slabs of at least one block and num_blocks >= 0, got "
                             f"num_blocks={num_blocks}, slab_blocks={slab_blocks}")
        self.layout = layout
        self.device = device
        self.dtype = layout.torch_dtype
        self.kv_device = torch.empty(0, device=device).device  # with its index (cuda:0), as tensors report it
        self.slab_blocks = slab_blocks
        self.slabs: list[torch.Tensor | None] = []  # each [n <= slab_blocks, L, 2, H_kv, block_size, D]; None: given up
        self._rows: list[list[Block] | None] = []  # the blocks of each slab, by row
        self.free_queue = FreeBlockQueue([])
        self.hash_to_block: dict[BlockHash, Block] = {}
        self.num_blocks = 0
        self.num_empty = 0  # free blocks without a hash
        while self.num_blocks < num_blocks:
            self.add_slab(min(slab_blocks, num_blocks - self.num_blocks))
        # (No gc.freeze() here: it would freeze every object of the process at that moment, request state
        # included, for good. The blocks are only walked by the rare full collections.)

    # ------------------------------------------------------------------------------------------------ slabs

    def add_slab(self, n: int) -> None:
        """n more empty blocks (1 <= n <= slab_blocks), in a slab of their own, taken before any cached block.
        Zeros either way: on the CPU the slab is mapped from the OS, whose pages read as zeros and are faulted in as
        blocks are first written (zeros() would touch it all when it is made: 256 MB, ~3.5 s on a 2-core VM, inside
        a request); on CUDA the caching allocator may hand back used memory, so it is cleared."""
        assert 1 <= n <= self.slab_blocks, f"a slab holds 1..{self.slab_blocks} blocks, asked {n}"
        shape = (n, *self.layout.block_shape)
        kv = (torch.zeros(shape, dtype=self.layout.torch_dtype, device=self.device)
              if torch.device(self.device).type != "cpu" else _os_zeroed(shape, self.layout.torch_dtype))
        index = self.slabs.index(None) if None in self.slabs else len(self.slabs)
        rows = [Block(index * self.slab_blocks + r) for r in range(n)]
        if index == len(self.slabs):
            self.slabs.append(kv)
            self._rows.append(rows)
        else:
            self.slabs[index], self._rows[index] = kv, rows
        for block in reversed(rows):
            self.free_queue.appendleft(block)
        self.num_blocks += n
        self.num_empty += n

    def _yield_order(self) -> list[int]:
        """Slabs that could be given up one after another (smallest first) with every held block (ref_cnt > 0)
        still fitting in the rest."""
        held = sum(1 for b in self.blocks if b.ref_cnt > 0)
        left, order = self.num_blocks, []
        for i in sorted((i for i, r in enumerate(self._rows) if r is not None), key=lambda i: len(self._rows[i])):
            if held <= left - len(self._rows[i]):
                left -= len(self._rows[i])
                order.append(i)
        return order

    def yieldable_bytes(self) -> int:
        """Bytes of the slabs this pool could give up, evicting what it must."""
        return sum(len(self._rows[i]) for i in self._yield_order()) * self.layout.block_bytes

    def can_yield(self, evicting: bool) -> bool:
        """Whether a slab can be given up at all (evicting: cached blocks may be evicted; else only moved)."""
        order = self._yield_order()
        return bool(order) and (evicting or self.num_empty >= len(self._rows[order[0]]))

    def oldest_cached(self) -> Block | None:
        """The least recently used free block with a hash (the next one evicted), if any."""
        block = self.free_queue.first()
        for _ in range(self.num_empty):
            block = block.next_free
        return block if block is not None and block.block_hash is not None else None

    def give_up_slab(self, demote: Callable[[list[tuple[BlockHash, int]]], None]) -> int:
        """Release the smallest slab that can go: evict the least recently used cached blocks until the slab's live
        blocks fit in the others' empty rows, call demote(evicted (hash, block_id)) while their KV is still intact,
        move the live blocks (hash, refs and place in the LRU order kept), free the slab. Returns its bytes."""
        order = self._yield_order()
        assert order, f"{self.layout.key}: no slab can be given up (held blocks need them all)"
        index = order[0]
        victims = self._rows[index]
        evicted = []
        block = self.oldest_cached()
        while self.num_empty < len(victims):  # each eviction frees a row in the victim or an empty row elsewhere
            assert block is not None, "a slab that can go has enough cached blocks to evict"
            after = block.next_free
            evicted.append((block.block_hash, block.block_id))
            self.drop(block)
            block = after if after is not None and after.block_hash is not None else None
        if evicted:
            demote(evicted)
        live = [b for b in victims if b.ref_cnt > 0 or b.block_hash is not None]
        empties = itertools.islice((b for b in self.free_queue if b.block_id // self.slab_blocks != index),
                                   len(live))
        pairs = list(zip(live, empties))
        assert len(pairs) == len(live), "every live block of the slab has an empty row to go to"
        if pairs:
            data = self.read_blocks(torch.tensor([src.block_id for src, _ in pairs]))
            self.write(torch.tensor([dst.block_id for _, dst in pairs]), data)
        for src, dst in pairs:
            self.free_queue.remove(dst)
            self.num_empty -= 1
            dst.ref_cnt, dst.block_hash, dst.stamp = src.ref_cnt, src.block_hash, src.stamp
            if src.block_hash is not None:
                self.hash_to_block[src.block_hash] = dst
            if src.ref_cnt == 0:
                self.free_queue.replace(src, dst)
                self.free_queue.appendleft(src)  # empty now: released with the slab below
                self.num_empty += 1
            src.ref_cnt, src.block_hash = 0, None
        for b in victims:
            if b.prev_free is None:
                self.free_queue.appendleft(b)
                self.num_empty += 1
        for b in victims:
            self.free_queue.remove(b)
        self.num_empty -= len(victims)
        self.num_blocks -= len(victims)
        self.slabs[index] = self._rows[index] = None
        return len(victims) * self.layout.block_bytes

    @property
    def blocks(self) -> list[Block]:
        return [b for rows in self._rows if rows is not None for b in rows]

    @property
    def bytes_reserved(self) -> int:
        """Bytes of the pool's slabs."""
        return self.num_blocks * self.layout.block_bytes

    # ------------------------------------------------------------------------------------------------ blocks

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def bytes_used(self) -> int:
        """Bytes of blocks holding KV. Between store operations every such block is indexed by its hash."""
        return len(self.hash_to_block) * self.layout.block_bytes

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.hash_to_block.get(block_hash)

    def allocate(self, n: int) -> tuple[list[Block], list[tuple[BlockHash, int]]]:
        """Take n free blocks, least recently used first. Returns them and the (hash, block_id) of the cached KV
        they held: that KV is still in the pool until the caller overwrites it, so it can be demoted first.
        Raises CapacityError (pool unchanged) when fewer than n blocks are free."""
        if n > self.free_queue.num_free:
            raise CapacityError(
                f"{self.layout.key}: need {n} free blocks, {self.free_queue.num_free} of {self.num_blocks} are free "
                "(the rest are pinned or in use)"
            )
        taken, evicted = [], []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append((block.block_hash, block.block_id))
                del self.hash_to_block[block.block_hash]
                block.block_hash = None
            else:
                self.num_empty -= 1
            block.ref_cnt = 1  # the caller holds it until it caches or releases it
            taken.append(block)
        return taken, evicted

    def set_hash(self, block: Block, block_hash: BlockHash) -> None:
        assert block.block_hash is None and block_hash not in self.hash_to_block, "hash already indexed"
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block

    def ref(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_empty -= block.block_hash is None
            block.ref_cnt += 1

    def unref(self, blocks: list[Block]) -> None:
        """Release blocks; those reaching 0 go to the most-recently-used end, the chain's tail first, so a chain
        is evicted from its tail back towards its head."""
        for block in reversed(blocks):
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                    self.num_empty += 1
                else:
                    block.stamp = next(_TICKS)
                    self.free_queue.append(block)

    def touch(self, blocks: list[Block]) -> None:
        """Mark free cached blocks as just used (tail first, as in unref)."""
        for block in reversed(blocks):
            if block.ref_cnt == 0 and block.block_hash is not None:
                self.free_queue.remove(block)
                block.stamp = next(_TICKS)
                self.free_queue.append(block)

    def drop(self, block: Block) -> None:
        """Forget a block's KV (delete): unindex it and, if free, make it the next one taken."""
        cached = block.block_hash is not None
        if cached:
            del self.hash_to_block[block.block_hash]
            block.block_hash = None
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
            self.num_empty += cached

    def check(self) -> list[str]:
        """Violated invariants, in words (empty when all hold)."""
        problems = []
        queued = set()
        seen_hashed_free = False
        for block in self.free_queue:
            queued.add(block.block_id)
            if block.block_hash is not None:
                seen_hashed_free = True
            elif seen_hashed_free:
                problems.append(f"{self.layout.key}: empty free block {block.block_id} queued after cached ones")
        if len(queued) != self.free_queue.num_free:
            problems.append(f"{self.layout.key}: free queue holds {len(queued)} blocks, "
                            f"counts {self.free_queue.num_free}")
        stamps = [b.stamp for b in self.free_queue if b.block_hash is not None]
        if stamps != sorted(stamps):
            problems.append(f"{self.layout.key}: cached free blocks are not in least-recently-used order")
        empty = sum(1 for b in self.free_queue if b.block_hash is None)
        if empty != self.num_empty:
            problems.append(f"{self.layout.key}: {empty} free blocks without a hash, num_empty counts {self.num_empty}")
        if len(self.blocks) != self.num_blocks or any(
                s is not None and s.shape[0] != len(r) for s, r in zip(self.slabs, self._rows)):
            problems.append(f"{self.layout.key}: slabs hold {len(self.blocks)} blocks, num_blocks counts "
                            f"{self.num_blocks}")
        for block in self.blocks:
            if (block.block_id in queued) == (block.ref_cnt > 0):
                problems.append(f"{self.layout.key}: block {block.block_id} ref_cnt {block.ref_cnt} but "
                                f"{'in' if block.block_id in queued else 'not in'} the free queue")
            if block.ref_cnt < 0:
                problems.append(f"{self.layout.key}: block {block.block_id} has ref_cnt {block.ref_cnt}")
            if block.block_hash is not None and self.hash_to_block.get(block.block_hash) is not block:
                problems.append(f"{self.layout.key}: block {block.block_id} hash not indexed to it")
        for h, block in self.hash_to_block.items():
            if block.block_hash != h:
                problems.append(f"{self.layout.key}: index maps a hash to block {block.block_id} holding another")
        return problems
