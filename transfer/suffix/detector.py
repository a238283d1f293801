"""Where a token sequence splits into reusable segments, read from the model's own attention.

`attention_entropy` runs the model over the tokens in chunks of queries (a causal prefill with a cache, so the
result equals one full pass) with the model's own eager attention, and reduces each requested layer's attention
probabilities to one entropy per query position (nats, mean over heads) as soon as that layer has run: at most one
layer's [H, chunk, T] probabilities exist at a time, and the forward stops after the deepest requested layer.

`SuffixDetector` turns that profile into segment starts: a segment starts where a sliding window (default 8
positions) first holds `run` positions (default 3) below `threshold` nats (default 0.8) — stricter mode: 5 below
0.75 — with every segment at least `min_segment` tokens long. After a start, a new one can fire only once the
window has left the low state again (one run of low entropy makes one start, however long it lasts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import eager_attention
from kvbridge.transfer.spec import ModelSpec
from torch import nn


@torch.no_grad()
def attention_entropy(model: nn.Module, spec: ModelSpec, token_ids, layers: list[int] | None = None,
                      chunk_tokens: int = 256, per_layer: bool = False) -> torch.Tensor:
    """[T] float32: per query position, the entropy (nats) of its attention distribution, mean over heads and
    `layers` (default: every layer); per_layer: [len(layers), T], one row per layer in ascending order.
    Not thread-safe with other forwards of the same model (it switches the model to eager attention)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    t = ids.numel()
    if t == 0:
        raise ValueError("token_ids is empty")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    layers = sorted(set(range(spec.num_layers) if layers is None else layers))
    if not layers or layers[0] < 0 or layers[-1] >= spec.num_layers:
        raise ValueError(f"layers must be indices in [0, {spec.num_layers}) of {spec.name!r}, got {layers}")
    blocks = kvcache.decoder_layers(model)
    device = next(model.parameters()).device
    rows = {layer: row for row, layer in enumerate(layers)}
    total = torch.zeros(len(layers), t, dtype=torch.float32)  # [n_layers, T]
    span = {"start": 0, "end": 0}

    def hook_for(index: int):
        def hook(module, args, output):
            probs = output[1]  # [B, H, q, k]: eager attention returns its probabilities
            if probs is None:
                raise RuntimeError(f"layer {index} returned no attention probabilities (not eager attention)")
            p = probs[0].float()
            entropy = -torch.special.xlogy(p, p).sum(-1).mean(0)  # [q]
            total[rows[index], span["start"]:span["end"]] = entropy.cpu()
        return hook

    handles = [blocks[i].self_attn.register_forward_hook(hook_for(i)) for i in layers]
    try:
        with eager_attention(model):
            cache = kvcache.build_cache()  # no config: every layer keeps every token (sliding layers too)
            for start in range(0, t, chunk_tokens):
                end = min(start + chunk_tokens, t)
                span.update(start=start, end=end)
                kvcache.forward_through(model, layers[-1], input_ids=ids[start:end][None].to(device),
                                        position_ids=torch.arange(start, end)[None].to(device), cache=cache,
                                        use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return total if per_layer else total.mean(0)


@dataclass(frozen=True)
class DetectorConfig:
    window: int = 8  # positions the sliding window looks at
    run: int = 3  # low-entropy positions the window must hold for a segment to start
    threshold: float = 0.8  # nats
    min_segment: int = 8  # tokens: no segment (the first and last included) is shorter
    layers: tuple[int, ...] | None = None  # layers averaged; None: every layer
    chunk_tokens: int = 256  # queries per forward chunk (bounds the attention held at once)

    def __post_init__(self):
        if not 1 <= self.run <= self.window:
            raise ValueError(f"run must be in [1, window={self.window}], got {self.run}")
        if self.threshold <= 0:
            raise ValueError(f"threshold must be > 0 nats, got {self.threshold}")
        if self.min_segment < 1:
            raise ValueError(f"min_segment must be >= 1, got {self.min_segment}")

    @classmethod
    def strict(cls, **kwargs) -> "DetectorConfig":
        """5 positions below 0.75 nats in the window; min segment 12."""
        return cls(**{"run": 5, "threshold": 0.75, "min_segment": 12, **kwargs})


def segment_starts(profile: torch.Tensor, config: DetectorConfig) -> list[int]:
    """Segment start positions (0 first) for an entropy profile [T]."""
    low = (profile < config.threshold).to(torch.int32)
    t = low.numel()
    w = config.window
    # count of low positions in the window starting at each p: [T]
    padded = torch.cat((low, torch.zeros(w, dtype=torch.int32)))
    csum = torch.cat((torch.zeros(1, dtype=torch.int64), padded.cumsum(0)))
    counts = (csum[w:w + t] - csum[:t]).tolist()
    low_list = low.tolist()
    starts = [0]
    armed = False  # a start may fire only after the window has been out of the low state
    for p in range(t):
        firing = counts[p] >= config.run
        if not firing:
            armed = True
            continue
        if not armed:
            continue
        # the segment starts at the first low position in the window
        first_low = p + low_list[p:p + w].index(1)
        if first_low - starts[-1] >= config.min_segment and t - first_low >= config.min_segment:
            starts.append(first_low)
            armed = False
    return starts


class SuffixDetector:
    """Segments of a token sequence from the model's attention entropy."""

    def __init__(self, config: DetectorConfig = DetectorConfig()):
        self.config = config

    def profile(self, model: nn.Module, spec: ModelSpec, token_ids) -> torch.Tensor:
        layers = list(self.config.layers) if self.config.layers is not None else None
        return attention_entropy(model, spec, token_ids, layers=layers, chunk_tokens=self.config.chunk_tokens)

    def segments(self, model: nn.Module, spec: ModelSpec, token_ids) -> list[tuple[int, int]]:
        """[(start, end)] covering 0..T, in order."""
        profile = self.profile(model, spec, token_ids)
        starts = segment_starts(profile, self.config)
        return list(zip(starts, starts[1:] + [profile.numel()]))
