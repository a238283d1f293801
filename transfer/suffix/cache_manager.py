"""SuffixCacheManager: a target model's own KV segments, reused across the requests and turns of a session.

Segments live in the PagedStore as "segment" entries in a per-session namespace (tenant and session are both in
the store's tenant field), so the key of a segment is its content hash combined with the session, and one session
never sees another's segments. Around the store the manager keeps, per session:
- a TTL (default 5 minutes of inactivity; the clock is injectable): an expired session's segments are flushed;
- a semantic temperature: 0.8 to start; when the TF-IDF cosine (scikit-learn) between a new turn and the
  session's previous turns falls below 0.3 it drops to 0.3 and the session's segments are flushed (the topic
  changed: they will not be reused). Each later on-topic turn warms it by 0.25, up to 0.8;
- a value scorer (default: learned online) that routes each offered segment: score >= 0.85 kept without TTL,
  0.6-0.85 kept for 30 minutes, < 0.6 not cached. It learns from every outcome: a find is a hit; a segment that
  leaves unused — expired, flushed, or evicted by the store (the store tells the manager) — is a miss.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import NotFound, PagedStore
from kvbridge.transfer.suffix.value_score import OnlineValueScorer, SegmentFeatures, ValueScorer

__all__ = ["SuffixCacheManager", "ManagerConfig", "Offer", "TurnInfo", "Reusable"]


@dataclass(frozen=True)
class ManagerConfig:
    session_ttl_s: float = 300.0  # a session idle this long is flushed
    keep_threshold: float = 0.85  # score >= this: kept without TTL
    cache_threshold: float = 0.6  # score >= this (and < keep): kept for mid_ttl_s; below: not cached
    mid_ttl_s: float = 1800.0
    start_temperature: float = 0.8
    drift_cosine: float = 0.3  # TF-IDF cosine below this: the topic changed
    drift_temperature: float = 0.3
    warm_step: float = 0.25

    def __post_init__(self):
        if not 0 <= self.cache_threshold <= self.keep_threshold <= 1:
            raise ValueError("need 0 <= cache_threshold <= keep_threshold <= 1, got "
                             f"{self.cache_threshold}, {self.keep_threshold}")
        if self.session_ttl_s <= 0 or self.mid_ttl_s <= 0:
            raise ValueError("session_ttl_s and mid_ttl_s must be > 0")


@dataclass(frozen=True)
class TurnInfo:
    cosine: float | None  # TF-IDF cosine with the previous turns (None on the first turn)
    temperature: float
    flushed: int  # segments flushed because the topic changed


@dataclass(frozen=True)
class Offer:
    score: float
    decision: str  # "keep" (no TTL), "ttl" (mid_ttl_s), "skip" (not cached)
    key: str | None  # the store entry when cached


@dataclass
class _Segment:
    key: str
    session: str
    features: SegmentFeatures
    start: int  # position the KV was computed at
    prefix_hash: str  # hash of the tokens before it when it was computed ("" at position 0)
    token_hash: str
    expires_at: float | None
    hits: int = 0


@dataclass
class _Session:
    last_active: float
    temperature: float
    turns: list[str] = field(default_factory=list)
    offered: dict[str, int] = field(default_factory=dict)  # token hash -> times offered
    keys: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Reusable:
    segment: KVSegment  # the KV as cached (at the positions it was computed at)
    prefix_hash: str  # hash of the tokens that preceded it then: equal to today's prefix -> exact reuse
    key: str


def token_hash(token_ids: torch.Tensor) -> str:
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16, person=b"kvbridge-toks").hexdigest()


class SuffixCacheManager:
    def __init__(self, store: PagedStore, tenant: str = "default", config: ManagerConfig = ManagerConfig(),
                 scorer: ValueScorer | None = None):
        """The manager reads time from the store's clock (one clock for session and entry TTLs)."""
        self.store = store
        self.tenant = tenant
        self.config = config
        self.scorer = scorer if scorer is not None else OnlineValueScorer()
        self.clock = store.clock
        self._sessions: dict[str, _Session] = {}
        self._segments: dict[str, _Segment] = {}  # store key -> metadata
        self._by_hash: dict[tuple[str, str], str] = {}  # (session, token hash) -> store key
        self._lock = threading.RLock()
        # keys of entries the store removed by itself (expired, lost): appended under the store's lock, drained
        # under ours (a deque append needs no lock, so the two locks are never held in both orders)
        self._gone: deque[str] = deque()
        prefix = self._namespace("x")[:-1]
        store.add_listener(lambda key, tenant, reason: self._gone.append(key)
                           if reason != "deleted" and tenant.startswith(prefix) else None)

    def _namespace(self, session: str) -> str:
        if not isinstance(session, str) or not session:
            raise ValueError("session must be a non-empty string")
        return f"{self.tenant}\x1fsession\x1f{session}"

    def _session(self, session: str) -> _Session:
        self._expire()
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session(last_active=self.clock(), temperature=self.config.start_temperature)
        s.last_active = self.clock()
        return s

    # ------------------------------------------------------------------------------------------ lifecycle

    def _expire(self) -> None:
        while self._gone:
            key = self._gone.popleft()
            if key in self._segments:
                self._forget(key)
        now = self.clock()
        for name in [n for n, s in self._sessions.items() if now - s.last_active >= self.config.session_ttl_s]:
            self._flush(name)
            del self._sessions[name]
        for key in [k for k, seg in self._segments.items() if seg.expires_at is not None and seg.expires_at <= now]:
            self._drop(key)

    def _forget(self, key: str) -> _Segment:
        """Drop a segment's metadata; one that was never hit is a miss for the scorer."""
        seg = self._segments.pop(key)
        self._by_hash.pop((seg.session, seg.token_hash), None)
        if seg.hits == 0:
            self.scorer.observe(seg.features, hit=False)  # it left the cache unused
        session = self._sessions.get(seg.session)
        if session is not None:
            session.keys.discard(key)
        return seg

    def _drop(self, key: str) -> None:
        seg = self._forget(key)
        self.store.delete(key, self._namespace(seg.session))

    def _flush(self, session: str) -> int:
        s = self._sessions.get(session)
        keys = list(s.keys) if s else []
        for key in keys:
            if key in self._segments:
                self._drop(key)
        return len(keys)

    def flush(self, session: str) -> int:
        """Drop every segment of a session; returns how many."""
        with self._lock:
            return self._flush(session)

    def begin_turn(self, session: str, text: str) -> TurnInfo:
        """Record a new turn of the session: update its temperature, flushing its segments on a change of topic."""
        with self._lock:
            s = self._session(session)
            cosine = None
            flushed = 0
            if s.turns and text.strip():
                cosine = _tfidf_cosine(" ".join(s.turns), text)
                if cosine < self.config.drift_cosine:
                    s.temperature = self.config.drift_temperature
                    flushed = self._flush(session)
                    s.turns.clear()
                else:
                    s.temperature = min(self.config.start_temperature, s.temperature + self.config.warm_step)
            if text.strip():
                s.turns.append(text)
            return TurnInfo(cosine=cosine, temperature=s.temperature, flushed=flushed)

    # ------------------------------------------------------------------------------------------ segments

    def offer(self, session: str, segment: KVSegment, prefix_ids: torch.Tensor, role: str = "other") -> Offer:
        """Score a segment the session just computed (its KV at its positions, after prefix_ids) and cache it or
        not, as the score says."""
        with self._lock:
            s = self._session(session)
            h = token_hash(segment.token_ids)
            repeats = s.offered.get(h, 0)
            s.offered[h] = repeats + 1
            features = SegmentFeatures(num_tokens=segment.num_tokens, role=role,
                                       position=int(segment.positions[0]), repeats=repeats,
                                       temperature=s.temperature)
            score = float(self.scorer.score(features))
            if score < self.config.cache_threshold:
                return Offer(score=score, decision="skip", key=None)
            keep = score >= self.config.keep_threshold
            ttl = None if keep else self.config.mid_ttl_s
            info = self.store.put(segment, self._namespace(session), kind="segment", ttl_s=ttl)
            if info.key not in self._segments:
                self._segments[info.key] = _Segment(
                    key=info.key, session=session, features=features, start=int(segment.positions[0]),
                    prefix_hash=token_hash(prefix_ids) if len(prefix_ids) else "", token_hash=h,
                    expires_at=self.clock() + ttl if ttl is not None else None)
                self._by_hash[(session, h)] = info.key
            else:
                seg = self._segments[info.key]
                seg.expires_at = self.clock() + ttl if ttl is not None else None
            s.keys.add(info.key)
            return Offer(score=score, decision="keep" if keep else "ttl", key=info.key)

    def find(self, session: str, token_ids: torch.Tensor) -> Reusable | None:
        """The session's cached segment of exactly these tokens, or None. A find is a hit for the scorer."""
        with self._lock:
            self._session(session)
            key = self._by_hash.get((session, token_hash(token_ids)))
            meta = self._segments.get(key) if key is not None else None
            if meta is None:
                return None
            try:
                cached = self.store.get(key, self._namespace(session))
            except NotFound:  # evicted from every tier
                self._drop(key)
                return None
            meta.hits += 1
            self.scorer.observe(meta.features, hit=True)
            return Reusable(segment=cached, prefix_hash=meta.prefix_hash, key=key)

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {"sessions": len(self._sessions), "segments": len(self._segments),
                    "hits": sum(s.hits for s in self._segments.values())}


def _tfidf_cosine(previous: str, new: str) -> float:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    try:
        matrix = TfidfVectorizer().fit_transform([previous, new])
    except ValueError:  # no word tokens at all (punctuation only): nothing in common
        return 0.0
    return float(cosine_similarity(matrix[0], matrix[1])[0, 0])
