"""One fetch's KV as a same-host shared-memory file: the safetensors layout of one tensor "kv" [L, 2, H_kv, T, D]
with its data 8-byte aligned (with `headroom` slots after each row: [L, 2, H_kv, T + headroom, D], the KV in the
first T, zeros after, so a client's map can take its next tokens in place), filled in place by the server through
a shared map of the file (`Filling`: the store gathers its blocks straight into it, each layer summed while still
in cache) and checked (size, mode, header, sum64 checksum) then mapped without a copy by the client (`map_kv`).

The checksum guards against a truncated, stale or foreign file, not against an attacker: whoever can write the file
(the server's OS user) can read every segment anyway. It is `sum64` (kvbridge.transfer.checksum) of the whole file,
at memory speed (CRC-32 would cost more than the copy it checks).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np
import torch
from kvbridge.transfer import tensor_blob
from kvbridge.transfer.checksum import sum64

LAYOUT = "safetensors"
CHECKSUM_PREFIX = "sum64:"
_ST_DTYPES = tensor_blob.ST_DTYPES


class SegmentError(OSError):
    """A segment that is not what its header says (size, mode, layout, checksum): the client streams instead."""


def checksum(buffer) -> str:
    """The sum64 checksum of a bytes-like object (a whole segment file)."""
    return f"{CHECKSUM_PREFIX}{sum64(buffer):016x}"


def _header(shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    # kv: [L, 2, H, T, D]; the data starts 8-byte aligned
    return tensor_blob.header("kv", dtype, tuple(shape))


def file_shape(shape: tuple[int, ...], headroom: int = 0) -> tuple[int, ...]:
    """The file's tensor [L, 2, H, T + headroom, D] for kv [L, 2, H, T, D]."""
    return (*shape[:3], shape[3] + headroom, *shape[4:])


def segment_size(shape: tuple[int, ...], dtype: torch.dtype, headroom: int = 0) -> int:
    """Bytes of the segment file holding kv of this shape and dtype with `headroom` slots after each row (header
    included)."""
    shape = file_shape(shape, headroom)
    return len(_header(shape, dtype)) + int(np.prod(shape)) * _element_size(dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class Filling:
    """A segment file being written in place: `kv` [L, 2, H, T, D] is a shared map of the open file (resized to
    the segment's size, its pages mapped writable in one call: a spare file's are already allocated; with headroom,
    a view of the first T slots of each row, the others left zero), the header is written; fill kv's layers in order
    and call `written(a, b)` after each group, which sums those bytes while they are still in cache; `finish()`
    gives (size, checksum) and lets go of the map (it goes with the last view)."""

    def __init__(self, fd: int, shape: tuple[int, ...], dtype: torch.dtype, headroom: int = 0):
        if len(shape) != 5 or shape[1] != 2 or dtype not in _ST_DTYPES or headroom < 0:
            raise ValueError(f"a segment holds a CPU [L, 2, H, T, D] tensor in {sorted(map(str, _ST_DTYPES))} with "
                             f"headroom >= 0, got {tuple(shape)} {dtype}, headroom {headroom}")
        full = file_shape(shape, headroom)
        head = _header(full, dtype)
        self.shape, self.size = tuple(shape), len(head) + int(np.prod(full)) * _element_size(dtype)
        os.ftruncate(fd, self.size)
        mapped = map_for_writing(fd, self.size)
        mapped[:len(head)] = head
        self._words = np.frombuffer(mapped, dtype="<u8", count=self.size // 8)
        self._mapped = mapped
        self._layer_bytes = (self.size - len(head)) // max(shape[0], 1)
        self._data_start = len(head)
        self._summed_words = 0  # words [0, _summed_words) are in _total
        self._total = 0
        self._layers_done = 0
        self.kv = torch.frombuffer(mapped, dtype=dtype, count=int(np.prod(full)), offset=len(head)).view(full)
        # the headroom slots are never written: zeros, as every file is new (made by `create` or a spare by
        # `make_spare`, both zero-filled by the kernel; a segment's file is never reused)
        self.kv = self.kv[:, :, :, :shape[3]]

    def written(self, start: int, end: int) -> None:
        """Layers [start, end) of kv are final (layers are written in order)."""
        assert start == self._layers_done and end <= self.shape[0], "layers are written once, in order"
        self._layers_done = end
        self._add(self._data_start + end * self._layer_bytes)

    def _add(self, end_byte: int) -> None:
        stop = end_byte // 8
        if stop > self._summed_words:
            self._total += int(self._words[self._summed_words:stop].sum(dtype=np.uint64))
            self._summed_words = stop

    def finish(self) -> tuple[int, str]:
        """(size, checksum) of the file once every layer is written."""
        assert self._layers_done == self.shape[0], f"{self._layers_done} of {self.shape[0]} layers written"
        self._add(self.size)
        total = self._total + sum64(self._mapped[self._summed_words * 8:self.size])  # the zero-padded tail word
        self._words = self._mapped = self.kv = None
        return self.size, f"{CHECKSUM_PREFIX}{total % (1 << 64):016x}"


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14: write-fault every page in one call


def map_for_writing(fd: int, nbytes: int) -> mmap.mmap:
    """A shared map of the file's first nbytes with every page mapped writable now, in one call. MAP_POPULATE
    alone maps a shared file's pages read-only, and the first write to each 4 KiB page then faults (on a 94 MB
    segment, 69 ms of copying instead of 24).
    A file system short of room (a full /dev/shm; tmpfs lets `ftruncate` grow a file past its free space) raises
    OSError(ENOSPC) here: a write to a page it could not give would kill the process with SIGBUS instead."""
    mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    try:
        mapped.madvise(_MADV_POPULATE_WRITE)
    except OSError as exc:
        mapped.close()
        if exc.errno != errno.EINVAL:  # EFAULT / ENOMEM: pages the file system cannot give
            raise OSError(errno.ENOSPC, f"no room for {nbytes:,} bytes of shared memory ({exc.strerror})") from exc
        # before Linux 5.14 (no such advice): reserve the pages first (ENOSPC now, not SIGBUS at a write); then
        # populated read-only, each page faults again on its first write
        os.posix_fallocate(fd, 0, nbytes)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
    return mapped


def create(path: str | os.PathLike) -> int:
    """A new file at `path` (0600, must not exist, no symlink followed), opened for reading and writing."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def make_spare(path: str | os.PathLike, nbytes: int) -> None:
    """Create `path` (as `create`) with nbytes of pages allocated and zeroed now (tmpfs's fallocate allocates but
    leaves the zeroing to the first touch), so a segment filled in it later pays neither."""
    fd = create(path)
    try:
        os.ftruncate(fd, nbytes)
        map_for_writing(fd, nbytes).close()
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def write(path: str | os.PathLike, kv: torch.Tensor) -> tuple[int, str]:
    """Create `path` (0600, must not exist, no symlink followed) holding kv [L, 2, H, T, D]; (size, checksum)."""
    if kv.device.type != "cpu":
        raise ValueError(f"a segment holds a CPU tensor, got one on {kv.device}")
    fd = create(path)
    try:
        filling = Filling(fd, tuple(kv.shape), kv.dtype)
        copy_layers(filling, kv)
        return filling.finish()
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def copy_layers(filling: Filling, kv: torch.Tensor) -> None:
    """Fill a segment from kv [L, 2, H, T, D], a layer at a time (each summed while in cache)."""
    for layer in range(kv.shape[0]):
        filling.kv[layer].copy_(kv[layer])
        filling.written(layer, layer + 1)


def map_file(path: str | os.PathLike, size: int, shape: tuple[int, ...], dtype: torch.dtype,
             headroom: int = 0) -> torch.Tensor:
    """The server's own view of a finished segment file it keeps: kv [L, 2, H, T, D] (the first T slots of each
    row), a copy-on-write map, no page touched (nothing is read or checked: the server wrote the file and never
    writes it again)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    full = file_shape(shape, headroom)
    numel = int(np.prod(full))
    kv = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=size - numel * _element_size(dtype)).view(full)
    return kv[:, :, :, :shape[3]]


def check_path(path: str, name: str) -> None:
    """SegmentError unless `path` is where a kvbridge server puts a segment named `name`
    (/ROOT/kvbridge-*/NAME.safetensors, absolute, no `..`): a client opens nothing else a server names."""
    p = Path(path)
    if not (p.is_absolute() and ".." not in p.parts and p.name == f"{name}.safetensors" and name
            and p.parent.name.startswith("kvbridge-")):
        raise SegmentError(f"{path!r} is not a kvbridge segment path (ROOT/kvbridge-*/NAME.safetensors)")


def open_segment(path: str | os.PathLike, size: int) -> int:
    """A read-only descriptor of the segment file, checked to be a regular 0600 file (no link) of `size` bytes;
    SegmentError when it is not, OSError when it cannot be opened here. The caller closes it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise SegmentError(f"{path}: not a regular file of mode 0600 (mode {stat.filemode(st.st_mode)})")
        if st.st_size != size or size < 8:
            raise SegmentError(f"{path}: {st.st_size} bytes, the header says {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_kv(path: str | os.PathLike, size: int, expected_checksum: str, shape: tuple[int, ...],
           dtype: torch.dtype) -> torch.Tensor:
    """The segment's tensor of this shape ([L, 2, H, T + headroom, D]: the KV in the first T slots of each row),
    a copy-on-write map of the file (no copy of the data; the map outlives the file's removal; what the caller
    writes into it stays its own). SegmentError when the file is not exactly what the fetch's header described; OSError
    (PermissionError, FileNotFoundError) when it cannot be opened here."""
    fd = open_segment(path, size)
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    (head_len,) = struct.unpack("<Q", mapped[:8])
    numel = int(np.prod(shape))
    nbytes = numel * _element_size(dtype)
    if head_len % 8 or 8 + head_len + nbytes != size:
        raise SegmentError(f"{path}: a {head_len}-byte header and {nbytes} bytes of KV do not make {size} bytes")
    try:
        meta = json.loads(mapped[8:8 + head_len])
    except ValueError as exc:
        raise SegmentError(f"{path}: the safetensors header is not JSON ({exc})") from None
    want = {"dtype": _ST_DTYPES.get(dtype), "shape": list(shape), "data_offsets": [0, nbytes]}
    if set(meta) - {"__metadata__"} != {"kv"} or meta["kv"] != want:
        raise SegmentError(f"{path}: the file holds {meta}, the fetch's header says kv {want}")
    # no MADV_POPULATE_READ first: the checksum's read faults 16 pages at a time (the kernel maps around a fault)
    # and was faster than populating every page on the AMD EPYC VM (97 MB: 19 ms against 25 ms, map and sum)
    got = checksum(mapped)
    if got != expected_checksum:
        raise SegmentError(f"{path}: checksum {got}, the header says {expected_checksum}")
    return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=8 + head_len).view(shape)
