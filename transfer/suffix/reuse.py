"""Reusing a cached segment at a new place: RoPE shift (exact when everything before it is what it was computed
after, shifted alike), recompute of its first k tokens given the real context, and the deviation from the KV
the model would have computed itself."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import custom_mask_attention
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.rope import ModelRope
from kvbridge.transfer.segment import KVSegment


def place(segment: KVSegment, rope: ModelRope, start: int) -> KVSegment:
    """The segment at positions start..start+T-1: keys rotated by the shift, values as they were."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if not segment.rotated:
        raise ValueError("place expects rotated keys (as cached)")
    moved = torch.arange(start, start + segment.num_tokens)
    if torch.equal(moved, segment.positions):
        return segment
    keys = rope.shift_all(segment.keys.float(), segment.positions, moved)  # [L, H, T, D]
    return segment.with_keys(keys.to(segment.dtype), moved, rotated=True)


@torch.no_grad()
def prefill_after(lm: LoadedModel, context: KVSegment | None, token_ids: torch.Tensor) -> KVSegment:
    """The model's KV of token_ids ([T]) read after `context` (rotated KV at positions 0..C-1, or None): one
    forward of the new tokens over the context (kvcache.extract's `prefix=`). Returns the new tokens' KV at positions
    C..C+T-1."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    if ids.numel() == 0:
        raise ValueError("token_ids is empty")
    if context is None or context.num_tokens == 0:
        return kvcache.extract(lm.model, lm.spec, ids)
    if not context.is_contiguous_from(0) or not context.rotated:
        raise ValueError("the context must be rotated KV at positions 0..C-1")
    both = kvcache.extract(lm.model, lm.spec, torch.cat((context.token_ids, ids)), prefix=context)
    new = both.slice(context.num_tokens, both.num_tokens)
    return replace(new, kv=new.kv.contiguous())  # not a view that keeps the context's copy alive


def recompute_first(lm: LoadedModel, context: KVSegment | None, reused: KVSegment, k: int) -> KVSegment:
    """`reused` (placed right after `context`) with the KV of its first k tokens recomputed by the model given the
    real context: exact for those k tokens, the rest as reused. context: the cache before it (positions 0..), or
    None when the segment starts the sequence."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    k = min(k, reused.num_tokens)
    if k == 0:
        return reused
    start = context.num_tokens if context is not None else 0
    if int(reused.positions[0]) != start:
        raise ValueError(f"the reused segment starts at position {int(reused.positions[0])}, right after the "
                         f"context is {start}: place it first")
    fresh = prefill_after(lm, context, reused.token_ids[:k])
    kv = torch.cat((fresh.kv.to(reused.kv), reused.kv[:, :, :, k:]), dim=3)
    return KVSegment(kv=kv, token_ids=reused.token_ids.clone(), positions=reused.positions.clone(),
                     model=reused.model, rotated=True)


@dataclass(frozen=True)
class Deviation:
    keys: float  # ||K_reused - K_exact|| / ||K_exact|| over all layers
    values: float
    worst_layer_keys: float  # the largest per-layer relative key error

    def line(self) -> str:
        return f"K {self.keys:.4f} (worst layer {self.worst_layer_keys:.4f}), V {self.values:.4f}"


def deviation(reused: KVSegment, exact: KVSegment) -> Deviation:
    """How far reused KV is from the KV the model computes for the same tokens at the same positions."""
    if reused.kv.shape != exact.kv.shape or not torch.equal(reused.positions, exact.positions):
        raise ValueError("compare segments of the same tokens at the same positions")
    dk = (reused.keys.float() - exact.keys.float())
    dv = (reused.values.float() - exact.values.float())
    per_layer = dk.flatten(1).norm(dim=1) / exact.keys.float().flatten(1).norm(dim=1).clamp(min=1e-12)
    return Deviation(keys=float(dk.norm() / exact.keys.float().norm()),
                     values=float(dv.norm() / exact.values.float().norm()),
                     worst_layer_keys=float(per_layer.max()))


@torch.no_grad()
def first_layers_kv(lm: LoadedModel, context: KVSegment | None, token_ids: torch.Tensor, layers: int) -> torch.Tensor:
    """The model's own KV of layers 0..layers-1 for token_ids ([T]) read after `context` (rotated KV at 0..C-1, or
    None): [layers, 2, H, T, D], from a forward that stops after layer `layers - 1`."""
    if not 1 <= layers <= lm.spec.num_layers:
        raise ValueError(f"layers must be in [1, {lm.spec.num_layers}], got {layers}")
    param = next(lm.model.parameters())
    start = context.num_tokens if context is not None else 0
    kv = context.kv.to(device=param.device, dtype=param.dtype)[:, :, None] if context is not None else None
    cache = kvcache.build_cache(kv)
    t = token_ids.numel()
    kvcache.forward_through(lm.model, layers - 1, input_ids=token_ids[None].to(param.device),
                            position_ids=torch.arange(start, start + t)[None].to(param.device), cache=cache,
                            use_cache=True)
    return torch.stack([torch.stack((cache.layers[i].keys[0, :, start:], cache.layers[i].values[0, :, start:]))
                        for i in range(layers)])


def checked_layer_deviation(lm: LoadedModel, context: KVSegment, placed: KVSegment, layer: int = 1) -> torch.Tensor:
    """[T] per token of `placed`: ||K_placed - K_exact|| / ||K_exact|| at one layer, the exact keys coming from a
    forward of the placed tokens after `context` through layers 0..layer only (layer 0's keys see no context,
    so layer 1 is the first that shows a changed prefix)."""
    if not 0 <= layer < lm.spec.num_layers:
        raise ValueError(f"layer must be in [0, {lm.spec.num_layers}), got {layer}")
    exact = first_layers_kv(lm, context, placed.token_ids, layer + 1)[layer, 0].float().cpu()  # [H, T, D]
    got = placed.kv[layer, 0].float().cpu()
    return (got - exact).norm(dim=(0, 2)) / exact.norm(dim=(0, 2)).clamp(min=1e-12)


def layer_masks(lm: LoadedModel, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
                ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The custom attention mask of a forward, in the form the model takes it.

    allowed: [S, N] bool, which keys each query may attend to before windows; q_pos [S], k_pos [N]: their positions.
    Sliding layers also drop keys `window` or more positions back (transformers' convention). When every layer
    attends the same way (all full, or all one window: Qwen2, Phi-3-mini-4k, Mistral), one 4-D mask; when layer types
    differ (Gemma3), a mask per layer type, which such models take as a dict. Layers of one type with different
    windows cannot be expressed either way and are refused."""
    windows: dict[str, set] = {}
    for layer in lm.spec.layers:
        windows.setdefault(layer.attention_type, set()).add(layer.sliding_window)
    if "chunked_attention" in windows:
        raise ValueError(f"{lm.name!r} has chunked-attention layers: selective recompute does not support them")
    for kind, seen in windows.items():
        if len(seen) > 1:
            raise ValueError(f"{lm.name!r}: its {kind} layers have different windows {sorted(seen, key=str)}; one "
                             "mask per layer type cannot express that")
    param = next(lm.model.parameters())
    distance = q_pos[:, None] - k_pos[None, :]  # [S, N]

    def form(window: int | None) -> torch.Tensor:
        m = allowed & (distance < window) if window else allowed
        # eager attention adds its mask to the scores: the float form; also under an induction prior, whose layers
        # without a biased head run the model's own ("kvbridge_induction_prior+eager", induction_attention)
        if lm.model.config._attn_implementation.rpartition("+")[2] == "eager":
            m = torch.where(m, 0.0, torch.finfo(param.dtype).min).to(param.dtype)
        return m[None, None].to(param.device)  # [1, 1, S, N]

    masks = {kind: form(next(iter(seen))) for kind, seen in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


@torch.no_grad()
def recompute_selected(lm: LoadedModel, context: KVSegment, placed: KVSegment, selected: torch.Tensor) -> KVSegment:
    """`placed` (right after `context`) with the KV of the `selected` token indices recomputed by the model in one
    forward: each selected token attends to the context, to the reused KV of the unselected tokens before it and
    to the recomputed selected tokens up to itself (a custom causal mask), as CacheBlend does. Exact for the
    selected tokens at layer 0; deeper, they see the reused KV of the others."""
    selected = torch.as_tensor(selected, dtype=torch.int64).unique()  # sorted
    if selected.numel() == 0:
        return placed
    t = placed.num_tokens
    if int(selected[0]) < 0 or int(selected[-1]) >= t:
        raise ValueError(f"selected indices must lie in [0, {t})")
    c = context.num_tokens
    if int(placed.positions[0]) != c:
        raise ValueError("place the segment right after the context first")
    param = next(lm.model.parameters())
    both = torch.cat((context.kv, placed.kv.to(context.kv)), dim=3).to(device=param.device, dtype=param.dtype)
    cache = kvcache.build_cache(both[:, :, None])
    n = c + t
    q_pos = c + selected  # [S] positions of the queries
    key_pos = torch.arange(n)  # [n] positions of the cached keys
    stale = torch.zeros(n, dtype=torch.bool)
    stale[c + selected] = True  # the selected tokens' reused KV: replaced, never attended
    mask = torch.cat(((key_pos[None, :] < q_pos[:, None]) & ~stale[None, :],  # [S, n]
                      selected[None, :] <= selected[:, None]), dim=1)  # [S, n + S]
    with custom_mask_attention(lm.model):  # a model loaded with flash-attention runs this forward with SDPA
        attention_mask = layer_masks(lm, mask, q_pos, torch.cat((key_pos, q_pos)))
        lm.model(input_ids=placed.token_ids[selected][None].to(param.device),
                 position_ids=q_pos[None].to(param.device), attention_mask=attention_mask, cache=cache, use_cache=True,
                 logits_to_keep=1)
    new = torch.stack([torch.stack((layer.keys[0, :, n:], layer.values[0, :, n:])) for layer in cache.layers])
    kv = placed.kv.clone()
    kv[:, :, :, selected.to(kv.device)] = new.to(kv)
    return KVSegment(kv=kv, token_ids=placed.token_ids.clone(), positions=placed.positions.clone(),
                     model=placed.model, rotated=True)


def recompute_most_deviating(lm: LoadedModel, context: KVSegment, placed: KVSegment, fraction: float,
                             layer: int = 1) -> tuple[KVSegment, torch.Tensor]:
    """Recompute the `fraction` of tokens whose keys deviate most at the checked layer; returns the segment and
    the recomputed indices."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    count = round(fraction * placed.num_tokens)
    if count == 0:
        return placed, torch.zeros(0, dtype=torch.int64)
    scores = checked_layer_deviation(lm, context, placed, layer)
    selected = scores.topk(count).indices.sort().values
    return recompute_selected(lm, context, placed, selected), selected
