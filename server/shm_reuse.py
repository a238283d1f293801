"""What the segment registry holds between fetches for the next ones: kept files and spare files (two mixins).

Kept files: finished files under a private name (`kept-*`, least recently used first) for a later fetch of the same
KV by the same tenant to link to. Spare files: files whose pages are allocated ahead (tmpfs allocates and zeroes each
4 KiB page on its first touch, which costs more than the copy into it), made by a thread between fetches at the sizes
of the last ones. Both use SegmentRegistry's lock, folder, held_bytes and max_bytes: both count in held_bytes and give
way to new segments.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvbridge.server import shm_layout
from kvbridge.server.shm_folder import KEPT_PREFIX, SPARE_PREFIX

log = logging.getLogger("kvbridge.server.shm_segments")  # the segments' one logger


@dataclass(slots=True)
class KeptFile:
    """A finished segment file kept under a private name for the next fetches of the same KV."""

    path: Path  # folder / f"kept-{token}": never told to a client
    size: int
    checksum: str
    last_used: float  # on the registry's clock


class KeptFiles:
    """SegmentRegistry's kept files: a finished segment's file under a second name, for the next fetch of the same KV
    (see the module docstring); `SegmentRegistry._link` lends one to a fetch."""

    def _find_kept(self, tenant: str, tag: tuple) -> KeptFile | None:
        if not self.keep_s:
            return None
        with self._lock:
            kept = self._kept.pop((tenant, tag), None)
            if kept is not None:
                kept.last_used = self.clock()
                self._kept[(tenant, tag)] = kept  # now the most recently used
            return kept

    def _keep(self, tenant: str, tag: tuple, path: Path, size: int, checksum: str) -> None:
        """Keep a segment's file (`path`: just published, not yet told to its client) under a private name for tag."""
        if not self.keep_s:
            return
        with self._lock:
            if (tenant, tag) in self._kept or self._stop.is_set():
                return
            self._make_room(size)
            if self.held_bytes + size > self.max_bytes:
                return
            kept = self.folder / f"{KEPT_PREFIX}{secrets.token_urlsafe(12)}"
            try:
                os.link(path, kept)
            except OSError as exc:
                log.info("shared-memory segment not kept (%s)", exc)
                return
            self.held_bytes += size
            self._kept[(tenant, tag)] = KeptFile(path=kept, size=size, checksum=checksum, last_used=self.clock())

    def _drop_kept(self, key: tuple) -> None:
        kept = self._kept.pop(key)
        self.held_bytes -= kept.size
        kept.path.unlink(missing_ok=True)

    def drop_kept(self) -> int:
        """Remove every kept file (the next fetches write new ones); how many."""
        with self._lock:
            keys = list(self._kept)
            for key in keys:
                self._drop_kept(key)
        return len(keys)

    @property
    def kept_files(self) -> int:
        with self._lock:
            return len(self._kept)


class SpareFiles:
    """SegmentRegistry's spare files (see the module docstring); `release` asks for them, the thread `start` runs
    makes them."""

    def _take_spare(self, nbytes: int) -> tuple[Path, int] | None:
        if not self._spares:
            return None
        fitting = [s for s in self._spares if s[1] >= nbytes]
        spare = min(fitting, key=lambda s: s[1]) if fitting else max(self._spares, key=lambda s: s[1])
        self._spares.remove(spare)
        return spare

    def _drop_spare(self, spare: tuple[Path, int]) -> None:
        self._spares.remove(spare)
        self.held_bytes -= spare[1]
        spare[0].unlink(missing_ok=True)

    def make_spares(self) -> int:
        """Make the spares wanted now, in this thread (the thread start() runs does it between fetches); how many."""
        made = 0
        while self._make_one(wait=False):
            made += 1
        return made

    def _make_one(self, wait: bool) -> bool:
        """Make one wanted spare (waiting for a want when `wait`); False when stopped or (not waiting) none wanted."""
        with self._lock:
            while True:
                if self._stop.is_set() or not (self._wanted or wait):
                    return False
                if self._wanted:
                    nbytes = self._wanted.pop(0)
                    if len(self._spares) < self.spares and self.held_bytes + nbytes <= self.max_bytes:
                        break
                else:
                    self._wake.wait()
            self.held_bytes += nbytes
        path = self.folder / f"{SPARE_PREFIX}{secrets.token_urlsafe(12)}"
        try:
            shm_layout.make_spare(path, nbytes)
        except OSError as exc:
            log.info("no spare shared-memory file (%s)", exc)
            self._give_back_bytes(nbytes)
            return True
        with self._lock:
            if self._stop.is_set():  # close() is removing the files: this one too
                self.held_bytes -= nbytes
                path.unlink(missing_ok=True)
                return False
            self._spares.append((path, nbytes))
        return True

    def _make_spares_until_closed(self) -> None:
        while self._make_one(wait=True):
            pass
