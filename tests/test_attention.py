"""The one switch of a model's attention: the implementation comes back (also on an error), blocks nest, and a block
holds the model's lock so another thread's switch waits for it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import zoo
from kvbridge.transfer.attention import (
    GROUPED_SDPA,
    _model_lock,
    custom_mask_attention,
    eager_attention,
    switched_attention,
    takes_custom_mask,
)


def test_the_implementation_comes_back_after_a_block_and_after_an_error():
    model = copy.deepcopy(zoo.build("qwen2").model)
    assert model.config._attn_implementation == GROUPED_SDPA
    with eager_attention(model):
        assert model.config._attn_implementation == "eager" == model.model.config._attn_implementation
        with switched_attention(model, "sdpa"):  # the same thread nests
            assert model.config._attn_implementation == "sdpa"
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == GROUPED_SDPA
    with pytest.raises(KeyError), switched_attention(model, "eager"):
        raise KeyError("inside")
    assert model.config._attn_implementation == GROUPED_SDPA


def test_custom_masks_go_through_sdpa_unless_the_model_already_takes_them():
    model = copy.deepcopy(zoo.build("qwen2").model)
    with custom_mask_attention(model):
        assert model.config._attn_implementation == GROUPED_SDPA  # takes masks: no switch
    model.config._attn_implementation = "flash_attention_2"
    assert not takes_custom_mask("flash_attention_2")
    ids = torch.arange(3, 9)[None]
    with custom_mask_attention(model), torch.no_grad():
        assert model.config._attn_implementation == GROUPED_SDPA  # on the CPU; "sdpa" on a GPU
        model(input_ids=ids)  # flash-attn is not installed here: this forward ran SDPA
    assert model.config._attn_implementation == "flash_attention_2"


def test_a_block_holds_the_models_lock_against_other_threads():
    model = copy.deepcopy(zoo.build("qwen2").model)
    seen = []

    def try_lock():
        lock = _model_lock(model)
        got = lock.acquire(blocking=False)
        seen.append(got)
        if got:
            lock.release()

    with eager_attention(model):
        other = threading.Thread(target=try_lock)
        other.start()
        other.join()
    other = threading.Thread(target=try_lock)
    other.start()
    other.join()
    assert seen == [False, True]
