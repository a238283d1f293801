"""Projection flights: each flight is one tenant's and one adapter's (another tenant or adapter projects at once),
and a same-host fetch whose kept segment lost its entry. (A correction of a segment entry holding the model:
tests/test_model_lock.py.)"""

from __future__ import annotations

import threading

from kvbridge.server import projecting as projecting_module
from test_service_races import TEXT, _service


def _all_inside_projection(service, monkeypatch, fetches, wait_s=8.0):
    """Runs the fetches on threads; each projection waits (up to wait_s) until every fetch is inside a projection at
    once. Returns (results, errors); a BrokenBarrierError in errors means some fetch waited on another's flight."""
    barrier = threading.Barrier(len(fetches), timeout=wait_s)
    real_project = projecting_module.project

    def project(*args, **kwargs):
        barrier.wait()
        return real_project(*args, **kwargs)

    monkeypatch.setattr(projecting_module, "project", project)
    results, errors = [], []

    def run(fetch):
        try:
            results.append(fetch())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in fetches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_two_tenants_fetching_the_same_new_text_project_at_once(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                               adapter):
    """The text's flight is per tenant; without the tenant in its name tenant b
    waits for tenant a's ingest and projection of the same text (and can time it: a cross-tenant side channel)."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    results, errors = _all_inside_projection(
        service, monkeypatch, [lambda: service.projected_cache("a", text=TEXT),
                               lambda: service.projected_cache("b", text=TEXT)])
    assert errors == [] and len(results) == 2 and not service._flights


def test_fetches_of_one_entry_through_two_adapters_project_at_once(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                                  adapter):
    """The entry's flight is per adapter; one adapter's projection does not wait
    for another's."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    service.adapters.add("other", adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    results, errors = _all_inside_projection(
        service, monkeypatch, [lambda: service.projected_cache("t", key=key, adapter="fitted"),
                               lambda: service.projected_cache("t", key=key, adapter="other")])
    assert errors == [] and len(results) == 2 and not service._flights


def test_a_same_host_fetch_whose_kept_segment_lost_its_entry_is_served_the_projection_made_meanwhile(
        tmp_path, monkeypatch, tiny_source, tiny_target, adapter, shm_root):
    """The same-host fetch's warm read takes the kept segment of an earlier fetch
    (reuse), then the entry is gone at touch (evicted) and another fetch projects it again; the fetch's second read
    must not offer the segment again (reuse() comes once: AssertionError, INTERNAL to the client)."""
    from kvbridge.server.shm_segments import SegmentRegistry

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    segments = SegmentRegistry(str(shm_root))
    service.projected_cache("t", text=TEXT)
    store, real_touch, lost = service.store, service.store.touch, []
    try:
        first = segments.reserve("t")
        first.publish(service.projected_cache("t", text=TEXT, out=first).segment.kv)  # kept under its entry's tag

        def touch(key, tenant, kv, serial):
            if not lost:
                lost.append(key)
                store._remove_entry(store.registry.get(key), "evicted")
                other = threading.Thread(target=lambda: service.projected_cache("t", text=TEXT))
                other.start()
                other.join(60)
            return real_touch(key, tenant, kv, serial)

        monkeypatch.setattr(store, "touch", touch)
        pending = segments.reserve("t")
        served = service.projected_cache("t", text=TEXT, out=pending)
        pending.publish(served.segment.kv)
        assert lost and served.segment.num_tokens > 0
        assert served.segment.kv.equal(service.projected_cache("t", text=TEXT).segment.kv)
        assert store.check() == [] and not service._flights
    finally:
        segments.close()
