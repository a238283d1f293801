"""SuffixCacheManager: a target model's own KV segments, reused across the requests and turns of a session.

Segments live in the PagedStore as "segment" entries in a per-session namespace (tenant and session are both in
the store's tenant field), so the key of a segment is its content hash combined with the session, the model and
the dtype (the store's namespace holds both), and one session never sees another's segments, nor one model (or
dtype: a float32 and a bfloat16 load share an identity) another's. Around the store the manager keeps, per session:
- a TTL (default 5 minutes of inactivity; the clock is injectable): an expired session's segments are flushed;
- a semantic temperature: 0.8 to start; when the TF-IDF cosine (scikit-learn) between a new turn and the
  session's last HISTORY_TURNS turns falls below 0.3 it drops to 0.3 and the session's segments are flushed (the
  topic changed: they will not be reused). Each later on-topic turn warms it by 0.25, up to 0.8;
- a value scorer (default: learned online) that routes each offered segment: score >= 0.85 kept without TTL,
  0.6-0.85 kept for 30 minutes, < 0.6 not cached. It learns from every outcome: a find is a hit; a segment that
  leaves unused — expired, flushed, or evicted by the store (the store tells the manager) — is a miss. A segment the
  store cannot hold (CapacityError, a tenant quota) is not cached and the request goes on: caching is optional.

Each segment records what it was computed after (`prefix_key`): the tokens before it and how their KV was made, so
a caller reuses it as it is only after identical KV. The manager listens to its store: `close()` (or a `with`
block) stops that and drops its segments; a manager that is never closed stays a listener of the store.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NO_TTL, CapacityError, NotFound, PagedStore, QuotaExceeded
from kvbridge.transfer.suffix.value_score import OnlineValueScorer, SegmentFeatures, ValueScorer

__all__ = ["SuffixCacheManager", "ManagerConfig", "Offer", "TurnInfo", "Reusable", "prefix_key", "token_hash",
           "HISTORY_TURNS", "OFFERED_LIMIT"]
log = logging.getLogger(__name__)

HISTORY_TURNS = 8  # the turns a new one is compared with (TF-IDF): the topic of the last few, at a bounded cost
OFFERED_LIMIT = 1024  # token hashes a session counts offers of (the scorer's `repeats`), least recently offered go


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
    decision: str  # "keep" (no TTL), "ttl" (mid_ttl_s), "skip" (not cached), "full" (the store cannot hold it)
    key: str | None  # the store entry when cached


@dataclass
class _Segment:
    key: str
    session: str
    features: SegmentFeatures
    start: int  # position the KV was computed at
    prefix_hash: str  # prefix_key of what it was computed after ("" at position 0)
    lookup: tuple[str, str, str, str]  # its key in _by_hash: (session, model key, dtype, token hash)
    expires_at: float | None
    hits: int = 0


@dataclass
class _Session:
    last_active: float
    temperature: float
    turns: deque[str] = field(default_factory=lambda: deque(maxlen=HISTORY_TURNS))  # the last turns
    # token hash -> times offered, least recently offered first (at most OFFERED_LIMIT)
    offered: OrderedDict[str, int] = field(default_factory=OrderedDict)
    keys: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Reusable:
    segment: KVSegment  # the KV as cached (at the positions it was computed at)
    prefix_hash: str  # prefix_key of what preceded it then: equal to today's -> identical KV before it, exact reuse
    key: str


def token_hash(token_ids: torch.Tensor) -> str:
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16, person=b"kvbridge-toks").hexdigest()


def prefix_key(token_ids: torch.Tensor, provenance: str = "") -> str:
    """What a segment was computed after: the tokens before it ([P]) and `provenance`, how their KV was made where
    it is not the model's own computation from those tokens ("": all of it is; the generator's `Provenance` names
    the projected and shifted parts). "" when there are no tokens. Equal keys: identical KV before the segment."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    if ids.numel() == 0:
        return ""
    h = hashlib.blake2b(ids.numpy().tobytes(), digest_size=16, person=b"kvbridge-prfx")
    h.update(provenance.encode())
    return h.hexdigest()


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
        self._by_hash: dict[tuple[str, str, str, str], str] = {}  # (session, model key, dtype, token hash) -> key
        self._lock = threading.RLock()
        self._not_stored = 0  # offers the store could not hold (CapacityError, quota)
        self._closed = False
        # keys of entries the store removed by itself (expired, lost): appended under the store's lock, drained
        # under ours (a deque append needs no lock, so the two locks are never held in both orders). The listener
        # holds the deque, not the manager: close() removes it
        gone: deque[str] = deque()
        self._gone = gone
        prefix = self._namespace("x")[:-1]
        self._listener = (lambda key, tenant, reason: gone.append(key)
                          if reason != "deleted" and tenant.startswith(prefix) else None)
        store.add_listener(self._listener)

    def close(self) -> None:
        """Drop every segment of every session from the store and stop listening to it (the store keeps its listeners
        otherwise). Later calls of the manager raise ValueError; closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            for name in list(self._sessions):
                self._flush(name)
            self._sessions.clear()
            self._closed = True
        self.store.remove_listener(self._listener)

    def __enter__(self) -> SuffixCacheManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _namespace(self, session: str) -> str:
        if not isinstance(session, str) or not session:
            raise ValueError("session must be a non-empty string")
        return f"{self.tenant}\x1fsession\x1f{session}"

    def _session(self, session: str) -> _Session:
        if self._closed:
            raise ValueError("the suffix cache manager is closed")
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
        if self._by_hash.get(seg.lookup) == key:
            del self._by_hash[seg.lookup]
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

    def offer(self, session: str, segment: KVSegment, prefix_ids: torch.Tensor, role: str = "other",
              provenance: str = "") -> Offer:
        """Score a segment the session just computed (its KV at its positions, after prefix_ids, whose KV was made as
        `provenance` says: see prefix_key) and cache it or not, as the score says. A segment the store cannot hold
        is not cached ("full")."""
        with self._lock:
            s = self._session(session)
            h = token_hash(segment.token_ids)
            repeats = s.offered.pop(h, 0)
            s.offered[h] = repeats + 1  # the most recent last
            while len(s.offered) > OFFERED_LIMIT:
                s.offered.popitem(last=False)
            features = SegmentFeatures(num_tokens=segment.num_tokens, role=role,
                                       position=int(segment.positions[0]), repeats=repeats,
                                       temperature=s.temperature)
            score = float(self.scorer.score(features))
            if score < self.config.cache_threshold:
                return Offer(score=score, decision="skip", key=None)
            keep = score >= self.config.keep_threshold
            ttl = None if keep else self.config.mid_ttl_s
            try:  # a kept segment never expires, whatever TTL the store gives entries by default
                info = self.store.put(segment, self._namespace(session), kind="segment",
                                      ttl_s=NO_TTL if keep else ttl)
            except (CapacityError, QuotaExceeded) as exc:  # caching is optional: the request goes on without it
                self._not_stored += 1
                log.info("a segment of %d tokens of session %r is not cached: %s", segment.num_tokens, session, exc)
                return Offer(score=score, decision="full", key=None)
            if info.key not in self._segments:
                lookup = (session, segment.model.key, str(segment.dtype), h)
                self._segments[info.key] = _Segment(
                    key=info.key, session=session, features=features, start=int(segment.positions[0]),
                    prefix_hash=prefix_key(prefix_ids, provenance), lookup=lookup,
                    expires_at=self.clock() + ttl if ttl is not None else None)
                self._by_hash[lookup] = info.key
            else:
                seg = self._segments[info.key]
                seg.expires_at = self.clock() + ttl if ttl is not None else None
            s.keys.add(info.key)
            return Offer(score=score, decision="keep" if keep else "ttl", key=info.key)

    def find(self, session: str, token_ids: torch.Tensor, model: ModelIdentity, dtype: torch.dtype
             ) -> Reusable | None:
        """The session's cached segment of exactly these tokens, of this model in this dtype, or None. A find is a
        hit for the scorer."""
        with self._lock:
            self._session(session)
            key = self._by_hash.get((session, model.key, str(dtype), token_hash(token_ids)))
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
                    "hits": sum(s.hits for s in self._segments.values()), "not_stored": self._not_stored}


def _tfidf_cosine(previous: str, new: str) -> float:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    try:
        matrix = TfidfVectorizer().fit_transform([previous, new])
    except ValueError:  # no word tokens at all (punctuation only): nothing in common
        return 0.0
    return float(cosine_similarity(matrix[0], matrix[1])[0, 0])
