"""Identical cold fetches at once project once: a request that comes while another projects the same entry (or
ingests and projects the same text) with the same adapter waits for it and is served what it stored."""

from __future__ import annotations

import threading

from kvbridge.server import projecting as projecting_module
from test_service_races import TEXT, _service


def _concurrently(service, monkeypatch, fetch, n=3):
    """n threads run fetch() together; the projection step waits until all n have reached a projection's flight,
    so that without one they would all be inside the projection at once. (results, projections computed)"""
    arrived, computed = threading.Semaphore(0), []
    real_flight, real_project = service._single_flight, projecting_module.project

    def single_flight(name):
        if "|" not in name:  # a projection's flight (a correction's name holds its mode after a "|")
            arrived.release()
        return real_flight(name)

    def project(*args, **kwargs):
        computed.append(1)
        if len(computed) == 1:
            for _ in range(n):
                assert arrived.acquire(timeout=30)  # every request is at the flight (or inside the projection)
        return real_project(*args, **kwargs)

    monkeypatch.setattr(service, "_single_flight", single_flight)
    monkeypatch.setattr(projecting_module, "project", project)
    results, errors = [], []

    def run():
        try:
            results.append(fetch())
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == n
    assert not service._flights  # nothing left behind
    return results, len(computed)


def test_identical_cold_fetches_of_an_entry_project_it_once(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                              adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    results, computed = _concurrently(service, monkeypatch, lambda: service.projected_cache("t", key=key))
    assert computed == 1
    n = results[0].segment.num_tokens
    assert len({r.entry_key for r in results}) == 1 and all(r.segment.num_tokens == n for r in results)
    assert all(r.segment.kv.equal(results[0].segment.kv) for r in results)
    assert service.token_counts[("projection", "computed")] == n
    assert service.token_counts[("projection", "reused")] == 2 * n


def test_identical_cold_fetches_of_a_new_text_ingest_and_project_it_once(tmp_path, monkeypatch, tiny_source,
                                                                        tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    results, computed = _concurrently(service, monkeypatch, lambda: service.projected_cache("t", text=TEXT))
    assert computed == 1
    assert len({r.source_key for r in results}) == 1 and len({r.entry_key for r in results}) == 1
    assert len(service.store.keys("t")) == 2  # the source entry and its projection
    assert service.token_counts[("projection", "computed")] == results[0].segment.num_tokens


def test_fetches_of_other_entries_or_tenants_do_not_wait_on_each_other(tmp_path, monkeypatch, tiny_source,
                                                                      tiny_target, adapter):
    """The flight is per tenant and entry: three tenants' cold fetches of the same text each project their own."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    tenants = iter(["a", "b", "c"])
    lock = threading.Lock()

    def fetch():
        with lock:
            tenant = next(tenants)
        return service.projected_cache(tenant, text=TEXT)

    results, computed = _concurrently(service, monkeypatch, fetch)
    assert computed == 3 and len({r.entry_key for r in results}) == 3


def test_a_fetch_by_text_that_comes_after_the_ingest_waits_for_the_projection(tmp_path, monkeypatch, tiny_source,
                                                                             tiny_target, adapter):
    """The second fetch of a text comes once the first has ingested it and while it projects: it found the new
    source entry, took that entry's flight (which the first never held) and projected again; now it waits on the
    text's flight the first holds."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    real_flight, real_project = service._single_flight, projecting_module.project
    projecting, waiting, computed, results = threading.Event(), threading.Event(), [], {}

    def single_flight(name):
        if threading.current_thread().name == "second" and "#text:" in name:
            waiting.set()
        return real_flight(name)

    def project(*args, **kwargs):
        computed.append(threading.current_thread().name)
        if len(computed) == 1:
            projecting.set()
            waiting.wait(5)  # until the second fetch waits on the text's flight (never, before)
        return real_project(*args, **kwargs)

    monkeypatch.setattr(service, "_single_flight", single_flight)
    monkeypatch.setattr(projecting_module, "project", project)
    first = threading.Thread(target=lambda: results.update(first=service.projected_cache("t", text=TEXT)),
                             name="first")
    first.start()
    assert projecting.wait(30)  # the first has ingested the text and projects it
    second = threading.Thread(target=lambda: results.update(second=service.projected_cache("t", text=TEXT)),
                              name="second")
    second.start()
    first.join(60)
    second.join(60)
    assert computed == ["first"] and set(results) == {"first", "second"}
    assert results["first"].entry_key == results["second"].entry_key
    assert not service._flights


def test_a_same_host_fetch_whose_warm_read_lost_its_entry_is_served_the_projection_made_meanwhile(
        tmp_path, monkeypatch, tiny_source, tiny_target, adapter, shm_root):
    """A same-host fetch offers its segment's buffer to the store read; when that read loses the stored projection
    (evicted before the gather) and another fetch projects it again meanwhile, the fetch read it a second time into
    the same segment, which takes a buffer once (AssertionError, INTERNAL to the client); now the second read makes
    its own tensor, which the segment copies in when it is published."""
    from kvbridge.server.shm_segments import SegmentRegistry

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    segments = SegmentRegistry(str(shm_root))
    service.projected_cache("t", text=TEXT)  # stored: the same-host fetch below starts as a warm one
    store, real_get, lost = service.store, service.store.get, []

    def get(key, tenant, out=None, written=None):
        if out is None or lost:
            return real_get(key, tenant, out=out, written=written)
        lost.append(key)
        store._remove_entry(store.registry.get(key), "evicted")  # gone just before this read
        try:
            return real_get(key, tenant, out=out, written=written)  # NotFound: on to the projection's flight
        finally:  # meanwhile another client's fetch projects it again
            other = threading.Thread(target=lambda: service.projected_cache("t", text=TEXT))
            other.start()
            other.join(60)

    monkeypatch.setattr(store, "get", get)
    pending = segments.reserve("t")
    try:
        served = service.projected_cache("t", text=TEXT, out=pending)
        segment = pending.publish(served.segment.kv)
        assert lost and served.segment.num_tokens > 0
        assert served.segment.kv.equal(service.projected_cache("t", text=TEXT).segment.kv)
        assert segment.name and store.check() == [] and not service._flights
    finally:
        segments.close()
