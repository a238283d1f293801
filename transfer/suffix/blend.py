"""CacheBlend for KV the target did not compute itself (projected from another model, or reused at a new place):
measure where it deviates, then recompute the tokens that matter most in one forward.

1. Selection pass: the target runs only its first m layers over the placed tokens after the exact context
   (≈ m/L of a prefill). Those layers' K/V are then exact for every token and replace the placed ones.
2. Per token, the deviation of the placed K/V from those exact K/V over the m layers:
   ||K_placed - K_own|| / ||K_own|| + ||V_placed - V_own|| / ||V_own|| (norms over heads and head_dim), summed over
   the layers.
3. The tokens to recompute, `count` of them: the first `sinks` tokens (attention sinks, EPIC) and the last `tail`
   (the ones the request reads first) are taken first, then the most deviating (rule "sinks+deviation", the
   default); or the most deviating alone ("deviation"), the last `count` ("last", what recompute:r does), or a
   seeded random choice ("random", the control).
4. One forward recomputes them through every layer over the rest (`reuse.recompute_selected`: exact causal
   attention to the context, to the placed KV of the unselected tokens before them and to each other).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.reuse import first_layers_kv, recompute_selected

RULES = ("sinks+deviation", "deviation", "last", "random")


@dataclass(frozen=True)
class BlendConfig:
    fraction: float  # share of the placed tokens recomputed through every layer
    layers: int = 1  # m: layers the selection pass runs (their K/V become exact for every token)
    sinks: int = 4  # first tokens always recomputed (rule sinks+deviation)
    tail: int = 4  # last tokens always recomputed (rule sinks+deviation)
    rule: str = "sinks+deviation"  # see RULES
    seed: int = 0  # the random rule's

    def __post_init__(self):
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.sinks < 0 or self.tail < 0:
            raise ValueError(f"sinks and tail must be >= 0, got {self.sinks}, {self.tail}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")


@dataclass(frozen=True)
class BlendResult:
    segment: KVSegment  # the placed tokens, blended (first m layers exact, the selected tokens recomputed)
    selected: torch.Tensor  # [S] int64, sorted: indices of the recomputed tokens
    deviation: torch.Tensor  # [T] float32: per token, before blending


def kv_deviation(placed: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """placed, own: [m, 2, H, T, D] -> [T]: relative K and V deviation per token, summed over the m layers."""
    diff = (placed.float() - own.float()).norm(dim=(2, 4))  # [m, 2, T]
    scale = own.float().norm(dim=(2, 4)).clamp(min=1e-12)
    return (diff / scale).sum(dim=(0, 1))


def select_tokens(deviation: torch.Tensor, count: int, config: BlendConfig) -> torch.Tensor:
    """[count] sorted token indices under the config's rule (deviation: [T])."""
    t = deviation.numel()
    count = min(count, t)
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if config.rule == "last":
        return torch.arange(t - count, t)
    if config.rule == "random":
        return torch.randperm(t, generator=torch.Generator().manual_seed(config.seed))[:count].sort().values
    chosen = torch.zeros(t, dtype=torch.bool)
    if config.rule == "sinks+deviation":
        chosen[:min(config.sinks, count)] = True
        room = count - int(chosen.sum())
        if room > 0 and config.tail:
            chosen[t - min(config.tail, room):] = True
    room = count - int(chosen.sum())
    if room > 0:
        order = deviation.float().masked_fill(chosen, float("-inf")).topk(room).indices
        chosen[order] = True
    return chosen.nonzero()[:, 0]


def blend(lm: LoadedModel, context: KVSegment, placed: KVSegment, config: BlendConfig) -> BlendResult:
    """`placed` (KV the model did not compute, right after `context`, which is exact) blended as the module says."""
    if int(placed.positions[0]) != context.num_tokens:
        raise ValueError("place the segment right after the context first")
    m = min(config.layers, lm.spec.num_layers)
    own = first_layers_kv(lm, context, placed.token_ids, m)  # [m, 2, H, T, D]
    deviation = kv_deviation(placed.kv[:m].to(own.device), own).cpu()
    kv = placed.kv.clone()
    kv[:m] = own.to(kv)
    exact_head = replace(placed, kv=kv)
    selected = select_tokens(deviation, round(config.fraction * placed.num_tokens), config)
    return BlendResult(recompute_selected(lm, context, exact_head, selected), selected, deviation)
