"""BlockPool's KV data: blocks written into, read from and gathered out of its slabs; a mixin of BlockPool.

One scatter or index_select per slab, or per run of consecutive blocks in one slab. Nothing here touches ref counts,
hashes or the free queue. It uses the pool's slabs, slab_blocks, layout, device, dtype and kv_device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PoolData:
    """BlockPool's reads and writes of KV (see the module docstring). A block's id is `slab * slab_blocks + row`."""

    def _by_slab(self, block_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """block_ids [n] (CPU) -> [(slab, positions in block_ids, rows in the slab)] for each slab they touch."""
        ids = block_ids.cpu()
        slab, rows = ids // self.slab_blocks, ids % self.slab_blocks
        if bool((slab == slab[0]).all()):
            return [(int(slab[0]), torch.arange(ids.numel()), rows)]
        return [(int(s), (slab == s).nonzero().flatten(), rows[slab == s]) for s in slab.unique().tolist()]

    def row(self, block_id: int) -> torch.Tensor:
        """One block's KV, a view: [L, 2, H_kv, block_size, D]."""
        return self.slabs[block_id // self.slab_blocks][block_id % self.slab_blocks]

    def write(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """One scatter per slab. block_ids: [n]; data: [n, L, 2, H_kv, block_size, D] (any strides)."""
        for s, pos, rows in self._by_slab(block_ids):
            kv = self.slabs[s]
            part = data if pos.numel() == data.shape[0] else data.index_select(0, pos.to(data.device))
            kv.index_copy_(0, rows.to(self.device), part.to(device=self.device, dtype=kv.dtype))

    def write_segment(self, block_ids: list[int], kv: torch.Tensor, which: list[int]) -> None:
        """Blocks `which` of a segment into pool blocks block_ids (one each): kv [L, 2, H_kv, T, D], block i holding
        tokens i·bs .. (i+1)·bs - 1; a last partial block is zero-padded. Each byte is copied once, straight from
        the segment (no padded or gathered copy of it first)."""
        bs = self.layout.block_size
        t = kv.shape[3]
        full = t // bs
        layers, _, h, _, d = kv.shape
        # [full, L, 2, H, bs, D]: a view of the whole blocks
        blocks = kv[:, :, :, :full * bs].reshape(layers, 2, h, full, bs, d).permute(3, 0, 1, 2, 4, 5)
        pairs = [(b, i) for b, i in zip(block_ids, which) if i < full]
        if pairs:
            ids = torch.tensor([b for b, _ in pairs])
            if len(pairs) == full:  # every whole block: the segment's own view, no gather
                self.write(ids, blocks)
            else:
                self.write(ids, blocks.index_select(0, torch.tensor([i for _, i in pairs], device=kv.device)))
        for b, i in zip(block_ids, which):
            if i >= full:  # the partial tail: its tokens, then zeros
                dest = self.row(b)  # [L, 2, H, bs, D]
                dest[:, :, :, t - full * bs:].zero_()
                dest[:, :, :, :t - full * bs].copy_(kv[:, :, :, full * bs:])

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids: [n] -> [n, L, 2, H_kv, block_size, D] (a copy)."""
        parts = self._by_slab(block_ids)
        if len(parts) == 1:
            return self.slabs[parts[0][0]].index_select(0, parts[0][2].to(self.device))
        out = torch.empty((block_ids.numel(), *self.layout.block_shape), dtype=self.dtype, device=self.device)
        for s, pos, rows in parts:
            out.index_copy_(0, pos.to(self.device), self.slabs[s].index_select(0, rows.to(self.device)))
        return out

    def gather(self, block_ids: torch.Tensor, num_tokens: int, out: torch.Tensor | None = None,
               written: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Gather blocks into the segment layout: block_ids [n] -> kv [L, 2, H_kv, num_tokens, D], contiguous.

        One index_select of the whole blocks written straight into the output per run of consecutive blocks in one
        slab (plus one copy of the partial tail block): as many kernels as runs, whatever n is. `out` (that shape and
        dtype, on the pool's device; each [T, D] row dense: contiguous, or the first T slots of each row of a longer
        buffer) is filled instead of a fresh tensor: large fresh CPU allocations page-fault on first write. With
        `written`, the layers are gathered one at a time and written(l, l + 1) is called after each (a caller can
        checksum a layer while it is still in cache).
        """
        layout = self.layout
        n = block_ids.numel()
        bs = layout.block_size
        assert (n - 1) * bs < num_tokens <= n * bs, "token count does not fit blocks"
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or out.device != self.kv_device \
                or out.stride()[3:] != (layout.head_dim, 1):
            raise ValueError(f"out must be a {self.dtype} tensor of shape {shape} on {self.device} with dense "
                             f"[T, D] rows, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
        ids = block_ids.cpu()
        slab_of, rows = ids // self.slab_blocks, (ids % self.slab_blocks).to(self.device)
        full = num_tokens // bs  # whole blocks
        cuts = [0, *((slab_of[1:full] != slab_of[:full - 1]).nonzero().flatten() + 1).tolist(), full] if full else []
        # runs of whole blocks in one slab: (slab viewed [L, 2, H, N, bs, D], first block, end)
        runs = [(self.slabs[int(slab_of[p])].permute(1, 2, 3, 0, 4, 5), p, q) for p, q in zip(cuts, cuts[1:])]
        steps = [(0, layout.num_layers)] if written is None else [(i, i + 1) for i in range(layout.num_layers)]
        for a, b in steps:
            for view, p, q in runs:
                dest = out[a:b, :, :, p * bs: q * bs].view(b - a, *shape[1:3], q - p, bs, layout.head_dim)
                torch.index_select(view[a:b], 3, rows[p:q], out=dest)
            if full < n:
                tail = self.row(int(ids[full]))  # [L, 2, H, bs, D]
                out[a:b, :, :, full * bs:].copy_(tail[a:b, :, :, : num_tokens - full * bs])
            if written is not None:
                written(a, b)
        return out
