"""The wire messages of recent streamed fetches, kept for the next streamed fetch of the same KV: a warm fetch then
sends the bytes it sent before (no gather from the store, no chunk copied out or joined), as a same-host fetch links
a kept file (server/shm_reuse.py).

What a kept fetch is: the tenant, the store entry and its serial (`EntryInfo.serial`: a re-made entry never
matches), the KV's shape and wire dtype, and the chunk size asked for. The messages are the CacheChunk bytes of
every chunk in order, without the header (each fetch writes its own header before the first chunk); bytes are
immutable, so a kept fetch is never changed by a later one.

Invariants: `held_bytes` (the kept messages' lengths) never exceeds max_bytes; a fetch larger than max_bytes is not
kept; kept fetches go least recently used first, and when unused for keep_s; a tenant gets only its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Kept:
    messages: tuple[bytes, ...]
    nbytes: int
    last_used: float


class WireCache:
    def __init__(self, max_bytes: int = 256 << 20, keep_s: float = 30.0, clock=time.monotonic):
        if max_bytes < 0 or keep_s < 0:
            raise ValueError(f"max_bytes and keep_s must be >= 0, got {max_bytes} and {keep_s}")
        self.max_bytes, self.keep_s, self.clock = max_bytes, keep_s, clock
        self.held_bytes = 0
        self.hits = 0
        self._kept: dict[tuple, _Kept] = {}  # (tenant, tag) -> messages; least recently used first
        self._lock = threading.Lock()

    def get(self, tenant: str, tag: tuple) -> tuple[bytes, ...] | None:
        """The messages kept for this tenant's `tag`, or None."""
        with self._lock:
            self._expire()
            kept = self._kept.pop((tenant, tag), None)
            if kept is None:
                return None
            kept.last_used = self.clock()
            self._kept[(tenant, tag)] = kept  # now the most recently used
            self.hits += 1
            return kept.messages

    def put(self, tenant: str, tag: tuple, messages: list[bytes]) -> bool:
        """Keep a fetch's messages (all of them, in order) for the next fetch of `tag`; whether they were kept."""
        nbytes = sum(len(m) for m in messages)
        if not self.keep_s or nbytes > self.max_bytes:
            return False
        with self._lock:
            self._expire()
            if (tenant, tag) in self._kept:
                return False
            while self._kept and self.held_bytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._kept)))
            self._kept[(tenant, tag)] = _Kept(tuple(messages), nbytes, self.clock())
            self.held_bytes += nbytes
            return True

    def clear(self) -> int:
        """Forget every kept fetch; how many."""
        with self._lock:
            keys = list(self._kept)
            for key in keys:
                self._drop(key)
            return len(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, kept in self._kept.items() if kept.last_used + self.keep_s <= now]:
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        self.held_bytes -= self._kept.pop(key).nbytes


class StreamOut:
    """A streamed fetch's destination (server.service.KVOut): `reuse` finds the messages an earlier fetch of the same
    KV sent (then `messages` holds them and the KV given back is a meta tensor: nothing to gather or copy); else the
    store gathers into `lent` (a reused buffer, or None: a new tensor), and `keep(messages)` after the stream keeps
    what was sent, if what was sent is that entry's KV."""

    def __init__(self, cache: WireCache | None, lent, tenant: str, dtype: torch.dtype | None, chunk_bytes: int):
        self.cache, self.lent, self.tenant, self.dtype, self.chunk_bytes = cache, lent, tenant, dtype, chunk_bytes
        self.messages: tuple[bytes, ...] | None = None
        self._tag: tuple | None = None
        self._gathered = False  # the store wrote the tagged entry's KV into tensor()

    def reuse(self, tag: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if self.cache is None:
            return None
        wire_dtype = self.dtype or dtype
        self._tag = (tag, tuple(shape), str(wire_dtype), self.chunk_bytes)
        self.messages = self.cache.get(self.tenant, self._tag)
        return None if self.messages is None else torch.empty(shape, dtype=wire_dtype, device="meta")

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        # the store gathers the tagged entry's KV next (into the buffer, or a new tensor when this gives None); if the
        # entry went meanwhile the fetch projects again, a new entry: what is kept under this tag is then never
        # asked for (the tag holds the old entry's serial) and only waits for its turn to go
        self._gathered = self._tag is not None
        return self.lent.tensor(shape, dtype) if self.lent is not None else None

    def written(self, start: int, end: int) -> None:
        if self.lent is not None:
            self.lent.written(start, end)

    def keep(self, messages: list[bytes]) -> bool:
        """After a stream that sent every chunk: keep its messages when they are the tagged entry's KV."""
        if self.cache is None or self._tag is None or not self._gathered or self.messages is not None:
            return False
        return self.cache.put(self.tenant, self._tag, messages)

    def discard(self) -> None:
        if self.lent is not None:
            self.lent.discard()
