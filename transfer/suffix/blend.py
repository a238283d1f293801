"""CacheBlend for KV the target did not compute itself (projected from another model, or reused at a new place):
find the tokens that matter most, then recompute them through every layer in one forward.

Selection, by rule (`count` tokens in all):
- "attention" (the default): the last `window` placed tokens, the ones the request reads first, run through every
  layer over the placed KV (≈ window/T of a prefill; eager attention, weights kept). Each other token's score is
  the attention those queries give it in the deeper layers (from `attention_from` of the depth on), summed over
  heads and queries; the window and the `sinks` first tokens are taken, then the highest scores. What the next
  queries will read is what matters: a cross-model projection is a little wrong everywhere (per-layer R² 0.5-0.7),
  not badly wrong at a few places, so the deviation of a token says little about its effect (docs/eval-small).
- the deviation rules, as CacheBlend for reused chunks: a selection pass runs only the target's first m layers over
  the placed tokens after the exact context (≈ m/L of a prefill); those layers' K/V become exact for every token.
  Per token, the deviation of the placed K/V from them over the m layers, ||K_placed - K_own|| / ||K_own|| +
  ||V_placed - V_own|| / ||V_own|| (norms over heads and head_dim). "sinks+deviation" takes the first `sinks` and the
  last `tail` tokens (attention sinks, EPIC; the ones the request reads first), then the most deviating;
  "deviation" the most deviating alone.
- "prompt": as "attention", but the queries that score are the request's own tokens after the document (`probe_ids`:
  the instruction a served request sends with its prompt), run once over all the placed KV (≈ len/T of a prefill):
  the tokens the answer's first queries read, not those the document's end reads.
- "last": the last `count` (what recompute:r does); "random": a seeded random choice (a control). With `layers` > 0
  they also make the first layers exact.
Then one forward recomputes the chosen tokens through every layer over the rest (`reuse.recompute_selected`: exact
causal attention to the context, to the placed KV of the unselected tokens before them and to each other), with the
target's induction prior on the KV that stays projected when one is given (transfer.suffix.induction).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import eager_attention
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.reuse import first_layers_kv, recompute_selected

SINKS = 4  # first tokens the attention and sinks+deviation rules always take

RULES = ("attention", "prompt", "sinks+deviation", "deviation", "last", "random")
DEVIATION_RULES = ("sinks+deviation", "deviation")


@dataclass(frozen=True)
class BlendConfig:
    fraction: float  # share of the placed tokens recomputed through every layer
    rule: str = "attention"  # see RULES
    window: int = 16  # attention: the last tokens whose queries score the others (always recomputed)
    attention_from: float = 0.5  # attention: the share of the depth from which the layers' attention counts
    sinks: int = SINKS  # first tokens always recomputed (rules attention and sinks+deviation)
    tail: int = 4  # last tokens always recomputed (rule sinks+deviation)
    layers: int | None = None  # m: layers of the exact selection pass; None: 1 for the deviation rules, else 0
    seed: int = 0  # the random rule's

    def __post_init__(self):
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.layers is not None and (self.layers < 0 or (self.layers == 0 and self.rule in DEVIATION_RULES)):
            raise ValueError(f"layers must be >= {1 if self.rule in DEVIATION_RULES else 0} for rule {self.rule!r}, "
                             f"got {self.layers}")
        if self.sinks < 0 or self.tail < 0 or self.window < 1:
            raise ValueError(f"sinks and tail must be >= 0 and window >= 1, got {self.sinks}, {self.tail}, "
                             f"{self.window}")
        if not 0 <= self.attention_from < 1:
            raise ValueError(f"attention_from must be in [0, 1), got {self.attention_from}")

    @property
    def exact_layers(self) -> int:
        """m, the layers the selection pass makes exact (0: no such pass)."""
        if self.layers is not None:
            return self.layers
        return 1 if self.rule in DEVIATION_RULES else 0


@dataclass(frozen=True)
class BlendResult:
    segment: KVSegment  # the placed tokens, blended (first m layers exact, the selected tokens recomputed)
    selected: torch.Tensor  # [S] int64, sorted: indices of the recomputed tokens
    score: torch.Tensor  # [T] float32: what the rule ranked by (attention received, or deviation; zeros otherwise)
    forwards: tuple[tuple[int, int, int], ...]  # the target's forwards: (new tokens, past tokens, layers run)
    exact_layers: int = 0  # m: the first layers the selection pass made the target's own at every placed token

    @property
    def still_projected(self) -> torch.Tensor:
        """[T] bool: the placed tokens whose KV was not recomputed: projected in layers exact_layers.. only (what an
        induction prior from layer exact_layers on reads as projected; `projected` says it per layer)."""
        kept = torch.ones(self.segment.num_tokens, dtype=torch.bool)
        kept[self.selected] = False
        return kept

    @property
    def projected(self) -> torch.Tensor:
        """[L, T] bool: per layer, the placed tokens whose KV there is still the projection's (none in the first
        exact_layers layers)."""
        return layer_marks(self.still_projected, self.segment.kv.shape[0], self.exact_layers)


def layer_marks(still: torch.Tensor, layers: int, exact_layers: int) -> torch.Tensor:
    """still [T] bool (tokens not recomputed) -> [layers, T] bool: still in every layer from exact_layers on."""
    marks = still.bool()[None].expand(layers, still.numel()).clone()
    marks[:exact_layers] = False
    return marks


def kv_deviation(placed: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """placed, own: [m, 2, H, T, D] -> [T]: relative K and V deviation per token, summed over the m layers."""
    diff = (placed.float() - own.float()).norm(dim=(2, 4))  # [m, 2, T]
    scale = own.float().norm(dim=(2, 4)).clamp(min=1e-12)
    return (diff / scale).sum(dim=(0, 1))


def select_tokens(score: torch.Tensor, count: int, config: BlendConfig) -> torch.Tensor:
    """[count] sorted token indices under the config's rule (score: [T], deviation or attention received)."""
    t = score.numel()
    count = min(count, t)
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if config.rule == "last":
        return torch.arange(t - count, t)
    if config.rule == "random":
        return torch.randperm(t, generator=torch.Generator().manual_seed(config.seed))[:count].sort().values
    chosen = torch.zeros(t, dtype=torch.bool)
    if config.rule in ("sinks+deviation", "attention", "prompt"):
        tail = config.window if config.rule in ("attention", "prompt") else config.tail
        chosen[t - min(tail, count):] = True
        room = count - int(chosen.sum())
        if room > 0:
            chosen[:min(config.sinks, room)] = True
    room = count - int(chosen.sum())
    if room > 0:
        order = score.float().masked_fill(chosen, float("-inf")).topk(room).indices
        chosen[order] = True
    return chosen.nonzero()[:, 0]


@torch.no_grad()
def attention_received(lm: LoadedModel, context: KVSegment, placed: KVSegment, window: int,
                       from_layer: int) -> torch.Tensor:
    """[T]: per placed token before the last `window`, the attention the last `window` placed tokens give it in
    layers from_layer.. (summed over heads and queries), from one forward of those tokens over the context and the
    placed KV before them, with eager attention (the weights are needed); the window's own entries are +inf."""
    t, c = placed.num_tokens, context.num_tokens
    window = min(window, t)
    param = next(lm.model.parameters())
    head = torch.cat((context.kv, placed.kv[:, :, :, :t - window].to(context.kv)), dim=3)
    cache = kvcache.build_cache(head.to(device=param.device, dtype=param.dtype)[:, :, None])
    with eager_attention(lm.model):
        out = lm.model(input_ids=placed.token_ids[t - window:][None].to(param.device),
                       position_ids=torch.arange(c + t - window, c + t)[None].to(param.device), cache=cache,
                       use_cache=True, output_attentions=True, logits_to_keep=1)
    mass = sum(a[0, :, :, c:c + t - window].float().sum(dim=(0, 1)) for a in out.attentions[from_layer:])
    return torch.cat((mass.cpu(), torch.full((window,), float("inf"))))


@torch.no_grad()
def attention_of_probe(lm: LoadedModel, context: KVSegment, placed: KVSegment, probe_ids: torch.Tensor,
                       from_layer: int) -> torch.Tensor:
    """[T]: per placed token, the attention that `probe_ids` (tokens right after the placed ones) give it in layers
    from_layer.. (summed over heads and queries), from one eager forward of the probe over the context and all the
    placed KV."""
    t, c = placed.num_tokens, context.num_tokens
    param = next(lm.model.parameters())
    head = torch.cat((context.kv, placed.kv.to(context.kv)), dim=3)
    cache = kvcache.build_cache(head.to(device=param.device, dtype=param.dtype)[:, :, None])
    n = probe_ids.numel()
    with eager_attention(lm.model):
        out = lm.model(input_ids=probe_ids.reshape(1, n).to(param.device),
                       position_ids=torch.arange(c + t, c + t + n)[None].to(param.device), cache=cache,
                       use_cache=True, output_attentions=True, logits_to_keep=1)
    return sum(a[0, :, :, c:c + t].float().sum(dim=(0, 1)) for a in out.attentions[from_layer:]).cpu()


def planned_forwards(t: int, c: int, layers: int, config: BlendConfig, probe_tokens: int = 0
                     ) -> tuple[tuple[int, int, int], ...]:
    """The target's forwards `blend` runs for `t` placed tokens after `c` context tokens on a model of `layers` layers,
    in order, as (new tokens, past tokens, layers run): the selection pass through the first m layers (exact_layers),
    the scoring pass where it recomputes more tokens than the window (the attention rule: the window's last tokens;
    the prompt rule: the request's `probe_tokens`), then the forward of the recomputed tokens over the rest. What
    a cost model counts for a blend it did not run (a server's stored correction: eval.summaries.served_forwards)."""
    count = min(round(config.fraction * t), t)
    m = min(config.exact_layers, layers)
    window = min(config.window, t)
    forwards = [(t, c, m)] if m else []
    if count > window and config.rule == "prompt":
        forwards.append((probe_tokens, c + t, layers))
    if count > window and config.rule == "attention":
        forwards.append((window, c + t - window, layers))
    if count:
        forwards.append((count, c + t - count, layers))
    return tuple(forwards)


def blend(lm: LoadedModel, context: KVSegment, placed: KVSegment, config: BlendConfig,
          prior: InductionPrior | None = None, context_projected: torch.Tensor | None = None,
          probe_ids: torch.Tensor | None = None, placed_projected: torch.Tensor | None = None) -> BlendResult:
    """`placed` (KV the model did not compute, right after `context`, which is exact) blended as the module says.

    With a `prior`, the forward that recomputes the selected tokens reads the placed KV that stays projected (and
    the context's positions where `context_projected`, [C] bool, is True; of the placed ones those `placed_projected`,
    [T] bool, marks, when a served correction recomputed some already) with it, from layer m on (the first m
    layers' KV is the target's own after the selection pass). The "prompt" rule needs `probe_ids` [N]: the tokens
    the request puts right after the placed ones."""
    if int(placed.positions[0]) != context.num_tokens:
        raise ValueError("place the segment right after the context first")
    t, c, layers = placed.num_tokens, context.num_tokens, lm.spec.num_layers
    if context_projected is not None and tuple(context_projected.shape) != (c,):
        raise ValueError(f"context_projected must be [{c}] bool (one per context token), got "
                         f"{tuple(context_projected.shape)}")
    count = min(round(config.fraction * t), t)
    m = min(config.exact_layers, layers)
    forwards = planned_forwards(t, c, layers, config, 0 if probe_ids is None else probe_ids.numel())
    score = torch.zeros(t)
    if m:
        own = first_layers_kv(lm, context, placed.token_ids, m)  # [m, 2, H, T, D]
        if config.rule in DEVIATION_RULES:
            score = kv_deviation(placed.kv[:m].to(own.device), own).cpu()
        kv = placed.kv.clone()
        kv[:m] = own.to(kv)
        placed = replace(placed, kv=kv)
    if config.rule == "prompt":
        if probe_ids is None or probe_ids.numel() == 0:
            raise ValueError("the prompt rule scores with the request's tokens after the document: give probe_ids")
        if count > min(config.window, t):
            score = attention_of_probe(lm, context, placed, probe_ids, int(config.attention_from * layers))
    if config.rule == "attention" and count > min(config.window, t):
        window = min(config.window, t)
        score = attention_received(lm, context, placed, window, int(config.attention_from * layers))
    selected = select_tokens(score, count, config)
    reading = contextlib.nullcontext()
    if selected.numel() != count:  # select_tokens takes `count` (the plan's last forward)
        raise RuntimeError(f"blend selected {selected.numel()} tokens of {t}, planned {count}")
    if selected.numel():
        still = torch.ones(t, dtype=torch.bool) if placed_projected is None else placed_projected.bool().cpu().clone()
        still[selected] = False
        before = torch.zeros(c, dtype=torch.bool) if context_projected is None else context_projected.bool().cpu()
        if prior is not None and bool(still.any() or before.any()):
            reading = prior.from_layer(m).reading(lm, torch.cat((context.token_ids, placed.token_ids)),
                                                  torch.cat((before, still)))
    with reading:
        segment = recompute_selected(lm, context, placed, selected)
    return BlendResult(segment, selected, score, forwards, exact_layers=m)
