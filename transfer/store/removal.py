"""How entries leave PagedStore (deleted, expired, lost) and the listeners told of each; a mixin of PagedStore.

`delete` takes an entry and, transitively, what derives from it; `_expire` (which the public methods that read or
change entries run first) the entries past their TTL; `_lose` the entries using a block that left the last tier. Each
goes through `_remove_entry`, which drops the blocks no other entry uses from the local tiers (never from Redis, which
other replicas' entries may read them from) and tells the listeners (`add_listener`) why.
It uses the store's lock, registry, pools, residency, config and stats.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.transfer.store.kv_blocks import BlockHash
from kvbridge.transfer.store.registry import Entry
from kvbridge.transfer.store.sharing import _ENTRY_KEY, _sends_redis_writes


class EntryRemoval:
    """PagedStore's removal of entries (see the module docstring)."""

    def add_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """Call listener(key, tenant, reason) whenever an entry leaves the store; reason is "deleted", "expired" or
        "lost" (a block left the last tier). It runs under the store's lock: it must be quick and must not call
        the store (queue the event and act on it later)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """Stop calling a listener `add_listener` gave (nothing if it is not one)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    @_sends_redis_writes
    def delete(self, key: str, tenant: str, if_generation: int | None = None, if_owner: object | None = None) -> int:
        """Remove an entry, the entries derived from it (transitively, also when the entry itself is gone), and
        every block only they used from the local tiers (in Redis, blocks expire by their TTL; entries shared through
        Redis: their records go: see _remove_entry). Returns how many entries went: 0 if there was nothing.
        if_generation: remove it only if it is still at that generation and nothing derives from it (undoing
        one's own put without taking an entry someone else stored or used since); if_owner: and only if no call
        but that one (registry.CALL) has read it since it was created (server/undo.py)."""
        if if_generation is None and isinstance(key, str) and _ENTRY_KEY.fullmatch(key):
            self._adopt_family(key, tenant)
        with self._lock:
            entry = self.registry.get(key) if isinstance(key, str) else None
            if entry is not None and entry.namespace.tenant != tenant:
                entry = None
            if if_generation is not None:
                if entry is None or entry.generation != if_generation or self.registry.derived_from(key, tenant) \
                        or (if_owner is not None and entry.owner is not if_owner):
                    return 0
            doomed = [entry] if entry is not None else self.registry.derived_from(key, tenant)
            removed = 0
            while doomed:
                entry = doomed.pop()
                if self.registry.get(entry.key) is not entry:
                    continue
                doomed += self.registry.derived_from(entry.key, tenant)
                self._remove_entry(entry, "deleted")
                removed += 1
            return removed

    def _remove_entry(self, entry: Entry, reason: str) -> None:
        """Forget an entry; blocks no other entry uses are dropped from the local tiers, never from Redis: blocks
        there are content-addressed, so any replica's entry of the same tokens may live on them (demoted there, or
        named by a shared record; another replica's, or this server's own before a restart), and no replica can see
        which; they expire after redis_ttl_s (each write or demotion of them restarts that).
        Entries shared through Redis: a deleted entry's record goes too, for every replica (no record read before is
        adopted after: stale_records; a forget Redis refuses goes again, the key never adopted back meanwhile). An
        expired entry's record leaves Redis at the same deadline, and is not adopted back here meanwhile. A lost
        entry's record is not forgotten here: the record key is every replica's that stores these tokens, and a
        delete of it could take the record a writer publishes again meanwhile (a refresh, a put of the same tokens).
        Only a read that Redis answered without the entry's blocks deletes a record, and that
        very one (compared by its tag: sharing._record_lost, before this); a read that failed deletes nothing."""
        pool = self.pools.get(entry.layout.key)
        if entry.pinned and pool is not None:
            pool.unref([pool.lookup(h) for h in entry.hashes])
        self.residency.drop(pool, self.registry.discard(entry))
        if self.config.share_entries and self.redis is not None and reason == "deleted":
            self.residency.outbox.append(("forget", [entry.key]))
            self._forgetting[entry.key] += 1
            self._stale.removed(entry.key)
        if reason == "expired":
            for record_id in entry.record_ids:
                self._stale.expired(record_id, self.clock())
        for listener in self._listeners:
            listener(entry.key, entry.namespace.tenant, reason)

    def _lose(self, hashes: list[BlockHash]) -> None:
        """Blocks that left the last tier: the entries using them cannot be served any more."""
        for h in hashes:
            for key in list(self.registry.users.get(h, ())):
                entry = self.registry.get(key)
                if entry is not None:
                    self._stats.lost_entries += 1
                    self._remove_entry(entry, "lost")

    def _expire(self) -> None:
        for entry in self.registry.due(self.clock()):
            if self.registry.get(entry.key) is entry:  # not lost meanwhile
                self._stats.expired_entries += 1
                self._remove_entry(entry, "expired")
