"""The Redis tier's entry records (entries shared through Redis: sharing): each entry's record under
`kvbridge:2:entry:<key>` and the set of the entries derived from it (redis_commands names the keys), tagged and checked
as redis_auth says. A mixin of RedisTier: it uses the tier's commands, auth and TTL, and its bookkeeping of failures
(`failed`: Redis out of reach, the tier down; `refused`: that call only).

A record never outlives the blocks it names, nor is written before them: `put_entries` first restarts the TTL of every
block the records name (the tier's), then writes only the records whose blocks all answered; a record lives at most
the tier's TTL less RECORD_MARGIN_MS (which covers the round trip between the two, and on a cluster the confirmation
that extends the record again a round trip later, and blocks kept by other nodes' clocks). So a record whose blocks a
reader finds gone lost them after it was written (Redis evicted or expired them, a replica deleted one as corrupt),
never while its writer was publishing it, and `delete_record_if` takes exactly that record, by its tag: any record of
the key written since (a writer publishing it again) has another tag, and stays. Nor does it take that very record once
its blocks are all there again (a writer sent the evicted one again, as a block of a longer entry or a demotion, the
record unchanged): the reader's finding is re-checked as the record goes. On one server the check and the DEL are one
Lua script; on a cluster the blocks live on other shards than the record, so their EXISTS precede the compare-and-delete
(a block sent again between the two still loses the record, until its writer's next refresh: sharing only, never KV).
"""

from __future__ import annotations

from kvbridge.transfer.store.kv_blocks import BlockHash
from kvbridge.transfer.store.redis_auth import TAG_CHARS, ForgedValue

RECORD_MARGIN_MS = 1000  # a record lives at most the tier's TTL less this: never past the blocks it names
# DEL the record at KEYS[1] only if its tag (the value's first TAG_CHARS bytes) is ARGV[1] and, when more keys follow
# (the blocks it names), one of them is not there: one command, atomic (one server; a cluster passes the record only)
_DELETE_IF_TAGGED = (f"if redis.call('GETRANGE', KEYS[1], 0, {TAG_CHARS - 1}) ~= ARGV[1] then return 0 end "
                     "if #KEYS > 1 then local gone = false "
                     "for i = 2, #KEYS do if redis.call('EXISTS', KEYS[i]) == 0 then gone = true break end end "
                     "if not gone then return 0 end end "
                     "return redis.call('DEL', KEYS[1])")


class RedisRecords:
    """RedisTier's entry records and derived sets (see the module docstring)."""

    def put_entries(self, items: list[tuple[str, bytes, str | None, float | None, list[BlockHash]]]
                    ) -> dict[str, list[BlockHash]] | None:
        """For each (entry key, record, source entry key or None, seconds the record may live: None for as long as
        the tier keeps values, the hashes of the blocks it names): a PEXPIRE of each of its blocks to the tier's TTL;
        then, if Redis had them all, a SET of the record (living at least a millisecond, at most the tier's TTL less
        RECORD_MARGIN_MS) and the key added to its source's derived set (the tier's TTL). Two round trips in all.
        Returns, for each record not written because Redis no longer had some of its blocks, those hashes (send them,
        then the record again); None when nothing was written (the tier down, or a write refused: Redis holds
        whatever record of each key it held before). On a cluster, replicas that do not confirm the records in time
        are counted (`unreplicated`), and the records stand."""
        if not items or not self._usable():
            return None if items else {}
        tier_ms = self.ttl_s * 1000
        longest_ms = max(1, tier_ms - RECORD_MARGIN_MS)
        try:
            pipe = self.commands.client.pipeline(transaction=False)
            for *_, hashes in items:
                for block_hash in hashes:
                    pipe.pexpire(self._key(block_hash), tier_ms)
            there = iter(pipe.execute())
            missing: dict[str, list[BlockHash]] = {}
            for key, *_, hashes in items:
                gone = [h for h, found in zip(hashes, [next(there) for _ in hashes]) if not found]
                if gone:
                    missing[key] = gone
            pipe = self.commands.client.pipeline(transaction=False)
            written = []
            for key, record, source_key, ttl_s, _ in items:
                if key in missing:
                    continue
                redis_key = self.commands.entry_key(key)
                ms = longest_ms if ttl_s is None or ttl_s * 1000 >= longest_ms else max(1, int(ttl_s * 1000))
                pipe.set(redis_key, self.auth.seal_record(redis_key, record), px=ms)
                written.append((redis_key, ms))
                if source_key is not None:
                    set_key = self.commands.derived_key(source_key)
                    pipe.sadd(set_key, self.auth.seal_member(set_key, key))
                    pipe.expire(set_key, self.ttl_s)
                    written.append((set_key, tier_ms))
            if written:
                pipe.execute()
                self._short(self.commands.confirm(written))
        except self._troubles as exc:
            self.trouble(exc)
            return None
        self._ok()
        return missing

    def record_tag(self, key: str, record: bytes) -> bytes:
        """The tag the record of entry `key` is stored with (what delete_record_if compares)."""
        return self.auth.record_tag(self.commands.entry_key(key), record)

    def get_entries(self, keys: list[str]) -> dict[str, tuple[bytes, float | None, bytes]]:
        """The records found whose tags check out, each with the seconds Redis keeps it still (None: no TTL) and its
        tag; a miss when the tier is down. The others are counted."""
        if not keys or not self._usable():
            return {}
        redis_keys = [self.commands.entry_key(k) for k in keys]
        try:
            pipe = self.commands.client.pipeline(transaction=False)
            for redis_key in redis_keys:
                pipe.get(redis_key)
                pipe.pttl(redis_key)
            replies = pipe.execute()
        except self._troubles as exc:
            self.trouble(exc)
            return {}
        self._ok()
        found, rejected = {}, []
        for key, redis_key, blob, left_ms in zip(keys, redis_keys, replies[0::2], replies[1::2]):
            if blob is not None and left_ms != -2:  # (-2: it expired between the two)
                try:
                    found[key] = (self.auth.open_record(redis_key, blob), None if left_ms < 0 else left_ms / 1000,
                                  blob[:TAG_CHARS])
                except ForgedValue as exc:
                    rejected.append((redis_key, str(exc)))
        if rejected:
            self._rejected("record", rejected)
        return found

    def derived_entries(self, keys: list[str]) -> list[str]:
        """The keys of the entries recorded as derived from these, whose tags check out (none when the tier is down)."""
        if not keys or not self._usable():
            return []
        set_keys = [self.commands.derived_key(k) for k in keys]
        try:
            pipe = self.commands.client.pipeline(transaction=False)
            for set_key in set_keys:
                pipe.smembers(set_key)
            sets = pipe.execute()
        except self._troubles as exc:
            self.trouble(exc)
            return []
        self._ok()
        found, rejected = set(), []
        for set_key, members in zip(set_keys, sets):
            for member in members:
                try:
                    found.add(self.auth.open_member(set_key, member))
                except (ForgedValue, UnicodeDecodeError) as exc:
                    rejected.append((set_key, str(exc)))
        if rejected:
            self._rejected("derived", rejected)
        return sorted(found)

    def delete_entries(self, keys: list[str]) -> bool:
        """DEL the records of these entries, and their derived sets. Whether Redis answered (False: the tier down, or
        the DEL refused: READONLY, NOPERM; Redis then holds them still)."""
        if not keys:
            return True
        if not self._usable():
            return False
        try:
            self.commands.client.delete(*[name for k in keys for name in (self.commands.entry_key(k),
                                                                          self.commands.derived_key(k))])
        except self._troubles as exc:
            self.trouble(exc)
            return False
        self._ok()
        return True

    def delete_record_if(self, key: str, tag: bytes, hashes: list[BlockHash] | None = None) -> bool:
        """DEL the record of entry `key` if it is still the one of this tag and, given the `hashes` of the blocks it
        names, Redis lacks one of them now (see the module docstring); its derived set stays: the entries derived from
        it may still be served. Whether Redis answered (False: the tier down, or the command refused)."""
        if not self._usable():
            return False
        record = self.commands.entry_key(key)
        blocks = [self._key(h) for h in hashes or ()]
        try:
            if blocks and self.commands.tagged:  # a cluster: the blocks are on other shards
                pipe = self.commands.client.pipeline(transaction=False)
                for block in blocks:
                    pipe.exists(block)
                if all(pipe.execute()):
                    self._ok()
                    return True
                blocks = []
            self.commands.client.eval(_DELETE_IF_TAGGED, 1 + len(blocks), record, *blocks, tag)
        except self._troubles as exc:
            self.trouble(exc)
            return False
        self._ok()
        return True
