"""The CUDA paths (marked `cuda`, skipped without a device; bench/gpu_check.sh runs them on a lent GPU): the store's
pool on the GPU and its pinned CPU tier, projection on the GPU against the CPU, flash-attn against SDPA in bf16, and
selective recompute on the GPU."""

from __future__ import annotations

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_store_pool_lives_on_the_gpu_and_its_cpu_tier_is_pinned():
    from kvbridge.transfer.store import PagedStore, StoreConfig

    block = 2 * 2 * 2 * 16 * 8 * 2  # [L=2, 2, H=2, 16, D=8] bf16
    st = PagedStore(StoreConfig(capacity_bytes=4 * block, max_layouts=1, cpu_capacity_bytes=16 * block,
                                device="cuda"))
    model = ModelIdentity("m", "a" * 64)
    segs = [KVSegment(kv=torch.randn(2, 2, 2, 48, 8, dtype=torch.bfloat16), token_ids=torch.arange(i, i + 48),
                      positions=torch.arange(48), model=model, rotated=True) for i in (0, 100)]
    keys = [st.put(s, "t").key for s in segs]  # 3 + 3 blocks in a 4-block pool: the first entry demotes
    assert next(iter(st.pools.values())).kv_device.type == "cuda"
    assert all(tensor.is_pinned() for _, (_, tensor) in st.cpu._blocks.items())
    for key, seg in zip(keys, segs):
        got = st.get(key, "t")
        assert got.kv.device.type == "cuda" and torch.equal(got.kv.cpu(), seg.kv)
    assert st.check() == []


def test_projection_on_the_gpu_matches_the_cpu(tiny_source, tiny_target, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text
    from kvbridge.transfer.tiny_pair import tiny_source as build_source
    from kvbridge.transfer.tiny_pair import tiny_target as build_target

    paired = pair_text("The json module encodes Python objects as JSON text.", tiny_source.tokenizer,
                       tiny_target.tokenizer)
    seg = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    cpu = project(adapter, seg, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    src, tgt = build_source(device="cuda"), build_target(device="cuda")
    gpu = project(adapter.to("cuda"), seg.to("cuda"), paired.alignment, paired.target_ids, src.rope, tgt.rope)
    assert gpu.kv.device.type == "cuda" and torch.allclose(gpu.kv.cpu(), cpu.kv, atol=1e-4, rtol=1e-4)


def test_flash_attn_and_sdpa_agree_in_bf16():
    from kvbridge.transfer.models import random_model

    lm = random_model(zoo.configs()["qwen2"], "q", device="cuda", dtype="bfloat16")
    used = lm.model.config._attn_implementation
    if used != "flash_attention_2":  # flash-attn not installed, or its first forward failed: SDPA against SDPA
        pytest.skip(f"the model runs {used!r}, not flash_attention_2 (flash-attn absent or unusable here)")
    ids = torch.randint(3, lm.spec.vocab_size, (1, 200), device="cuda")
    with torch.no_grad():
        a = lm.model(input_ids=ids).logits.float()
        lm.model.set_attn_implementation("sdpa")
        b = lm.model(input_ids=ids).logits.float()
    assert torch.allclose(a, b, atol=5e-2 * float(b.abs().max())), used


def test_selective_recompute_on_the_gpu_is_exact_at_full_share():
    from dataclasses import replace

    from kvbridge.transfer.models import random_model
    from kvbridge.transfer.suffix.reuse import prefill_after, recompute_selected

    lm = random_model(zoo.configs()["phi3-sliding"], "p", device="cuda", dtype="float32")
    ids = torch.randint(3, lm.spec.vocab_size, (70,))
    context = kvcache.extract(lm.model, lm.spec, ids[:30])
    exact = prefill_after(lm, context, ids[30:])
    wrong = replace(exact, kv=exact.kv + 0.5)
    fixed = recompute_selected(lm, context, wrong, torch.arange(40))
    assert torch.allclose(fixed.kv, exact.kv, atol=1e-4, rtol=1e-3)
