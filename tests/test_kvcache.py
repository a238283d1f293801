"""Exact inject-and-continue: extract -> to_cache -> greedy continue equals plain generate; full sliding capture;
clear errors for bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.selfcheck import check_inject, check_real_shift, check_tokens, sample_text
from kvbridge.transfer.spec import ModelIdentity
from transformers import DynamicCache


def ids_for(lm, n, seed=0):
    return torch.randint(0, lm.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def assert_inject_exact(lm, ids, tail=3, new_tokens=12):
    seg = kvcache.extract(lm.model, lm.spec, ids[:-tail])
    ours = kvcache.generate(lm.model, lm.spec, seg, ids[-tail:], max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens)
    ref = kvcache.generate_plain(lm.model, lm.spec, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    assert ours.shape == (new_tokens,)
    assert torch.equal(ours, ref), f"{lm.name}: {ours.tolist()} != {ref.tolist()}"
    return ours


@pytest.mark.parametrize("name", ["qwen2", "phi3-partial", "llama3", "llama-yarn", "gemma3", "mistral-sliding"])
def test_inject_and_continue_is_exact_on_tiny_models(name):
    lm = zoo.build(name)
    assert_inject_exact(lm, ids_for(lm, 80))  # 80 > the sliding windows (16, 24) of gemma3 and mistral


def test_half_precision_selfcheck_compares_logits_within_a_tolerance_and_greedy_agreement():
    """bf16 rounds injected and plain runs differently, so exact token equality is not asked of it; float32 stays
    exact. A wrong cache still fails in bf16."""
    from kvbridge.transfer.models import random_model
    from kvbridge.transfer.selfcheck import AGREE_SHARE

    lm = random_model(zoo.configs()["qwen2"], "qwen2-bf16", seed=0, dtype="bfloat16", device="cpu")
    ids = ids_for(lm, 80)
    result = check_inject(lm, ids)
    assert result.passed and "bfloat16" in result.detail and "tol" in result.detail, result.line()
    assert 0 <= result.error < 5e-2 and f"need {AGREE_SHARE:.0%}" in result.detail
    import dataclasses
    from unittest import mock

    real = kvcache.extract

    def corrupted(model, spec, token_ids, start_position=0):  # a cache that is not the model's: values zeroed
        seg = real(model, spec, token_ids, start_position)
        kv = seg.kv.clone()
        kv[:, 1] = 0
        return dataclasses.replace(seg, kv=kv)

    with mock.patch.object(kvcache, "extract", corrupted):
        bad = check_inject(lm, ids)
    assert not bad.passed, bad.line()


def test_inject_and_continue_on_tiny_presets(tiny_source, tiny_target):
    for lm in (tiny_source, tiny_target):
        ids = check_tokens(lm, 120)
        out = assert_inject_exact(lm, ids)
        assert len(set(out.tolist())) > 1, "greedy output of the tiny preset should not be degenerate"


def test_extract_layout_and_metadata(tiny_source):
    ids = check_tokens(tiny_source, 40)
    seg = kvcache.extract(tiny_source.model, tiny_source.spec, ids, start_position=7)
    spec = tiny_source.spec
    assert seg.kv.shape == (spec.num_layers, 2, spec.num_kv_heads, 40, spec.head_dim)
    assert seg.positions.tolist() == list(range(7, 47))
    assert torch.equal(seg.token_ids, ids)
    assert seg.rotated and seg.model == spec.identity
    # the keys are what the model itself caches
    cache = DynamicCache(config=tiny_source.model.config)
    tiny_source.model(input_ids=ids[None], position_ids=seg.positions[None], cache=cache)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys[0], seg.keys[i]) and torch.equal(layer.values[0], seg.values[i])


@pytest.mark.parametrize("name", ["qwen2", "phi3-partial", "gemma3", "mistral-sliding"])
def test_extract_writes_every_layer_in_place_and_equals_a_plain_prefill(name, monkeypatch):
    """One [L, 2, H, T, D] buffer the forward writes into (no per-layer concatenation, no stacking at the end: the
    from_cache fallback never runs), equal to what a plain DynamicCache keeps; with a prefix, only the rest runs."""
    lm = zoo.build(name)
    ids = ids_for(lm, 40)
    plain = DynamicCache()
    lm.model(input_ids=ids[None], position_ids=torch.arange(40)[None], cache=plain, use_cache=True)
    expected = kvcache.from_cache(plain, lm.spec, ids)

    def no_fallback(*args, **kwargs):
        raise AssertionError("extract fell back to stacking the cache's layers")

    monkeypatch.setattr(kvcache, "from_cache", no_fallback)
    seg = kvcache.extract(lm.model, lm.spec, ids)
    assert seg.kv.is_contiguous() and seg.kv.dtype == expected.kv.dtype
    torch.testing.assert_close(seg.kv, expected.kv, atol=1e-5, rtol=1e-5)
    calls = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward",
                        lambda *a, **kw: calls.append(kw["input_ids"].shape[1]) or forward(*a, **kw))
    extended = kvcache.extract(lm.model, lm.spec, ids, prefix=seg.slice(0, 25))
    assert calls == [15]
    torch.testing.assert_close(extended.kv, expected.kv, atol=1e-5, rtol=1e-5)
    assert torch.equal(extended.kv[:, :, :, :25], seg.kv[:, :, :, :25])  # the prefix copied as it was
    for bad, match in [(seg.slice(0, 40), "the prefix must be the first 1..39"),
                       (seg.slice(5, 20), "the prefix must be the first"),
                       (dataclasses.replace(seg.slice(0, 10), positions=torch.arange(3, 13)),
                        "the prefix must lie at positions 0..9"),
                       (dataclasses.replace(seg.slice(0, 10), rotated=False), "the prefix must hold rotated keys")]:
        with pytest.raises(ValueError, match=match):
            kvcache.extract(lm.model, lm.spec, ids, prefix=bad)


def test_sliding_layers_are_captured_in_full():
    lm = zoo.build("gemma3")  # window 16: the model's own cache keeps only the last 15 tokens of sliding layers
    ids = ids_for(lm, 50)
    seg = kvcache.extract(lm.model, lm.spec, ids)
    cache = DynamicCache(config=lm.model.config)
    lm.model(input_ids=ids[None], cache=cache)
    for i, layer in enumerate(cache.layers):
        kept = layer.keys.shape[2]
        if lm.spec.layers[i].attention_type == "sliding_attention":
            assert kept == 15
        assert seg.keys.shape[2] == 50
        assert torch.allclose(seg.keys[i, :, -kept:], layer.keys[0], atol=1e-6)
    rebuilt = kvcache.to_cache(seg, lm.model, lm.spec)
    assert rebuilt.get_seq_length() == 50
    assert all(layer.get_seq_length() == 50 for layer in rebuilt.layers)
    for i, layer in enumerate(rebuilt.layers):  # the model's own cache keeps as much, with the same values
        assert layer.keys.shape == cache.layers[i].keys.shape
        assert torch.allclose(layer.keys, cache.layers[i].keys, atol=1e-6)


def test_to_cache_of_one_segment_holds_views_of_it_and_generation_leaves_it_unchanged(tiny_target):
    lm = tiny_target
    ids = check_tokens(lm, 30)
    seg = kvcache.extract(lm.model, lm.spec, ids[:-4])
    kept = seg.kv.clone()
    cache = kvcache.to_cache(seg, lm.model, lm.spec)
    for i, layer in enumerate(cache.layers):  # no copy: the cache reads the segment's own memory
        assert layer.keys.data_ptr() == seg.keys[i].data_ptr() and layer.values.data_ptr() == seg.values[i].data_ptr()
    out = lm.model.generate(input_ids=ids[None], attention_mask=torch.ones(1, 30, dtype=torch.long), cache=cache,
                            max_new_tokens=3, do_sample=False)
    assert torch.equal(out[0, 30:], kvcache.generate_plain(lm.model, lm.spec, ids, max_new_tokens=3))
    assert torch.equal(seg.kv, kept)  # the cache grew into new tensors


def test_growing_layer_writes_the_next_tokens_in_place_and_moves_when_full():
    g = torch.Generator().manual_seed(0)
    room_k, room_v = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g)
    layer = kvcache.GrowingLayer()
    layer.adopt(room_k[:, :, :6], room_v[:, :, :6], room_k, room_v)
    before = room_k[:, :, :6].clone()
    new_k, new_v = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    keys, values = layer.update(new_k, new_v)
    assert keys.data_ptr() == room_k.data_ptr() and values.data_ptr() == room_v.data_ptr()  # in place: no copy
    assert torch.equal(keys, torch.cat((before, new_k), dim=2)) and layer.get_seq_length() == 9
    assert torch.equal(room_v[:, :, 6:9], new_v)
    more_k, more_v = torch.randn(1, 2, 2, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g)
    keys, values = layer.update(more_k, more_v)  # 11 > 10 slots: moved, with room to spare
    assert keys.data_ptr() != room_k.data_ptr() and layer._room_k.shape[2] >= 11 + kvcache.GrowingLayer.MIN_ROOM
    assert torch.equal(keys, torch.cat((before, new_k, more_k), dim=2))
    assert torch.equal(values[:, :, 6:9], new_v) and torch.equal(values[:, :, 9:], more_v)
    moved = keys.data_ptr()
    layer.crop(-4)  # 7 tokens left; the next update reuses the cropped slots
    keys, _ = layer.update(more_k, more_v)
    assert keys.data_ptr() == moved and torch.equal(keys, torch.cat((before, new_k[:, :, :1], more_k), dim=2))
    layer.reorder_cache(torch.tensor([0]))  # new tensors: the next update copies them into new buffers
    keys, _ = layer.update(new_k, new_v)
    assert keys.data_ptr() != moved and torch.equal(keys[:, :, -3:], new_k) and layer.get_seq_length() == 12

    bare = kvcache.GrowingLayer()  # no room handed over: the first update concatenates as DynamicLayer's would,
    bare.adopt(before, before)  # the second moves to buffers with room, the third writes in place
    first, _ = bare.update(new_k, new_v)
    assert first.is_contiguous() and first.shape[2] == 9 and bare._room_k is None
    second, _ = bare.update(more_k, more_v)
    third, _ = bare.update(new_k, new_v)
    assert second.data_ptr() == third.data_ptr() != first.data_ptr()
    assert torch.equal(third, torch.cat((before, new_k, more_k, new_k), dim=2))


def test_to_cache_with_room_generates_in_place_and_exactly(tiny_target):
    """A segment handed over with slots to spare (as a same-host fetch maps it): generation writes its tokens there,
    leaves the segment's own slots unchanged, and gives the tokens of a plain generate, also beyond the room."""
    lm = tiny_target
    ids = check_tokens(lm, 30)
    seg = kvcache.extract(lm.model, lm.spec, ids[:-4])
    t = seg.num_tokens
    room = torch.full((*seg.kv.shape[:3], t + 5, seg.kv.shape[-1]), float("nan"))
    room[:, :, :, :t] = seg.kv
    held = dataclasses.replace(seg, kv=room[:, :, :, :t])
    cache = kvcache.to_cache(held, lm.model, lm.spec, room=room)
    attention = torch.ones(1, 30, dtype=torch.long)
    out = lm.model(input_ids=ids[None, -4:], position_ids=torch.arange(t, 30)[None], cache=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == room[i, 0].data_ptr() and layer.get_seq_length() == 30
    assert torch.equal(room[:, :, :, :t], seg.kv)  # the segment's own slots are never written
    plain = lm.model(input_ids=ids[None], use_cache=False).logits[0, -1]
    # a 4-token forward over a cache and a 30-token one take different SDPA kernels: equal to float rounding (on an
    # Intel Xeon VM 1.2e-5 apart, bitwise equal on the AMD EPYC ones); the tokens below must be identical
    assert torch.allclose(out.logits[0, -1], plain, atol=1e-4, rtol=0) and out.logits[0, -1].argmax() == plain.argmax()
    cache = kvcache.to_cache(held, lm.model, lm.spec, room=room)
    out = lm.model.generate(input_ids=ids[None], attention_mask=attention, cache=cache, max_new_tokens=9,
                            min_new_tokens=9, do_sample=False)  # 4 + 9 tokens: past the 5 spare slots
    ref = kvcache.generate_plain(lm.model, lm.spec, ids, max_new_tokens=9, min_new_tokens=9)
    assert torch.equal(out[0, 30:], ref)
    with pytest.raises(ValueError, match="beginning with the segment's kv"):
        kvcache.to_cache(seg, lm.model, lm.spec, room=room)  # seg.kv is not room's first slots


def test_to_cache_batches_segments_and_casts_dtype(tiny_target):
    lm = tiny_target
    a = kvcache.extract(lm.model, lm.spec, check_tokens(lm, 30))
    b = kvcache.extract(lm.model, lm.spec, ids_for(lm, 30, seed=5))
    cache = kvcache.to_cache([a.to(dtype=torch.bfloat16), b], lm.model, lm.spec)
    assert cache.layers[0].keys.shape == (2, lm.spec.num_kv_heads, 30, lm.spec.head_dim)
    assert cache.layers[0].keys.dtype == torch.float32
    assert torch.equal(cache.layers[1].values[1], b.values[1])


def test_generate_after_shifted_round_trip_is_exact(tiny_source):
    """Keys moved to other positions and back are still the model's cache: continuation unchanged."""
    lm = tiny_source
    ids = check_tokens(lm, 60)
    seg = kvcache.extract(lm.model, lm.spec, ids[:-2])
    moved = lm.rope.shift_all(seg.keys, seg.positions, seg.positions + 500)
    back = seg.with_keys(lm.rope.shift_all(moved, seg.positions + 500, seg.positions), seg.positions, rotated=True)
    out = kvcache.generate(lm.model, lm.spec, back, ids[-2:], max_new_tokens=8, min_new_tokens=8)
    assert torch.equal(out, kvcache.generate_plain(lm.model, lm.spec, ids, max_new_tokens=8, min_new_tokens=8))


def test_real_key_shift_matches_prefill_at_shifted_positions():
    for name in ("qwen2", "gemma3", "llama3"):
        result = check_real_shift(zoo.build(name), ids_for(zoo.build(name), 48), delta=300)
        assert result.passed, result.line()


class TestBadInput:
    def test_empty_ids(self, tiny_source):
        with pytest.raises(ValueError, match="empty"):
            kvcache.extract(tiny_source.model, tiny_source.spec, [])

    def test_empty_text_through_tokenizer(self, tiny_source):
        ids = tiny_source.tokenizer("", add_special_tokens=True)["input_ids"]  # Qwen2-style: no BOS -> nothing
        with pytest.raises(ValueError, match="empty"):
            kvcache.extract(tiny_source.model, tiny_source.spec, ids)

    def test_out_of_vocabulary(self, tiny_source):
        with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, \d+\)"):
            kvcache.extract(tiny_source.model, tiny_source.spec, [1, 2, 10**6])

    def test_float_ids_and_wrong_rank(self, tiny_source):
        with pytest.raises(ValueError, match="integer token ids"):
            kvcache.extract(tiny_source.model, tiny_source.spec, torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match="1-D"):
            kvcache.extract(tiny_source.model, tiny_source.spec, torch.ones(2, 3, dtype=torch.long))

    def test_negative_start(self, tiny_source):
        with pytest.raises(ValueError, match="start_position"):
            kvcache.extract(tiny_source.model, tiny_source.spec, [1, 2], start_position=-1)

    def test_cache_of_another_model(self, tiny_source, tiny_target):
        seg = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6, 7])
        with pytest.raises(ValueError, match="holds KV of tiny-qwen2.*not of tiny-phi3"):
            kvcache.to_cache(seg, tiny_target.model, tiny_target.spec)

    def test_same_name_other_config(self, tiny_source):
        seg = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6, 7])
        forged = type(seg)(kv=seg.kv, token_ids=seg.token_ids, positions=seg.positions,
                           model=ModelIdentity("tiny-qwen2", "0" * 64), rotated=True)
        with pytest.raises(ValueError, match="not of tiny-qwen2"):
            kvcache.to_cache(forged, tiny_source.model, tiny_source.spec)

    def test_wrong_layout(self, tiny_source):
        seg = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6, 7])
        bad = type(seg)(kv=seg.kv[:, :, :1], token_ids=seg.token_ids, positions=seg.positions, model=seg.model,
                        rotated=True)
        with pytest.raises(ValueError, match="layout .* does not match"):
            kvcache.to_cache(bad, tiny_source.model, tiny_source.spec)

    def test_unrotated_or_displaced_segment(self, tiny_source):
        lm = tiny_source
        seg = kvcache.extract(lm.model, lm.spec, [5, 6, 7])
        un = seg.with_keys(lm.rope.unrotate_all(seg.keys, seg.positions), seg.positions, rotated=False)
        with pytest.raises(ValueError, match="un-rotated"):
            kvcache.to_cache(un, lm.model, lm.spec)
        displaced = kvcache.extract(lm.model, lm.spec, [5, 6, 7], start_position=10)
        with pytest.raises(ValueError, match="positions 10..12.*shift"):
            kvcache.to_cache(displaced, lm.model, lm.spec)

    def test_generate_needs_a_new_token(self, tiny_source):
        seg = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6, 7])
        with pytest.raises(ValueError, match="at least one"):
            kvcache.generate(tiny_source.model, tiny_source.spec, seg, [])

    def test_batch_rows_must_match(self, tiny_source):
        a = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6, 7])
        b = kvcache.extract(tiny_source.model, tiny_source.spec, [5, 6])
        with pytest.raises(ValueError, match="batch rows"):
            kvcache.to_cache([a, b], tiny_source.model, tiny_source.spec)

    def test_partial_cache_is_refused(self):
        lm = zoo.build("gemma3")
        ids = ids_for(lm, 40)
        cache = DynamicCache(config=lm.model.config)  # sliding layers drop tokens
        lm.model(input_ids=ids[None], cache=cache)
        with pytest.raises(ValueError, match="sliding-window layer keeps only its last tokens"):
            kvcache.from_cache(cache, lm.spec, ids)


@pytest.mark.slow
def test_gemma3_270m_inject_beyond_its_512_window(gemma):
    ids = check_tokens(gemma, 600)
    assert gemma.spec.layers[0].sliding_window == 512 and ids.numel() == 600
    result = check_inject(gemma, ids, tail=4, new_tokens=16)
    assert result.passed, result.line()


@pytest.mark.slow
def test_smollm2_inject_and_continue(smollm2):
    ids = check_tokens(smollm2, 300)
    result = check_inject(smollm2, ids, tail=4, new_tokens=16)
    assert result.passed, result.line()


@pytest.mark.slow
def test_real_models_speak_sensibly(smollm2):
    """Guard against a broken conversion: the converted model continues real text with real words."""
    text = sample_text()[:400]
    ids = torch.tensor(smollm2.tokenizer(text)["input_ids"])
    seg = kvcache.extract(smollm2.model, smollm2.spec, ids[:-1])
    out = kvcache.generate(smollm2.model, smollm2.spec, seg, ids[-1:], max_new_tokens=12)
    words = smollm2.tokenizer.decode(out)
    assert sum(c.isalpha() for c in words) > 10, words
