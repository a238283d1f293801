"""Reused CPU buffers that a streamed fetch gathers its KV into: a fresh tensor of ~100 MB page-faults on every
4 KiB page it is first written to, and the stream only needs the KV until its last chunk is out (bench_grpc, 94 MB,
2-core VM at load 3-4: a warm streamed fetch 234-242 ms with them, 280-282 ms without).

Invariants: a buffer is lent to one fetch at a time, and taken back only once that fetch's stream has ended (the
chunks sent are copies); the buffers kept between fetches hold at most max_bytes.
"""

from __future__ import annotations

import threading

import torch


class GatherBuffers:
    def __init__(self, max_bytes: int = 256 << 20):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []  # flat uint8 buffers not lent now
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)

    def lend(self, dtype: torch.dtype | None = None) -> "LentBuffer":
        """A KVOut (server.service) for one streamed fetch whose KV goes out in `dtype` (None: any); give it back
        with discard() once the stream has ended."""
        return LentBuffer(self, dtype)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            # by position, never list.remove: that compares tensors with ==, elementwise (and fails on two sizes)
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel)
            while self._free and sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop(0)  # the smallest go first: the large ones are the ones worth keeping


class LentBuffer:
    def __init__(self, pool: GatherBuffers, dtype: torch.dtype | None):
        self.pool, self.dtype = pool, dtype
        self._buffer: torch.Tensor | None = None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        # -> [L, 2, H, T, D] of dtype, a view of a reused buffer
        if (self.dtype is not None and dtype != self.dtype) or self._buffer is not None:
            return None
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.pool.max_bytes:
            return None  # it would not be kept: a fresh tensor is as good
        self._buffer = self.pool._take(nbytes)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def reuse(self, tag: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return None  # a stream sends copies: nothing of a fetch is kept for the next

    def written(self, start: int, end: int) -> None:
        pass

    def discard(self) -> None:
        """The stream has ended: the buffer goes back to the pool."""
        if self._buffer is not None:
            self.pool._give_back(self._buffer)
            self._buffer = None
