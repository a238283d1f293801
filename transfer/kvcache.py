"""The one place that converts between KVSegment and transformers caches: extract, to_cache, and generation; every
transformers cache is built by `build_cache`, and forwards stopped after a layer run through `forward_through`.

Facts this rests on (transformers 5.x): the forward argument is `cache`; keys are cached after RoPE (and after
Gemma3's k_norm); `cache.layers[i].keys` is `[B, H_kv, T, D]`; a `DynamicCache` built with the model's config
makes sliding-window layers that keep only the last `window - 1` tokens, while one built without a config keeps
every token of every layer (the prefill's attention masks come from the config either way, so this is how
`extract` captures the full KV of sliding layers); `generate` needs at least one token the cache does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelSpec
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _as_ids(token_ids, what: str, vocab_size: int) -> torch.Tensor:
    # token_ids: list[int] | [T] | [1, T] -> [T] int64 on the CPU
    ids = torch.as_tensor(token_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{what} is empty: there is no text to run the model on")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    ids = ids.to(torch.int64).cpu()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{what} holds ids outside the model's vocabulary [0, {vocab_size}): min {low}, max {high}")
    return ids


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends in place. Its keys and values ([B, H_kv, T, D]) are views of the
    first T slots of buffers [B, H_kv, capacity, D]; update() writes the new tokens into the slots after them and
    returns longer views, where transformers' DynamicLayer concatenates the whole layer into a new tensor on every
    update (at 2k tokens of SmolLM2 in float32, 94 MB copied per forward, for the question and again for every
    generated token). A layer that never had room (none handed over) concatenates at its first update, as
    DynamicLayer does, so a single forward costs what it costs there; when there is no room left the layer moves to
    buffers a quarter larger than it needs (at least MIN_ROOM slots more), so decoding copies the cache rarely.

    Invariants: the slots before T are never written again by this layer unless the cache was cropped below them
    (then the cropped slots are reused, as a new DynamicLayer's would be replaced); keys and values that stop being
    views of the buffers (reorder_cache, batch_select_indices, ... give new tensors) are moved to new buffers at the
    next update. The buffers are this layer's own, or room a caller hands over with `adopt` and never uses again.
    """

    MIN_ROOM = 64  # slots added at least when a layer moves: a few generated tokens do not move it again

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._room_k: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._room_v: torch.Tensor | None = None
        self._concatenated = False  # an update without room concatenated (the next one without room moves)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, room_k: torch.Tensor | None = None,
              room_v: torch.Tensor | None = None) -> None:
        """Hold keys and values ([B, H_kv, T, D]) without copying them; room_k / room_v ([B, H_kv, C >= T, D],
        whose first T slots are keys / values) are buffers the next tokens may be written into in place."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._room_k = self._room_v = None
        self._concatenated = False
        if room_k is not None and room_v is not None:
            self._room_k, self._room_v = room_k, room_v
            assert self._in_room(), "room_k / room_v must begin with keys / values"

    def _in_room(self) -> bool:
        """Whether keys and values are the first slots of this layer's buffers."""
        def prefix_of(t: torch.Tensor, room: torch.Tensor | None) -> bool:
            # storage and offset rather than data_ptr(), which is 0 for the empty view of a layer with no tokens yet
            return (room is not None and t.storage_offset() == room.storage_offset() and t.stride() == room.stride()
                    and t.untyped_storage().data_ptr() == room.untyped_storage().data_ptr()
                    and t.shape[:-2] == room.shape[:-2] and t.shape[-1] == room.shape[-1]
                    and t.shape[-2] <= room.shape[-2] and t.dtype == room.dtype and t.device == room.device)

        return prefix_of(self.keys, self._room_k) and prefix_of(self.values, self._room_v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, S, D] -> keys, values [B, H_kv, T + S, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, s = self.get_seq_length(), key_states.shape[-2]
        if not self._in_room() or t + s > self._room_k.shape[-2]:  # (an empty layer's keys are in no room)
            if self._room_k is None and not self._concatenated:  # as DynamicLayer: a tensor of T + S slots
                self._concatenated = True
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
                return self.keys, self.values
            self._move(key_states, value_states, t, t + s)
        self._room_k[..., t:t + s, :].copy_(key_states)
        self._room_v[..., t:t + s, :].copy_(value_states)
        self.keys, self.values = self._room_k[..., :t + s, :], self._room_v[..., :t + s, :]
        return self.keys, self.values

    def _move(self, key_states: torch.Tensor, value_states: torch.Tensor, t: int, needed: int) -> None:
        capacity = needed + max(needed // 4, self.MIN_ROOM)
        b, h, _, d = key_states.shape
        room_k = key_states.new_empty((b, h, capacity, d))
        room_v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
        if t:
            room_k[..., :t, :].copy_(self.keys)
            room_v[..., :t, :].copy_(self.values)
        self._room_k, self._room_v = room_k, room_v

    def reset(self) -> None:
        super().reset()
        self._room_k = self._room_v = None
        self._concatenated = False


def build_cache(kv: torch.Tensor | None = None, config=None, copy: bool = True,
                room: torch.Tensor | None = None) -> DynamicCache:
    """A transformers DynamicCache holding kv ([L, 2, B, H_kv, T, D]; None: empty).

    config None: every layer keeps every token, sliding-window layers too (the model still masks them by position):
    what extraction and recompute over long contexts need. With the model's config the cache is the one generation
    uses: sliding layers keep their last window - 1 tokens, full-attention layers are GrowingLayers (new tokens
    written in place). copy=False: the layers hold views of kv instead of copies (GrowingLayers, and sliding ones
    with a config); kv is never written. room ([L, 2, B, H_kv, C >= T, D] whose first T slots are kv; copy=False
    only): buffers the caller hands over for the next tokens to be written into in place (the caller must not use
    its slots after T again).
    """
    if kv is None:
        return _growing(DynamicCache(config=config)) if config is not None else DynamicCache()
    if kv.ndim != 6 or kv.shape[1] != 2:
        raise ValueError(f"build_cache takes kv [L, 2, B, H_kv, T, D], got shape {tuple(kv.shape)}")
    if room is not None and (copy or room.shape[:4] != kv.shape[:4] or room.shape[5] != kv.shape[5]
                             or room.shape[4] < kv.shape[4]):
        raise ValueError(f"room {tuple(room.shape)} must be [L, 2, B, H_kv, C >= T, D] around kv {tuple(kv.shape)}, "
                         "with copy=False")
    if copy and config is None:
        return DynamicCache(ddp_cache_data=[(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])
    # no config and no copy: every layer a GrowingLayer that keeps every token (as DynamicLayer without a config)
    cache = _growing(DynamicCache(config=config) if config is not None
                     else DynamicCache(ddp_cache_data=[(None, None)] * kv.shape[0]))
    if len(cache.layers) != kv.shape[0]:
        raise ValueError(f"the config makes {len(cache.layers)} cache layers, kv has {kv.shape[0]}")
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, kv.unbind(0))):
        if copy:
            layer.update(k, v)  # a copy (a GrowingLayer's into buffers with room)
        elif isinstance(layer, GrowingLayer):
            layer.adopt(k, v, *((room[i, 0], room[i, 1]) if room is not None else ()))
        else:  # what update() does to an empty layer, without its torch.cat onto an empty tensor (a copy)
            layer.lazy_initialization(k, v)
            if getattr(layer, "is_sliding", False):
                layer.cumulative_length = k.shape[-2]
                k, v = k[..., -(layer.sliding_window - 1):, :], v[..., -(layer.sliding_window - 1):, :]
            layer.keys, layer.values = k, v
    return cache


def _growing(cache: DynamicCache) -> DynamicCache:
    """The cache with its plain full-attention layers (DynamicLayer itself) made GrowingLayers (every layer, for a
    cache built without a config)."""
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (model.model.layers)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers (not a transformers "
                         "causal LM)")
    return layers


class _Stop(Exception):
    """Raised after the last layer a forward_through needs: the rest of the forward is skipped."""


def forward_through(model: nn.Module, layer: int, **forward_kwargs) -> None:
    """Run `model(**forward_kwargs)` only as far as decoder layer `layer`'s attention: the cache given in
    forward_kwargs then holds the K/V of layers 0..layer (≈ (layer + 1) / L of a prefill). Forward hooks registered
    before this call on that attention module still run."""
    blocks = decoder_layers(model)
    if not 0 <= layer < len(blocks):
        raise ValueError(f"layer must be in [0, {len(blocks)}), got {layer}")

    def stop(module, args, output):
        raise _Stop

    handle = blocks[layer].self_attn.register_forward_hook(stop)
    try:
        model(**forward_kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def extract(model: nn.Module, spec: ModelSpec, token_ids, start_position: int = 0,
            prefix: KVSegment | None = None) -> KVSegment:
    """Prefill `token_ids` ([T]) at positions start_position.. and return the full KV of every layer.

    The KV is exactly what the model caches (keys rotated), in the model's dtype, on the model's device — for
    sliding-window layers too: all T tokens, not only the last window. With `prefix` (this model's KV of the first
    P < T of token_ids, at the same positions) the model runs only on the other T - P tokens, over it: the same KV
    as a prefill of all of them, up to the float error of a different split of the same sums.

    The forward writes every layer's new K/V in place into one [L, 2, H_kv, T, D] buffer (the cache's layers are
    views of it with room up to T, every token kept): no concatenation per layer, no second copy at the end.
    """
    ids = _as_ids(token_ids, "token_ids", spec.vocab_size)
    if start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {start_position}")
    t, p = ids.numel(), 0
    check_rope_window(spec, start_position + t)
    positions = torch.arange(start_position, start_position + t, dtype=torch.int64)
    if prefix is not None:
        p = prefix.num_tokens
        if not 0 < p < t or not torch.equal(prefix.token_ids, ids[:p]):
            raise ValueError(f"the prefix must be the first 1..{t - 1} tokens of token_ids, got {p} tokens")
        if not torch.equal(prefix.positions, positions[:p]):
            raise ValueError(f"the prefix must lie at positions {start_position}..{start_position + p - 1}")
        if not prefix.rotated:
            raise ValueError("the prefix must hold rotated keys, as the model caches them")
        check_compatible(prefix, spec)
    param = next(model.parameters())
    kv = torch.empty((spec.num_layers, 2, spec.num_kv_heads, t, spec.head_dim), dtype=param.dtype,
                     device=param.device)
    if p:
        kv[:, :, :, :p] = prefix.kv
    cache = build_cache(kv[:, :, None, :, :p], copy=False, room=kv[:, :, None])
    model(input_ids=ids[p:][None].to(param.device), position_ids=positions[p:][None].to(param.device), cache=cache,
          use_cache=True, logits_to_keep=1)
    if any(layer.keys.data_ptr() != kv[i, 0].data_ptr() or layer.keys.shape[-2] != t
           for i, layer in enumerate(cache.layers)):
        return from_cache(cache, spec, ids, positions)  # a layer moved out of the buffer, or kept fewer tokens
    return KVSegment(kv=kv, token_ids=ids.to(torch.int64).cpu(), positions=positions, model=spec.identity,
                     rotated=True)


def check_rope_window(spec: ModelSpec, end: int, generating: bool = False) -> None:
    """A forward over positions 0..end-1 of a model whose RoPE tables depend on the call's longest position (longrope,
    dynamic NTK) rotates every key, those below the switch too, with the tables of that length: such KV could never
    be un-rotated or moved exactly (ModelRope refuses only positions past the switch). ValueError naming it.
    generating: the positions a generation over cached KV reaches (its forwards past the switch would rotate the new
    keys with other tables than the cached ones)."""
    for layer in spec.layers:
        rope = layer.rope
        if rope is None or not rope.position_dependent or end <= rope.original_max_positions:
            continue
        n = rope.original_max_positions
        if generating:
            raise ValueError(f"{spec.name!r}: {rope.rope_type} RoPE switches tables past {n} positions, and "
                             f"generating up to position {end - 1} would rotate the new keys with other tables than "
                             f"the cached ones: keep the context, the new tokens and max_new_tokens below {n} tokens")
        raise ValueError(f"{spec.name!r}: {rope.rope_type} RoPE rotates every key of a call reaching position "
                         f"{end - 1} with other tables than a shorter call's (they switch past {n} positions), so "
                         f"its KV cannot be moved or re-rotated exactly: keep documents and their placement below "
                         f"{n} tokens")


def from_cache(cache, spec: ModelSpec, token_ids: torch.Tensor, positions: torch.Tensor | None = None,
               batch_index: int = 0) -> KVSegment:
    """A KVSegment from a transformers cache that holds every token of every layer.

    token_ids: [T]; positions: [T] (default 0..T-1). Raises if a layer dropped tokens (a sliding-window cache
    layer that is full) or if the cache does not match the spec.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    if len(layers) != spec.num_layers:
        raise ValueError(f"the cache has {len(layers)} layers, {spec.name!r} has {spec.num_layers}")
    t = token_ids.numel()
    expected = (spec.num_kv_heads, t, spec.head_dim)
    keys, values = [], []
    for i, layer in enumerate(layers):
        k, v = layer.keys, layer.values
        if k is None or v is None:
            raise ValueError(f"layer {i} of the cache is empty")
        if k.ndim != 4 or not 0 <= batch_index < k.shape[0]:
            raise ValueError(f"layer {i}: keys of shape {tuple(k.shape)} have no batch row {batch_index}")
        if tuple(k.shape[1:]) != expected or tuple(v.shape[1:]) != expected:
            hint = (" (a sliding-window layer keeps only its last tokens: extract with a cache that keeps all)"
                    if getattr(layer, "is_sliding", False) else "")
            raise ValueError(
                f"layer {i}: cached keys {tuple(k.shape[1:])} / values {tuple(v.shape[1:])} do not match "
                f"{spec.name!r} with {t} tokens, expected [H_kv, T, D] = {expected}{hint}"
            )
        keys.append(k[batch_index])
        values.append(v[batch_index])
    kv = torch.stack((torch.stack(keys), torch.stack(values)), dim=1)  # [L, 2, H_kv, T, D]
    if positions is None:
        positions = torch.arange(t, dtype=torch.int64)
    return KVSegment(kv=kv, token_ids=token_ids.to(torch.int64).cpu(), positions=positions.to(torch.int64).cpu(),
                     model=spec.identity, rotated=True)


def check_compatible(segment: KVSegment, spec: ModelSpec) -> None:
    """Raise ValueError unless the segment is KV of this model, in a layout its cache can hold."""
    if segment.model != spec.identity:
        raise ValueError(f"the segment holds KV of {segment.model.key}, not of {spec.identity.key}")
    expected = (spec.num_layers, 2, spec.num_kv_heads, segment.num_tokens, spec.head_dim)
    if tuple(segment.kv.shape) != expected:
        raise ValueError(f"segment layout {tuple(segment.kv.shape)} does not match {spec.name!r}: expected {expected}")


def to_cache(segments: KVSegment | Sequence[KVSegment], model: nn.Module, spec: ModelSpec,
             room: torch.Tensor | None = None) -> DynamicCache:
    """A transformers DynamicCache the model continues from, holding one segment per batch row.

    Every segment must be rotated KV of this model at positions 0..T-1 (shift it first otherwise), all of one
    length. Tensors are converted to the model's dtype and device; one segment already in them is not copied: the
    cache's layers are views of its kv (generation never writes into them). Sliding-window layers keep their last
    `window - 1` tokens and count all T (their `cumulative_length`), so the next position is T. Full-attention
    layers write the next tokens in place (GrowingLayer): into `room` ([L, 2, H_kv, C >= T, D] whose first T slots
    are the one segment's kv, handed over by the caller, e.g. a same-host fetch's file mapped with slots to spare)
    when it is given and no conversion is needed, else into buffers made at the first forward (one copy, as
    transformers' own concatenation).
    """
    if isinstance(segments, KVSegment):
        segments = [segments]
    if not segments:
        raise ValueError("to_cache needs at least one segment")
    t = segments[0].num_tokens
    for i, seg in enumerate(segments):
        check_compatible(seg, spec)
        if not seg.rotated:
            raise ValueError(f"segment {i} holds un-rotated keys: rotate them at their positions before caching")
        if seg.num_tokens != t:
            raise ValueError(f"segment {i} has {seg.num_tokens} tokens, segment 0 has {t}: batch rows must match")
        if t == 0:
            raise ValueError("cannot build a cache from an empty segment")
        if not seg.is_contiguous_from(0):
            raise ValueError(
                f"segment {i} sits at positions {int(seg.positions[0])}..{int(seg.positions[-1])}, a cache needs "
                "0..T-1: shift its keys to the positions it will occupy"
            )
    param = next(model.parameters())
    # [L, 2, B, H, T, D]; one segment already in the model's dtype and device is used as it is (no copy)
    kv = segments[0].kv[:, :, None] if len(segments) == 1 else torch.stack([seg.kv for seg in segments], dim=2)
    converted = kv.to(device=param.device, dtype=param.dtype)
    if room is not None:
        if len(segments) != 1:
            raise ValueError("room is for a cache of one segment")
        head, kv0 = room[:, :, :, :t], segments[0].kv
        if room.ndim != 5 or (head.data_ptr(), head.shape, head.stride()) != (kv0.data_ptr(), kv0.shape, kv0.stride()):
            raise ValueError(f"room {tuple(room.shape)} must be [L, 2, H_kv, C, D] beginning with the segment's kv")
    keep_room = room is not None and converted.data_ptr() == kv.data_ptr()
    cache = build_cache(converted, config=model.config, copy=False, room=room[:, :, None] if keep_room else None)
    for i, layer in enumerate(cache.layers):  # sliding layers count all T (cumulative_length), not what they keep
        assert layer.get_seq_length() == t, f"layer {i} reports {layer.get_seq_length()} cached tokens, expected {t}"
    return cache


@torch.no_grad()
def generate(model: nn.Module, spec: ModelSpec, segment: KVSegment, new_ids, **generate_kwargs) -> torch.Tensor:
    """Continue from a cached segment plus at least one new token; returns only the generated ids ([N]).

    new_ids: [N_new] tokens after the segment (the model prefills these). generate_kwargs go to `model.generate`
    (max_new_tokens, do_sample, ...); greedy decoding unless told otherwise. A model whose RoPE tables switch past a
    length (longrope, dynamic NTK) is refused a generation reaching past it (check_rope_window), before any forward.
    """
    new = _as_ids(new_ids, "new_ids (the uncached tokens after the segment; generate needs at least one)",
                  spec.vocab_size)
    prompt = segment.num_tokens + new.numel()
    budget = generate_kwargs.get("max_new_tokens", model.generation_config.max_new_tokens)
    if budget is None:  # transformers' max_length counts the prompt
        budget = generate_kwargs.get("max_length", model.generation_config.max_length) - prompt
    check_rope_window(spec, prompt + max(int(budget), 0), generating=True)
    cache = to_cache(segment, model, spec)
    device = _model_device(model)
    input_ids = torch.cat((segment.token_ids, new))[None].to(device)
    generate_kwargs.setdefault("do_sample", False)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                         **generate_kwargs)
    return out[0, input_ids.shape[1]:].cpu()


@torch.no_grad()
def generate_plain(model: nn.Module, spec: ModelSpec, token_ids, **generate_kwargs) -> torch.Tensor:
    """Reference: `model.generate` on the full token sequence with no injected cache; returns the new ids ([N])."""
    ids = _as_ids(token_ids, "token_ids", spec.vocab_size)[None].to(_model_device(model))
    generate_kwargs.setdefault("do_sample", False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
    return out[0, ids.shape[1]:].cpu()
