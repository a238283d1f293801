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
        raised = []

        def another_request():  # on a thread of its own, as a server runs it (its own call: server/undo)
            try:
                action()
            except BaseException as exc:
                raised.append(exc)

        runner = threading.Thread(target=another_request)
        runner.start()
        runner.join()
        if raised:
            raise raised[0]
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


def _upload(service, tiny_source, kv) -> str:
    """PutSourceKV of TEXT's source ids with `kv`: the same key for any KV of the same ids."""
    from kvbridge.server.service import SourceUpload

    spec = tiny_source.spec
    upload = SourceUpload(model=spec.name, config_hash="", dtype=kv.dtype, num_layers=spec.num_layers,
                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          token_ids=torch.as_tensor(tiny_source.tokenizer(TEXT)["input_ids"]), positions=None,
                          rotated=True, kind="prefix")
    return service.put_source("t", upload, kv)[0].key


@pytest.mark.parametrize("mode", ["replace", "blend:0.2"])
def test_what_derives_from_a_source_deleted_and_stored_again_meanwhile_is_never_kept(tmp_path, monkeypatch,
                                                                                    tiny_source, tiny_target,
                                                                                    adapter, mode):
    """A key is its tokens' content key: another upload of the same ids (other KV) is the same key. A fetch that read
    the old KV, its source deleted and uploaded again meanwhile, stored its projection (and correction) linked to the
    new entry, and every later fetch was served the deleted KV's projection. Now it is refused (NOT_FOUND: stored
    again since), and the next fetch projects the new KV."""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    old = service.source_cache("x", text=TEXT).segment.kv.clone()
    new = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(0)).to(old.dtype)
    key = _upload(service, tiny_source, old)
    reference = _service(tiny_source, tiny_target, tmp_path / "reference", adapter)
    want = reference.projected_cache("t", key=_upload(reference, tiny_source, new), mode=mode).segment.kv
    _during_projection(monkeypatch, lambda: (service.delete("t", key), _upload(service, tiny_source, new)),
                       fail=False)
    with pytest.raises(NotFound, match="stored again since"):
        service.projected_cache("t", key=key, mode=mode)
    monkeypatch.undo()
    torch.testing.assert_close(service.projected_cache("t", key=key, mode=mode).segment.kv, want, rtol=0, atol=0)
    assert service.store.check() == []


def test_two_identical_corrections_at_once_compute_it_once(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                            adapter):
    """The second of two fetches of one correction waited for the correction slot behind the first, then ran the
    target over the document again; now it waits for the first and is served its stored result."""
    from kvbridge.server import corrections

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = service.ingest("t", text=TEXT).entries[0][0].key
    service.projected_cache("t", key=key, mode="replace")  # the projection is stored: only the correction runs
    waiting, computed = threading.Semaphore(0), []
    real_flight, real_correct = service._single_flight, corrections.correct

    def single_flight(name):
        waiting.release()  # this fetch reached the correction's one flight
        return real_flight(name)

    def correct(*args, **kwargs):
        computed.append(1)
        assert waiting.acquire(timeout=30) and waiting.acquire(timeout=30)  # both fetches are there
        time.sleep(0.1)  # and the second one waits on the first
        return real_correct(*args, **kwargs)

    monkeypatch.setattr(service, "_single_flight", single_flight)
    monkeypatch.setattr(corrections, "correct", correct)
    results = []
    threads = [threading.Thread(target=lambda: results.append(service.projected_cache("t", key=key, mode="blend:0.1")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and len(computed) == 1
    assert results[0].entry_key == results[1].entry_key and results[0].recomputed == results[1].recomputed
    assert service.token_counts[("correction", "reused")] == results[0].segment.num_tokens
    assert not service._flights  # nothing left behind


def test_a_corrected_fetch_whose_prefix_entry_is_deleted_meanwhile_corrects_the_entry_it_projects(
        tmp_path, tiny_source, tiny_target, adapter):
    """A text held as a prefix entry and as a detected segment: the fetch looked the text up (the prefix entry, lead
    1), the prefix entry was deleted, and the projection found the segment entry; its correction was computed as the
    prefix entry's (with a start token it does not hold) and named the deleted entry. It is the segment entry's."""
    from test_prompt_place import _segment_entry

    mode = "recompute:0.2"
    service, piece, doc = _segment_entry(tmp_path, tiny_source, tiny_target, adapter)
    prefix_key = service.ingest("t", text=piece).entries[0][0].key
    real, deleted = service._cached_projection, []

    def cached_projection(*args, **kwargs):
        if not deleted:  # another client deletes the prefix entry once this fetch looked the text up
            deleted.append(service.delete("t", prefix_key))
        return real(*args, **kwargs)

    service._cached_projection = cached_projection
    got = service.projected_cache("t", text=piece, mode=mode)
    del service._cached_projection
    clean = service.projected_cache("t", text=piece, mode=mode)  # the segment entry's own correction, stored
    assert got.source_key == clean.source_key != prefix_key and got.source_key in service.store.keys("t")
    assert (got.document_index, got.entry_key, got.recomputed) == (0, clean.entry_key, clean.recomputed)
    torch.testing.assert_close(got.segment.kv, clean.segment.kv, rtol=0, atol=0)


def test_a_warm_segment_fetch_whose_entry_is_deleted_after_its_read_says_where_its_document_begins(
        tmp_path, tiny_source, tiny_target, adapter):
    """A warm fetch asked whether its source was a prefix or a segment entry after reading the projection, and took
    a source deleted meanwhile for a prefix entry: the reply said the segment's document began at 1, not 0."""
    from test_prompt_place import _segment_entry

    service, piece, doc = _segment_entry(tmp_path, tiny_source, tiny_target, adapter)
    key = service.projected_cache("t", text=piece, require_cached=True).source_key  # its projection stored
    real = service._gathered

    def gathered(*args, **kwargs):
        out = real(*args, **kwargs)
        service.delete("t", key)  # another client deletes the entry right after this fetch read it
        return out

    service._gathered = gathered
    got = service.projected_cache("t", key=key)
    assert got.segment.token_ids.tolist() == doc and got.document_index == 0


class _Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _clocked_service(tmp_path, tiny_source, tiny_target, adapter) -> tuple[KVBridgeService, _Clock]:
    """A service whose store reads the returned clock (a test moves it on to expire entries)."""
    clock = _Clock()
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"), clock=clock)
    registry = AdapterRegistry(tmp_path, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry), clock


@pytest.mark.parametrize("mode", ["replace", "blend:0.1"])
def test_a_projection_outliving_its_expired_source_is_still_served_by_its_key(tmp_path, tiny_source, tiny_target,
                                                                              adapter, mode):
    """A projection outlives a source that expires (or is evicted): a fetch by the source's key is a warm hit, in
    every mode, though the source's kind and serial are not known any more."""
    service, clock = _clocked_service(tmp_path, tiny_source, tiny_target, adapter)
    store = service.store
    key = service.ingest("t", text=TEXT, ttl_s=10).entries[0][0].key
    first = service.projected_cache("t", key=key, mode=mode)  # stored with no TTL
    clock.now += 20  # the source expires; its projection stays
    assert key not in store.keys("t") and first.entry_key in store.keys("t")
    again = service.projected_cache("t", key=key, mode=mode)
    assert (again.entry_key, again.document_index) == (first.entry_key, first.document_index)
    torch.testing.assert_close(again.segment.kv, first.segment.kv, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["replace", "blend:0.2"])
def test_a_segment_entrys_projection_outliving_its_source_keeps_its_document_position(tmp_path, tiny_source,
                                                                                      tiny_target, adapter, mode):
    """A segment entry's projection holds the document's tokens alone (document index 0). Once the segment entry
    expired, a warm fetch of its projection took it for a prefix entry's (the start token first): the document
    position it told was one token off. The projection records it now."""
    import served
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    service, clock = _clocked_service(tmp_path, tiny_source, tiny_target, adapter)
    store = service.store
    service.detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))
    _, *segments = service.ingest("t", " ".join(served.text(i) for i in range(10, 14)), detect_segments=True,
                                  ttl_s=10).entries
    key = max((info for info, _ in segments), key=lambda i: i.num_tokens).key
    first = service.projected_cache("t", key=key, mode=mode)
    assert first.document_index == 0
    clock.now += 20  # the segment entry expires; its projection (and correction) stay
    assert key not in store.keys("t")
    again = service.projected_cache("t", key=key, mode=mode)
    assert (again.entry_key, again.document_index) == (first.entry_key, 0)
    torch.testing.assert_close(again.segment.kv, first.segment.kv, rtol=0, atol=0)
