"""One KV block as a Redis value: its blob's encoding, decoding and checks, and the sums kept for it.

The blob is safetensors holding one block `[L, 2, H_kv, block_size, D]` with its layout key, a sum64 checksum of its
bytes and a tag (redis_auth fills it in) in the metadata, written and read without safetensors' own copies; it decodes
to a read-only view of the received bytes, served only when its checksum and layout check out. Nothing is ever
unpickled. A block's sum64 is taken where the store writes the block's CPU copy, while it is in cache (`block_sums`),
and a put reuses it; a put of a block without one sums it then.
"""

from __future__ import annotations

import functools
import warnings
import weakref
import zlib

import numpy as np
import torch
from kvbridge.transfer import tensor_blob
from kvbridge.transfer.checksum import sum64
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.redis_auth import TAG_CHARS


class BlockSums:
    """sum64s of CPU blocks, taken when the store wrote their bytes (in cache: ~15 us for a 295 kB block just
    copied, against ~37 us once it is out of cache), so that a Redis put sends the block without reading it again.

    A sum belongs to one tensor object and counts only while that object lives and its version counter stands where
    it stood when the sum was taken: any in-place torch write to the tensor, or through a view of its storage, bumps
    the counter, and the put then sums the bytes afresh (a stale sum would make every reader drop the blob as
    corrupt). Inference tensors have no version counter: their sums are not kept. Writes that bypass torch
    (through `.numpy()`) are not seen; the store makes none to these copies."""

    def __init__(self):
        self._sums: dict[int, tuple[weakref.ref, int, int]] = {}  # id(block) -> (block, its _version, sum64)

    def take(self, block: torch.Tensor) -> int:
        """Sum a contiguous CPU block's bytes now and keep the sum with the block."""
        assert block.device.type == "cpu" and block.is_contiguous(), "sums are taken of contiguous CPU blocks"
        total = sum64(block.view(torch.uint8).reshape(-1).numpy())
        if not block.is_inference():
            key = id(block)
            ref = weakref.ref(block, functools.partial(self._forget, key))
            self._sums[key] = (ref, block._version, total)
        return total

    def get(self, block: torch.Tensor) -> int | None:
        """The sum taken of this very tensor, if its bytes have not been written since; else None."""
        item = self._sums.get(id(block))
        if item is None or item[0]() is not block or item[1] != block._version:
            return None
        return item[2]

    def _forget(self, key: int, ref: weakref.ref) -> None:
        item = self._sums.get(key)
        if item is not None and item[0] is ref:  # not a newer tensor's sum under a reused id
            self._sums.pop(key, None)

    def __len__(self) -> int:
        return len(self._sums)


block_sums = BlockSums()  # one per process: a tensor's identity is process-wide


def block_checksum(data) -> str:
    """sum64 of the block's bytes (a bytes-like object): catches corruption and truncation at memory speed. It is
    not a MAC (the tag, redis_auth, is)."""
    return f"{sum64(data):016x}"


def encode_block(layout_key: str, block: torch.Tensor) -> bytes:
    """A safetensors blob holding one block, its layout key and checksum, and a zero tag (RedisAuth.seal_block fills
    it in): a small header, then the block's bytes."""
    return b"".join(block_parts(layout_key, block))


def block_parts(layout_key: str, block: torch.Tensor) -> tuple[bytes, memoryview]:
    """encode_block's blob in two parts, without copying the block: (header, a view of the block's bytes). The
    block's sum64 is the one `block_sums` holds for it, or taken now."""
    total = block_sums.get(block)
    block = block.detach().to("cpu").contiguous()
    data = block.view(torch.uint8).reshape(-1).numpy()
    checksum = f"{total:016x}" if total is not None else block_checksum(data)
    head, at = _block_header(layout_key, block.dtype, tuple(block.shape))
    return head[:at] + checksum.encode() + head[at + 16:], memoryview(data)


@functools.lru_cache(maxsize=64)
def _block_header(layout_key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """(the blob's header with a zero checksum and tag, where the checksum's 16 hex digits start in it)."""
    head = tensor_blob.header("kv", dtype, shape, {"layout": layout_key, "sum64": "0" * 16, "mac": "0" * TAG_CHARS})
    return head, head.index(b'"sum64":"') + len(b'"sum64":"')


def decode_block(blob: bytes) -> tuple[str, torch.Tensor]:
    """Inverse of encode_block: (layout key, the block as a view of the blob's bytes, no copy: read it, never write
    into it). Raises ValueError for a blob that is not one (bad bytes, wrong checksum). Blobs written with a CRC-32
    (before sum64) are still read."""
    try:
        dtype, shape, offset, meta = tensor_blob.parse(blob, "kv")
    except ValueError as exc:
        raise ValueError(f"not a kvbridge block blob: {exc}") from None
    if "layout" not in meta:
        raise ValueError(f"not a kvbridge block blob: no layout in its metadata {sorted(meta)}")
    data = np.frombuffer(blob, dtype=np.uint8, offset=offset)
    if "sum64" in meta:
        ok = block_checksum(data) == meta["sum64"]
    elif "crc32" in meta:
        ok = f"{zlib.crc32(data):08x}" == meta["crc32"]
    else:
        raise ValueError(f"not a kvbridge block blob: no checksum in its metadata {sorted(meta)}")
    if not ok:
        raise ValueError("block blob checksum mismatch: the stored bytes are corrupt")
    return meta["layout"], _read_only_view(blob, dtype, data.size // dtype.itemsize, offset).view(shape)


def fitting(key: str, block: torch.Tensor, layout: PoolLayout | str) -> torch.Tensor:
    """The decoded block if it is of this layout (key; dtype and shape too with a PoolLayout), else ValueError."""
    expected = layout if isinstance(layout, str) else layout.key
    if key != expected:
        raise ValueError(f"a block of layout {key!r} where its record says {expected!r}")
    if not isinstance(layout, str) and (block.dtype != layout.torch_dtype or tuple(block.shape) != layout.block_shape):
        raise ValueError(f"a {str(block.dtype)[6:]} block of shape {list(block.shape)} where its record says "
                         f"{layout.dtype} {list(layout.block_shape)}")
    return block


def _read_only_view(blob: bytes, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    # torch.frombuffer warns (once per process, TORCH_WARN_ONCE) that bytes are not writable: these views are only
    # read (the store copies them into a pool), so that one warning is taken here, at import, and not shown
    return torch.frombuffer(blob, dtype=dtype, count=count, offset=offset)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    _read_only_view(bytes(8), torch.uint8, 8, 0)
