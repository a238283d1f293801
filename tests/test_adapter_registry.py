"""The adapter registry through the service: what one tenant loads is its own, and projections are keyed by an
adapter's content, so an adapter replaced under the same name and version never serves the old one's KV."""

from __future__ import annotations

import dataclasses

import torch
from kvbridge.adapters.io import save_adapter
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.service import KVBridgeService, ServiceLimits
from kvbridge.transfer.store import PagedStore, StoreConfig

TEXT = "Readers skip the fields they do not understand, and writers keep the order of the fields they were given."


def _service(tiny_source, tiny_target, folder, adapter):
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)  # the server's: every tenant's
    return KVBridgeService(tiny_source, [tiny_target], store, registry, ServiceLimits())


def _retrained(adapter):
    """Another adapter with the same name, metadata and version: other weights."""
    return dataclasses.replace(adapter, wk=adapter.wk * 1.5, bv=adapter.bv + 0.25)


def _kv(service, tenant, adapter=""):
    return service.projected_cache(tenant, text=TEXT, adapter=adapter).segment.kv


def test_an_adapter_a_tenant_loads_is_that_tenants_only(tmp_path, tiny_source, tiny_target, adapter):
    other = _retrained(adapter)
    save_adapter(other, tmp_path / "fitted.safetensors")  # a file named like the server's own adapter
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    alone = _service(tiny_source, tiny_target, tmp_path / "none", adapter)  # what b must keep getting
    registry, src, tgt = service.adapters, tiny_source.spec, tiny_target.spec
    info = registry.load("fitted", tenant="a")  # LoadAdapter by tenant a
    assert info.loaded and info.is_default  # a's default names "fitted": a's own now
    assert registry.resolve("fitted", src, tgt, "a")[1].digest == other.digest
    for tenant in ("b", None):
        assert registry.resolve("fitted", src, tgt, tenant)[1].digest == adapter.digest
        assert registry.resolve("", src, tgt, tenant)[1].digest == adapter.digest
    assert torch.equal(_kv(service, "b"), _kv(alone, "b"))
    assert torch.equal(_kv(service, "b", "fitted"), _kv(alone, "b"))
    assert not torch.allclose(_kv(service, "a", "fitted"), _kv(service, "b", "fitted"))
    registry.load("fitted", tenant="c")  # the same file for another tenant: one object in memory
    assert registry.resolve("fitted", src, tgt, "c")[1] is registry.resolve("fitted", src, tgt, "a")[1]
    assert {a.name for a in registry.available("b") if a.loaded} == {"fitted"}


def test_a_replaced_adapter_never_serves_the_old_ones_cached_kv(tmp_path, tiny_source, tiny_target, adapter):
    retrained = _retrained(adapter)
    assert retrained.meta == adapter.meta and retrained.digest != adapter.digest
    save_adapter(adapter, tmp_path / "x.safetensors")
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    first = service.projected_cache("a", text=TEXT, adapter="x")  # loaded on first use, projected, stored
    assert first.adapter == "x@1"
    save_adapter(retrained, tmp_path / "x.safetensors")  # retrained, saved under the same name and version
    service.adapters.load("x", tenant="a")  # LoadAdapter("x") again
    second = service.projected_cache("a", text=TEXT, adapter="x")
    assert second.adapter == "x@1" and second.entry_key != first.entry_key  # the wire and shm caches key by it
    fresh = _service(tiny_source, tiny_target, tmp_path, retrained)
    assert torch.equal(second.segment.kv, _kv(fresh, "a", "x"))
    assert not torch.allclose(second.segment.kv, first.segment.kv)
    assert service.store.check() == []
