"""The compute dtype of half-precision operands on the CPU: a bf16 adapter maps in bf16 where the CPU multiplies bf16
natively and in float32 elsewhere; both paths are forced here on one machine and agree to bf16 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvbridge.adapters.adapter import map_tokens, project
from kvbridge.adapters.pairs import pair_text
from kvbridge.transfer import kvcache
from kvbridge.transfer.devices import HALF_GEMM_ENV, compute_dtype, compute_path, cpu_half_gemm_native, half_gemm
from test_adapters import random_adapter

MAPS = ("mix_k", "mix_v", "wk", "bk", "wv", "bv")


def test_compute_dtype_follows_the_cpu_unless_forced(monkeypatch):
    monkeypatch.delenv(HALF_GEMM_ENV, raising=False)
    native = cpu_half_gemm_native(torch.bfloat16)
    assert compute_dtype(torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert compute_dtype(torch.float32) == torch.float32 and compute_dtype(torch.int64) == torch.int64
    with half_gemm("native"):
        assert compute_dtype(torch.bfloat16) == torch.bfloat16 and compute_dtype(torch.float16) == torch.float16
        with half_gemm("float32"):  # the innermost block wins
            assert compute_dtype(torch.bfloat16) == torch.float32
            assert "forced" in compute_path()
        assert compute_dtype(torch.bfloat16) == torch.bfloat16
    assert compute_dtype(torch.bfloat16, "meta") == torch.bfloat16  # not the CPU: its own dtype
    monkeypatch.setenv(HALF_GEMM_ENV, "float32")
    assert compute_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setenv(HALF_GEMM_ENV, "bf16")
    with pytest.raises(ValueError, match=HALF_GEMM_ENV):
        compute_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="half_gemm choice"):
        with half_gemm("fast"):
            pass
    monkeypatch.delenv(HALF_GEMM_ENV)
    assert compute_path().startswith(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


@pytest.mark.parametrize("path", ["native", "float32"])
def test_a_bf16_adapter_projects_to_bf16_rounding_on_either_path(path, tiny_source, tiny_target):
    """Forced to bf16 GEMM (products rounded to bf16) or to float32 GEMM of the same bf16 weights (exactly the
    float32 adapter holding those weights): both within bf16 rounding of float32, the output float32."""
    adapter = random_adapter(tiny_source, tiny_target, k=3, layer_map="mix")
    half = dataclasses.replace(adapter, **{n: getattr(adapter, n).to(torch.bfloat16) for n in MAPS})
    same_weights = dataclasses.replace(adapter, **{n: getattr(half, n).float() for n in MAPS})
    paired = pair_text("import os\nos.getcwd() returns the working directory.", tiny_source.tokenizer,
                       tiny_target.tokenizer)
    seg = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    with half_gemm(path):
        got = project(half, seg, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    want = project(same_weights, seg, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    assert got.kv.dtype == torch.float32
    err = float((got.kv - want.kv).norm() / want.kv.norm())
    if path == "native":
        assert 0 < err < 2e-2, err  # rounded (so the bf16 GEMM ran), and only by bf16 rounding
    else:
        assert err < 1e-6, err  # the same float32 products


def test_float32_maps_of_a_bf16_adapter_are_converted_once_and_follow_changes(tiny_source, tiny_target):
    adapter = random_adapter(tiny_source, tiny_target)
    half = adapter.with_maps_dtype(torch.bfloat16)
    first = half.maps_in(torch.float32)
    assert first["wk"].dtype == torch.float32 and torch.equal(first["wk"], half.wk.float())
    assert half.maps_in(torch.float32)["wk"] is first["wk"]  # kept
    assert half.maps_in(torch.bfloat16)["wk"] is half.wk  # already in that dtype: no copy
    x = torch.randn(tiny_source.spec.num_layers, 3,
                    tiny_source.spec.num_kv_heads * tiny_source.spec.head_dim)
    with half_gemm("float32"):
        before, _ = map_tokens(half, x, x)
        half.wk.mul_(2)  # changed in place: the converted copy must follow
        after, _ = map_tokens(half, x, x)
    assert half.maps_in(torch.float32)["wk"] is not first["wk"]
    assert torch.equal(half.maps_in(torch.float32)["wk"], half.wk.float())
    assert not torch.allclose(before, after)
    replaced = dataclasses.replace(half, wv=half.wv * 0)  # a new adapter object starts with nothing converted
    assert torch.equal(replaced.maps_in(torch.float32)["wv"], torch.zeros_like(half.wv, dtype=torch.float32))
