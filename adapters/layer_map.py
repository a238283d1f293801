"""Which source layers feed each target layer: S(j) for j in the target's layers.

Every strategy returns, per target layer, k source layer indices (k is the same for every target layer, so
application is one batched gather). With k > 1 the adapter mixes them (a convex combination learned per target
layer) before its linear map.
"""

from __future__ import annotations

LAYER_MAPS = ("proportional", "nearest", "last-aligned", "mix")


def _clip(i: int, n: int) -> int:
    return max(0, min(n - 1, i))


def proportional(num_source: int, num_target: int) -> list[int]:
    """Relative depth, floor: target layer j reads source layer floor(j * L_s / L_t) (18 -> 30 is one-to-many)."""
    return [_clip(j * num_source // num_target, num_source) for j in range(num_target)]


def nearest(num_source: int, num_target: int) -> list[int]:
    """Relative depth of layer centres, rounded: the source layer whose centre is nearest target layer j's."""
    return [_clip(round((j + 0.5) * num_source / num_target - 0.5), num_source) for j in range(num_target)]


def last_aligned(num_source: int, num_target: int) -> list[int]:
    """Align the tops: the last target layer reads the last source layer, counting down one for one (layers
    below the source's depth read source layer 0, or when the source is deeper, the lowest ones are skipped)."""
    return [_clip(num_source - num_target + j, num_source) for j in range(num_target)]


def neighbourhood(num_source: int, num_target: int, k: int) -> list[list[int]]:
    """The k source layers nearest (by relative depth) each target layer's nearest source layer, sorted."""
    if not 1 <= k <= num_source:
        raise ValueError(f"k must be in [1, {num_source}] (the source's layer count), got {k}")
    out = []
    for centre in nearest(num_source, num_target):
        lo = _clip(centre - (k - 1) // 2, num_source - k + 1)
        out.append(list(range(lo, lo + k)))
    return out


def build_layer_map(strategy: str, num_source: int, num_target: int, k: int = 3) -> list[list[int]]:
    """S(j) for every target layer j: [num_target][k] source layer indices (k = 1 except for "mix")."""
    if num_source < 1 or num_target < 1:
        raise ValueError(f"layer counts must be >= 1, got source {num_source}, target {num_target}")
    if strategy == "proportional":
        return [[s] for s in proportional(num_source, num_target)]
    if strategy == "nearest":
        return [[s] for s in nearest(num_source, num_target)]
    if strategy == "last-aligned":
        return [[s] for s in last_aligned(num_source, num_target)]
    if strategy == "mix":
        return neighbourhood(num_source, num_target, min(k, num_source))
    raise ValueError(f"unknown layer map {strategy!r}; choose one of {LAYER_MAPS}")
