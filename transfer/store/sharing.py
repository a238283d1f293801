"""Entries shared with other replicas through Redis, the part of PagedStore that talks to Redis without its lock:
`_run` runs a public method's locked part and fetches, unlocked, the blocks and records it needs from Redis;
`_flush` sends the queued Redis writes in order; `_entry_for`, `_adopt` and `_adopt_family` register entries another
replica stored, from their records (checked: the key is recomputed from the contents; never a record stale here:
stale_records); `_share` queues a new entry's record and blocks. A record's TTL in Redis is its entry's when the entry
expires (set from the entry's deadline as it is sent), and a replica that adopts it expires it then. A mixin of
PagedStore (it uses the store's lock, registry, residency, budget, config and clock).
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections import Counter
from collections.abc import Callable

import torch
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout
from kvbridge.transfer.store.kv_blocks import DIGEST_SIZE, BlockHash, Namespace, content_key
from kvbridge.transfer.store.registry import KINDS, Entry, entry_record, parse_record
from kvbridge.transfer.store.residency import NeedRemote, read_to_cpu

log = logging.getLogger("kvbridge.transfer.store.paged_store")  # the store's one logger

_ENTRY_KEY = re.compile(f"[0-9a-f]{{{2 * DIGEST_SIZE}}}")  # what content_key returns
_REMOTE_ROUNDS = 8  # Redis reads one call may make (more only while other calls keep demoting its blocks)


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
        prefetched: dict = {}  # also ("entry", key) -> the record found, ("read", key) -> its read's stamp
        try:
            for _ in range(_REMOTE_ROUNDS):
                try:
                    with self._lock:
                        return locked(prefetched)
                except NeedRemote as need:  # no lock held here
                    if need.hashes:
                        got = self.redis.get_many(need.hashes, need.layout)  # each block must fit it
                        for h in need.hashes:
                            prefetched[h] = got.get(h)
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
                        failed = self._send(op, items)
                    except Exception as exc:  # not a Redis error (the tier handles those): still no caller's
                        log.exception("redis tier: sending %d queued %r write(s) failed", len(items), op)
                        residency.redis.failed(exc)
                        failed = items if op in ("put", "keep") else []
                    with self._lock:
                        self._sent(op, items, failed)
            finally:
                self._sending.release()

    def _send(self, op: str, items: list) -> list:
        """One queued write, sent (no lock held); for puts and keeps, the (hash, layout key, block) items Redis does
        not hold after it."""
        redis = self.residency.redis
        if op == "delete":
            redis.delete_many(items)
        elif op == "entries":  # each record lives in Redis until its entry's deadline, if it has one
            now = self.clock()
            redis.put_entries([(key, record, source_key, None if expires_at is None else expires_at - now)
                               for key, record, source_key, expires_at in items])
        elif op == "forget":
            redis.delete_entries(items)
        elif op == "keep":  # Redis had them: restart their TTL, send only those it no longer has
            found = redis.refresh_many([h for h, _, _ in items])
            failed = items if found is None else [item for item, there in zip(items, found) if not there]
            return [] if found is not None and redis.put_many(failed) else failed
        else:
            return [] if redis.put_many(items) else items
        return []

    def _sent(self, op: str, items: list, failed: list) -> None:
        """The bookkeeping after a queued write went (sent or failed; under the store's lock)."""
        residency = self.residency
        if op == "forget":
            self._forgetting -= Counter(items)
        if op not in ("put", "keep"):
            return
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
        blob, left_s = found
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
        self.budget.pool_for(layout, create=True)
        hashes = self._chain(ns, kind, key, tokens)
        self.registry.claim(key, hashes)
        if record.get("expires") is True and left_s is not None:  # the writer's deadline, on Redis's clock
            expires_at = now + left_s
        else:
            ttl = self.config.default_ttl_s
            expires_at, record_id = (now + ttl if ttl is not None else None), None
        entry = Entry(key=key, namespace=ns, kind=kind, layout=layout, model=model, token_ids=tokens,
                      positions=positions, rotated=bool(record["rotated"]), hashes=hashes,
                      expires_at=expires_at, pinned=False, last_access=now,
                      text=record.get("text"), source_key=record.get("source_key"),
                      annotations=dict(record.get("annotations") or {}), generation=1,  # stored elsewhere
                      record_id=record_id)
        self.registry.add(entry)
        return entry

    def _share(self, entry: Entry, pool: BlockPool, new: list[tuple[BlockHash, int]]) -> None:
        """Entries shared through Redis: queue the entry's record (a new one, with its deadline: again whenever that
        changes) and its new blocks (written through: replicas read them there) for the sender."""
        if not (self.config.share_entries and self.redis is not None):
            return
        if new:
            data = read_to_cpu(pool, [i for _, i in new], [True] * len(new))
            self.residency.outbox.append(("put", [(h, pool.layout.key, block) for (h, _), block in zip(new, data)]))
        record_id = secrets.token_hex(8)
        entry.record_id = record_id if entry.expires_at is not None else None
        self.residency.outbox.append(("entries", [(entry.key, entry_record(entry, record_id), entry.source_key,
                                                   entry.expires_at)]))
