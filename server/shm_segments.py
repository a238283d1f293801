"""The server's same-host segments: each fetch asking for shared memory gets its KV written (the store gathers it
straight into the file's map) to a file in a private folder under /dev/shm (`shm_folder`), handed to that tenant by
an unguessable name once complete, and removed when the tenant releases it, when its TTL passes (a sweeper thread), or
when the server stops. The file is a spare when one is ready (`shm_reuse`: a thread makes spare files, pages
allocated, zeroed and unnamed, never told to anyone, at the sizes of the last released segments).

A finished file is also kept (`shm_reuse`: a second, private name, `kept-*`) for `keep_s` after the last fetch that
used it, tagged by what it holds (the tenant, the store entry and its serial, shape and dtype): the next same-host
fetch of the same KV by the same tenant gets a new name linked to it (a hard link, nothing copied or written) instead
of a new file. The server never writes a file once it is named, and clients map it copy-on-write, so every name sees
the KV the first fetch wrote. Kept files give way (least recently used first, after the spares) to new segments at
max_bytes.

Invariants:
- the folder is the server's own (mkdtemp: a random name, mode 0700) and every file in it is 0600: only the server's
  OS user (and root) can list or open them. Same host therefore means same OS user, or a trusted one.
- a segment's name (secrets.token_urlsafe) is told only to the tenant whose fetch made it; `release` by any other
  tenant finds nothing. Names from clients are looked up, never used as paths.
- while the server lives, its folder holds `.lock`, flock-ed by it (the kernel drops the lock when the process dies,
  SIGKILL included): a new registry removes the folders under its root whose `.lock` it can take (left by a server
  that was killed), and no other (`shm_folder`).
- `held_bytes` is the sum of the sizes of the live segments, the kept files, the spares and the files being filled
  (a live name of a kept file counts again: an upper bound of the memory they hold), and never exceeds max_bytes:
  spares go first, then kept files, then a fetch that would pass it is streamed instead (SegmentsFull).
- a kept file is lent only to its own tenant, under its own tag; a tenant's client is told a fresh name, never the
  kept one.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from kvbridge.server import shm_layout
from kvbridge.server.shm_folder import FOLDER_PREFIX, SPARE_PREFIX, hold_lock, remove_stale_folders
from kvbridge.server.shm_reuse import KeptFile, KeptFiles, SpareFiles

__all__ = ["SegmentRegistry", "PendingSegment", "Segment", "SegmentsFull", "KeptFile", "remove_stale_folders"]

log = logging.getLogger(__name__)


class SegmentsFull(Exception):
    """The live segments hold max_bytes already: this fetch goes by stream."""


@dataclass(frozen=True, slots=True)
class Segment:
    name: str  # unguessable; the file is folder / f"{name}.safetensors"
    path: Path
    tenant: str  # the only tenant that may release it
    size: int  # bytes in the file
    checksum: str  # shm_layout.checksum of the file
    expires_at: float  # on the registry's clock


class SegmentRegistry(KeptFiles, SpareFiles):
    def __init__(self, root: str | Path = "/dev/shm", ttl_s: float = 30.0, max_bytes: int = 4 << 30,
                 clock=time.monotonic, spares: int = 2, keep_s: float = 30.0, headroom: int = 0):
        if ttl_s <= 0 or max_bytes <= 0 or keep_s < 0 or headroom < 0:
            raise ValueError(f"ttl_s and max_bytes must be > 0, keep_s and headroom >= 0, got {ttl_s}, {max_bytes}, "
                             f"{keep_s} and {headroom}")
        self.ttl_s = ttl_s
        self.headroom = headroom  # token slots after each row of a segment's KV, for the client's next tokens
        self.keep_s = keep_s  # a finished file is kept this long after its last fetch; 0: never kept
        self.max_bytes = max_bytes
        self.clock = clock
        remove_stale_folders(root)
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=root))  # 0700, random name
        self._lock_fd = hold_lock(self.folder)
        self._closed = False
        self.spares = spares  # spare files kept ready (made only once start() runs the thread that makes them)
        self.held_bytes = 0
        self._live: dict[str, Segment] = {}
        self._kept: dict[tuple, KeptFile] = {}  # (tenant, tag) -> file; in least-recently-used order
        self.kept_hits = 0  # fetches served by linking a kept file
        self._spares: list[tuple[Path, int]] = []  # (path, bytes allocated)
        self._wanted: list[int] = []  # sizes of spares to make
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def publish(self, tenant: str, kv: torch.Tensor) -> Segment:
        """Write kv [L, 2, H, T, D] (CPU) to a new segment of `tenant`. SegmentsFull, or OSError (no space)."""
        pending = self.reserve(tenant)
        return pending.publish(kv)

    def reserve(self, tenant: str, dtype: torch.dtype | None = None) -> "PendingSegment":
        """A segment of `tenant` to be filled in place (its KV in `dtype`, None: any); nothing is made until its
        `tensor` is asked for."""
        return PendingSegment(self, tenant, dtype)

    def _open(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Path, int, int]:
        """(path, fd, bytes reserved) of a file for a new segment: a spare when one is there, else a new file.
        SegmentsFull when the segments (and spares) would pass max_bytes even without spares."""
        nbytes = shm_layout.segment_size(shape, dtype, self.headroom)
        with self._lock:  # reserve the bytes first: concurrent fetches never pass max_bytes together
            spare = self._take_spare(nbytes)  # its bytes become this segment's (resized to nbytes)
            if spare is not None:
                self.held_bytes -= spare[1]
            self._make_room(nbytes)
            if self.held_bytes + nbytes > self.max_bytes:
                if spare is not None:
                    self._spares.append(spare)
                    self.held_bytes += spare[1]
                raise SegmentsFull(f"shared-memory segments hold {self.held_bytes} of {self.max_bytes} bytes")
            self.held_bytes += nbytes
            path = spare[0] if spare is not None else None
        fresh = path is None
        path = path or self.folder / f"{SPARE_PREFIX}{secrets.token_urlsafe(12)}"
        try:
            fd = shm_layout.create(path) if fresh else os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except BaseException:
            if fresh:  # create() made nothing
                self._give_back_bytes(nbytes)
            else:
                self._give_back(path, nbytes)
            raise
        return path, fd, nbytes

    def _add(self, pending: "PendingSegment", path: Path, size: int, checksum: str, reserved: int) -> Segment:
        name = secrets.token_urlsafe(24)
        final = self.folder / f"{name}.safetensors"
        os.rename(path, final)  # written in full before it has a name a client could be told
        segment = Segment(name=name, path=final, tenant=pending.tenant, size=size, checksum=checksum,
                          expires_at=self.clock() + self.ttl_s)
        with self._lock:
            self.held_bytes += size - reserved
            self._live[name] = segment
        return segment

    def _make_room(self, nbytes: int) -> None:
        """Drop spares, then the least recently used kept files, until nbytes more fit (or none is left); under the
        lock."""
        while self._spares and self.held_bytes + nbytes > self.max_bytes:
            self._drop_spare(self._spares[-1])
        while self._kept and self.held_bytes + nbytes > self.max_bytes:
            self._drop_kept(next(iter(self._kept)))

    def _link(self, tenant: str, kept: KeptFile) -> Segment:
        """A new segment of `tenant`: a fresh name linked to a kept file, nothing copied. SegmentsFull; OSError
        (FileNotFoundError: the kept file went in the meantime)."""
        name = secrets.token_urlsafe(24)
        final = self.folder / f"{name}.safetensors"
        with self._lock:
            self._make_room(kept.size)
            if self.held_bytes + kept.size > self.max_bytes:
                raise SegmentsFull(f"shared-memory segments hold {self.held_bytes} of {self.max_bytes} bytes")
            if self._stop.is_set():
                raise FileNotFoundError(f"{kept.path}: the registry is closing")
            os.link(kept.path, final)
            segment = Segment(name=name, path=final, tenant=tenant, size=kept.size, checksum=kept.checksum,
                              expires_at=self.clock() + self.ttl_s)
            self.held_bytes += kept.size
            self._live[name] = segment
            self.kept_hits += 1
        return segment

    def _give_back(self, path: Path, reserved: int) -> None:
        path.unlink(missing_ok=True)
        self._give_back_bytes(reserved)

    def _give_back_bytes(self, reserved: int) -> None:
        with self._lock:
            self.held_bytes -= reserved

    def release(self, tenant: str, name: str) -> bool:
        """Remove the tenant's segment `name`; False when it has none of that name (gone, or another's)."""
        with self._lock:
            segment = self._live.get(name)
            if segment is None or segment.tenant != tenant:
                return False
            self._drop(segment)
            # the next fetches are likely this size: make spares of it meanwhile (after a read, not during a fetch)
            self._wanted += [segment.size] * (self.spares - len(self._spares) - len(self._wanted))
            self._wake.notify()
        return True

    def sweep(self) -> int:
        """Remove the segments whose TTL has passed, and the kept files unused for keep_s; how many segments."""
        now = self.clock()
        with self._lock:
            expired = [s for s in self._live.values() if s.expires_at <= now]
            for segment in expired:
                self._drop(segment)
            for key in [k for k, kept in self._kept.items() if kept.last_used + self.keep_s <= now]:
                self._drop_kept(key)
        if expired:
            log.info("removed %d shared-memory segment(s) never released within %g s", len(expired), self.ttl_s)
        return len(expired)

    def _drop(self, segment: Segment) -> None:
        del self._live[segment.name]
        self.held_bytes -= segment.size
        segment.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._live)

    def start(self, interval_s: float | None = None) -> None:
        """Sweep in a daemon thread every interval_s (default: a quarter of the TTL, at most 5 s); make spares in
        another."""
        interval = interval_s or min(self.ttl_s / 4, 5.0)

        def run():
            while not self._stop.wait(interval):
                self.sweep()

        self._threads = [threading.Thread(target=run, name="kvbridge-shm-sweeper", daemon=True),
                         threading.Thread(target=self._make_spares_until_closed, name="kvbridge-shm-spares",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop the sweeper and remove every segment and the folder (server shutdown); once: a second call does
        nothing (its lock file's descriptor, closed here, may be another file's by then)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join()
        with self._lock:
            for segment in list(self._live.values()):
                self._drop(segment)
            for spare in list(self._spares):
                self._drop_spare(spare)
            for key in list(self._kept):
                self._drop_kept(key)
        shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._lock_fd)


class PendingSegment:
    """One fetch's segment before it is published: `tensor(shape, dtype)` gives a [L, 2, H, T, D] buffer that is the
    file itself (the caller fills its layers in order and calls `written(a, b)`; None when this segment cannot be
    made: full, no space, another dtype), `publish(kv)` names it (copying kv in first unless kv is that buffer) and
    `discard()` removes it. The file is 0600 and named only once it is complete. `reuse(tag, ...)` first: the KV of
    a kept file with that tag when there is one (publish then links it), else publish keeps the new file under tag."""

    def __init__(self, registry: SegmentRegistry, tenant: str, dtype: torch.dtype | None):
        self.registry, self.tenant, self.dtype = registry, tenant, dtype
        self.refused: Exception | None = None  # why tensor() gave None
        self._filling: shm_layout.Filling | None = None
        self._path: Path | None = None
        self._reserved = 0
        self._tag: tuple | None = None  # what the KV is, when the caller said (reuse)
        self._lent: tuple[KeptFile, torch.Tensor] | None = None  # the kept file reuse() gave, and its map

    def reuse(self, tag: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """kv [L, 2, H, T, D] that a kept file of this tenant already holds for `tag` (hashable: what the KV is, e.g.
        a store entry and its serial), in this fetch's dtype (`dtype`: the KV's own, used when the fetch asked for
        none): the file mapped, no page read. None when no file is kept for it; publish() then keeps the file it
        makes under the tag."""
        if self._filling is not None or self._tag is not None:
            raise AssertionError("reuse() comes once, before tensor()")
        self._tag = (tag, tuple(shape), str(self.dtype or dtype))
        kept = self.registry._find_kept(self.tenant, self._tag)
        if kept is None:
            return None
        try:
            kv = shm_layout.map_file(kept.path, kept.size, tuple(shape), self.dtype or dtype, self.registry.headroom)
        except OSError:  # dropped in the meantime
            return None
        self._lent = (kept, kv)
        return kv

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        # -> [L, 2, H, T, D] of dtype, a shared map of the segment's file
        if self._filling is not None:
            raise AssertionError("a segment's tensor is asked for once")
        if self.dtype is not None and dtype != self.dtype:
            return None
        try:
            path, fd, self._reserved = self.registry._open(shape, dtype)
        except (SegmentsFull, OSError) as exc:
            self.refused = exc
            return None
        self._path = path
        try:
            self._filling = shm_layout.Filling(fd, shape, dtype, self.registry.headroom)
        except BaseException as exc:
            self.discard()
            if not isinstance(exc, OSError):
                raise
            self.refused = exc
            return None
        finally:
            os.close(fd)
        return self._filling.kv

    def written(self, start: int, end: int) -> None:
        """Layers [start, end) of the tensor are final."""
        self._filling.written(start, end)

    def publish(self, kv: torch.Tensor) -> Segment:
        """The segment holding kv [L, 2, H, T, D] (CPU), registered for this tenant. SegmentsFull or OSError when
        it cannot be made (nothing is left behind)."""
        # keep the file for the tag only when it holds the KV the tag names: gathered in place after reuse() found
        # nothing, or the lent file's (not a fetch that fell back to another KV after reuse())
        in_place = self._filling is not None and self._filling.kv is not None \
            and kv.data_ptr() == self._filling.kv.data_ptr()
        lent = self._lent is not None and kv.data_ptr() == self._lent[1].data_ptr()
        keep = self._tag is not None and (in_place or lent)
        if self._lent is not None:
            kept, self._lent = self._lent[0], None
            if lent:
                try:
                    return self.registry._link(self.tenant, kept)
                except FileNotFoundError:  # the kept file went meanwhile: kv still maps its pages; copied below
                    pass
        if self._filling is None or self._filling.kv is None or kv.data_ptr() != self._filling.kv.data_ptr():
            if self._filling is not None:
                self.discard()
            if self.tensor(tuple(kv.shape), kv.dtype) is None:
                raise self.refused or SegmentsFull(f"no segment in {self.dtype}")
            try:
                shm_layout.copy_layers(self._filling, kv)
            except BaseException:
                self.discard()
                raise
        size, checksum = self._filling.finish()
        try:
            segment = self.registry._add(self, self._path, size, checksum, self._reserved)
        except BaseException:
            self.discard()
            raise
        self._path, self._filling, self._reserved = None, None, 0  # the registry's now
        if keep:
            self.registry._keep(self.tenant, self._tag, segment.path, segment.size, segment.checksum)
        return segment

    def discard(self) -> None:
        """Remove the file (a fetch that failed, or streams instead) and give its bytes back."""
        self._lent = None
        if self._path is not None:
            self.registry._give_back(self._path, self._reserved)
            self._path, self._filling, self._reserved = None, None, 0
