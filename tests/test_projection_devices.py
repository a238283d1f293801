"""Projection and selective recompute's masks on a GPU's terms, proven on a CPU: run with the adapter, the source KV
and the models on the meta device (which, like CUDA, refuses to mix with CPU tensors and cannot be read back),
`project` (tiled or not) and `layer_masks` make every tensor on that device and read no value back."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import zoo
from kvbridge.adapters.adapter import project
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import AlignKind
from kvbridge.transfer.rope import ModelRope
from kvbridge.transfer.spec import find_rotary_module
from kvbridge.transfer.suffix.reuse import layer_masks
from test_adapters import identity_alignment, random_adapter

META = torch.device("meta")


def _on_meta(lm, name: str):
    model = copy.deepcopy(lm.model).to(META)
    return model, ModelRope(lm.spec, find_rotary_module(model, name))


@pytest.mark.parametrize("tile,context", [(None, 0), (8, 0), (None, 4), (8, 4), (None, 5), (8, 5)])
def test_project_makes_everything_on_the_adapters_device(tiny_source, tiny_target, tile, context):
    """One piece (a GPU's way) and in tiles of 8 tokens (a CPU's way), some target tokens without a source; with and
    without a context branch (format 4: its tiles read the tokens before them; format 5: its filter as GEMMs)."""
    adapter = random_adapter(tiny_source, tiny_target)
    if context:
        lt, d_in, d_t = adapter.wk.shape
        adapter = dataclasses.replace(adapter, ctx_lags=torch.tensor([1, 2, 3]), ctx_mu=torch.zeros(lt, 2 * d_in),
                                      ctx_g=torch.ones(lt, 3, 2 * d_in), ctx_a=torch.randn(lt, 2 * d_in, 4),
                                      ctx_b=torch.randn(lt, 4, 2 * d_t),
                                      meta=dataclasses.replace(adapter.meta, format_version=context))
        assert adapter.context_norm == (context == 4)
    adapter = adapter.to(META)
    ids = torch.arange(5, 29)
    seg = kvcache.extract(tiny_source.model, tiny_source.spec, ids).to(device=META)
    _, src_rope = _on_meta(tiny_source, "tiny_source")
    _, tgt_rope = _on_meta(tiny_target, "tiny_target")
    alignment = identity_alignment(24)
    alignment.source_index[5] = -1  # one target token without a source token: zero input
    alignment.kind[5] = AlignKind.UNMAPPED
    out = project(adapter, seg, alignment, ids, src_rope, tgt_rope, offset=3, dtype=torch.bfloat16, tile=tile)
    assert out.kv.device == META and out.kv.dtype == torch.bfloat16
    assert out.kv.shape == (tiny_target.spec.num_layers, 2, tiny_target.spec.num_kv_heads, 24,
                            tiny_target.spec.head_dim)


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3-sliding"])
def test_recompute_masks_land_on_the_models_device(name):
    lm = zoo.build(name)
    meta = copy.copy(lm)
    meta.model = copy.deepcopy(lm.model).to(META)
    q_pos, k_pos = torch.tensor([3, 7]), torch.arange(10)
    masks = layer_masks(meta, k_pos[None, :] <= q_pos[:, None], q_pos, k_pos)
    for mask in masks.values() if isinstance(masks, dict) else [masks]:
        assert mask.device == META and mask.shape == (1, 1, 2, 10)
