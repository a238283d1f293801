"""Prometheus metrics of a server: requests by method and status, latencies, bytes streamed, and the store's
hits, misses, evictions, bytes per tier and invariant violations (read from the store when scraped). Each server has
its own registry."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class StoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        s = self.store.stats()
        yield CounterMetricFamily("kvbridge_store_hits", "store lookups and gets that found KV", value=s.hits)
        yield CounterMetricFamily("kvbridge_store_misses", "store lookups and gets that found nothing", value=s.misses)
        ev = CounterMetricFamily("kvbridge_store_evictions", "blocks pushed down from a tier", labels=["tier"])
        for tier, n in s.evictions.items():
            ev.add_metric([tier], n)
        yield ev
        used = GaugeMetricFamily("kvbridge_store_bytes", "bytes of KV held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvbridge_store_capacity_bytes", "capacity per tier", labels=["tier"])
        for tier in s.bytes_used:
            used.add_metric([tier], s.bytes_used[tier])
            cap.add_metric([tier], s.bytes_capacity[tier])
        yield used
        yield cap
        yield GaugeMetricFamily("kvbridge_store_entries", "entries stored", value=s.entries)
        # store.check() walks every block and entry under the store's lock (26 ms for a 20,000-block pool holding
        # 1,250 entries on the 2-core VM): fine at a scrape every few seconds
        problems = self.store.check()
        if problems:
            log.error("store check: %d violated invariants, first: %s", len(problems), problems[:3])
        yield GaugeMetricFamily("kvbridge_store_check_problems",
                                "invariants the store violates now (store.check(); 0 when consistent)",
                                value=len(problems))
        if s.redis is not None:
            yield GaugeMetricFamily("kvbridge_store_redis_up", "1 when the Redis tier answers",
                                    value=1 if s.redis.get("available") else 0)
            rejected = CounterMetricFamily("kvbridge_store_redis_rejected",
                                           "values read from Redis and not served: a tag that does not check out "
                                           "(forged, moved from another key, another secret), or a block that does "
                                           "not fit its record", labels=["kind"])
            for kind, n in sorted(s.redis["rejected"].items()):
                rejected.add_metric([kind], n)
            yield rejected


class TokenCollector:
    """Tokens read from the store instead of computed, and computed: source tokens at ingest, target tokens at
    projection (KVBridgeService.token_counts)."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        family = CounterMetricFamily("kvbridge_tokens", "tokens reused from the store or computed, by stage",
                                     labels=["stage", "how"])
        for (stage, how), n in sorted(dict(self.service.token_counts).items()):
            family.add_metric([stage, how], n)
        yield family


class StreamCollector:
    """Streamed calls running on the stream threads and waiting for one (server/fair_pool.py), over all tenants."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        family = GaugeMetricFamily("kvbridge_stream_calls", "streamed calls running on a stream thread or waiting "
                                   "for one (a tenant past its share of the threads waits)", labels=["state"])
        family.add_metric(["running"], sum(self.pool.running().values()))
        family.add_metric(["waiting"], sum(self.pool.waiting().values()))
        yield family


class Metrics:
    def __init__(self, store=None, service=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvbridge_requests", "RPCs by method and status code", ["method", "code"],
                                registry=self.registry)
        self.latency = Histogram("kvbridge_request_seconds", "RPC latency (streams: until the last message)",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.bytes_streamed = Counter("kvbridge_streamed_bytes", "KV bytes sent or received in chunks",
                                      ["method", "direction"], registry=self.registry)
        if store is not None:
            self.registry.register(StoreCollector(store))
        if service is not None:
            self.registry.register(TokenCollector(service))
        self._http = None

    def watch_streams(self, pool) -> None:
        """Report the stream threads' FairPool on /metrics."""
        self.registry.register(StreamCollector(pool))

    @contextmanager
    def observe(self, method: str):
        """Times a call; the body sets the status code on the yielded dict (default OK)."""
        outcome = {"code": "OK"}
        t0 = time.perf_counter()
        try:
            yield outcome
        finally:
            self.latency.labels(method).observe(time.perf_counter() - t0)
            self.requests.labels(method, outcome["code"]).inc()

    def serve_http(self, address: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port (port 0: a free one)."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        self._http = server
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
