"""Bounded work on the server: how many client-streamed uploads a tenant (and the server) may hold open at once, and
a watchdog that cancels streams that have moved no message for too long.

Why uploads are counted and downloads are not: an upload's length is the client's to choose (a header, then
nothing), so a tenant could hold every stream thread with calls that never end; a download is paced by the server
and ends when its chunks are out, unless the client stops reading, which the idle watchdog catches (and until then
holds one of its tenant's share of the stream threads: server/fair_pool.py). The thread budgets that keep health and
unary calls apart from streams are in `app` (one pool each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["StreamSlots", "TooManyStreams", "IdleWatchdog", "Watched"]


class TooManyStreams(RuntimeError):
    """Refused before any work: the tenant (or the server) holds as many open uploads as it may."""


class StreamSlots:
    """Per-tenant and server-wide counts of open client-streamed calls; `hold` refuses at the limit, never waits
    (waiting would hold a thread, which is what the limit protects)."""

    def __init__(self, per_tenant: int, total: int):
        if per_tenant < 1 or total < 1:
            raise ValueError(f"stream limits must be >= 1, got per_tenant={per_tenant}, total={total}")
        self.per_tenant = per_tenant
        self.total = total
        self._open: Counter = Counter()
        self._lock = threading.Lock()

    def open_for(self, tenant: str) -> int:
        with self._lock:
            return self._open[tenant]

    @contextmanager
    def hold(self, tenant: str, what: str = "uploads"):
        with self._lock:
            if self._open[tenant] >= self.per_tenant:
                raise TooManyStreams(f"this tenant already has {self._open[tenant]} {what} open (the limit is "
                                     f"{self.per_tenant}): finish or cancel one first")
            if sum(self._open.values()) >= self.total:
                raise TooManyStreams(f"the server has {self.total} {what} open, its limit: try again shortly")
            self._open[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[tenant] -= 1
                if not self._open[tenant]:
                    del self._open[tenant]


@dataclass(eq=False)
class Watched:
    """One stream under the watchdog: `touch()` on every message moved."""

    cancel: Callable[[], None]  # ends the call (grpc's context.cancel)
    last: float
    clock: Callable[[], float] = field(repr=False, default=time.monotonic)
    expired: bool = False  # set when the watchdog cancelled it

    def touch(self) -> None:
        self.last = self.clock()


class IdleWatchdog:
    """Cancels a watched stream once idle_s pass without a message; `sweep(now)` does one pass (tests call it with
    their clock), a daemon thread calls it every idle_s / 4 once `start` is called."""

    def __init__(self, idle_s: float, clock: Callable[[], float] = time.monotonic):
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self.clock = clock
        self._watched: set[Watched] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, cancel: Callable[[], None]):
        w = Watched(cancel=cancel, last=self.clock(), clock=self.clock)
        with self._lock:
            self._watched.add(w)
        try:
            yield w
        finally:
            with self._lock:
                self._watched.discard(w)

    @property
    def watching(self) -> int:
        """Streams under watch now."""
        with self._lock:
            return len(self._watched)

    def sweep(self, now: float | None = None) -> int:
        """Cancel every stream idle for idle_s or more; how many were cancelled."""
        now = self.clock() if now is None else now
        with self._lock:
            due = [w for w in self._watched if not w.expired and now - w.last >= self.idle_s]
            for w in due:
                w.expired = True
        for w in due:
            w.cancel()
        return len(due)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbridge-idle-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.idle_s / 4):
            self.sweep()

    def stop(self) -> None:
        self._stop.set()
