"""Prefix hits (issue 16, part 1): an Ingest whose text extends a cached prefix runs the source model on the new
tokens only, over the cached KV, and gets the KV of a full prefill; a projection of it projects only the target
tokens not already projected for that prefix. Counted as tokens reused vs computed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvbridge.adapters.adapter import project
from kvbridge.adapters.pairs import pair_text
from kvbridge.server import projecting as projecting_module
from kvbridge.server import service as service_module
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.service import KVBridgeService, ServiceLimits, extend_prefix
from kvbridge.transfer import kvcache
from kvbridge.transfer.store import PagedStore, StoreConfig

BASE = ("The json module encodes Python objects as JSON text and decodes JSON text back into Python objects. "
        "dumps() returns a string, dump() writes to a file; loads() and load() read them back. ") * 3
MORE = "Floats are written with repr, and NaN is allowed unless allow_nan is false."


def _service(tiny_source, tiny_target, folder, adapter):
    store = PagedStore(StoreConfig(capacity_bytes=64 << 20, device="cpu"))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry, ServiceLimits())


def test_extend_prefix_equals_a_full_prefill(tiny_source):
    ids = torch.as_tensor(tiny_source.tokenizer(BASE + MORE)["input_ids"])
    full = kvcache.extract(tiny_source.model, tiny_source.spec, ids)
    for p in (16, 48, ids.numel() - 1):
        extended = extend_prefix(tiny_source, full.slice(0, p), ids)
        assert torch.equal(extended.token_ids, ids) and torch.equal(extended.positions, torch.arange(ids.numel()))
        assert extended.kv.is_contiguous()  # written in place after the prefix: one buffer, nothing reassembled
        torch.testing.assert_close(extended.kv, full.kv, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="the prefix must be the first"):
        extend_prefix(tiny_source, full.slice(0, 16), ids.flip(0))


def test_an_ingest_that_extends_a_cached_prefix_computes_only_the_new_tokens(tmp_path, monkeypatch, tiny_source,
                                                                             tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    first = service.ingest("t", text=BASE)
    assert service.token_counts[("ingest", "computed")] == first.source_ids.numel()
    forwarded = []
    real = service_module.extend_prefix

    def counting(lm, prefix, ids):
        forwarded.append(ids.numel() - prefix.num_tokens)
        return real(lm, prefix, ids)

    monkeypatch.setattr(service_module, "extend_prefix", counting)
    second = service.ingest("t", text=BASE + MORE)
    ids = second.source_ids
    common = int((ids[:first.source_ids.numel()] == first.source_ids).cumprod(0).sum())
    reused = common // 16 * 16
    assert forwarded == [ids.numel() - reused] and reused >= 64
    assert service.token_counts[("ingest", "reused")] == reused
    assert service.token_counts[("ingest", "computed")] == first.source_ids.numel() + ids.numel() - reused
    stored = service.store.get(second.entries[0][0].key, "t")
    torch.testing.assert_close(stored.kv, kvcache.extract(tiny_source.model, tiny_source.spec, ids).kv,
                               atol=1e-5, rtol=1e-5)
    # another tenant's cache is never a prefix for this one
    other = service.ingest("u", text=BASE + MORE)
    assert forwarded == [ids.numel() - reused] and other.entries[0][0].new_blocks > 0
    assert service.store.check() == []


@pytest.mark.parametrize("context", [False, True])
def test_a_projection_of_an_extended_text_projects_only_the_new_target_tokens(tmp_path, monkeypatch, tiny_source,
                                                                             tiny_target, adapter, context):
    """With a context branch (format 4) the new tokens' projection also reads the 3 tokens before them, and the
    result is still the whole text's projection."""
    halo = 3 if context else 0
    if context:
        lt, d_in, d_t = adapter.wk.shape
        gen = torch.Generator().manual_seed(0)
        adapter = dataclasses.replace(adapter, ctx_lags=torch.tensor([1, 2, 3]), ctx_mu=torch.zeros(lt, 2 * d_in),
                                      ctx_g=torch.rand(lt, 3, 2 * d_in, generator=gen),
                                      ctx_a=torch.randn(lt, 2 * d_in, 4, generator=gen),
                                      ctx_b=torch.randn(lt, 4, 2 * d_t, generator=gen))
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    service.projected_cache("t", text=BASE)
    projected_tokens = []
    real = projecting_module.project

    def counting(adapter_, segment, alignment, target_ids, *args, **kwargs):
        projected_tokens.append(target_ids.numel())
        return real(adapter_, segment, alignment, target_ids, *args, **kwargs)

    monkeypatch.setattr(projecting_module, "project", counting)
    before = dict(service.token_counts)
    result = service.projected_cache("t", text=BASE + MORE)
    paired = pair_text(BASE + MORE, tiny_source.tokenizer, tiny_target.tokenizer)
    first = pair_text(BASE, tiny_source.tokenizer, tiny_target.tokenizer)
    t_t = paired.target_ids.numel()
    assert len(projected_tokens) == 1 and projected_tokens[0] < t_t - first.target_ids.numel() // 2
    reused = t_t - projected_tokens[0] + halo
    assert service.token_counts[("projection", "reused")] - before.get(("projection", "reused"), 0) == reused
    assert service.token_counts[("projection", "computed")] - before[("projection", "computed")] == t_t - reused
    source_kv = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    expected = real(adapter, source_kv, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    assert torch.equal(result.segment.token_ids, paired.target_ids)
    assert torch.equal(result.segment.positions, torch.arange(t_t))
    torch.testing.assert_close(result.segment.kv, expected.kv, atol=1e-4, rtol=1e-4)
    # fetched again: the whole projection is reused
    again = service.projected_cache("t", text=BASE + MORE)
    torch.testing.assert_close(again.segment.kv, result.segment.kv, atol=0, rtol=0)
    assert len(projected_tokens) == 1 and service.store.check() == []
    assert project is real


@pytest.mark.slow
def test_extend_prefix_equals_a_full_prefill_past_gemmas_sliding_window(gemma):
    """Gemma-3's sliding layers (window 512) over a cached prefix longer than the window."""
    ids = torch.as_tensor(gemma.tokenizer((BASE + MORE) * 8)["input_ids"])[:700]
    full = kvcache.extract(gemma.model, gemma.spec, ids)
    extended = extend_prefix(gemma, full.slice(0, 592), ids)
    torch.testing.assert_close(extended.kv, full.kv, atol=2e-4, rtol=2e-4)


def test_the_metrics_count_tokens_reused_and_computed(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.server.metrics import Metrics
    from prometheus_client import generate_latest

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    service.ingest("t", text=BASE)
    service.ingest("t", text=BASE + MORE)
    text = generate_latest(Metrics(service.store, service).registry).decode()
    for (stage, how), n in service.token_counts.items():
        assert f'kvbridge_tokens_total{{how="{how}",stage="{stage}"}} {float(n)}' in text
    assert service.token_counts[("ingest", "reused")] > 0
