"""Stream threads shared fairly between tenants.

A streamed call holds its thread for as long as it runs, and a fetch whose client stops reading runs until the idle
watchdog cancels it (`--stream-idle-s`, 60 s). On one first-come pool, a tenant that opened more such fetches than
there are stream threads held every thread, and another tenant's fetch waited behind all of its queued calls, one
idle timeout each. Here:

- a tenant runs at most `per_tenant` streamed calls at once (fewer than the threads whenever several tenants can
  call), so a thread is left for the others whatever one tenant does; its further calls wait in its own queue, which
  holds no thread and refuses nothing (a client with eight concurrent fetches gets all of them, in turn);
- a free thread takes the next call of the tenant running fewest, the longest-waiting call first among equals.

grpc picks a method's pool by its behavior's `experimental_thread_pool`, which must be a ThreadPoolExecutor: each
tenant gets a `TenantLane`, a ThreadPoolExecutor whose `submit` queues into the shared `FairPool`, and
`FairStreams`, a server interceptor, points a streamed call's behavior at its caller's lane (the tenant is known from
the call's metadata before grpc submits it).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter, deque
from concurrent import futures

import grpc

__all__ = ["FairPool", "TenantLane", "FairStreams", "default_per_tenant"]


def default_per_tenant(threads: int, tenants: int, uploads: int = 0) -> int:
    """Stream threads one tenant may hold: all of them when it is the only one that can call, else all but a quarter
    (at least one) kept for the others; and always one more than the uploads it may hold open (`uploads`), so that
    its own uploads, which last as long as its client wants, never leave its fetches waiting (on 2 stream threads
    that takes both: no thread is then kept for the others)."""
    share = threads if tenants <= 1 else max(1, threads - max(1, threads // 4))
    return min(threads, max(share, uploads + 1))


class FairPool:
    """`threads` worker threads running calls queued per tenant; see the module's docstring for the order."""

    def __init__(self, threads: int, per_tenant: int, name: str = "kvbridge-stream"):
        if threads < 1 or not 1 <= per_tenant <= threads:
            raise ValueError(f"a fair pool needs threads >= 1 and 1 <= per_tenant <= threads, got threads={threads}, "
                             f"per_tenant={per_tenant}")
        self.threads, self.per_tenant, self.name = threads, per_tenant, name
        self._queues: dict[str, deque] = {}  # tenant -> (sequence, future, fn, args, kwargs) waiting
        self._running: Counter = Counter()
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._lanes: dict[str, TenantLane] = {}
        self._closed = False
        # at exit, before Python joins the worker threads: close, so idle workers end (as ThreadPoolExecutor does)
        closing = weakref.ref(self)
        threading._register_atexit(lambda: (pool := closing()) is not None and pool.shutdown(wait=False))

    def lane(self, tenant: str) -> TenantLane:
        """The executor grpc submits this tenant's streamed calls to (one per tenant, kept)."""
        with self._cond:
            lane = self._lanes.get(tenant)
            if lane is None:
                lane = self._lanes[tenant] = TenantLane(self, tenant)
            return lane

    def submit(self, tenant: str, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queues.setdefault(tenant, deque()).append((next(self._order), future, fn, args, kwargs))
            if len(self._workers) < self.threads:
                # not daemons: at exit a call runs to its end (a daemon killed inside grpc's core aborts the process)
                worker = threading.Thread(target=self._work, name=f"{self.name}_{len(self._workers)}")
                self._workers.append(worker)
                worker.start()
            self._cond.notify()
        return future

    def waiting(self) -> dict[str, int]:
        """Calls queued per tenant (none running yet)."""
        with self._cond:
            return {t: len(q) for t, q in self._queues.items() if q}

    def running(self) -> dict[str, int]:
        """Calls running per tenant."""
        with self._cond:
            return dict(+self._running)

    def _next(self):
        """The call a free thread takes now (under the lock), or None."""
        best = None
        for tenant, queue in self._queues.items():
            if queue and self._running[tenant] < self.per_tenant:
                rank = (self._running[tenant], queue[0][0])
                if best is None or rank < best[0]:
                    best = (rank, tenant)
        if best is None:
            return None
        tenant = best[1]
        _, future, fn, args, kwargs = self._queues[tenant].popleft()
        if not self._queues[tenant]:
            del self._queues[tenant]
        self._running[tenant] += 1
        return tenant, future, fn, args, kwargs

    def _work(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None:
                    if self._closed and not self._queues:
                        return
                    self._cond.wait()
            tenant = job[0]
            try:
                _run(*job[1:])
            finally:
                # no reference to the call kept while this thread waits: grpc's call objects must go with the call
                # (kept until the process exits, they are freed after grpc's core has shut down, which aborts it)
                del job
                with self._cond:
                    self._running[tenant] -= 1
                    self._cond.notify_all()  # this tenant may be under its limit again

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._closed = True
            if cancel_futures:
                for queue in self._queues.values():
                    for _, future, *_ in queue:
                        future.cancel()
                self._queues.clear()
            self._cond.notify_all()
            workers = list(self._workers)
        if wait:
            for worker in workers:
                worker.join()


def _run(future: futures.Future, fn, args, kwargs) -> None:
    """One call, its outcome on its future (as ThreadPoolExecutor's workers do); nothing of it outlives this."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # the future carries it
        future.set_exception(exc)
    else:
        future.set_result(result)


class TenantLane(futures.ThreadPoolExecutor):
    """One tenant's door into a FairPool, in the type grpc's per-method thread pool must have. It starts no thread of
    its own (ThreadPoolExecutor starts threads only in its `submit`, which this replaces)."""

    def __init__(self, pool: FairPool, tenant: str):
        super().__init__(max_workers=1)
        self.pool, self.tenant = pool, tenant

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        return self.pool.submit(self.tenant, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The pool's to shut down, not a lane's."""


_KINDS = ("unary_stream", "stream_unary", "stream_stream")


class FairStreams(grpc.ServerInterceptor):
    """Points each streamed call whose behavior runs on `pool` at its tenant's lane; a call whose token names no
    tenant keeps the pool's default lane (the auth interceptor refuses it, on no stream thread)."""

    def __init__(self, pool: FairPool, tenant_of):
        self.pool = pool
        self.tenant_of = tenant_of  # invocation metadata -> tenant name or None (Authenticator.tenant)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        kind = next((k for k in _KINDS if getattr(handler, k) is not None), None)
        behavior = getattr(handler, kind) if kind else None
        lane = getattr(behavior, "experimental_thread_pool", None)
        if not isinstance(lane, TenantLane) or lane.pool is not self.pool:
            return handler
        tenant = self.tenant_of(handler_call_details.invocation_metadata)
        if tenant is None or tenant == lane.tenant:
            return handler

        def run(*args):
            return behavior(*args)
        run.experimental_thread_pool = self.pool.lane(tenant)
        return handler._replace(**{kind: run})
