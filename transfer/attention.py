"""Which attention a model runs: kvbridge's registered SDPA, and the one place that switches a loaded model's attention
implementation for a block.

transformers picks a layer's attention from `config._attn_implementation` on every forward (`AttentionInterface`:
`ALL_ATTENTION_FUNCTIONS`, `ALL_MASK_ATTENTION_FUNCTIONS`), so a block of forwards can run another registered
implementation by naming it there and naming the old one again after. kvbridge does that for eager attention (the
only kind that returns its weights), for the induction prior's biased attention, for the adapter trainer's capture,
and for the forwards that pass a custom mask (selective recompute), which flash-attention cannot take: a model loaded
with flash_attention_2 on a GPU runs them with PyTorch SDPA (`custom_mask_attention`).

Threads: the implementation is the model's (its config's), not a thread's. One lock per model, held for the whole
block, serialises the blocks that switch it (a thread may nest its own blocks); a forward of the same model that
another thread runs outside any block meanwhile runs the switched implementation.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

GROUPED_SDPA = "kvbridge_sdpa"  # transformers' SDPA attention, with KV heads shared by query heads read as they are
SDPA_NAMES = ("sdpa", GROUPED_SDPA)  # PyTorch SDPA, either way: takes any boolean or float mask
_CUSTOM_MASK_READY = {"eager", *SDPA_NAMES}  # implementations that take a 4-D [B, 1, Q, K] mask as given
_CUSTOM_MASK_FALLBACKS: dict[str, str] = {}  # implementation -> the one a forward with a custom mask runs instead



def _grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except in one case: several query tokens with a mask (a prefill over a cache,
    or selective recompute's custom mask) and KV heads shared by several query heads. There transformers repeats K
    and V for every query head before PyTorch's SDPA, a copy of the whole cache in every layer; this passes them as
    they are (`enable_gqa`), the same arithmetic (an 11-token prefill over 2,049 cached tokens of SmolLM2-135M on one
    CPU thread: 190 ms -> 147 ms, identical logits). q [B, H, q, D], k and v [B, H_kv, k, D], the mask [B, 1, q, k]
    (bool, or float added to the scores; sliding windows are in it) -> ([B, q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = not (kwargs.get("softcap") or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None
                 or kwargs.get("output_attentions"))
    if attention_mask is None or query.shape[2] == 1 or groups == 1 or not plain or attention_mask.dim() != 4:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, _grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its RLock
_locks_guard = threading.Lock()


def accepts_custom_masks(name: str) -> None:
    """Declare that the registered attention `name` takes a 4-D boolean or float mask as given (a kvbridge
    implementation built on SDPA)."""
    _CUSTOM_MASK_READY.add(name)


def custom_mask_fallback(name: str, fallback: str) -> None:
    """Declare that a forward with a custom mask runs `fallback` where the model runs attention `name` (which takes
    none): the induction prior over flash-attention falls back to the prior over SDPA, not to plain SDPA."""
    _CUSTOM_MASK_FALLBACKS[name] = fallback


def takes_custom_mask(name: str) -> bool:
    """Whether attention `name` runs a forward's own 4-D mask (flash-attention kernels take none)."""
    return name in _CUSTOM_MASK_READY


def _model_lock(model: nn.Module) -> threading.RLock:
    with _locks_guard:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = threading.RLock()
        return lock


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    """Every distinct config the model's modules read their attention from (a causal LM and its base model share
    one; a composite model has one per part)."""
    seen: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen.setdefault(id(config), config)
    if not seen:
        raise ValueError(f"{type(model).__name__} has no transformers config: its attention cannot be switched")
    return list(seen.values())


@contextmanager
def switched_attention(model: nn.Module, name: str) -> Iterator[None]:
    """Within the block the model runs attention `name` (registered with transformers, or one of its own); the
    implementation each config named comes back after, also on an error. Assigned on the config, not through
    `set_attn_implementation`, which would re-check (and on a CPU refuse) flash-attention when switching back."""
    with _model_lock(model):
        configs = _configs(model)
        before = [config._attn_implementation for config in configs]
        if all(b == name for b in before):
            yield
            return
        try:
            for config in configs:
                config._attn_implementation = name
            yield
        finally:
            for config, b in zip(configs, before):
                config._attn_implementation = b


def eager_attention(model: nn.Module) -> contextmanager:
    """Within the block the model runs eager attention (the only kind that returns its weights, for
    `output_attentions`)."""
    return switched_attention(model, "eager")


def custom_mask_attention(model: nn.Module) -> contextmanager:
    """Within the block the model runs an attention that takes a forward's own 4-D mask: the one it runs when that
    does, else PyTorch SDPA (flash_attention_2 on a GPU in bf16 takes none)."""
    current = model.config._attn_implementation
    if takes_custom_mask(current):
        return switched_attention(model, current)  # no switch; the lock still keeps other switches out
    if current in _CUSTOM_MASK_FALLBACKS:
        return switched_attention(model, _CUSTOM_MASK_FALLBACKS[current])
    device = next(model.parameters()).device
    return switched_attention(model, GROUPED_SDPA if device.type == "cpu" else "sdpa")
