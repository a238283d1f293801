"""A corrected fetch (server/projecting.py) resolves its adapter once: a tenant's LoadAdapter(make_default=True)
landing during the fetch never makes the server store one adapter's correction under another's label."""

from __future__ import annotations

import dataclasses

import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.corrections import CorrectionLimits, Corrections
from kvbridge.server.service import KVBridgeService
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.correction import Correction, correct
from kvbridge.transfer.suffix.induction import InductionPrior

TEXT = ("Readers skip the fields they do not understand, and writers keep the order of the fields they were given. "
        "A reader may stop at any field; a writer never reorders what it was handed.")
MODE = "blend:0.1"


def test_a_default_changed_during_a_corrected_fetch_never_mislabels_its_correction(tmp_path, monkeypatch,
                                                                                  tiny_source, tiny_target, adapter):
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    registry = AdapterRegistry(tmp_path, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    service = KVBridgeService(tiny_source, [tiny_target], store, registry, corrections=Corrections(CorrectionLimits()))
    other = dataclasses.replace(adapter, bk=adapter.bk + 0.5, bv=adapter.bv - 0.5)  # another adapter, other KV
    assert other.digest != adapter.digest
    key = service.ingest("t", text=TEXT).entries[0][0].key

    real, calls = registry.resolve, []

    def resolve(*args, **kwargs):
        found = real(*args, **kwargs)
        calls.append(found[0])
        if len(calls) == 1:  # the tenant's LoadAdapter(make_default=True) lands right after the fetch's first look
            registry.add("other", other, make_default=True, tenant="t")
        return found

    monkeypatch.setattr(registry, "resolve", resolve)
    served = service.projected_cache("t", key=key, mode=MODE)
    monkeypatch.setattr(registry, "resolve", real)

    name = served.adapter.split("@")[0]
    chosen = adapter if name == "fitted" else other
    assert served.adapter_digest == chosen.digest
    plain = service.projected_cache("t", key=key, adapter=name, mode="replace")
    want = correct(tiny_target, plain.segment, Correction.parse(MODE), prior=InductionPrior.for_model(tiny_target))
    torch.testing.assert_close(served.segment.kv, want.segment.kv, atol=1e-5, rtol=1e-5)
    # the stored correction, fetched again under that label, is the same KV
    again = service.projected_cache("t", key=key, adapter=name, mode=MODE)
    assert again.entry_key == served.entry_key
    torch.testing.assert_close(again.segment.kv, want.segment.kv, atol=1e-5, rtol=1e-5)


def test_a_default_changed_during_a_placement_files_it_under_the_adapter_that_made_it(tmp_path, monkeypatch,
                                                                                    tiny_source, tiny_target, adapter):
    """A prompt with a head (server/prompt_place.py): the placed cache is stored under the namespace of the adapter
    whose projection it holds, not under the default a LoadAdapter(make_default=True) set meanwhile."""
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    registry = AdapterRegistry(tmp_path, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    service = KVBridgeService(tiny_source, [tiny_target], store, registry)
    other = dataclasses.replace(adapter, bk=adapter.bk + 0.5, bv=adapter.bv - 0.5)
    stored = service.projected_cache("t", text=TEXT, mode="replace")
    ids = stored.segment.token_ids.tolist()
    prompt = [ids[0], 17, 23, 5, 42] + ids[1:] + [7, 8]  # a template's head before the document

    real, calls = registry.resolve, []

    def resolve(*args, **kwargs):
        found = real(*args, **kwargs)
        calls.append(found[0])
        if len(calls) == 2:  # after the projection the placement is made of
            registry.add("other", other, make_default=True, tenant="t")
        return found

    monkeypatch.setattr(registry, "resolve", resolve)
    placed = service.prompt_cache("t", prompt, text=TEXT, mode="replace")
    monkeypatch.setattr(registry, "resolve", real)
    assert placed.adapter_digest == adapter.digest
    # asked of the new default, the prompt gets that adapter's KV, never the placement the first one made
    served = service.prompt_cache("t", prompt, text=TEXT, adapter="other", mode="replace")
    assert served.adapter_digest == other.digest
    assert not torch.equal(served.segment.kv, placed.segment.kv)
    again = service.prompt_cache("t", prompt, text=TEXT, adapter="fitted", mode="replace")
    torch.testing.assert_close(again.segment.kv, placed.segment.kv)
