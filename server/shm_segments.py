"""The server's same-host segments: each fetch asking for shared memory gets its KV written to a fresh file in a
private folder under /dev/shm, handed to that tenant by an unguessable name, and removed when the tenant releases
it, when its TTL passes (a sweeper thread), or when the server stops.

Invariants:
- the folder is the server's own (mkdtemp: a random name, mode 0700) and every file in it is 0600: only the server's
  OS user (and root) can list or open them. Same host therefore means same OS user, or a trusted one.
- a segment's name (secrets.token_urlsafe) is told only to the tenant whose fetch made it; `release` by any other
  tenant finds nothing. Names from clients are looked up, never used as paths.
- while the server lives, its folder holds `.lock`, flock-ed by it (the kernel drops the lock when the process dies,
  SIGKILL included): a new registry removes the folders under its root whose `.lock` it can take (left by a server
  that was killed), and no other.
- `held_bytes` is the sum of the live segments' sizes and never exceeds max_bytes: a fetch that would pass it is
  streamed instead (SegmentsFull).
"""

from __future__ import annotations

import fcntl
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


class SegmentRegistry:
    def __init__(self, root: str | Path = "/dev/shm", ttl_s: float = 30.0, max_bytes: int = 4 << 30,
                 clock=time.monotonic):
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError(f"ttl_s and max_bytes must be > 0, got {ttl_s} and {max_bytes}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        remove_stale_folders(root)
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=root))  # 0700, random name
        self._lock_fd = _hold_lock(self.folder)
        self.held_bytes = 0
        self._live: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def publish(self, tenant: str, kv: torch.Tensor) -> Segment:
        """Write kv [L, 2, H, T, D] (CPU) to a new segment of `tenant`. SegmentsFull, or OSError (no space)."""
        nbytes = kv.numel() * kv.element_size()
        with self._lock:  # reserve the bytes first: concurrent fetches never pass max_bytes together
            if self.held_bytes + nbytes > self.max_bytes:
                raise SegmentsFull(f"shared-memory segments hold {self.held_bytes} of {self.max_bytes} bytes")
            self.held_bytes += nbytes
        name = secrets.token_urlsafe(24)
        path = self.folder / f"{name}.safetensors"
        try:
            size, checksum = shm_layout.write(path, kv)
        except BaseException:
            with self._lock:
                self.held_bytes -= nbytes
            raise
        segment = Segment(name=name, path=path, tenant=tenant, size=size, checksum=checksum,
                          expires_at=self.clock() + self.ttl_s)
        with self._lock:
            self.held_bytes += size - nbytes
            self._live[name] = segment
        return segment

    def release(self, tenant: str, name: str) -> bool:
        """Remove the tenant's segment `name`; False when it has none of that name (gone, or another's)."""
        with self._lock:
            segment = self._live.get(name)
            if segment is None or segment.tenant != tenant:
                return False
            self._drop(segment)
        return True

    def sweep(self) -> int:
        """Remove the segments whose TTL has passed; how many."""
        now = self.clock()
        with self._lock:
            expired = [s for s in self._live.values() if s.expires_at <= now]
            for segment in expired:
                self._drop(segment)
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
        """Sweep in a daemon thread every interval_s (default: a quarter of the TTL, at most 5 s)."""
        interval = interval_s or min(self.ttl_s / 4, 5.0)

        def run():
            while not self._stop.wait(interval):
                self.sweep()

        self._sweeper = threading.Thread(target=run, name="kvbridge-shm-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Stop the sweeper and remove every segment and the folder (server shutdown)."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join()
        with self._lock:
            for segment in list(self._live.values()):
                self._drop(segment)
        shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._lock_fd)


FOLDER_PREFIX = "kvbridge-"
LOCK_NAME = ".lock"


def _hold_lock(folder: Path) -> int:
    """Create folder/.lock already locked (made under another name, locked, then renamed: a folder whose `.lock`
    exists is never taken for a dead server's); the open descriptor, held for the server's life."""
    making = folder / f"{LOCK_NAME}.new"
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(making, folder / LOCK_NAME)
    return fd


def remove_stale_folders(root: str | Path) -> list[Path]:
    """Remove the segment folders under root left by servers that died without closing (their `.lock` is free);
    the folders removed. Files and folders without a `.lock` (another program's, or a server still starting) are
    left alone."""
    removed = []
    for folder in Path(root).glob(f"{FOLDER_PREFIX}*"):
        lock = folder / LOCK_NAME
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.geteuid():
                continue
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live server holds it
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        removed.append(folder)
    if removed:
        log.warning("removed %d shared-memory folder(s) left by a server that did not stop cleanly: %s", len(removed),
                    ", ".join(map(str, removed)))
    return removed
