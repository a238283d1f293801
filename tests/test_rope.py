"""RoPE identities: free functions, every layer family of every zoo model, scaled and partial variants, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import random_model
from kvbridge.transfer.rope import ModelRope, rotate, rotate_half, unrotate
from kvbridge.transfer.spec import find_rotary_module


def tables(positions: torch.Tensor, dim: int, base: float = 10000.0, scale: float = 1.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    emb = torch.cat([positions[:, None].float() * inv] * 2, dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def test_rotate_half_pairs_first_and_second_half():
    x = torch.arange(6.0)
    assert rotate_half(x).tolist() == [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]


def test_rotate_matches_complex_multiplication():
    # HF rotate_half convention: dim i pairs with i + D/2 as the real and imaginary parts of one complex number
    pos = torch.arange(5)
    cos, sin = tables(pos, 8)
    x = torch.randn(2, 5, 8)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(5, 4), torch.atan2(sin[:, :4], cos[:, :4]))
    assert torch.allclose(rotate(x, cos, sin), torch.cat([z.real, z.imag], -1), atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.integers(0, 100_000), st.sampled_from([1.0, 0.7, 1.3]), st.sampled_from([8, 16, 32]))
def test_unrotate_inverts_rotate(t, start, scale, rot_dim):
    pos = torch.arange(start, start + t)
    cos, sin = tables(pos, rot_dim, scale=scale)
    x = torch.randn(3, t, 32)
    y = rotate(x, cos, sin)
    assert torch.allclose(unrotate(y, cos, sin), x, atol=1e-5)
    if rot_dim < 32:  # partial rotary: the pass-through dims are untouched
        assert torch.equal(y[..., rot_dim:], x[..., rot_dim:])
    assert not torch.allclose(y, x) or (start == 0 and t == 1 and scale == 1.0)


def test_rotation_preserves_dtype_and_bfloat16_round_trip():
    pos = torch.arange(100)
    cos, sin = tables(pos, 16)
    x = torch.randn(2, 100, 16, dtype=torch.bfloat16)
    y = rotate(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert (unrotate(y, cos, sin).float() - x.float()).abs().max() < 0.05


@pytest.mark.parametrize("name", sorted(zoo.configs()))
def test_every_layer_family_round_trips_and_shifts(name):
    lm = zoo.build(name)
    gen = torch.Generator().manual_seed(1)
    families = {layer.rope: layer.index for layer in lm.spec.layers if layer.rope is not None}
    assert families, "every zoo model applies RoPE"
    for rope, layer in families.items():
        limit = min(rope.original_max_positions, 2048)
        pos = torch.randint(0, limit // 2, (64,), generator=gen)
        x = torch.randn(lm.spec.num_kv_heads, 64, lm.spec.head_dim, generator=gen)
        rotated = lm.rope.rotate(x, layer, pos)
        assert not torch.allclose(rotated, x)
        assert torch.allclose(lm.rope.unrotate(rotated, layer, pos), x, atol=1e-5)
        delta = 17
        shifted = lm.rope.shift(rotated, layer, pos, pos + delta)
        assert torch.allclose(shifted, lm.rope.rotate(x, layer, pos + delta), atol=1e-3)


def test_gemma3_layer_types_use_their_own_bases():
    lm = zoo.build("gemma3")
    sliding, full = lm.spec.layers[0].rope, lm.spec.layers[3].rope
    assert (sliding.base, full.base) == (10000.0, 1e6)
    pos = torch.arange(50, 60)
    assert not torch.allclose(lm.rope.cos_sin(0, pos)[0], lm.rope.cos_sin(3, pos)[0])
    # the tables are the model's own: layer 3's equal a plain 1e6-base table
    assert torch.allclose(lm.rope.cos_sin(3, pos)[0], tables(pos, 32, base=1e6)[0], atol=1e-6)


def test_batched_all_layer_ops_equal_per_layer_ops():
    lm = zoo.build("gemma3")
    keys = torch.randn(lm.spec.num_layers, 1, 20, lm.spec.head_dim)
    pos = torch.arange(100, 120)
    rotated = lm.rope.rotate_all(keys, pos)
    for layer in range(lm.spec.num_layers):
        assert torch.equal(rotated[layer], lm.rope.rotate(keys[layer], layer, pos))
    assert torch.allclose(lm.rope.unrotate_all(rotated, pos), keys, atol=1e-5)
    moved = lm.rope.shift_all(rotated, pos, pos - 100)
    assert torch.allclose(moved, lm.rope.rotate_all(keys, pos - 100), atol=1e-4)
    out = torch.full_like(keys, math.nan)  # written in place, runs of layers as slices: every layer written
    assert lm.rope.rotate_all(keys, pos, out=out) is out and torch.equal(out, rotated)
    # with autograd (adapter training) the same values and a gradient through every layer's run
    leaf = keys.clone().requires_grad_(True)
    traced = lm.rope.rotate_all(leaf, pos)
    assert torch.equal(traced.detach(), rotated)
    traced.square().sum().backward()
    assert torch.allclose(leaf.grad, 2 * keys, atol=1e-4)  # a rotation keeps norms: d|Rx|^2/dx = 2x
    with pytest.raises(ValueError, match="not differentiable"):
        lm.rope.rotate_all(leaf, pos, out=out)


def test_longrope_is_exact_below_its_original_window_and_refuses_positions_past_it():
    lm = zoo.build("phi3-longrope")  # original_max_position_embeddings 256
    ids = torch.randint(0, lm.spec.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    seg = kvcache.extract(lm.model, lm.spec, ids)  # the model's own keys (short factors: its forward stays < 256)
    un = lm.rope.unrotate_all(seg.keys, seg.positions)
    assert torch.allclose(lm.rope.rotate_all(un, seg.positions), seg.keys, atol=1e-5)
    moved = lm.rope.shift_all(seg.keys[:, :, :10], seg.positions[:10], seg.positions[:10] + 246)  # up to 255: fine
    assert torch.allclose(lm.rope.unrotate_all(moved, seg.positions[:10] + 246), un[:, :, :10], atol=1e-5)
    # a call reaching past 256 would switch every key to the long factors: refused, naming model, layer and rule
    for call in (lambda: lm.rope.cos_sin(0, torch.arange(300)),
                 lambda: lm.rope.rotate_all(un, seg.positions + 100),
                 lambda: lm.rope.shift_all(seg.keys[:, :, :10], seg.positions[:10], seg.positions[:10] + 250)):
        with pytest.raises(ValueError, match=r"phi3-longrope.*layer 0: longrope.*positions >= 256"):
            call()
    # nor is KV made by a forward past 256: its keys below 256 carry the long factors too (a slice of it, a shared
    # prefix block, would pass the check above and be un-rotated with the short tables)
    longer = torch.randint(0, lm.spec.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    for call in (lambda: kvcache.extract(lm.model, lm.spec, longer),
                 lambda: kvcache.extract(lm.model, lm.spec, ids[:100], start_position=200)):
        with pytest.raises(ValueError, match=r"phi3-longrope.*longrope RoPE rotates every key .* below 256 tokens"):
            call()


def test_dynamic_rope_refuses_positions_it_cannot_reproduce():
    lm = zoo.build("llama-dynamic")  # max_position_embeddings 2048
    x = torch.randn(2, 3, 16)
    lm.rope.rotate(x, 0, torch.tensor([0, 5, 2047]))
    with pytest.raises(ValueError, match=r"llama-dynamic.*layer 0.*dynamic-NTK"):
        lm.rope.rotate(x, 0, torch.tensor([0, 5, 2048]))


def test_asking_for_tables_does_not_change_the_live_model():
    lm = zoo.build("phi3-longrope")
    live = next(m for n, m in lm.model.named_modules() if n.endswith("rotary_emb"))
    before = live.inv_freq.clone()
    lm.rope._compute_tables(lm.spec.layers[0].rope, torch.arange(1000))  # past 256: the module switches factors
    assert torch.equal(live.inv_freq, before)


@pytest.mark.parametrize("name, message", [
    ("gpt2", "has no rotary embedding module"),
    ("cohere-interleaved", "does not follow the rotate_half convention"),
])
def test_models_that_cannot_be_rerotated_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        random_model(zoo.non_rope_configs()[name], name, device="cpu")


def test_bad_arguments_name_the_problem():
    lm = zoo.build("qwen2")
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        lm.rope.rotate(x, 0, torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="1-D"):
        lm.rope.rotate(x, 0, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(IndexError, match="qwen2.*2 layers"):
        lm.rope.rotate(x, 5, torch.arange(3))
    with pytest.raises(ValueError, match="differ"):
        lm.rope.shift(x, 0, torch.arange(3), torch.arange(4))


def test_rotation_is_differentiable_and_agrees_with_the_fast_path():
    pos = torch.arange(7)
    cos, sin = tables(pos, 8, scale=1.2)
    x = torch.randn(2, 7, 12, requires_grad=True)
    y = unrotate(rotate(x, cos, sin), cos, sin)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.ones_like(x), atol=1e-5)
    assert torch.allclose(rotate(x, cos, sin), rotate(x.detach(), cos, sin))  # autograd path == fast path


@pytest.mark.parametrize("name", ["qwen2", "phi3-partial", "gemma3"])
def test_the_convention_probe_and_the_rotations_make_their_tensors_on_the_models_device(name):
    """A model on CUDA must get no CPU tensor from kvbridge's RoPE code (its own apply_rotary_pos_emb would raise and
    every load on a GPU fail). The "meta" device stands in for CUDA on a CPU-only build: like CUDA, mixing it with
    CPU tensors raises. (FakeTensorMode's fake CUDA cannot index a tensor on a CPU-only build, so it cannot run the
    modeling code.) Positions stay CPU tensors, as callers pass them; no value is read."""
    lm = zoo.build(name)
    model = copy.deepcopy(lm.model).to("meta")
    rope = ModelRope(lm.spec, find_rotary_module(model, name))
    for layer in sorted({layer.index for layer in lm.spec.layers if layer.rope is not None}):
        ours, theirs = rope.convention_probe(model, layer)
        assert ours.device.type == theirs.device.type == "meta" and ours.shape == theirs.shape
    keys = torch.empty(lm.spec.num_layers, lm.spec.num_kv_heads, 5, lm.spec.head_dim, device="meta")
    pos = torch.arange(5)
    cos, sin = rope.cos_sin(0, pos)
    for out in (rope.rotate_all(keys, pos), rope.unrotate_all(keys, pos), rope.shift_all(keys, pos, pos + 3),
                rope.rotate_all(keys, pos, out=torch.empty(keys.shape, device="meta")),
                rope.shift(keys[0], 0, pos, pos + 3)[None].expand_as(keys), rotate(keys, cos, sin),
                unrotate(keys, cos, sin)):
        assert out.device.type == "meta" and out.shape == keys.shape


@pytest.mark.parametrize("no_rope_layers, nope, roped", [([1, 1, 1, 0], 3, 0),  # the last layer without RoPE
                                                          ([1, 0, 1, 1], 1, 2)])  # one between RoPE layers
def test_batched_rope_ops_leave_layers_without_rope_as_they_are(no_rope_layers, nope, roped):
    from transformers import SmolLM3Config

    config = SmolLM3Config(**zoo.COMMON, num_hidden_layers=4, no_rope_layers=no_rope_layers,
                           max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm = random_model(config, "smollm3-tiny", device="cpu")
    keys = torch.randn(4, lm.spec.num_kv_heads, 5, lm.spec.head_dim)
    pos = torch.arange(5)
    for out in (lm.rope.rotate_all(keys, pos), lm.rope.unrotate_all(keys, pos), lm.rope.shift_all(keys, pos, pos + 3)):
        assert torch.equal(out[nope], keys[nope]) and not torch.equal(out[roped], keys[roped])


def test_consecutive_runs_keeps_a_gap_of_one_layer_apart():
    from kvbridge.transfer.rope import consecutive_runs

    assert consecutive_runs([0, 1, 2, 5, 6]) == [slice(0, 3), slice(5, 7)]
    assert consecutive_runs([0, 2, 3]) == [slice(0, 1), slice(2, 4)]
