"""What a SuffixReuseGenerator request may ask, checked before anything runs, and what a context source may return:
ValueErrors that name the argument, the value and what was expected."""

from __future__ import annotations

from numbers import Real

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.tensor_blob import ST_DTYPES

__all__ = ["GREEDY_OPTIONS", "check_options", "check_recompute", "check_positions", "check_projected",
           "max_positions"]

# the model.generate options a greedy decode of one sequence takes (beyond max_new_tokens); do_sample and num_beams
# are taken at their greedy values only, and the generator's own streamer times the first token
GREEDY_OPTIONS = ("eos_token_id", "pad_token_id", "min_new_tokens", "repetition_penalty", "no_repeat_ngram_size")
_GREEDY_VALUES = {"do_sample": False, "num_beams": 1}


def check_options(max_new_tokens, options: dict) -> None:
    """max_new_tokens an int >= 1; `options` (generate's other keyword arguments) among GREEDY_OPTIONS."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    refused = [f"{name}={value!r}" if name in _GREEDY_VALUES else name for name, value in options.items()
               if name not in GREEDY_OPTIONS and not (name in _GREEDY_VALUES and value == _GREEDY_VALUES[name])]
    if refused:
        raise ValueError(f"SuffixReuseGenerator.generate does not take {', '.join(refused)}: it decodes one sequence "
                         "by greedy search (no sampling, no beams) with its own streamer (the time to the first "
                         f"token); besides max_new_tokens it takes {', '.join(GREEDY_OPTIONS)}")


def check_recompute(recompute_k, recompute_fraction) -> None:
    if isinstance(recompute_k, bool) or not isinstance(recompute_k, int) or recompute_k < 0:
        raise ValueError(f"recompute_k must be an int >= 0, got {recompute_k!r}")
    if isinstance(recompute_fraction, bool) or not isinstance(recompute_fraction, Real) or not (
            0 <= recompute_fraction <= 1):
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction!r}")


def max_positions(lm: LoadedModel) -> int:
    """The positions the model has (its config's max_position_embeddings; unbounded when it names none)."""
    config = lm.model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 0) or 1 << 31)


def check_positions(lm: LoadedModel, prompt: int, max_new_tokens: int) -> None:
    """A request of `prompt` tokens (context and new turn) generating up to max_new_tokens must fit the model's
    positions, and stay below the length where its RoPE tables switch (longrope, dynamic NTK)."""
    total, limit = prompt + max_new_tokens, max_positions(lm)
    if total > limit:
        raise ValueError(f"the request needs {prompt} context and turn tokens + {max_new_tokens} new tokens = {total} "
                         f"positions, more than {lm.name!r} has ({limit}): shorten the context or the turn, or ask "
                         "for fewer new tokens")
    kvcache.check_rope_window(lm.spec, total, generating=True)


def check_projected(segment, token_ids: torch.Tensor, offset: int, index: int, lm: LoadedModel) -> None:
    """The context source's KV for part `index`: token_ids ([T]) at positions offset.., of this model, in its cache's
    layout, rotated, in a dtype KV travels in."""
    what = f"the context source's segment for part {index}"
    spec, n = lm.spec, token_ids.numel()
    if not isinstance(segment, KVSegment):
        raise ValueError(f"{what}: expected a KVSegment, got {type(segment).__name__}")
    if segment.num_tokens != n:
        raise ValueError(f"{what}: KV for {segment.num_tokens} tokens, expected the part's {n} tokens")
    if segment.model != spec.identity:
        raise ValueError(f"{what}: KV of {segment.model.key}, not of {spec.identity.key}")
    expected = (spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim)
    if tuple(segment.kv.shape) != expected:
        raise ValueError(f"{what}: layout {tuple(segment.kv.shape)}, expected {expected} for {lm.name!r} "
                         "([L, 2, H_kv, T, D])")
    if segment.dtype not in ST_DTYPES:
        raise ValueError(f"{what}: dtype {segment.dtype}, expected one of "
                         f"{', '.join(str(d) for d in ST_DTYPES)}")
    if not segment.rotated:
        raise ValueError(f"{what}: un-rotated keys; the generator places KV with its keys rotated at its positions, "
                         "as the model caches it")
    if not segment.is_contiguous_from(offset):
        shown = ", ".join(str(p) for p in segment.positions[:4].tolist()) + (", ..." if n > 4 else "")
        raise ValueError(f"{what}: positions {shown}, expected {offset}..{offset + n - 1}")
    if not torch.equal(segment.token_ids, token_ids):
        raise ValueError(f"{what}: KV of other tokens than the part's (does the source tokenize the text as the "
                         f"generator's tokenizer of {lm.name!r} does?)")
