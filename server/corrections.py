"""Served corrections: what GetProjectedCache's `mode` asks for, computed with the target model once per (source
entry, adapter, mode) and stored, so every later fetch — any client, any transport — is a store hit.

kvbridge places a document at the start of the target's context, so the KV that `recompute:r` or `blend:r`
(transfer.suffix.correction) makes of a projection depends only on the document, the adapter and the mode. The
service stores the result as an entry of the projection's source entry under the namespace
"<adapter>|<mode>#<source key>" (a Delete of the source removes it; a Redis replica adopts it like any entry); its
annotations keep the mode and the positions the target recomputed, which the header of every fetch carries.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import torch
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.correction import Corrected, Correction, correct
from kvbridge.transfer.suffix.induction import InductionPrior

__all__ = ["CorrectionLimits", "Corrections", "recomputed_of"]

RECOMPUTED = "recomputed"  # the annotation: positions the target recomputed, as "p,p,p" (short, JSON-able)
MODE = "mode"
log = logging.getLogger(__name__)
WARM_TEXT = ("A reader skips the fields it does not understand; a writer keeps the order of the fields it was given, "
             "so that a reader may stop at any field and a writer never reorders what it was handed.")


@dataclass(frozen=True)
class CorrectionLimits:
    default: str = "replace"  # what a fetch that names no mode gets
    max_running: int = 1  # corrections computed at once (each runs the target over the document); more wait
    prior: bool = True  # recompute with the target's induction prior over the KV that stays projected
    # a fitted prior file (`kvbridge prior fit --adapter FILE --out PRIOR`) for the target it was fitted for, instead
    # of the one that ships for it; other targets keep theirs
    prior_file: str = ""

    def __post_init__(self):
        Correction.parse(self.default, "correction")
        if self.max_running <= 0:
            raise ValueError(f"max_corrections must be > 0, got {self.max_running}")


class Corrections:
    """The modes a service serves and the computing of corrections (bounded; the target's prior loaded once)."""

    def __init__(self, limits: CorrectionLimits = CorrectionLimits()):
        self.limits = limits
        self.default = Correction.parse(limits.default, "correction")
        self._running = threading.BoundedSemaphore(limits.max_running)
        self._priors: dict[str, InductionPrior | None] = {}
        self._tags: dict[str, str] = {}  # target -> its prior's part of the stored corrections' namespace
        self._stale_told: set[tuple[str, str]] = set()  # (target, adapter digest) whose stale prior was logged
        self._lock = threading.Lock()

    def resolve(self, mode: str) -> Correction:
        """The request's mode ('' = the server's default); ValueError naming the field `mode` otherwise."""
        if not mode:
            return self.default
        correction = Correction.parse(mode, "mode")
        if correction.rule != "attention":
            raise ValueError(f"mode {mode!r}: served blends use the attention rule")
        return correction

    def prior_tag(self, lm: LoadedModel) -> str:
        """What the stored corrections' namespace adds for the prior they were computed with: nothing for the one
        that ships for the target, "/noprior" without one, "/prior~<sha256 of the terms>" for a given file (replicas
        sharing a Redis tier, or a restart with another prior, never serve one prior's corrections for another's)."""
        if not self.limits.prior:
            return "/noprior"
        self.prior(lm)
        return self._tags[lm.name]

    def prior(self, lm: LoadedModel) -> InductionPrior | None:
        """The target's prior, made once: the given file where it was fitted for `lm`, else the one that ships."""
        if not self.limits.prior:
            return None
        with self._lock:
            if lm.name not in self._priors:
                prior, tag = None, ""
                if self.limits.prior_file:
                    try:
                        prior = InductionPrior.load_for(self.limits.prior_file, lm)
                        terms = prior.terms.contiguous().numpy().tobytes()
                        tag = "/prior~" + hashlib.sha256(terms).hexdigest()[:16]
                    except (ValueError, OSError):  # another target's file, a damaged one, none: check_prior_file says
                        prior = None
                self._priors[lm.name] = prior if prior is not None else InductionPrior.for_model(lm)
                self._tags[lm.name] = tag
            return self._priors[lm.name]

    def check_prior_file(self, targets: list[LoadedModel]) -> None:
        """At start: the given prior file loads and was fitted for one of the served targets (ValueError naming it)."""
        if self.limits.prior_file and self.limits.prior and not any(self.prior_tag(lm) for lm in targets):
            InductionPrior.load(self.limits.prior_file)  # not a prior file at all: its own error
            raise ValueError(f"correction_prior_file {self.limits.prior_file}: fitted for none of the served targets "
                             f"({', '.join(lm.name for lm in targets)})")

    def compute(self, lm: LoadedModel, projected: KVSegment, correction: Correction, adapter: str = "",
                lock: threading.Lock | None = None) -> Corrected:
        """The correction of a projection (start token at 0, the document after it) by the target `lm`, at most
        `max_running` at once; KV on the model's device and in the projection's dtype. `adapter`: the digest of the
        adapter that projected it; a fitted prior made for another one is still read, and said once in the log.
        `lock`: the model's (ServedModel.lock), held for the correction's forwards once it has its slot: the prior's
        reading hooks every forward of the model, so another request's forward meanwhile (a prompt's head) would
        run under it and reset what it read."""
        prior = self.prior(lm)
        stale = prior.stale_for(adapter) if prior is not None and adapter else None
        if stale and (lm.name, adapter) not in self._stale_told:
            self._stale_told.add((lm.name, adapter))
            log.warning("corrections of %s: %s", lm.name, stale)
        device = next(lm.model.parameters()).device
        with self._running, lock or contextlib.nullcontext(), torch.no_grad():
            fixed = correct(lm, projected.to(device=device), correction, prior=prior)
        return Corrected(fixed.segment.to(device=projected.device, dtype=projected.dtype), fixed.still_projected,
                         fixed.forwards, fixed.exact_layers)

    def warm(self, lm: LoadedModel) -> float:
        """At start, so that no user's first fetch pays for it: the target's prior built (or loaded) and one
        correction of each kind of a short document of the target's own KV (its kernels' first runs). Seconds."""
        from kvbridge.transfer import kvcache

        t0 = time.perf_counter()
        ids = torch.tensor(lm.tokenizer(WARM_TEXT)["input_ids"][:64])
        own = kvcache.extract(lm.model, lm.spec, ids)  # positions 0.., as a placed document's
        for mode in dict.fromkeys(("recompute:0.1", "blend:0.1", str(self.default))):
            self.compute(lm, own, Correction.parse(mode, "mode"))  # the prior built by the first
        return time.perf_counter() - t0

    @staticmethod
    def annotations(correction: Correction, fixed: Corrected) -> dict:
        recomputed = (~fixed.still_projected).nonzero()[:, 0].tolist()
        return {MODE: str(correction), RECOMPUTED: ",".join(map(str, recomputed))}


def recomputed_of(annotations: dict, num_tokens: int) -> list[int]:
    """The positions an entry's annotations say the target recomputed, checked (records may come back from Redis):
    sorted, distinct, inside [0, num_tokens); ValueError otherwise."""
    text = annotations.get(RECOMPUTED, "")
    if not isinstance(text, str) or len(text) > 12 * num_tokens:
        raise ValueError("the entry's recomputed positions are not a short string")
    try:
        positions = [int(p) for p in text.split(",")] if text else []
    except ValueError:
        raise ValueError("the entry's recomputed positions are not integers") from None
    if any(b <= a for a, b in zip(positions, positions[1:])) or (
            positions and not (0 <= positions[0] and positions[-1] < num_tokens)):
        raise ValueError(f"the entry's recomputed positions are not sorted, distinct and inside [0, {num_tokens})")
    return positions
