"""One fetch's KV as a same-host shared-memory file: the safetensors layout of one tensor "kv" [L, 2, H_kv, T, D]
with its data 8-byte aligned, written in one pass by the server (`write`) and checked (size, mode, header, sum64
checksum) then mapped without a copy by the client (`map_kv`).

The checksum guards against a truncated, stale or foreign file, not against an attacker: whoever can write the file
(the server's OS user) can read every segment anyway. It is the file's little-endian uint64 words (the tail
zero-padded) summed mod 2^64, at memory speed (CRC-32 would cost more than the copy it checks).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np
import torch

LAYOUT = "safetensors"
CHECKSUM_PREFIX = "sum64:"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SLICE_BYTES = 4 << 20  # written, then summed while still in cache


class SegmentError(OSError):
    """A segment that is not what its header says (size, mode, layout, checksum): the client streams instead."""


def _sum64(buffer) -> int:
    view = memoryview(buffer).cast("B")
    whole = len(view) // 8 * 8
    total = int(np.frombuffer(view, dtype="<u8", count=whole // 8).sum(dtype=np.uint64)) if whole else 0
    if whole < len(view):
        total += int.from_bytes(bytes(view[whole:]).ljust(8, b"\0"), "little")
    return total % (1 << 64)


def checksum(buffer) -> str:
    """The sum64 checksum of a bytes-like object (a whole segment file)."""
    return f"{CHECKSUM_PREFIX}{_sum64(buffer):016x}"


def _header(kv: torch.Tensor) -> bytes:
    # kv: [L, 2, H, T, D]; the JSON is padded with spaces so the data starts 8-byte aligned (as safetensors does)
    meta = {"kv": {"dtype": _ST_DTYPES[kv.dtype], "shape": list(kv.shape),
                   "data_offsets": [0, kv.numel() * kv.element_size()]}}
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write(path: str | os.PathLike, kv: torch.Tensor) -> tuple[int, str]:
    """Create `path` (0600, must not exist, no symlink followed) holding kv [L, 2, H, T, D]; (size, checksum)."""
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.dtype not in _ST_DTYPES or kv.device.type != "cpu":
        raise ValueError(f"a segment holds a CPU [L, 2, H, T, D] tensor in {sorted(map(str, _ST_DTYPES))}, got "
                         f"{tuple(kv.shape)} {kv.dtype} on {kv.device}")
    head = _header(kv)
    data = memoryview(kv.contiguous().view(torch.uint8).reshape(-1).numpy())
    total = _sum64(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, memoryview(head))
        for start in range(0, len(data), _SLICE_BYTES):
            part = data[start:start + _SLICE_BYTES]
            _write_all(fd, part)
            total += _sum64(part)  # every slice but the last is a multiple of 8 bytes
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return len(head) + len(data), f"{CHECKSUM_PREFIX}{total % (1 << 64):016x}"


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]


def check_path(path: str, name: str) -> None:
    """SegmentError unless `path` is where a kvbridge server puts a segment named `name`
    (/ROOT/kvbridge-*/NAME.safetensors, absolute, no `..`): a client opens nothing else a server names."""
    p = Path(path)
    if not (p.is_absolute() and ".." not in p.parts and p.name == f"{name}.safetensors" and name
            and p.parent.name.startswith("kvbridge-")):
        raise SegmentError(f"{path!r} is not a kvbridge segment path (ROOT/kvbridge-*/NAME.safetensors)")


def map_kv(path: str | os.PathLike, size: int, expected_checksum: str, shape: tuple[int, ...],
           dtype: torch.dtype) -> torch.Tensor:
    """The segment's kv [L, 2, H, T, D], a copy-on-write map of the file (no copy of the data; the map outlives
    the file's removal). SegmentError when the file is not exactly what the fetch's header described; OSError
    (PermissionError, FileNotFoundError) when it cannot be opened here."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise SegmentError(f"{path}: not a regular file of mode 0600 (mode {stat.filemode(st.st_mode)})")
        if st.st_size != size or size < 8:
            raise SegmentError(f"{path}: {st.st_size} bytes, the header says {size}")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    (head_len,) = struct.unpack("<Q", mapped[:8])
    numel = int(np.prod(shape))
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if head_len % 8 or 8 + head_len + nbytes != size:
        raise SegmentError(f"{path}: a {head_len}-byte header and {nbytes} bytes of KV do not make {size} bytes")
    try:
        meta = json.loads(mapped[8:8 + head_len])
    except ValueError as exc:
        raise SegmentError(f"{path}: the safetensors header is not JSON ({exc})") from None
    want = {"dtype": _ST_DTYPES.get(dtype), "shape": list(shape), "data_offsets": [0, nbytes]}
    if set(meta) - {"__metadata__"} != {"kv"} or meta["kv"] != want:
        raise SegmentError(f"{path}: the file holds {meta}, the fetch's header says kv {want}")
    got = checksum(mapped)
    if got != expected_checksum:
        raise SegmentError(f"{path}: checksum {got}, the header says {expected_checksum}")
    return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=8 + head_len).view(shape)
