"""PagedStore: KV segments of many models and tenants in paged block pools, with CPU and Redis tiers below.

Entries are KVSegments stored as lists of block hashes (their page tables). Two kinds:
- "prefix": KV of tokens at positions 0..T-1. Block hashes chain from a per-namespace root, so entries that share
  a prefix share its full blocks, and `lookup` finds the longest cached prefix of any token sequence.
- "segment": KV of a run of tokens anywhere (position-independent reuse). Keyed by the tokens alone; its chain
  starts at its own key, so it shares no blocks (its KV depends on context the store never saw).

Where a block lives: in its layout's device pool (found by `pool.lookup`), else in the CPU tier, else in Redis.
Eviction from the pool demotes to the CPU tier, eviction from there to Redis; a block that leaves the last
local tier with no Redis to take it is lost, and so are the entries that use it. Reads promote blocks back.

Invariants (`check`): pool invariants; a block's ref_cnt equals the number of pinned entries using it; a hash is
on the device or in the CPU tier, not both; `_users[h]` is exactly the set of entries using h; without Redis,
every entry's blocks are all present locally; byte accounting matches; no layout exceeds its share.
One lock serialises every public method (the gRPC server calls in from many threads).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.block_pool import BlockPool, CapacityError, PoolLayout, layout_key
from kvbridge.transfer.kv_blocks import BlockHash, Namespace, chain_root, content_key, hash_chain
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.tiers import CpuTier, RedisTier

log = logging.getLogger(__name__)

KINDS = ("prefix", "segment")
__all__ = ["PagedStore", "StoreConfig", "EntryInfo", "LookupResult", "StoreStats", "CapacityError", "NotFound"]


class NotFound(KeyError):
    """No such entry for this tenant (also when it exists for another tenant: the two are indistinguishable)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


@dataclass(frozen=True)
class StoreConfig:
    capacity_bytes: int | None = None  # device pool budget over all layouts; None: capacity_fraction of free memory
    capacity_fraction: float = 0.5  # of free CUDA memory (or of RAM on a CPU-only store) when capacity_bytes is None
    block_size: int = 16  # tokens per block (vLLM's default)
    max_layouts: int = 4  # each layout's pool is capacity_bytes / max_layouts (source + a few projected models)
    cpu_capacity_bytes: int = 0  # 0: no CPU tier
    redis_url: str | None = None  # None: no Redis tier
    redis_ttl_s: int = 3600
    redis_retry_s: float = 2.0
    default_ttl_s: float | None = None  # entry TTL when put() gives none; None: until evicted or deleted
    device: str = "auto"

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if not 0 < self.capacity_fraction <= 1:
            raise ValueError(f"capacity_fraction must be in (0, 1], got {self.capacity_fraction}")
        if self.max_layouts < 1:
            raise ValueError(f"max_layouts must be >= 1, got {self.max_layouts}")
        if self.cpu_capacity_bytes < 0:
            raise ValueError(f"cpu_capacity_bytes must be >= 0, got {self.cpu_capacity_bytes}")
        if self.default_ttl_s is not None and self.default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0 or None, got {self.default_ttl_s}")


@dataclass(slots=True)
class _Entry:
    key: str  # content key (hex)
    namespace: Namespace
    kind: str  # "prefix" | "segment"
    layout: PoolLayout
    model: ModelIdentity
    token_ids: torch.Tensor  # [T] int64, CPU
    positions: torch.Tensor  # [T] int64, CPU
    rotated: bool
    hashes: list[BlockHash]  # page table: one hash per block, the tail block last
    expires_at: float | None
    pinned: bool
    last_access: float


@dataclass(frozen=True, slots=True)
class EntryInfo:
    key: str
    kind: str
    num_tokens: int
    num_blocks: int
    new_blocks: int  # blocks written by this put (the rest were shared or already there)
    pinned: bool
    expires_at: float | None
    tier: str  # where its blocks are: "device", "cpu", "redis" or "mixed"


@dataclass(frozen=True, slots=True)
class LookupResult:
    key: str | None  # the entry holding exactly these tokens, if any
    num_tokens: int  # tokens of the query found cached (exact entry: all; else the longest full-block prefix)
    tier: str | None  # lowest tier the match touches ("device" < "cpu" < "redis"); None on a miss


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    puts: int = 0
    entries: int = 0
    evictions: dict = field(default_factory=lambda: {"device": 0, "cpu": 0})  # blocks pushed down from each tier
    bytes_used: dict = field(default_factory=lambda: {"device": 0, "cpu": 0})
    bytes_capacity: dict = field(default_factory=lambda: {"device": 0, "cpu": 0})
    lost_entries: int = 0  # entries dropped because a block left the last tier
    expired_entries: int = 0
    redis: dict | None = None  # RedisStats as a dict, None without a Redis tier


def _default_capacity(device: torch.device, fraction: float) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * fraction)


class PagedStore:
    def __init__(self, config: StoreConfig = StoreConfig(), clock: Callable[[], float] = time.monotonic):
        from kvbridge.transfer.models import resolve_device

        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        self.capacity_bytes = config.capacity_bytes or _default_capacity(self.device, config.capacity_fraction)
        self.layout_bytes = self.capacity_bytes // config.max_layouts
        self.pools: dict[str, BlockPool] = {}
        self.cpu = CpuTier(config.cpu_capacity_bytes, pin_memory=self.device.type == "cuda") \
            if config.cpu_capacity_bytes else None
        self.redis = RedisTier(config.redis_url, ttl_s=config.redis_ttl_s, retry_s=config.redis_retry_s,
                               clock=clock) if config.redis_url else None
        self._entries: dict[str, _Entry] = {}
        self._users: dict[BlockHash, set[str]] = {}  # block hash -> keys of the entries using it
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, key); stale items skipped
        self._lock = threading.RLock()
        self._stats = StoreStats()

    # ------------------------------------------------------------------------------------------------ helpers

    def _layout_of(self, segment: KVSegment) -> PoolLayout:
        return PoolLayout(model=segment.model.key, dtype=str(segment.dtype).removeprefix("torch."),
                          num_layers=segment.num_layers, num_kv_heads=segment.num_kv_heads,
                          head_dim=segment.head_dim, block_size=self.config.block_size)

    def _pool_for(self, layout: PoolLayout, create: bool) -> BlockPool | None:
        pool = self.pools.get(layout.key)
        if pool is not None:
            if pool.layout != layout:
                raise ValueError(
                    f"layout mismatch for {layout.key}: the store holds [L={pool.layout.num_layers}, "
                    f"H_kv={pool.layout.num_kv_heads}, D={pool.layout.head_dim}, block {pool.layout.block_size}], "
                    f"got [L={layout.num_layers}, H_kv={layout.num_kv_heads}, D={layout.head_dim}, "
                    f"block {layout.block_size}]"
                )
            return pool
        if not create:
            return None
        if len(self.pools) >= self.config.max_layouts:
            raise CapacityError(f"the store already holds {len(self.pools)} layouts (max_layouts); "
                                f"cannot add {layout.key}")
        num_blocks = self.layout_bytes // layout.block_bytes
        if num_blocks < 1:
            raise CapacityError(f"{layout.key}: one block needs {layout.block_bytes} bytes, the layout's share of the "
                                f"store is {self.layout_bytes} bytes")
        pool = BlockPool(layout, num_blocks, self.device)
        self.pools[layout.key] = pool
        log.info("pool %s: %d blocks of %d tokens (%d bytes) on %s", layout.key, num_blocks, layout.block_size,
                 num_blocks * layout.block_bytes, self.device)
        return pool

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

    def _tier_of(self, pool: BlockPool | None, h: BlockHash) -> str | None:
        if pool is not None and pool.lookup(h) is not None:
            return "device"
        if self.cpu is not None and h in self.cpu:
            return "cpu"
        return None

    def _remove_entry(self, entry: _Entry, drop_remote: bool = True) -> None:
        """Forget an entry; blocks no other entry uses are dropped from the local tiers, and from Redis too when
        drop_remote (deletes and expiry: the data must be gone; not for losses, where Redis has it or not)."""
        self._entries.pop(entry.key, None)
        pool = self.pools.get(entry.layout.key)
        if entry.pinned and pool is not None:
            pool.unref([pool.lookup(h) for h in entry.hashes])
        self._release_users(entry.key, entry.hashes, pool, drop_remote)

    def _release_users(self, key: str, hashes: list[BlockHash], pool: BlockPool | None,
                       drop_remote: bool) -> None:
        orphans = []
        for h in hashes:
            users = self._users.get(h)
            if users is None:
                continue
            users.discard(key)
            if not users:
                del self._users[h]
                orphans.append(h)
        for h in orphans:
            block = pool.lookup(h) if pool is not None else None
            if block is not None:
                pool.drop(block)
            if self.cpu is not None:
                self.cpu.pop(h)
        if orphans and drop_remote and self.redis is not None:
            self.redis.delete_many(orphans)

    def _lose(self, hashes: list[BlockHash]) -> None:
        """Blocks that left the last tier: the entries using them cannot be served any more."""
        for h in hashes:
            for key in list(self._users.get(h, ())):
                entry = self._entries.get(key)
                if entry is not None:
                    self._stats.lost_entries += 1
                    self._remove_entry(entry, drop_remote=False)

    def _demote(self, pool: BlockPool, evicted: list[tuple[BlockHash, int]]) -> None:
        """Move evicted device blocks (still intact in the pool) down a tier, before they are overwritten."""
        if not evicted:
            return
        self._stats.evictions["device"] += len(evicted)
        live = [(h, i) for h, i in evicted if h in self._users]
        if not live:
            return
        data = pool.read_blocks(torch.tensor([i for _, i in live])).to("cpu")
        below: list[tuple[BlockHash, str, torch.Tensor]] = []
        if self.cpu is not None:
            for (h, _), block in zip(live, data):
                below += self.cpu.put(h, pool.layout.key, block)
            self._stats.evictions["cpu"] += len(below)
        else:
            below = [(h, pool.layout.key, block) for (h, _), block in zip(live, data)]
        below = [item for item in below if item[0] in self._users]
        if not below:
            return
        if self.redis is not None and self.redis.put_many(below):
            return  # Redis expires blocks itself (TTL); its own evictions are not seen from here
        self._lose([h for h, _, _ in below])

    def _allocate(self, pool: BlockPool, n: int):
        blocks, evicted = pool.allocate(n)
        self._demote(pool, evicted)
        return blocks

    def _expire(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
                self._stats.expired_entries += 1
                self._remove_entry(entry)

    def _entry_for(self, key: str, tenant: str) -> _Entry:
        entry = self._entries.get(key) if isinstance(key, str) else None
        if entry is None or entry.namespace.tenant != tenant:
            raise NotFound(f"no entry {key!r}")
        return entry

    def _make_resident(self, pool: BlockPool, entry_hashes: list[BlockHash], keep_ref: bool):
        """Bring every block of a chain onto the device (promoting from CPU / Redis). Returns the device blocks,
        each holding one extra ref (released by the caller unless keep_ref). Raises NotFound if a block is gone."""
        present, missing = [], []
        for i, h in enumerate(entry_hashes):
            block = pool.lookup(h)
            if block is not None:
                present.append(block)
            else:
                missing.append(i)
        pool.ref(present)  # protect them while promotion allocates
        try:
            if missing:
                layout_key = pool.layout.key
                # Blocks leave the CPU tier before allocation can demote into it (so they cannot be evicted
                # meanwhile); on failure exactly those go back, into the room they left.
                data: dict[int, torch.Tensor] = {}
                from_cpu: list[int] = []
                redis_wanted = []
                for i in missing:
                    item = self.cpu.pop(entry_hashes[i]) if self.cpu is not None else None
                    if item is not None:
                        data[i] = item[1]
                        from_cpu.append(i)
                    else:
                        redis_wanted.append(i)

                def restore() -> None:
                    for i in from_cpu:
                        evicted = self.cpu.put(entry_hashes[i], layout_key, data[i])
                        assert not evicted, "restoring popped blocks cannot overflow the CPU tier"

                if redis_wanted and self.redis is not None:
                    found = self.redis.get_many([entry_hashes[i] for i in redis_wanted], layout_key)
                    for i in redis_wanted:
                        if entry_hashes[i] in found:
                            data[i] = found[entry_hashes[i]]
                absent = [i for i in missing if i not in data]
                if absent:
                    restore()
                    raise NotFound(f"{len(absent)} of {len(entry_hashes)} blocks are no longer stored")
                try:
                    new_blocks = self._allocate(pool, len(missing))
                except CapacityError:  # raised before any eviction: the CPU tier is as we left it
                    restore()
                    raise
                ids = torch.tensor([b.block_id for b in new_blocks])
                pool.write(ids, torch.stack([data[i] for i in missing]))
                for i, block in zip(missing, new_blocks):
                    pool.set_hash(block, entry_hashes[i])
        except Exception:
            pool.unref(present)
            raise
        blocks = [pool.lookup(h) for h in entry_hashes]
        # present ones hold our ref; new ones hold the allocation ref: one extra ref each, as documented
        if not keep_ref:
            pool.unref(blocks)
        return blocks

    # ------------------------------------------------------------------------------------------------ API

    def put(self, segment: KVSegment, tenant: str, kind: str = "prefix", adapter: str = "",
            ttl_s: float | None = None, pin: bool = False) -> EntryInfo:
        """Store a segment (a copy: the caller keeps its tensor). Idempotent per (tenant, model, dtype, adapter,
        kind, tokens): a second put refreshes TTL and pin and writes nothing. Prefix entries must sit at 0..T-1.
        Raises ValueError for bad input and CapacityError when it cannot fit; the store is unchanged then."""
        if not isinstance(segment, KVSegment):
            raise ValueError(f"put takes a KVSegment, got {type(segment).__name__}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if segment.num_tokens == 0:
            raise ValueError("cannot store an empty segment")
        if kind == "prefix" and not segment.is_contiguous_from(0):
            raise ValueError(f"a prefix entry must hold positions 0..T-1; this one starts at "
                             f"{int(segment.positions[0])} (store it as kind='segment')")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        ns = self._namespace(tenant, segment.model, segment.dtype, adapter)
        layout = self._layout_of(segment)
        with self._lock:
            self._expire()
            pool = self._pool_for(layout, create=True)
            bs = layout.block_size
            n_blocks = -(-segment.num_tokens // bs)
            if n_blocks > pool.num_blocks:
                raise CapacityError(f"{layout.key}: the entry needs {n_blocks} blocks of {bs} tokens, the pool has "
                                    f"{pool.num_blocks} in all")
            key = content_key(ns.digest(), kind, segment.token_ids)
            ttl = ttl_s if ttl_s is not None else self.config.default_ttl_s
            now = self.clock()
            expires_at = now + ttl if ttl is not None else None
            existing = self._entries.get(key)
            if existing is not None:
                try:
                    blocks = self._make_resident(pool, existing.hashes, keep_ref=False)
                except NotFound:
                    self._remove_entry(existing, drop_remote=False)
                else:
                    pool.touch(blocks)
                    if pin and not existing.pinned:
                        pool.ref(blocks)
                        existing.pinned = True
                    existing.expires_at = expires_at
                    existing.last_access = now
                    if expires_at is not None:
                        heapq.heappush(self._expiry, (expires_at, key))
                    self._stats.puts += 1
                    return self._info(existing, new_blocks=0)
            hashes = self._chain(ns, kind, key, segment.token_ids)
            # Claim the hashes first: evictions below may lose other entries, and must not orphan (and drop)
            # blocks this entry is about to use.
            for h in hashes:
                self._users.setdefault(h, set()).add(key)
            present = [pool.lookup(h) for h in hashes]
            held = [b for b in present if b is not None]
            pool.ref(held)
            try:
                missing = [i for i, b in enumerate(present) if b is None]
                new_blocks = self._allocate(pool, len(missing))
            except CapacityError:
                pool.unref(held)
                self._release_users(key, hashes, pool, drop_remote=False)
                raise
            # one scatter of the new blocks: segment kv [L, 2, H, T, D] -> [n, L, 2, H, bs, D]
            kv = segment.kv
            pad = n_blocks * bs - segment.num_tokens
            if pad:
                kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
            blocks_view = kv.reshape(layout.num_layers, 2, layout.num_kv_heads, n_blocks, bs, layout.head_dim)
            if missing:
                idx = torch.tensor(missing, device=kv.device)
                data = blocks_view.index_select(3, idx).permute(3, 0, 1, 2, 4, 5)
                pool.write(torch.tensor([b.block_id for b in new_blocks]), data)
            for i, block in zip(missing, new_blocks):
                if self.cpu is not None:
                    self.cpu.pop(hashes[i])  # now on the device: one local copy only
                pool.set_hash(block, hashes[i])
                present[i] = block
            entry = _Entry(key=key, namespace=ns, kind=kind, layout=layout, model=segment.model,
                           token_ids=segment.token_ids.clone(), positions=segment.positions.clone(),
                           rotated=segment.rotated, hashes=hashes, expires_at=expires_at, pinned=pin,
                           last_access=now)
            self._entries[key] = entry
            if expires_at is not None:
                heapq.heappush(self._expiry, (expires_at, key))
            # every block of the chain holds one ref from above (held or fresh); a pin keeps it
            if not pin:
                pool.unref(present)
            self._stats.puts += 1
            return self._info(entry, new_blocks=len(missing))

    def get(self, key: str, tenant: str, out: torch.Tensor | None = None) -> KVSegment:
        """The stored segment (a contiguous copy on the store's device, or written into `out`, a contiguous
        [L, 2, H_kv, T, D] tensor of the entry's dtype on that device). Raises NotFound."""
        with self._lock:
            self._expire()
            entry = self._entry_for(key, tenant)
            pool = self.pools[entry.layout.key]
            try:
                blocks = self._make_resident(pool, entry.hashes, keep_ref=True)
            except NotFound:
                self._stats.misses += 1
                self._stats.lost_entries += 1
                self._remove_entry(entry, drop_remote=False)
                raise NotFound(f"no entry {key!r}") from None
            try:
                kv = pool.gather(torch.tensor([b.block_id for b in blocks]), entry.token_ids.numel(), out=out)
            finally:
                pool.unref(blocks)
            entry.last_access = self.clock()
            self._stats.hits += 1
            self._stats.hit_tokens += entry.token_ids.numel()
            return KVSegment(kv=kv, token_ids=entry.token_ids.clone(), positions=entry.positions.clone(),
                             model=entry.model, rotated=entry.rotated)

    def lookup(self, token_ids: torch.Tensor, tenant: str, model: ModelIdentity, dtype: torch.dtype | str,
               adapter: str = "", kind: str = "prefix") -> LookupResult:
        """The entry holding exactly these tokens, else (prefix kind) the longest cached full-block prefix."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().reshape(-1)
        ns = self._namespace(tenant, model, dtype, adapter)
        with self._lock:
            self._expire()
            key = content_key(ns.digest(), kind, token_ids)
            entry = self._entries.get(key)
            pool = self._pool_of(ns)
            if entry is not None:
                tiers = {self._tier_of(pool, h) or "redis" for h in entry.hashes}
                self._stats.hits += 1
                self._stats.hit_tokens += token_ids.numel()
                return LookupResult(key, token_ids.numel(), _lowest(tiers))
            if kind == "segment" or token_ids.numel() < self.config.block_size:
                self._stats.misses += 1
                return LookupResult(None, 0, None)
            digest = ns.digest()
            hashes = hash_chain(token_ids, self.config.block_size, chain_root(digest, "prefix"), digest,
                                full_only=True)
            found, tiers = 0, set()
            on_device = pool.hash_to_block if pool is not None else {}
            for h in hashes:  # the hot loop: a dict probe per block, the CPU tier only on a device miss
                if h in on_device:
                    tiers.add("device")
                elif self.cpu is not None and h in self.cpu:
                    tiers.add("cpu")
                else:
                    break
                found += 1
            if found < len(hashes) and self.redis is not None:
                in_redis = self.redis.exists_many(hashes[found:])
                for ok in in_redis:
                    if not ok:
                        break
                    tiers.add("redis")
                    found += 1
            if found == 0:
                self._stats.misses += 1
                return LookupResult(None, 0, None)
            self._stats.hits += 1
            self._stats.hit_tokens += found * self.config.block_size
            return LookupResult(None, found * self.config.block_size, _lowest(tiers))

    def get_prefix(self, token_ids: torch.Tensor, tenant: str, model: ModelIdentity, dtype: torch.dtype | str,
                   num_tokens: int, adapter: str = "") -> KVSegment:
        """KV of the first num_tokens (a multiple of block_size, as `lookup` reports) of a cached prefix."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().reshape(-1)
        bs = self.config.block_size
        if num_tokens <= 0 or num_tokens % bs or num_tokens > token_ids.numel():
            raise ValueError(f"num_tokens must be a positive multiple of {bs} and at most {token_ids.numel()}, "
                             f"got {num_tokens}")
        ns = self._namespace(tenant, model, dtype, adapter)
        with self._lock:
            pool = self._pool_of(ns)
            if pool is None:
                raise NotFound(f"nothing stored for {ns.model} in {ns.dtype}")
            digest = ns.digest()
            hashes = hash_chain(token_ids[:num_tokens], bs, chain_root(digest, "prefix"), digest)
            blocks = self._make_resident(pool, hashes, keep_ref=True)
            try:
                kv = pool.gather(torch.tensor([b.block_id for b in blocks]), num_tokens)
            finally:
                pool.unref(blocks)
            self._stats.hits += 1
            self._stats.hit_tokens += num_tokens
            return KVSegment(kv=kv, token_ids=token_ids[:num_tokens].clone(),
                             positions=torch.arange(num_tokens, dtype=torch.int64), model=model, rotated=True)

    def delete(self, key: str, tenant: str) -> bool:
        """Remove an entry and every block only it used, from every tier. False if there was none."""
        with self._lock:
            try:
                entry = self._entry_for(key, tenant)
            except NotFound:
                return False
            self._remove_entry(entry)
            return True

    def pin(self, key: str, tenant: str, pinned: bool = True) -> EntryInfo:
        """Pinned entries stay on the device (never evicted) until unpinned, deleted or expired."""
        with self._lock:
            self._expire()
            entry = self._entry_for(key, tenant)
            pool = self.pools[entry.layout.key]
            if pinned and not entry.pinned:
                self._make_resident(pool, entry.hashes, keep_ref=True)
                entry.pinned = True
            elif not pinned and entry.pinned:
                pool.unref([pool.lookup(h) for h in entry.hashes])
                entry.pinned = False
            return self._info(entry, new_blocks=0)

    def refresh(self, key: str, tenant: str, ttl_s: float | None = None, pin: bool = False) -> EntryInfo:
        """What a second put of the same entry does, without its tensor: restart the TTL (ttl_s, else the
        default), and pin it if asked (never unpins). Raises NotFound."""
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        with self._lock:
            self._expire()
            entry = self._entry_for(key, tenant)
            ttl = ttl_s if ttl_s is not None else self.config.default_ttl_s
            now = self.clock()
            entry.expires_at = now + ttl if ttl is not None else None
            entry.last_access = now
            if entry.expires_at is not None:
                heapq.heappush(self._expiry, (entry.expires_at, key))
            if pin:
                return self.pin(key, tenant)
            return self._info(entry, new_blocks=0)

    def info(self, key: str, tenant: str) -> EntryInfo:
        with self._lock:
            self._expire()
            return self._info(self._entry_for(key, tenant), new_blocks=0)

    def keys(self, tenant: str) -> list[str]:
        with self._lock:
            self._expire()
            return [k for k, e in self._entries.items() if e.namespace.tenant == tenant]

    def purge_expired(self) -> None:
        with self._lock:
            self._expire()

    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            out = StoreStats(hits=s.hits, misses=s.misses, hit_tokens=s.hit_tokens, puts=s.puts,
                             entries=len(self._entries), evictions=dict(s.evictions),
                             lost_entries=s.lost_entries, expired_entries=s.expired_entries)
            out.bytes_used = {"device": sum(p.bytes_used for p in self.pools.values()),
                              "cpu": self.cpu.bytes_used if self.cpu else 0}
            out.bytes_capacity = {"device": self.capacity_bytes, "cpu": self.config.cpu_capacity_bytes}
            if self.redis is not None:
                out.redis = dict(vars(self.redis.stats))
            return out

    def check(self) -> list[str]:
        """Every violated invariant, in words; [] when the store is consistent."""
        with self._lock:
            problems = []
            for pool in self.pools.values():
                problems += pool.check()
                expected = {b.block_id: 0 for b in pool.blocks}
                for entry in self._entries.values():
                    if entry.pinned and entry.layout.key == pool.layout.key:
                        for h in entry.hashes:
                            block = pool.lookup(h)
                            if block is None:
                                problems.append(f"pinned entry {entry.key} has block {h.hex()} off the device")
                            else:
                                expected[block.block_id] += 1
                for block in pool.blocks:
                    if block.ref_cnt != expected[block.block_id]:
                        problems.append(f"{pool.layout.key}: block {block.block_id} ref_cnt {block.ref_cnt}, "
                                        f"{expected[block.block_id]} pinned entries use it")
                if pool.num_blocks * pool.layout.block_bytes > self.layout_bytes:
                    problems.append(f"{pool.layout.key}: pool exceeds its share of the capacity")
                if self.cpu is not None:
                    both = set(pool.hash_to_block).intersection(self.cpu.hashes())
                    if both:
                        problems.append(f"{len(both)} blocks are both on the device and in the CPU tier")
            if self.cpu is not None:
                problems += self.cpu.check()
            users: dict[BlockHash, set[str]] = {}
            for entry in self._entries.values():
                for h in entry.hashes:
                    users.setdefault(h, set()).add(entry.key)
                if self.redis is None:
                    pool = self.pools.get(entry.layout.key)
                    lost = [h for h in entry.hashes if self._tier_of(pool, h) is None]
                    if lost:
                        problems.append(f"entry {entry.key} has {len(lost)} blocks in no tier")
            if users != self._users:
                problems.append("the hash -> entries index disagrees with the entries' page tables")
            return problems

    def _info(self, entry: _Entry, new_blocks: int) -> EntryInfo:
        pool = self.pools.get(entry.layout.key)
        tiers = {self._tier_of(pool, h) or "redis" for h in entry.hashes}
        return EntryInfo(key=entry.key, kind=entry.kind, num_tokens=entry.token_ids.numel(),
                         num_blocks=len(entry.hashes), new_blocks=new_blocks, pinned=entry.pinned,
                         expires_at=entry.expires_at, tier=tiers.pop() if len(tiers) == 1 else "mixed")


def _lowest(tiers: set) -> str | None:
    for tier in ("redis", "cpu", "device"):
        if tier in tiers:
            return tier
    return None
