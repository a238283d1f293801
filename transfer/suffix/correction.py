"""Corrections of a projected document cache that depend only on the document: the target recomputes chosen tokens
over the projection once, and the result serves every later request that places the document at the start.

A projected document cache holds the target's start token at position 0 (its own exact KV) and the document's
tokens at 1..d (projected). A correction (`Correction.parse("blend:0.1")`):
  replace        the projection as it is;
  recompute:r    the last k = max(1, round(r·d)) document tokens prefilled by the target over the others;
  blend:r        `transfer.suffix.blend` (its default rule, "attention") recomputing k tokens chosen by the
                 attention the document's last tokens give them.
The forwards that recompute tokens read the KV that stays projected with the target's induction prior when one is
given (as `eval rouge` and the generator do). The result keeps the same positions and tokens; `projected` says per
layer which tokens' KV is still the projection's. A blend with a deviation rule first runs the target's first m
layers over the document (`exact_layers`): there every token's KV is the target's own, recomputed or not, and only
the layers from m on hold projected KV. `still_projected` is the tokens not recomputed (projected in layers m..), and
`reading_prior(prior)` the prior that reads them there (`prior.from_layer(m)`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.blend import RULES, BlendConfig, blend, layer_marks, planned_forwards
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.reuse import prefill_after

KINDS = ("replace", "recompute", "blend")


@dataclass(frozen=True)
class Correction:
    kind: str  # one of KINDS
    fraction: float = 0.0  # r: the share of the document's tokens recomputed (0 for replace)
    rule: str = "attention"  # blend's selection rule (transfer.suffix.blend.RULES); served blends use the default

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"correction kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "replace" and self.fraction:
            raise ValueError("replace recomputes nothing: it takes no fraction")
        if self.kind != "replace" and not (0 < self.fraction <= 1 and math.isfinite(self.fraction)):
            raise ValueError(f"{self.kind} needs a fraction in (0, 1], got {self.fraction}")
        if self.rule != "attention" and (self.kind != "blend" or self.rule not in RULES):
            raise ValueError(f"a selection rule is blend's, one of {RULES}; got {self.rule!r} for {self.kind}")

    @classmethod
    def parse(cls, text: str, field: str = "mode") -> "Correction":
        """'replace', 'recompute:0.1', 'blend:0.1' -> a Correction; ValueError naming `field` otherwise."""
        kind, sep, value = text.strip().partition(":")
        try:
            if kind == "replace" and not sep:
                return cls("replace")
            if kind in KINDS and kind != "replace" and sep:
                return cls(kind, float(value))
        except ValueError as exc:
            raise ValueError(f"{field} {text!r}: {exc}") from None
        raise ValueError(f"{field} must be 'replace', 'recompute:R' or 'blend:R' with R in (0, 1], got {text!r}")

    def __str__(self) -> str:
        """The correction's name, which stored corrections are keyed by: the fraction as Python's shortest repr, which
        parses back to the same float ('%g' kept 6 digits, and two fractions that recompute different tokens could
        share a name), without a trailing '.0' ('blend:1', as before)."""
        rule = "" if self.rule == "attention" else f"[{self.rule}]"
        value = repr(self.fraction)
        return self.kind if self.kind == "replace" else f"{self.kind}{rule}:{value.removesuffix('.0')}"

    def tokens(self, doc_tokens: int) -> int:
        """k, the document tokens this correction recomputes."""
        return 0 if self.kind == "replace" else min(doc_tokens, max(1, round(self.fraction * doc_tokens)))

    def forwards(self, doc_tokens: int, layers: int, probe_tokens: int = 0) -> tuple[tuple[int, int, int], ...]:
        """The target's forwards `correct` runs for this correction of a document of `doc_tokens` tokens (after the
        start token) on a model of `layers` layers, as (new tokens, past tokens, layers run): none for replace, the
        tail over the head for recompute, blend's plan (blend.planned_forwards; `probe_tokens`: the request's tokens
        the prompt rule scores with)."""
        if doc_tokens < 1:
            raise ValueError(f"a correction needs at least one document token, got {doc_tokens}")
        d, k = doc_tokens, self.tokens(doc_tokens)
        if self.kind == "replace":
            return ()
        if self.kind == "recompute":
            return ((k, d + 1 - k, layers),)
        return planned_forwards(d, 1, layers, self._blend_config(d), probe_tokens)

    def _blend_config(self, doc_tokens: int) -> BlendConfig:
        return BlendConfig(fraction=self.tokens(doc_tokens) / doc_tokens, rule=self.rule)


@dataclass(frozen=True)
class Corrected:
    segment: KVSegment  # [L, 2, H, 1 + d, D]: the start token and the document, positions 0..d
    # [1 + d] bool: the positions the target did not recompute: their KV is the projection's in layers exact_layers..
    still_projected: torch.Tensor
    forwards: tuple[tuple[int, int, int], ...]  # the target's forwards: (new tokens, past tokens, layers run)
    exact_layers: int = 0  # m: layers whose KV is the target's own at every position (a deviation rule's pass)

    @property
    def projected(self) -> torch.Tensor:
        """[L, 1 + d] bool: per layer, the positions whose KV there is still the projection's."""
        return layer_marks(self.still_projected, self.segment.kv.shape[0], self.exact_layers)

    def reading_prior(self, prior: InductionPrior | None) -> InductionPrior | None:
        """The induction prior to read this cache with (on still_projected): `prior` on the layers whose KV is still
        projected somewhere, none on the first exact_layers."""
        return prior.from_layer(self.exact_layers) if prior is not None else None


def correct(lm: LoadedModel, projected: KVSegment, correction: Correction,
            prior: InductionPrior | None = None, probe_ids: torch.Tensor | None = None) -> Corrected:
    """The projected document cache (the start token at position 0, exact; the document at 1..d) corrected.
    probe_ids: the request's tokens after the document (blend's "prompt" rule scores with them)."""
    if int(projected.positions[0]) != 0 or projected.num_tokens < 2:
        raise ValueError("a correction needs the start token at position 0 and at least one document token")
    d = projected.num_tokens - 1
    k = correction.tokens(d)
    still = torch.ones(d + 1, dtype=torch.bool)
    still[0] = False  # the start token's KV is the target's own
    if correction.kind == "replace":
        return Corrected(projected, still, ())
    if correction.kind == "recompute":
        head = projected.slice(0, d + 1 - k)
        still[d + 1 - k:] = False
        with (prior.reading(lm, head.token_ids, still[:d + 1 - k]) if prior is not None
              else contextlib.nullcontext()):
            tail = prefill_after(lm, head, projected.token_ids[d + 1 - k:])
        return Corrected(KVSegment.concat([head, tail.to(dtype=head.dtype)]), still,
                         correction.forwards(d, lm.spec.num_layers))
    blended = blend(lm, projected.slice(0, 1), projected.slice(1, d + 1), correction._blend_config(d), prior=prior,
                    probe_ids=probe_ids)
    still[1:] = blended.still_projected
    return Corrected(KVSegment.concat([projected.slice(0, 1), blended.segment]), still, blended.forwards,
                     blended.exact_layers)
