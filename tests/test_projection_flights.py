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
