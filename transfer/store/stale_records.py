"""Which entry records read from Redis a replica must not adopt (entries shared through Redis); a part of PagedStore's
state, covered by its lock (no locking here).

Records are read without the store's lock, and adopted under it later. Two kinds come back stale:
- a record of a key this replica deleted (its "forget" queued) after the read began: it may be the deleted entry's,
  even once the forget was sent. Each read takes the count of removals so far as it
  begins (`begin_read`, under the lock, with the check that no forget of the key is pending); a removal stamps its
  key with the next count; a record whose key was stamped after its read began is refused. Stamps are kept only while
  a read older than them is under way (`end_read` drops the rest): none at all while no read is.
- a record whose entry expired here (by its id: each record written gets one). The record leaves Redis at that
  deadline (its TTL there is set from ours as it is sent), but a clock other than Redis's may pass it first; it is
  refused for EXPIRED_GRACE_S after. Another record of the key (stored again, by any replica) is a new id. The ids an
  expired entry marks are every one Redis may still hold (Entry.record_ids: a refresh whose record write failed
  leaves the one before, with its older deadline).
"""

from __future__ import annotations

from collections import Counter

EXPIRED_GRACE_S = 60.0  # an expired entry's record is refused this long after: Redis drops it at the deadline (up to
# a round trip), so this only covers clocks that run apart from Redis's (a test's fake clock, a paused process)


class StaleRecords:
    """Keys removed while reads were under way, and records whose entries expired here (see the module docstring)."""

    def __init__(self):
        self._removals = 0  # removals of shared entries so far: a read's stamp is this count as it begins
        self._removed: dict[str, int] = {}  # key -> stamp of its last removal (stamp order), while a read older is out
        self._reads: Counter[int] = Counter()  # stamp -> reads under way that began at it
        self._expired: dict[str, float] = {}  # record id -> until when it is refused (in time order)

    def begin_read(self) -> int:
        """A read of entry records is about to be made (no forget of its keys pending); its stamp, for `stale` and
        `end_read`."""
        self._reads[self._removals] += 1
        return self._removals

    def end_read(self, read: int) -> None:
        """The read's records were adopted or dropped: stamps no read under way is older than go."""
        self._reads[read] -= 1
        if not self._reads[read]:
            del self._reads[read]
        oldest = min(self._reads, default=self._removals)
        while self._removed:
            key, stamp = next(iter(self._removed.items()))
            if stamp > oldest:
                break
            del self._removed[key]

    def removed(self, key: str) -> None:
        """A shared entry of this key was deleted here and its record's forget queued."""
        self._removals += 1
        if self._reads:  # else no read can have begun before it
            self._removed.pop(key, None)
            self._removed[key] = self._removals

    def expired(self, record_id: str, now: float) -> None:
        """The entry adopted from (or shared as) this record expired here."""
        self._drop_expired(now)
        self._expired.pop(record_id, None)
        self._expired[record_id] = now + EXPIRED_GRACE_S

    def stale(self, key: str, record_id: str | None, read: int, now: float) -> bool:
        """Whether a record of `key` with this id, read under stamp `read`, must not be adopted."""
        self._drop_expired(now)
        return self._removed.get(key, -1) > read or (record_id is not None and record_id in self._expired)

    def _drop_expired(self, now: float) -> None:
        while self._expired:
            record_id, until = next(iter(self._expired.items()))
            if until > now:
                break
            del self._expired[record_id]
