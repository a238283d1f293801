"""vLLM's paged KV layout writers on a GPU's terms, proven on a CPU: with the cache, the KV and the slots on the meta
device (which, like CUDA, refuses to mix with CPU tensors and cannot be read back), every write stays there."""

from __future__ import annotations

import pytest
import torch
from kvbridge.vllm.layouts import REFERENCES

META = torch.device("meta")


@pytest.mark.parametrize("isa", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_writers_stay_on_the_caches_device(isa, dtype):
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM picks amx for bfloat16 only")
    blocks, heads, bs, d, t = 4, 3, 32, 64, 50
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=dtype, device=META)
    key = torch.empty(t, heads, d, dtype=torch.float32, device=META)  # another dtype: converted where it lies
    value = torch.empty(t, heads, d, dtype=torch.float32, device=META)
    slots = torch.empty(t, dtype=torch.int64, device=META)
    REFERENCES[isa](cache, key, value, slots)
    assert cache.device == META and cache.shape == (blocks, heads, bs, 2 * d)

