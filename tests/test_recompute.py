"""Selective recompute (`reuse.recompute_selected`) for every layer-type mix the foundation supports: all full
(Qwen2), one window on every layer (Phi-3-mini-4k's shape, Mistral), sliding and full layers mixed (Gemma3). Recomputing
every token over a wrong cache is exact; recomputing none changes nothing; the masks take the form each model reads."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.suffix.blend import BlendConfig, blend
from kvbridge.transfer.suffix.reuse import layer_masks, prefill_after, recompute_selected

MIXES = ["qwen2", "phi3-sliding", "mistral-sliding", "gemma3"]


def _wrong_after(lm, context, ids):
    """KV of `ids` right after `context` that is wrong everywhere: the exact KV plus noise of its own size."""
    exact = prefill_after(lm, context, ids)
    gen = torch.Generator().manual_seed(7)
    noise = torch.randn(exact.kv.shape, generator=gen) * exact.kv.float().std()
    return exact, replace(exact, kv=exact.kv + noise.to(exact.kv))


@pytest.mark.parametrize("name", MIXES)
def test_recomputing_every_token_is_exact_for_every_layer_mix(name):
    lm = zoo.build(name)
    windows = {layer.sliding_window for layer in lm.spec.layers}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, lm.spec.vocab_size, (70,), generator=gen)  # longer than every window here (16-24)
    context = kvcache.extract(lm.model, lm.spec, ids[:30])
    exact, wrong = _wrong_after(lm, context, ids[30:])
    fixed = recompute_selected(lm, context, wrong, torch.arange(40))
    assert torch.allclose(fixed.kv, exact.kv, atol=1e-5, rtol=1e-4), (name, windows)
    assert torch.equal(recompute_selected(lm, context, wrong, torch.tensor([], dtype=torch.int64)).kv, wrong.kv)


@pytest.mark.parametrize("name", MIXES)
def test_a_selected_token_sees_exactly_what_a_prefill_would_show_it(name):
    """Recompute only the last token over the exact KV of the others: it must equal the exact KV (the window cuts
    the same keys a plain prefill cuts)."""
    lm = zoo.build(name)
    ids = torch.randint(3, lm.spec.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    context = kvcache.extract(lm.model, lm.spec, ids[:20])
    exact = prefill_after(lm, context, ids[20:])
    wrong_last = exact.kv.clone()
    wrong_last[:, :, :, -1] += 1.0
    fixed = recompute_selected(lm, context, replace(exact, kv=wrong_last), torch.tensor([43]))
    assert torch.allclose(fixed.kv, exact.kv, atol=1e-5, rtol=1e-4), name


def test_masks_take_the_form_each_model_reads():
    q_pos, k_pos = torch.tensor([38, 39]), torch.arange(40)
    allowed = k_pos[None, :] <= q_pos[:, None]  # causal
    one = layer_masks(zoo.build("phi3-sliding"), allowed, q_pos, k_pos)  # Phi3 takes one mask, window applied
    assert isinstance(one, torch.Tensor) and one.shape == (1, 1, 2, 40)
    assert one[0, 0, 0].sum() == 20 and not one[0, 0, 0, 18] and one[0, 0, 0, 19]  # keys 19..38 for query 38
    both = layer_masks(zoo.build("gemma3"), allowed, q_pos, k_pos)  # mixed layer types: one mask per type
    assert set(both) == {"full_attention", "sliding_attention"}
    assert both["full_attention"][0, 0, 0].sum() == 39 and both["sliding_attention"][0, 0, 0].sum() == 16
    plain = layer_masks(zoo.build("qwen2"), allowed, q_pos, k_pos)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain[0, 0], allowed)


def test_a_model_loaded_with_flash_attention_recomputes_through_sdpa_and_keeps_its_choice():
    """On a GPU in bf16 the target loads with flash_attention_2, which takes no custom mask. flash-attn is not
    installed here, so a forward that reached it would fail: selective recompute (alone and inside blend) must run
    its masked forward through SDPA, give the SDPA model's KV, and leave the model's own choice as it was."""
    lm = zoo.build("phi3-sliding")
    flash = dataclasses.replace(lm, model=copy.deepcopy(lm.model))
    flash.model.config._attn_implementation = "flash_attention_2"  # as load_model leaves it on a GPU
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, lm.spec.vocab_size, (60,), generator=gen)
    context = kvcache.extract(lm.model, lm.spec, ids[:25])
    _, wrong = _wrong_after(lm, context, ids[25:])
    with pytest.raises(Exception, match="flash|kernels"), torch.no_grad():  # the flag is live: a forward fails
        flash.model(input_ids=ids[None, :4])
    selected = torch.tensor([0, 3, 4, 20, 34])
    fixed = recompute_selected(flash, context, wrong, selected)
    assert torch.equal(fixed.kv, recompute_selected(lm, context, wrong, selected).kv)
    assert flash.model.config._attn_implementation == "flash_attention_2"
    config = BlendConfig(fraction=0.3)  # the served default rule: an eager scoring pass, then the masked forward
    assert torch.equal(blend(flash, context, wrong, config).segment.kv, blend(lm, context, wrong, config).segment.kv)
    assert flash.model.config._attn_implementation == "flash_attention_2"
