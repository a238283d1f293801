"""Entries shared with other replicas through Redis, the part of PagedStore that talks to Redis without its lock:
`_run` runs a public method's locked part and fetches, unlocked, the blocks and records it needs from Redis;
`_flush` sends the queued Redis writes in order; `_entry_for`, `_adopt` and `_adopt_family` register entries another
replica stored, from their records (checked: the key is recomputed from the contents; never a record stale here:
stale_records); `_share` queues a new entry's record and blocks. A record's TTL in Redis is its entry's when the entry
expires (set from the entry's deadline as it is sent), and a replica that adopts it expires it then.

A record is written only once Redis holds every block it names, and never outlives them (redis_records): the TTL of
each restarts first (those it reuses from older entries too); when Redis no longer has some, they go again from this
replica's tiers, then the record (`_records_sent`). A record write that fails leaves Redis the record of the key it
held before, with its deadline: the entry owes Redis its record, made again from the entry as it is then and sent once
the tier's retry interval has passed (`_resend_owed`); the failed one is never sent again (its deadline may be stale
by then). Meanwhile that record says what the entry no longer says (an older deadline, text, annotations): it is
withdrawn (deleted if it is still the one this replica last wrote or read, by its tag), which Redis allows where it
refuses the SET for memory (a DEL takes none); where it refuses every write (READONLY) the withdrawal goes again with
the owed record, and other replicas may adopt the older record until Redis takes writes again. A delete whose forget
Redis refused (or could not be sent) is owed too: its key is never adopted back here, and the forget goes again
(`_resend_owed`; first, before any record of the key this replica writes since).

A replica that finds an entry's blocks gone from Redis (Redis answered: absent, or corrupt and deleted) takes a miss and
deletes that very record (by its tag: `_record_lost`), not any record of the key: one a writer publishes again has
another tag, and its blocks are back before it; nor that record once its blocks are all back (redis_records). A read
that failed deletes nothing (the blocks may be there). A mixin of PagedStore (it uses the store's lock, registry,
residency, budget, config and clock).
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout
from kvbridge.transfer.store.kv_blocks import DIGEST_SIZE, BlockHash, Namespace, content_key
from kvbridge.transfer.store.registry import KINDS, Entry, entry_record, parse_record
from kvbridge.transfer.store.residency import NeedRemote, read_to_cpu

log = logging.getLogger("kvbridge.transfer.store.paged_store")  # the store's one logger

_ENTRY_KEY = re.compile(f"[0-9a-f]{{{2 * DIGEST_SIZE}}}")  # what content_key returns
REPUBLISH_S = 1.0  # an unchanged entry's record is written again at most this often per replica (_republish_due)
_REMOTE_ROUNDS = 8  # Redis reads one call may make (more only while other calls keep demoting its blocks)


@dataclass(slots=True)
class RecordWrite:
    """An entry's record queued for Redis (`_share`), with what its send and the bookkeeping after it need."""

    key: str  # the entry's key
    record: bytes  # registry.entry_record
    record_id: str  # the id in it
    source_key: str | None  # the entry it derives from: the key joins that one's derived set
    expires_at: float | None  # the entry's deadline as queued (the store's clock): the record's TTL is set from it
    hashes: list[BlockHash]  # the blocks it names: their TTL restarts with it
    layout_key: str  # their pool's
    serial: int  # the entry's: the outcome is booked to that very entry only
    tag: bytes  # its tag in Redis (redis_records.record_tag)
    again: bool = False  # queued again after the blocks Redis lacked were sent: not a third time (then owed)


def _sends_redis_writes(method):
    """The public method, then the Redis writes it queued (sent without the store's lock)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self._flush()
    return run


class RedisSharing:
    """PagedStore's Redis round trips and shared entries (see the module docstring)."""

    def _run(self, locked: Callable[[dict], object]):
        """locked(prefetched) under the store's lock. When it needs blocks only Redis has (NeedRemote), they are
        fetched without the lock and it runs again with them; Redis writes it queued are sent after, also without
        the lock."""
        # also ("entry", key) -> the record found, ("read", key) -> its read's stamp, ("unread", hash) -> True: a
        # block the read of which Redis did not answer
        prefetched: dict = {}
        try:
            for _ in range(_REMOTE_ROUNDS):
                try:
                    with self._lock:
                        return locked(prefetched)
                except NeedRemote as need:  # no lock held here
                    if need.hashes:
                        got = self.redis.get_many(need.hashes, need.layout)  # each block must fit it
                        unanswered = not getattr(got, "answered", True)
                        for h in need.hashes:
                            prefetched[h] = got.get(h)
                            if unanswered:  # (may be there all the same: _record_lost)
                                prefetched[("unread", h)] = True
                    if need.entries:
                        records = self.redis.get_entries(need.entries)
                        for k in need.entries:
                            prefetched[("entry", k)] = records.get(k)
            raise NotFound(f"blocks kept leaving the device while {_REMOTE_ROUNDS} Redis reads brought them back")
        finally:
            reads = [stamp for slot, stamp in prefetched.items() if isinstance(slot, tuple) and slot[0] == "read"]
            if reads:
                with self._lock:
                    for stamp in reads:
                        self._stale.end_read(stamp)
            self._flush()

    def _flush(self) -> None:
        """Send the queued Redis writes in order, without the store's lock (one sender at a time; a thread that
        finds another sending leaves the queue to it). Blocks whose put fails are lost (their entries go). Nothing
        raises out of here: the writes may be other calls' (the tier turns Redis errors into failed writes; anything
        else is logged and counted as a tier failure, and the writes it took count as failed too)."""
        residency = self.residency
        if residency.redis is None or self._lock._is_owned():
            return
        if self._owed or self._unforgotten:
            with self._lock:
                self._resend_owed()
        while residency.outbox:
            if not self._sending.acquire(blocking=False):
                return
            try:
                while True:
                    with self._lock:
                        if not residency.outbox:
                            break
                        op, items = residency.outbox.popleft()
                    try:
                        outcome = self._send(op, items)
                    except Exception as exc:  # not a Redis error (the tier handles those): still no caller's
                        log.exception("redis tier: sending %d queued %r write(s) failed", len(items), op)
                        residency.redis.failed(exc)
                        outcome = items if op in ("put", "keep") else None
                    with self._lock:
                        self._sent(op, items, outcome)
            finally:
                self._sending.release()

    def _send(self, op: str, items: list):
        """One queued write, sent (no lock held). Puts and keeps: the (hash, layout key, block) items Redis does not
        hold after it; entries: RedisTier.put_entries's answer (None: not written)."""
        redis = self.residency.redis
        if op == "entries":  # each record lives in Redis until its entry's deadline, if it has one
            now = self.clock()
            return redis.put_entries([(w.key, w.record, w.source_key,
                                       None if w.expires_at is None else w.expires_at - now, w.hashes) for w in items])
        if op == "forget":
            return redis.delete_entries(items)
        if op == "withdraw":
            for key, tag in items:
                redis.delete_record_if(key, tag)
        elif op == "lost":
            for key, tag, hashes in items:
                redis.delete_record_if(key, tag, hashes)
        elif op == "keep":  # Redis had them: restart their TTL, send only those it no longer has
            found = redis.refresh_many([h for h, _, _ in items])
            failed = items if found is None else [item for item, there in zip(items, found) if not there]
            return [] if found is not None and redis.put_many(failed) else failed
        else:
            return [] if redis.put_many(items) else items
        return None

    def _sent(self, op: str, items: list, outcome) -> None:
        """The bookkeeping after a queued write went (sent or failed; under the store's lock); outcome: _send's."""
        residency = self.residency
        if op == "forget":
            if outcome:
                self._forgetting -= Counter(items)
            else:  # Redis holds the deleted entries' records still: never adopted here, the forget owed
                now = self.clock()
                for key in items:
                    if key in self._unforgotten:  # owed already: one forget (and one count) covers both
                        self._forgetting -= Counter([key])
                    self._unforgotten[key] = now
        if op == "entries":
            self._records_sent(items, outcome)
        if op not in ("put", "keep"):
            return
        failed = outcome
        for h, _, block in items:
            waiting = residency.pending.get(h)
            if waiting is not None and waiting[1] is block:
                del residency.pending[h]
        gone = {h for h, _, _ in failed}
        # (a block deleted meanwhile is no entry's now: not kept; its delete follows in the outbox)
        residency.in_redis.update(h for h, _, _ in items if h not in gone and h in self.registry.users)
        residency.in_redis.difference_update(gone)
        # blocks not back on a local tier (nor demoted again) are gone
        self._lose([h for h, key, _ in failed if h not in residency.pending
                    and residency.tier_of(self.pools.get(key), h) is None])

    def _records_sent(self, items: list[RecordWrite], missing: dict[str, list[BlockHash]] | None) -> None:
        """After records were sent (under the store's lock). Not written (missing None): Redis holds the record of
        the key it held before, so the entry owes it its record (`_resend_owed`). Written: Redis holds none older of
        it; an entry that left meanwhile (expired) is not adopted back from it here. Not written because Redis no
        longer had some of its blocks (`missing`, by entry key): those go again from the device or the CPU tier (unless
        a put of them is queued already), then the record, made again (once; then it is owed). When a block is on no
        tier here, the record is not written: its entries find the block gone when they read it."""
        now = self.clock()
        for w in items:
            entry = self.registry.get(w.key)
            current = entry is not None and entry.serial == w.serial
            if missing is None or w.key in missing:  # not written
                if current and w.record_id in entry.record_ids:
                    entry.record_ids.remove(w.record_id)
                if current and (missing is None or w.again):
                    self._owed[w.key] = now
                    if entry.record_tag is not None:  # what it says the entry no longer says: withdrawn
                        self.residency.outbox.append(("withdraw", [(w.key, entry.record_tag)]))
                elif current:
                    self._send_again(entry, missing[w.key])
                continue
            if self._unforgotten.pop(w.key, None) is not None:  # this record took the place of the deleted one's
                self._forgetting -= Counter([w.key])
            if current and w.record_id in entry.record_ids:
                del entry.record_ids[:entry.record_ids.index(w.record_id)]
                entry.record_tag = w.tag
            elif not current and w.expires_at is not None:
                self._stale.expired(w.record_id, now)

    def _send_again(self, entry: Entry, hashes: list[BlockHash]) -> None:
        """Queue the blocks of `entry` Redis no longer has (from the local tiers, unless already queued), then its
        record again; nothing when a block is on no tier here."""
        pool, cpu, pending = self.pools[entry.layout.key], self.cpu, self.residency.pending
        on_device, copies = [], []
        for h in hashes:
            block = pool.lookup(h)
            if block is not None:
                on_device.append((h, block.block_id))
            elif cpu is not None and (held := cpu.copy_of(h)) is not None:
                copies.append((h, *held))
            elif h not in pending:
                return
        data = read_to_cpu(pool, [i for _, i in on_device], [True] * len(on_device)) if on_device else []
        copies += [(h, pool.layout.key, block) for (h, _), block in zip(on_device, data)]
        if copies:
            self.residency.outbox.append(("put", copies))
        self._share(entry, pool, [], again=True)

    def _resend_owed(self) -> None:
        """Queue again, once the tier's retry interval has passed since they failed (under the store's lock), the
        forgets Redis refused (`_sent`), then the records whose writes failed (`_records_sent`), made from their
        entries as they are now."""
        redis = self.residency.redis
        if not redis.usable():
            return
        now = self.clock()
        for key, since in list(self._unforgotten.items()):
            if now >= since + redis.retry_s:
                del self._unforgotten[key]
                self.residency.outbox.append(("forget", [key]))  # (still counted in _forgetting)
        for key, since in list(self._owed.items()):
            if now >= since + redis.retry_s:
                del self._owed[key]
                entry = self.registry.get(key)
                if entry is not None:
                    self._share(entry, self.pools[entry.layout.key], [])

    def _entry_for(self, key: str, tenant: str, prefetched: dict) -> Entry:
        """The tenant's entry of this key: local, else (entries shared through Redis) the record another replica
        left there, adopted; NotFound when there is none. Raises NeedRemote to have the record fetched."""
        entry = self.registry.get(key) if isinstance(key, str) else None
        if entry is None and self.config.share_entries and self.redis is not None and isinstance(key, str) \
                and _ENTRY_KEY.fullmatch(key) and key not in self._forgetting:
            slot = ("entry", key)
            if slot not in prefetched:
                if ("read", key) not in prefetched:  # (begun with the check above: no forget of it pending)
                    prefetched[("read", key)] = self._stale.begin_read()
                raise NeedRemote([], None, entries=[key])
            if prefetched[slot] is not None:
                entry = self._adopt(prefetched[slot], tenant, prefetched[("read", key)])
        if entry is None or entry.namespace.tenant != tenant:
            raise NotFound(f"no entry {key[:80]!r}" if isinstance(key, str) else "no entry: the key is not a string")
        return entry

    def _adopt_family(self, key: str, tenant: str) -> None:
        """Entries shared through Redis: adopt the records of `key` and of the entries derived from it
        (transitively) that this replica does not hold, so that a Delete finds them and removes them from Redis
        too (another replica, or this server before a restart, may have made them). No lock held on Redis."""
        if not (self.config.share_entries and self.redis is not None):
            return
        todo, seen = [key], set()
        while todo:
            seen.update(todo)
            with self._lock:
                missing = [k for k in todo if self.registry.get(k) is None and k not in self._forgetting]
                read = self._stale.begin_read()
            try:
                records = self.redis.get_entries(missing)
                derived = self.redis.derived_entries(todo)
                with self._lock:
                    for found in records.values():
                        self._adopt(found, tenant, read)
            finally:
                with self._lock:
                    self._stale.end_read(read)
            todo = [d for d in derived if d not in seen and _ENTRY_KEY.fullmatch(d)]

    def _adopt(self, found: tuple[bytes, float | None], tenant: str, read: int) -> Entry | None:
        """Register an entry another replica stored, from its record as get_entries found it (the record, the seconds
        Redis keeps it still) in the read of stamp `read`; its blocks come from Redis when read. It expires with its
        record when the record says it expires (else after default_ttl_s). None when the record is another tenant's,
        does not check out (its key is recomputed from its contents), or is stale here (a forget of its key pending,
        or: stale_records)."""
        blob, left_s, tag = found
        try:
            record = parse_record(blob)
            if record["tenant"] != tenant:
                return None
            record_id = record.get("id")
            if record_id is not None and not isinstance(record_id, str):
                raise ValueError("its id is not a string")
            model = ModelIdentity(record["model_name"], record["config_hash"])
            ns = Namespace(tenant=tenant, model=model.key, dtype=record["dtype"], adapter=record["adapter"])
            kind = record["kind"]
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r}")
            tokens = torch.tensor(record["token_ids"], dtype=torch.int64)
            t = tokens.numel()
            positions = torch.arange(t) if record["positions"] is None else torch.tensor(record["positions"],
                                                                                          dtype=torch.int64)
            layout = PoolLayout(model=model.key, dtype=ns.dtype, num_layers=int(record["num_layers"]),
                                num_kv_heads=int(record["num_kv_heads"]), head_dim=int(record["head_dim"]),
                                block_size=int(record["block_size"]))
            if layout.block_size != self.config.block_size or positions.shape != (t,) or t == 0:
                raise ValueError("block size or positions do not fit")
            key = content_key(ns.digest(), kind, tokens)
            if key != record["key"]:
                raise ValueError("its key is not the key of its contents")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("redis: ignoring an entry record that does not check out (%s)", exc)
            return None
        existing = self.registry.get(key)
        if existing is not None:
            return existing
        now = self.clock()
        if key in self._forgetting or self._stale.stale(key, record_id, read, now):
            return None
        try:
            self.budget.pool_for(layout, create=True)
        except CapacityError as exc:  # this replica holds as many layouts as it may: the entry is not served here
            log.warning("redis: not adopting entry %s... (%s)", key[:16], exc)
            return None
        hashes = self._chain(ns, kind, key, tokens)
        self.registry.claim(key, hashes)
        if record.get("expires") is True and left_s is not None:  # the writer's deadline, on Redis's clock
            expires_at, record_ids = now + left_s, [record_id] if record_id is not None else []
        else:  # a record without a deadline: another record of the key, adopted after it expires here, is no stale one
            ttl = self.config.default_ttl_s
            expires_at, record_ids = (now + ttl if ttl is not None else None), []
        entry = Entry(key=key, namespace=ns, kind=kind, layout=layout, model=model, token_ids=tokens,
                      positions=positions, rotated=bool(record["rotated"]), hashes=hashes,
                      expires_at=expires_at, pinned=False, last_access=now,
                      text=record.get("text"), source_key=record.get("source_key"),
                      annotations=dict(record.get("annotations") or {}), generation=1,  # stored elsewhere
                      record_ids=record_ids, record_tag=tag)
        self.registry.add(entry)
        return entry

    def _republish_due(self, entry: Entry, now: float) -> bool:
        """A put or refresh of an entry that changes nothing of its record still publishes it again when this replica
        has not for REPUBLISH_S (or never: one adopted from Redis): Redis may have lost it meanwhile (another
        replica's Delete of it, a Redis restart), and the put is the client's word that it is stored, so the other
        replicas must find it. Not more often: a record write restarts the TTL of every block it names (one command
        each), which a hot text's every Ingest made 140 times slower."""
        return bool(self.config.share_entries and self.redis is not None) and (
            entry.published_at is None or now - entry.published_at >= REPUBLISH_S)

    def _share(self, entry: Entry, pool: BlockPool, new: list[tuple[BlockHash, int]], again: bool = False) -> None:
        """Entries shared through Redis: queue the entry's record (a new one, with its deadline: again whenever that
        changes; the TTL of every block it names restarts with it) and its new blocks (written through: replicas
        read them there) for the sender."""
        if not (self.config.share_entries and self.redis is not None):
            return
        if new:
            data = read_to_cpu(pool, [i for _, i in new], [True] * len(new))
            self.residency.outbox.append(("put", [(h, pool.layout.key, block) for (h, _), block in zip(new, data)]))
        entry.published_at = self.clock()
        record_id = secrets.token_hex(8)
        record = entry_record(entry, record_id)
        entry.record_ids.append(record_id)
        self._owed.pop(entry.key, None)  # this one supersedes a record whose write failed
        if self._unforgotten.pop(entry.key, None) is not None:  # a delete Redis refused goes first (still counted)
            self.residency.outbox.append(("forget", [entry.key]))
        self.residency.outbox.append(("entries", [RecordWrite(
            key=entry.key, record=record, record_id=record_id, source_key=entry.source_key,
            expires_at=entry.expires_at, hashes=list(entry.hashes), layout_key=entry.layout.key,
            serial=entry.serial, tag=self.redis.record_tag(entry.key, record), again=again)]))

    def _record_lost(self, entry: Entry, prefetched: dict) -> None:
        """`entry` was just found lost on a read (under the store's lock, before its removal). Entries shared through
        Redis: when Redis answered that its blocks are not there, delete the record of it this replica last wrote or
        read, if Redis still holds that very one (another, published since, stays) and still lacks one of its blocks
        (a writer may have sent them again since, the record unchanged); after a read that failed, or with no record
        known, nothing."""
        if not (self.config.share_entries and self.redis is not None) or entry.record_tag is None:
            return
        if any(("unread", h) in prefetched for h in entry.hashes):
            return
        self.residency.outbox.append(("lost", [(entry.key, entry.record_tag, list(entry.hashes))]))
