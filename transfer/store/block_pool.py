"""BlockPool: the preallocated KV blocks of one layout, with ref counts, a hash index and LRU eviction.

Nothing here knows about entries, tenants or tiers: the store decides what a block holds, the pool keeps the
bookkeeping right. Invariants (checked by `check`):
- a block is in the free queue if and only if its ref_cnt is 0;
- `hash_to_block[h] is b` if and only if `b.block_hash == h`;
- free blocks without a hash sit before every free block with one (they are taken first).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvbridge.transfer.errors import CapacityError
from kvbridge.transfer.store.kv_blocks import Block, BlockHash, FreeBlockQueue

__all__ = ["BlockPool", "PoolLayout", "CapacityError", "layout_key"]


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


class BlockPool:
    def __init__(self, layout: PoolLayout, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"a pool needs at least one block; {layout.key} got {num_blocks}")
        self.layout = layout
        self.device = device
        # kv: [num_blocks, L, 2, H_kv, block_size, D]. Zeros either way: on the CPU a fresh allocation of this size
        # is mapped from the OS, whose pages read as zeros and are faulted in as blocks are first written (zeros()
        # would touch the whole pool when it is made: 256 MB, ~3.5 s on a 2-core VM, inside the first request of a
        # model); on CUDA the caching allocator may hand back used memory, so it is cleared.
        shape = (num_blocks, *layout.block_shape)
        self.kv = (torch.zeros(shape, dtype=layout.torch_dtype, device=device) if torch.device(device).type != "cpu"
                   else _os_zeroed(shape, layout.torch_dtype))
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_to_block: dict[BlockHash, Block] = {}
        # (No gc.freeze() here: it would freeze every object of the process at that moment, request state
        # included, for good. The blocks are only walked by the rare full collections.)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

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
        they held: that KV is still in `kv` until the caller overwrites it, so it can be demoted first.
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
                else:
                    self.free_queue.append(block)

    def touch(self, blocks: list[Block]) -> None:
        """Mark free cached blocks as just used (tail first, as in unref)."""
        for block in reversed(blocks):
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.free_queue.append(block)

    def drop(self, block: Block) -> None:
        """Forget a block's KV (delete): unindex it and, if free, make it the next one taken."""
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash = None
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)

    def write(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """One scatter. block_ids: [n]; data: [n, L, 2, H_kv, block_size, D] (any strides)."""
        self.kv.index_copy_(0, block_ids.to(self.device), data.to(device=self.device, dtype=self.kv.dtype))

    def write_segment(self, block_ids: list[int], kv: torch.Tensor, which: list[int]) -> None:
        """Blocks `which` of a segment into pool blocks block_ids (one each): kv [L, 2, H_kv, T, D], block i holding
        tokens i·bs .. (i+1)·bs - 1; a last partial block is zero-padded. Each byte is copied once, straight from
        the segment (no padded or gathered copy of it first)."""
        bs = self.layout.block_size
        t = kv.shape[3]
        full = t // bs
        l, _, h, _, d = kv.shape
        # [full, L, 2, H, bs, D]: a view of the whole blocks
        blocks = kv[:, :, :, :full * bs].reshape(l, 2, h, full, bs, d).permute(3, 0, 1, 2, 4, 5)
        pairs = [(b, i) for b, i in zip(block_ids, which) if i < full]
        if pairs:
            ids = torch.tensor([b for b, _ in pairs])
            if len(pairs) == full:  # every whole block: the segment's own view, no gather
                self.write(ids, blocks)
            else:
                self.write(ids, blocks.index_select(0, torch.tensor([i for _, i in pairs], device=kv.device)))
        for b, i in zip(block_ids, which):
            if i >= full:  # the partial tail: its tokens, then zeros
                dest = self.kv[b]  # [L, 2, H, bs, D]
                dest[:, :, :, t - full * bs:].zero_()
                dest[:, :, :, :t - full * bs].copy_(kv[:, :, :, full * bs:])

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids: [n] -> [n, L, 2, H_kv, block_size, D] (a copy)."""
        return self.kv.index_select(0, block_ids.to(self.device))

    def gather(self, block_ids: torch.Tensor, num_tokens: int, out: torch.Tensor | None = None,
               written: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Gather blocks into the segment layout: block_ids [n] -> kv [L, 2, H_kv, num_tokens, D], contiguous.

        One index_select of the whole blocks written straight into the output (plus one copy of the partial tail
        block), the same number of kernels whatever n is. `out` (that shape and dtype, on the pool's device; each
        [T, D] row dense: contiguous, or the first T slots of each row of a longer buffer) is filled instead of a
        fresh tensor: large fresh CPU allocations page-fault on first write. With
        `written`, the layers are gathered one at a time and written(l, l + 1) is called after each (a caller can
        checksum a layer while it is still in cache).
        """
        layout = self.layout
        n = block_ids.numel()
        bs = layout.block_size
        assert (n - 1) * bs < num_tokens <= n * bs, "token count does not fit blocks"
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
        if out is None:
            out = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != self.kv.dtype or out.device != self.kv.device \
                or out.stride()[3:] != (layout.head_dim, 1):
            raise ValueError(f"out must be a {self.kv.dtype} tensor of shape {shape} on {self.device} with dense "
                             f"[T, D] rows, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
        view = self.kv.permute(1, 2, 3, 0, 4, 5)  # [L, 2, H, N, bs, D], no copy
        block_ids = block_ids.to(self.device)
        steps = [(0, layout.num_layers)] if written is None else [(i, i + 1) for i in range(layout.num_layers)]
        full = num_tokens // bs  # whole blocks
        for a, b in steps:
            if full:
                dest = out[a:b, :, :, : full * bs].view(b - a, *shape[1:3], full, bs, layout.head_dim)
                torch.index_select(view[a:b], 3, block_ids[:full], out=dest)
            if full < n:
                out[a:b, :, :, full * bs:].copy_(view[a:b, :, :, block_ids[full], : num_tokens - full * bs])
            if written is not None:
                written(a, b)
        return out

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
