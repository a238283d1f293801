"""How the KV of a request's context was made, part by part: the key a cached segment's exact reuse is matched by.

A segment the target computed is exact at the same positions only after identical KV: the same tokens, each of them
made the same way. A part the target computes itself (prefilled, or reused exact) is made by its tokens and what came
before, which the key already covers; a part whose KV comes from elsewhere is named by what makes it, given the
context before it (itself named so):
- projected: a fingerprint of the KV the context source returned, the adapter digest it tells, the blend fraction
  and which of its positions stay projected in which layers (a blend whose selection pass made the first layers the
  target's own is another KV than one that did not), and the induction prior every later forward reads them with;
- shifted (reused after another prefix, then partly recomputed): the cached entry (its store key, the key of what it
  was computed after, its first position), recompute_k, recompute_fraction and the tokens recomputed.
What the target recomputes is named by how, not by its bytes: a recompute over the same KV split into other forwards
differs in the last bits, as a prefill of the same tokens in other forwards does, and that is still exact.
The fingerprint is per layer, keys or values, and token, the sum and the norm over heads and head_dim: one reduction
on the KV's device, deterministic there, which two projections (adapters, corrections) of the same tokens do not
share. `cache_manager.prefix_key` combines the tokens and this account into the key.
"""

from __future__ import annotations

import hashlib

import torch
from kvbridge.transfer.suffix.cache_manager import prefix_key

__all__ = ["Provenance", "kv_fingerprint", "prior_digest"]


def kv_fingerprint(kv: torch.Tensor) -> str:
    """kv: [L, 2, H, T, D] -> a hex digest of its per (layer, k/v, token) sum and norm."""
    stats = torch.stack((kv.sum(dim=(2, 4)), torch.linalg.vector_norm(kv, dim=(2, 4))))  # [2, L, 2, T]
    return hashlib.blake2b(stats.float().cpu().numpy().tobytes(), digest_size=16).hexdigest()


def prior_digest(prior) -> str:
    """What names an induction prior's effect: its terms (and whether every layer reads through it); "none" for no
    prior; an object without terms is named by its identity."""
    if prior is None:
        return "none"
    terms = getattr(prior, "terms", None)
    if not isinstance(terms, torch.Tensor):
        return f"{type(prior).__qualname__}@{id(prior):x}"
    h = hashlib.blake2b(terms.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=16)
    h.update(b"every" if getattr(prior, "every_layer", False) else b"heads")
    return h.hexdigest()


class Provenance:
    """One request's account of its context parts whose KV the target did not compute itself from the tokens before
    them; `key(token_ids)` is the prefix_key of the context up to a part's start."""

    def __init__(self):
        self._made: list[tuple[int, str]] = []  # (end, "start:end:how") per such part, in order

    def projected(self, start: int, end: int, source_kv: torch.Tensor, adapter_digest: str, fraction: float,
                  still: torch.Tensor, prior) -> None:
        """A projected part at [start, end): source_kv [L, 2, H, T, D] as the context source returned it, blended
        with `fraction`; still, its positions whose KV stays projected (read with `prior`): [T] bool where that is so
        in every layer, or [L, T] bool per layer (`BlendResult.projected`, `Corrected.projected`)."""
        if still.ndim == 2 and bool((still == still[:1]).all()):
            still = still[0]  # the same in every layer: named as the [T] form is
        elif still.ndim not in (1, 2):
            raise ValueError(f"still must be [T] or [L, T] bool, got {tuple(still.shape)}")
        marks = hashlib.blake2b(still.to(torch.uint8).cpu().numpy().tobytes(), digest_size=8)
        if still.ndim == 2:
            marks.update(f"layers={still.shape[0]}".encode())
        marks = marks.hexdigest()
        how = f"projected/{kv_fingerprint(source_kv)}/{adapter_digest}/{fraction!r}/{marks}/{prior_digest(prior)}"
        self._made.append((end, f"{start}:{end}:{how}"))

    def shifted(self, start: int, end: int, entry: str, entry_prefix: str, entry_start: int, k: int,
                fraction: float, recomputed: torch.Tensor) -> None:
        """A cached entry (store key `entry`, computed at entry_start after entry_prefix: a prefix_key) reused at
        [start, end), its first k and its `fraction` most deviating tokens recomputed (recomputed: [R] indices)."""
        redone = ",".join(str(i) for i in recomputed.tolist())
        how = f"shifted/{entry}/{entry_prefix}/{entry_start}/{k}/{fraction!r}/{redone}"
        self._made.append((end, f"{start}:{end}:{how}"))

    def key(self, token_ids: torch.Tensor) -> str:
        """prefix_key of the context's first P tokens (token_ids: [P]) as this request made them."""
        return prefix_key(token_ids, self.text(int(token_ids.numel())))

    def text(self, end: int) -> str:
        """The account of the parts before position `end` (what `cache_manager.offer` takes as provenance)."""
        return ";".join(how for stop, how in self._made if stop <= end)
