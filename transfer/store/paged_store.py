"""PagedStore, the facade callers use: KV segments of many models and tenants in paged block pools, with CPU and
Redis tiers below.

Entries are KVSegments stored as lists of block hashes (their page tables). Two kinds:
- "prefix": KV of tokens at positions 0..T-1. Block hashes chain from a per-namespace root, so entries that share
  a prefix share its full blocks, and `lookup` finds the longest cached prefix of any token sequence.
- "segment": KV of a run of tokens anywhere (position-independent reuse). Keyed by the tokens alone; its chain
  starts at its own key, so it shares no blocks (its KV depends on context the store never saw).

An entry may carry the text it was made from, and a derived entry (a projection) the key of its source entry:
deleting an entry deletes what was derived from it.

Where a block lives and how it moves between tiers: `residency`. How the pools of every layout share one device
byte budget (which layout gives up room when another needs it): `budget`. What is stored, TTL, pins and links:
`registry`. Entries shared with other replicas through Redis (the lock-free Redis round trips, adopting records):
`sharing`; which records read back must not be adopted (removed or expired here): `stale_records`. What callers
may ask of it without changing it (info, usage, stats, `check`): `queries`. Finding the longest cached prefix of a
token sequence (`lookup`, `get_prefix`): `prefix_lookup`. How entries leave it (delete, expiry, loss) and the
listeners told: `removal`. The invariants `check` verifies: `checker`. One lock serialises every public method (the
gRPC server calls in from many threads). This module: the store's state, and storing, reading, pinning and
refreshing entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout, layout_key
from kvbridge.transfer.store.budget import DeviceBudget
from kvbridge.transfer.store.config import (
    NO_TTL,
    LookupResult,
    QuotaExceeded,
    StoreConfig,
    StoreStats,
    TenantUsage,
    check_ttl,
    default_capacity,
)
from kvbridge.transfer.store.kv_blocks import BlockHash, Namespace, chain_root, content_key, hash_chain
from kvbridge.transfer.store.prefix_lookup import PrefixLookup
from kvbridge.transfer.store.queries import StoreQueries
from kvbridge.transfer.store.registry import CALL, KINDS, Entry, EntryInfo, EntryRegistry, info_of
from kvbridge.transfer.store.removal import EntryRemoval
from kvbridge.transfer.store.residency import Residency
from kvbridge.transfer.store.sharing import RedisSharing
from kvbridge.transfer.store.stale_records import StaleRecords
from kvbridge.transfer.store.tiers import CpuTier, RedisTier

log = logging.getLogger(__name__)

__all__ = ["PagedStore", "StoreConfig", "EntryInfo", "LookupResult", "StoreStats", "TenantUsage", "CapacityError",
           "QuotaExceeded", "NotFound"]


DEFAULT_CONFIG = StoreConfig()


class PagedStore(StoreQueries, PrefixLookup, EntryRemoval, RedisSharing):
    def __init__(self, config: StoreConfig = DEFAULT_CONFIG, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        self.capacity_bytes = config.capacity_bytes or default_capacity(self.device, config.capacity_fraction)
        self.budget = DeviceBudget(self.capacity_bytes, config.slab_bytes, config.max_layouts, self.device)
        self.pools = self.budget.pools  # layout key -> pool, all of them drawing on one byte budget
        self.registry = EntryRegistry()
        self._stats = StoreStats()
        cpu = CpuTier(config.cpu_capacity_bytes, pin_memory=self.device.type == "cuda",
                      checksums=config.redis_url is not None) if config.cpu_capacity_bytes else None
        redis = RedisTier(config.redis_url, ttl_s=config.redis_ttl_s, retry_s=config.redis_retry_s,
                          clock=clock, secret=config.redis_secret) if config.redis_url else None
        self.residency = Residency(self.registry, cpu, redis, self._stats.evictions)
        self._listeners: list[Callable[[str, str, str], None]] = []
        self._lock = threading.RLock()
        self._sending = threading.Lock()  # one thread sends the queued Redis writes at a time
        # keys whose "forget" is queued or being sent: their records may still be in Redis, never adopted back
        self._forgetting: Counter[str] = Counter()
        self._owed: dict[str, float] = {}  # key -> when the write of its entry's record failed (sharing._resend_owed)
        # key -> when its forget failed (Redis refused the DEL): sent again (sharing._resend_owed); still _forgetting
        self._unforgotten: dict[str, float] = {}
        self._stale = StaleRecords()  # records read from Redis that must not be adopted (a removal or expiry here)

    @property
    def cpu(self) -> CpuTier | None:
        return self.residency.cpu

    @property
    def redis(self) -> RedisTier | None:
        return self.residency.redis

    # ------------------------------------------------------------------------------------------------ helpers

    def _layout_of(self, segment: KVSegment) -> PoolLayout:
        return PoolLayout(model=segment.model.key, dtype=str(segment.dtype).removeprefix("torch."),
                          num_layers=segment.num_layers, num_kv_heads=segment.num_kv_heads,
                          head_dim=segment.head_dim, block_size=self.config.block_size)

    def _pool_of(self, ns: Namespace) -> BlockPool | None:
        """The pool holding this namespace's model and dtype."""
        return self.pools.get(layout_key(ns.model, ns.dtype))

    @staticmethod
    def _namespace(tenant: str, model: ModelIdentity, dtype: torch.dtype | str, adapter: str) -> Namespace:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("tenant must be a non-empty string")
        return Namespace(tenant=tenant, model=model.key, dtype=str(dtype).removeprefix("torch."), adapter=adapter)

    def _chain(self, ns: Namespace, kind: str, key: str, tokens: torch.Tensor) -> list[BlockHash]:
        digest = ns.digest()
        root = chain_root(digest, kind, key.encode() if kind == "segment" else b"")
        return hash_chain(tokens, self.config.block_size, root, digest)

    def _allocate(self, pool: BlockPool, n: int):
        blocks, lost = self.budget.allocate(pool, n, self.residency.demote)
        self._lose(lost)
        return blocks

    def _make_resident(self, pool: BlockPool, hashes: list[BlockHash], keep_ref: bool,
                       prefetched: dict | None = None):
        return self.residency.make_resident(pool, hashes, keep_ref, self._allocate, prefetched, self._lose)

    def _info(self, entry: Entry, new_blocks: int) -> EntryInfo:
        pool = self.pools.get(entry.layout.key)
        tiers = {self.residency.tier_of(pool, h) or "redis" for h in entry.hashes}
        return info_of(entry, new_blocks, tiers.pop() if len(tiers) == 1 else "mixed")

    def _check_quota(self, tenant: str, new_entry: bool, pin: tuple[list[BlockHash], PoolLayout] | None = None
                     ) -> None:
        """QuotaExceeded when storing one more entry (new_entry) or pinning the blocks `pin` names (hashes, layout)
        would take the tenant past its quota. Pinned bytes count each block once, as Stats does: pinned documents
        that share a prefix (a system prompt) hold its blocks once."""
        cfg = self.config
        if new_entry and cfg.tenant_max_entries is not None:
            held = self.registry.per_tenant.get(tenant, 0)
            if held >= cfg.tenant_max_entries:
                raise QuotaExceeded(f"this tenant holds {held} entries, its quota: delete some (or let them "
                                    "expire) before storing more")
        if pin is not None and cfg.tenant_max_pinned_bytes is not None:
            held = {(e.layout.key, h): e.layout.block_bytes for e in self.registry.entries.values()
                    if e.pinned and e.namespace.tenant == tenant for h in e.hashes}
            pinned = sum(held.values())
            hashes, layout = pin
            pin_bytes = sum(layout.block_bytes for h in dict.fromkeys(hashes) if (layout.key, h) not in held)
            if pinned + pin_bytes > cfg.tenant_max_pinned_bytes:
                raise QuotaExceeded(f"pinning {pin_bytes} more bytes would take this tenant's pinned KV to "
                                    f"{pinned + pin_bytes} bytes, over its quota of {cfg.tenant_max_pinned_bytes}: "
                                    "unpin or delete pinned entries, or store this one unpinned")

    # ------------------------------------------------------------------------------------------------ API

    def put(self, segment: KVSegment, tenant: str, kind: str = "prefix", adapter: str = "",
            ttl_s: float | None = None, pin: bool = False, text: str | None = None,
            source_key: str | None = None, annotations: dict | None = None,
            source_serial: int | None = None) -> EntryInfo:
        """Store a segment (a copy: the caller keeps its tensor). Idempotent per (tenant, model, dtype, adapter,
        kind, tokens): a second put refreshes TTL and pin and writes nothing. Prefix entries must sit at 0..T-1.
        `ttl_s`: seconds until it expires (None: the default, NO_TTL: never). `text`: what the tokens were made from,
        kept with the entry; `source_key`: the tenant's entry this one is derived from (deleting that deletes this;
        NotFound when there is no such entry, or, with `source_serial`, when it is not that one any more: deleted and
        stored again since the caller read the KV it derived this from); `annotations`: small JSON-able facts kept
        with it. Raises ValueError for bad input and CapacityError when it cannot fit; the store is unchanged
        then."""
        if not isinstance(segment, KVSegment):
            raise ValueError(f"put takes a KVSegment, got {type(segment).__name__}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if segment.num_tokens == 0:
            raise ValueError("cannot store an empty segment")
        if kind == "prefix" and not segment.is_contiguous_from(0):
            raise ValueError(f"a prefix entry must hold positions 0..T-1; this one starts at "
                             f"{int(segment.positions[0])} (store it as kind='segment')")
        check_ttl("ttl_s", ttl_s)
        if text is not None and not isinstance(text, str):
            raise ValueError(f"text must be a str or None, got {type(text).__name__}")
        ns = self._namespace(tenant, segment.model, segment.dtype, adapter)
        layout = self._layout_of(segment)
        def locked(prefetched):
            self._expire()
            if source_key is not None:
                source = self.registry.for_tenant(source_key, tenant)  # NotFound: nothing to derive from
                if source_serial is not None and source.serial != source_serial:
                    raise NotFound(f"entry {source_key[:16]}... was stored again since its KV was read")
            created = layout.key not in self.budget.pools
            pool = self.budget.pool_for(layout, create=True)
            try:
                return into(pool, prefetched)
            except BaseException:  # refused: a pool this put created for it must not hold a layout slot for good
                if created:
                    self.budget.drop_if_unused(pool)
                raise

        def into(pool, prefetched):
            bs = layout.block_size
            n_blocks = -(-segment.num_tokens // bs)
            if n_blocks > self.budget.max_blocks(layout):
                raise CapacityError(f"{layout.key}: the entry needs {n_blocks} blocks of {bs} tokens, the store holds "
                                    f"{self.budget.max_blocks(layout)} of them in all")
            key = content_key(ns.digest(), kind, segment.token_ids)
            ttl = ttl_s if ttl_s is not None else self.config.default_ttl_s
            now = self.clock()
            expires_at = now + ttl if ttl is not None and ttl != NO_TTL else None
            existing = self.registry.get(key)
            if existing is not None and pin and not existing.pinned:
                self._check_quota(tenant, False, (existing.hashes, layout))
            if existing is not None:
                try:
                    blocks = self._make_resident(pool, existing.hashes, keep_ref=False, prefetched=prefetched)
                except NotFound:
                    self._record_lost(existing, prefetched)
                    self._remove_entry(existing, "lost")
                else:
                    pool.touch(blocks)
                    if pin and not existing.pinned:
                        pool.ref(blocks)
                        existing.pinned = True
                    changed = (text is not None and text != existing.text) or bool(annotations) \
                        or expires_at is not None or existing.expires_at is not None
                    existing.expires_at = expires_at
                    existing.last_access = now
                    if text is not None:
                        existing.text = text
                    existing.annotations.update(annotations or {})
                    if changed or self._republish_due(existing, now):
                        self._share(existing, pool, [])  # the record again, with what it knows now and its deadline
                    existing.generation += 1
                    self.registry.schedule(existing)
                    self._stats.puts += 1
                    return self._info(existing, new_blocks=0)
            hashes = self._chain(ns, kind, key, segment.token_ids)
            self._check_quota(tenant, True, (hashes, layout) if pin else None)
            # Claim the hashes first: evictions below may lose other entries, and must not orphan (and drop)
            # blocks this entry is about to use.
            self.registry.claim(key, hashes)
            present = [pool.lookup(h) for h in hashes]
            held = [b for b in present if b is not None]
            pool.ref(held)
            missing = [i for i, b in enumerate(present) if b is None]
            # CPU-tier copies of the blocks written below leave it first (they will be on the device: one local copy
            # only), so that the room allocation makes there cannot push them out, losing the entries that use them
            # for nothing; put back if the blocks cannot be had
            moved = {i: item for i in missing if self.cpu is not None and (item := self.cpu.pop(hashes[i]))}

            def given_back(new_blocks):  # nothing stored: the blocks, the claim and the CPU tier's copies as before
                popped = [(hashes[i], key_of_layout, block) for i, (key_of_layout, block) in moved.items()]
                self._lose(self.residency.give_back(pool, new_blocks, popped, held))
                self.residency.drop(pool, self.registry.release(key, hashes))

            try:
                new_blocks = self._allocate(pool, len(missing))
            except CapacityError:  # raised before any eviction: the CPU tier has the room they left
                given_back([])
                raise
            try:
                # the new blocks, straight from the segment: kv [L, 2, H, T, D] -> pool [n, L, 2, H, bs, D] (a
                # device's out-of-memory error, say, stores nothing)
                if missing:
                    pool.write_segment([b.block_id for b in new_blocks], segment.kv, missing)
                for i, block in zip(missing, new_blocks):
                    pool.set_hash(block, hashes[i])
                    present[i] = block
            except BaseException:
                given_back(new_blocks)
                raise
            # (A source lost to the evictions above keeps its link here: links outlive their source, so a Delete of
            # that key, or of the same text stored again, still removes this entry.)
            entry = Entry(key=key, namespace=ns, kind=kind, layout=layout, model=segment.model,
                          token_ids=segment.token_ids.clone(), positions=segment.positions.clone(),
                          rotated=segment.rotated, hashes=hashes, expires_at=expires_at, pinned=pin,
                          last_access=now, text=text, source_key=source_key, annotations=dict(annotations or {}),
                          owner=CALL.get())
            self.registry.add(entry)
            self._share(entry, pool, [(hashes[i], present[i].block_id) for i in missing])
            # every block of the chain holds one ref from above (held or fresh); a pin keeps it
            if not pin:
                pool.unref(present)
            self._stats.puts += 1
            return self._info(entry, new_blocks=len(missing))

        return self._run(locked)

    def get(self, key: str, tenant: str, out: torch.Tensor | None = None,
            written: Callable[[int, int], None] | None = None) -> KVSegment:
        """The stored segment (a contiguous copy on the store's device, or written into `out`, a contiguous
        [L, 2, H_kv, T, D] tensor of the entry's dtype on that device; with `written`, a layer at a time, calling
        written(l, l + 1) after each, under the store's lock). Raises NotFound."""
        def locked(prefetched):
            self._expire()
            entry = self._entry_for(key, tenant, prefetched)
            pool = self.pools[entry.layout.key]
            try:
                blocks = self._make_resident(pool, entry.hashes, keep_ref=True, prefetched=prefetched)
            except NotFound:
                self._stats.misses += 1
                self._stats.lost_entries += 1
                self._record_lost(entry, prefetched)
                self._remove_entry(entry, "lost")
                raise NotFound(f"no entry {key!r}") from None
            try:
                kv = pool.gather(torch.tensor([b.block_id for b in blocks]), entry.token_ids.numel(), out=out,
                                  written=written)
            finally:
                pool.unref(blocks)
            return self._hit(entry, kv)

        return self._run(locked)

    def _hit(self, entry: Entry, kv: torch.Tensor) -> KVSegment:
        """A get of entry answered with kv: the entry just used, counted as a hit (under the lock)."""
        entry.last_access = self.clock()
        self._stats.hits += 1
        self._stats.hit_tokens += entry.token_ids.numel()
        return KVSegment(kv=kv, token_ids=entry.token_ids.clone(), positions=entry.positions.clone(),
                         model=entry.model, rotated=entry.rotated)

    def touch(self, key: str, tenant: str, kv: torch.Tensor, serial: int) -> KVSegment:
        """The stored segment with `kv` for its KV: a copy of it the caller holds already (a same-host segment of
        this entry kept by the server), valid while the entry's `serial` is the one given. Counts as a get (a hit,
        the entry and its blocks on the device just used) without reading a block. NotFound when the entry is gone
        or is another one now (another serial); ValueError when kv is not of its shape."""
        def locked(prefetched):
            self._expire()
            entry = self._entry_for(key, tenant, prefetched)
            if entry.serial != serial:
                raise NotFound(f"entry {key[:16]}... was stored again since")
            shape = (entry.layout.num_layers, 2, entry.layout.num_kv_heads, entry.token_ids.numel(),
                     entry.layout.head_dim)
            if tuple(kv.shape) != shape:
                raise ValueError(f"kv of shape {tuple(kv.shape)} for entry {key[:16]}... of shape {shape}")
            pool = self.pools[entry.layout.key]
            pool.touch([pool.hash_to_block[h] for h in entry.hashes if h in pool.hash_to_block])
            return self._hit(entry, kv)

        return self._run(locked)

    def pin(self, key: str, tenant: str, pinned: bool = True) -> EntryInfo:
        """Pinned entries stay on the device (never evicted) until unpinned, deleted or expired."""
        def locked(prefetched):
            self._expire()
            entry = self._entry_for(key, tenant, prefetched)
            self._pin_entry(entry, tenant, pinned, prefetched)
            return self._info(entry, new_blocks=0)

        return self._run(locked)

    def _pin_entry(self, entry: Entry, tenant: str, pinned: bool, prefetched: dict) -> None:
        pool = self.pools[entry.layout.key]
        if pinned and not entry.pinned:
            self._check_quota(tenant, False, (entry.hashes, entry.layout))
            self._make_resident(pool, entry.hashes, keep_ref=True, prefetched=prefetched)
            entry.pinned = True
        elif not pinned and entry.pinned:
            pool.unref([pool.lookup(h) for h in entry.hashes])
            entry.pinned = False

    def refresh(self, key: str, tenant: str, ttl_s: float | None = None, pin: bool = False,
                text: str | None = None) -> EntryInfo:
        """What a second put of the same entry does, without its tensor: restart the TTL (ttl_s, else the
        default), pin it if asked (never unpins), keep `text` with it if given. Raises NotFound."""
        check_ttl("ttl_s", ttl_s)
        def locked(prefetched):
            self._expire()
            entry = self._entry_for(key, tenant, prefetched)
            if pin:  # first: it may need Redis (NeedRemote, then this runs again) and changes nothing until then
                self._pin_entry(entry, tenant, True, prefetched)
            ttl = ttl_s if ttl_s is not None else self.config.default_ttl_s
            now = self.clock()
            changed = (ttl is not None and ttl != NO_TTL) or entry.expires_at is not None \
                or (text is not None and text != entry.text)
            entry.expires_at = now + ttl if ttl is not None and ttl != NO_TTL else None
            entry.last_access = now
            if text is not None:
                entry.text = text
            if changed or self._republish_due(entry, now):
                self._share(entry, self.pools[entry.layout.key], [])  # the record again (see _republish_due)
            entry.generation += 1
            self.registry.schedule(entry)
            return self._info(entry, new_blocks=0)

        return self._run(locked)
