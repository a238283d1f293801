"""Bounded work in the service and the store (issue 16, part 5), without gRPC: the races named in the issue,
provoked deterministically by running the concurrent request inside the projection step; per-tenant quotas;
per-tenant adapter defaults; the projection semaphore; no gc.freeze in the pool."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from kvbridge.server import projecting as projecting_module
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.service import KVBridgeService, ServiceLimits
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, QuotaExceeded, StoreConfig
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout

TEXT = "Readers skip the fields they do not understand, and writers keep the order of the fields they were given."


M = ModelIdentity("model-q", "q" * 64)


def _seg(n: int, seed: int) -> KVSegment:
    gen = torch.Generator().manual_seed(seed)
    return KVSegment(kv=torch.randn(2, 2, 2, n, 8, generator=gen), token_ids=torch.arange(seed, seed + n),
                     positions=torch.arange(n), model=M, rotated=True)


def _service(tiny_source, tiny_target, folder, adapter, limits: ServiceLimits | None = None, **store_config):
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu", **store_config))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry, limits or ServiceLimits())


def _during_projection(monkeypatch, action, fail: bool):
    """Run action() inside the service's projection step (where a concurrent request can interleave), then fail
    the projection or let it finish."""
    real = projecting_module.project

    def project(*args, **kwargs):
        action()
        if fail:
            raise RuntimeError("the projection failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(projecting_module, "project", project)


def test_a_failed_by_text_projection_keeps_a_source_another_request_ingested(tmp_path, monkeypatch, tiny_source,
                                                                            tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    other = {}
    _during_projection(monkeypatch, lambda: other.update(key=service.ingest("t", text=TEXT).entries[0][0].key),
                       fail=True)
    with pytest.raises(RuntimeError, match="the projection failed"):
        service.projected_cache("t", text=TEXT)
    assert service.store.keys("t") == [other["key"]]  # the other request's entry is still there
    assert service.store.get(other["key"], "t").num_tokens > 0 and service.store.check() == []


def test_a_failed_by_text_projection_undoes_its_own_ingest(tmp_path, monkeypatch, tiny_source, tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    _during_projection(monkeypatch, lambda: None, fail=True)
    with pytest.raises(RuntimeError):
        service.projected_cache("t", text=TEXT)
    assert service.store.keys("t") == [] and service.store.check() == []


def test_a_projection_racing_a_delete_of_its_source_leaves_no_orphan(tmp_path, monkeypatch, tiny_source,
                                                                     tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    _during_projection(monkeypatch, lambda: service.delete("t", key), fail=False)
    with pytest.raises(NotFound):
        service.projected_cache("t", key=key)
    assert service.store.keys("t") == [] and service.store.check() == []


def test_a_projection_whose_source_is_lost_meanwhile_leaves_no_orphan(tmp_path, monkeypatch, tiny_source,
                                                                      tiny_target, adapter):
    """The source leaves the store (evicted past the last tier) while its projection is made: nothing is
    registered (there is nothing to link to), and the client is told NOT_FOUND."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    _during_projection(monkeypatch, lambda: service.store._remove_entry(service.store.registry.get(key), "lost"),
                       fail=False)
    with pytest.raises(NotFound):
        service.projected_cache("t", key=key)
    assert service.store.keys("t") == [] and service.store.check() == []


def test_a_derived_entry_whose_source_its_own_put_evicted_keeps_its_link():
    """The derived entry's own allocation evicts its source's blocks (no lower tier: the source is lost). The
    derived entry keeps its link (links outlive their source), so a Delete of the source key still removes it;
    before, it was registered unlinked and outlived every Delete."""
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4
    store = PagedStore(StoreConfig(capacity_bytes=4 * block_bytes, max_layouts=1, device="cpu"))
    source = store.put(_seg(32, 1), "t")  # 2 of the 4 blocks
    derived = store.put(_seg(48, 100), "t", adapter="x#" + source.key, source_key=source.key)  # 3: evicts one
    assert store.keys("t") == [derived.key]  # the source was lost to the eviction
    assert store.info(derived.key, "t").source_key == source.key
    assert store.delete(source.key, "t") == 1 and store.keys("t") == [] and store.check() == []


def test_delete_if_generation_spares_an_entry_stored_again_or_projected(tmp_path, tiny_source, tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    store = service.store
    info = service.ingest("t", text=TEXT).entries[0][0]
    assert info.generation == 0
    service.ingest("t", text=TEXT)  # stored again: generation 1
    assert store.delete(info.key, "t", if_generation=0) == 0 and store.keys("t") == [info.key]
    service.projected_cache("t", key=info.key)
    assert store.delete(info.key, "t", if_generation=1) == 0  # something derives from it
    assert store.delete(info.key, "t") == 2 and store.check() == []


def test_tenant_quotas_on_entries_and_pinned_bytes():
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4
    store = PagedStore(StoreConfig(capacity_bytes=64 * block_bytes, max_layouts=1, device="cpu",
                                   tenant_max_entries=3, tenant_max_pinned_bytes=4 * block_bytes))
    store.put(_seg(32, 1), "a", pin=True)  # 2 blocks pinned
    over = "pinning 12288 more bytes would take this tenant.s pinned KV to 20480 bytes, over its quota of 16384"
    with pytest.raises(QuotaExceeded, match=over):
        store.put(_seg(48, 2), "a", pin=True)  # 3 more: over 4
    second = store.put(_seg(48, 2), "a")  # unpinned: fine
    with pytest.raises(QuotaExceeded, match="over its quota"):
        store.pin(second.key, "a")
    with pytest.raises(QuotaExceeded, match="over its quota"):
        store.put(_seg(48, 2), "a", pin=True)  # pinning an existing entry counts too
    store.put(_seg(16, 3), "a")
    with pytest.raises(QuotaExceeded, match="this tenant holds 3 entries, its quota"):
        store.put(_seg(16, 4), "a")
    store.put(_seg(32, 1), "a")  # the same entry again is no new entry
    store.put(_seg(16, 4), "b", pin=True)  # another tenant has its own quota
    store.delete(second.key, "a")
    store.put(_seg(16, 4), "a")
    assert store.registry.per_tenant == {"a": 3, "b": 1} and store.check() == []


def test_a_tenants_default_adapter_is_its_own(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.io import save_adapter

    save_adapter(adapter, tmp_path / "mine.safetensors")
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    registry = service.adapters
    info = registry.load("mine", make_default=True, tenant="a")
    assert info.is_default
    src, tgt = tiny_source.spec, tiny_target.spec
    assert registry.resolve("", src, tgt, "a")[0] == "mine@1"
    assert registry.resolve("", src, tgt, "b")[0] == "fitted@1" == registry.resolve("", src, tgt)[0]
    assert {a.name for a in registry.available("a") if a.is_default} == {"mine"}
    assert {a.name for a in registry.available("b") if a.is_default} == {"fitted"}
    assert service.projected_cache("a", text=TEXT).adapter == "mine@1"
    assert service.projected_cache("b", text=TEXT).adapter == "fitted@1"


class _CountingSemaphore:
    """Wraps a semaphore and counts the threads it made wait, so a test can hold the ones inside until the others are
    blocked on it."""

    def __init__(self, real):
        self.real, self.blocked, self.lock = real, 0, threading.Lock()

    def __enter__(self):
        if not self.real.acquire(blocking=False):
            with self.lock:
                self.blocked += 1
            self.real.acquire()
        return self

    def __exit__(self, *exc):
        self.real.release()


def _wait_until(condition, what: str, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"gave up waiting until {what}"
        time.sleep(0.01)


def test_projections_wait_for_the_semaphore(tmp_path, monkeypatch, tiny_source, tiny_target, adapter):
    """Four projections contend for a limit of two: two are held inside the projection until the other two are
    blocked on the semaphore, and no more than two are ever inside at once (exactly two are)."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter, ServiceLimits(max_projections=2))
    service._projecting = semaphore = _CountingSemaphore(service._projecting)
    inside, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()
    real = projecting_module.project

    def project(*args, **kwargs):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        release.wait(60)
        with lock:
            inside[0] -= 1
        return real(*args, **kwargs)

    monkeypatch.setattr(projecting_module, "project", project)
    texts = [f"{TEXT} Part {i}." for i in range(4)]
    for t in texts:
        service.ingest("t", text=t)
    errors = []

    def request(text):
        try:
            service.projected_cache("t", text=text)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=request, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    try:
        _wait_until(lambda: semaphore.blocked == 2 and inside[0] == 2,
                    "two requests are inside the projection and two are blocked on the semaphore")
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert peak[0] == 2 and len(service.store.keys("t")) == 8


def test_a_block_pool_does_not_freeze_the_process_heap():
    before = gc.get_freeze_count()
    BlockPool(PoolLayout("m", "float32", 1, 1, 4, 16), 8, torch.device("cpu"))
    assert gc.get_freeze_count() == before
