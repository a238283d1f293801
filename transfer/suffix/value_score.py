"""How much a cached segment is worth keeping: features of a segment, the scorer interface, a fixed scorer, and the
default one, learned online (logistic regression, scikit-learn's SGDClassifier) from the hits the suffix cache
manager observes. Scores route segments: >= 0.85 kept without TTL, 0.6-0.85 kept for 30 minutes, < 0.6 not
cached (thresholds live in the manager)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

ROLES = ("system", "document", "turn", "other")


@dataclass(frozen=True)
class SegmentFeatures:
    num_tokens: int
    role: str  # one of ROLES: what the segment is in the request
    position: int  # where it starts in the request
    repeats: int  # times the session offered these tokens before
    temperature: float  # the session's semantic temperature when offered

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def vector(self) -> np.ndarray:
        role = [1.0 if self.role == r else 0.0 for r in ROLES]
        return np.array([math.log1p(self.num_tokens) / 8, math.log1p(self.position) / 8,
                         math.log1p(self.repeats), self.temperature, *role], dtype=np.float64)


class ValueScorer(Protocol):
    def score(self, features: SegmentFeatures) -> float: ...  # in [0, 1]

    def observe(self, features: SegmentFeatures, hit: bool) -> None: ...  # outcome of a segment it scored


class FixedScorer:
    """A constant score per role (a default for every other role); learns nothing."""

    def __init__(self, default: float, by_role: dict[str, float] | None = None):
        self.default = default
        self.by_role = dict(by_role or {})

    def score(self, features: SegmentFeatures) -> float:
        return self.by_role.get(features.role, self.default)

    def observe(self, features: SegmentFeatures, hit: bool) -> None:
        pass


class OnlineValueScorer:
    """P(a segment is hit again) by online logistic regression on SegmentFeatures.

    Each outcome the manager reports is one `partial_fit` step: a hit is a positive, a segment that left the cache
    (expired, flushed, evicted) without any hit a negative. Until both kinds of outcome have been seen the score is
    `prior` (0.7: cache for 30 minutes, long enough to learn).
    """

    def __init__(self, prior: float = 0.7, learning_rate: float = 0.05, seed: int = 0):
        from sklearn.linear_model import SGDClassifier

        self.prior = prior
        self._model = SGDClassifier(loss="log_loss", learning_rate="constant", eta0=learning_rate, alpha=1e-4,
                                    random_state=seed)
        self._seen = set()
        self._lock = threading.Lock()
        self.observations = 0

    def score(self, features: SegmentFeatures) -> float:
        with self._lock:
            if len(self._seen) < 2:
                return self.prior
            return float(self._model.predict_proba(features.vector()[None])[0, 1])

    def observe(self, features: SegmentFeatures, hit: bool) -> None:
        with self._lock:
            self._model.partial_fit(features.vector()[None], np.array([int(hit)]), classes=np.array([0, 1]))
            self._seen.add(bool(hit))
            self.observations += 1
