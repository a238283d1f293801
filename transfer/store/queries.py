"""PagedStore's read side: what callers may ask of the store about entries, tenants and tiers (info, derived
entries, keys, usage, capacity, stats) and `check`, the invariants it verifies; plus purge_expired. A mixin of
PagedStore: it uses the store's lock, registry, pools, residency and config.
"""

from __future__ import annotations

import torch
from kvbridge.transfer.store.checker import check_store
from kvbridge.transfer.store.config import StoreStats, TenantUsage
from kvbridge.transfer.store.kv_blocks import BlockHash
from kvbridge.transfer.store.registry import EntryInfo
from kvbridge.transfer.store.sharing import _sends_redis_writes


class StoreQueries:
    """PagedStore's queries (see the module docstring)."""

    def info(self, key: str, tenant: str) -> EntryInfo:
        def locked(prefetched):
            self._expire()
            return self._info(self._entry_for(key, tenant, prefetched), new_blocks=0)

        return self._run(locked)

    def token_ids(self, key: str, tenant: str) -> torch.Tensor:
        """The token ids an entry holds (a copy), without reading its KV; NotFound as `info`."""
        def locked(prefetched):
            self._expire()
            return self._entry_for(key, tenant, prefetched).token_ids.clone()

        return self._run(locked)

    @_sends_redis_writes
    def derived(self, key: str, tenant: str) -> list[EntryInfo]:
        """The tenant's entries derived from entry `key` (projections of it), whether or not it is still stored."""
        with self._lock:
            self._expire()
            return [self._info(e, new_blocks=0) for e in self.registry.derived_from(key, tenant)]

    @_sends_redis_writes
    def sharing_prefix(self, key: str, tenant: str) -> list[tuple[str, int]]:
        """The tenant's other prefix entries that share this prefix entry's first full blocks (same model, dtype and
        adapter: blocks are namespaced), as (key, tokens shared), the most shared first. [] for a segment entry."""
        with self._lock:
            self._expire()
            entry = self.registry.for_tenant(key, tenant)
            if entry.kind != "prefix":
                return []
            shared: dict[str, int] = {}
            for i, h in enumerate(entry.hashes):  # chained hashes: sharing block i means sharing blocks 0..i
                for other in self.registry.users.get(h, ()):
                    if other != key and self.registry.entries[other].kind == "prefix":
                        shared[other] = (i + 1) * self.config.block_size
            return sorted(shared.items(), key=lambda kv: (-kv[1], kv[0]))

    @_sends_redis_writes
    def keys(self, tenant: str) -> list[str]:
        with self._lock:
            self._expire()
            return self.registry.keys(tenant)

    @_sends_redis_writes
    def purge_expired(self) -> None:
        with self._lock:
            self._expire()

    @_sends_redis_writes
    def tenant_usage(self, tenant: str) -> TenantUsage:
        """What one tenant holds: its entries, their tokens, and the bytes of its distinct blocks per tier (tenants
        never share blocks, so nothing here counts another tenant's KV)."""
        with self._lock:
            self._expire()
            entries = [e for e in self.registry.entries.values() if e.namespace.tenant == tenant]
            usage = TenantUsage(entries=len(entries), tokens=sum(e.token_ids.numel() for e in entries))
            seen: set[BlockHash] = set()
            for e in entries:
                pool = self.pools.get(e.layout.key)
                for h in e.hashes:
                    if h not in seen:
                        seen.add(h)
                        tier = self.residency.tier_of(pool, h) or "redis"
                        usage.bytes_used[tier] = usage.bytes_used.get(tier, 0) + e.layout.block_bytes
            return usage

    def capacity(self) -> dict[str, int]:
        """Bytes each local tier may hold (fixed by the configuration)."""
        return {"device": self.capacity_bytes, "cpu": self.config.cpu_capacity_bytes}

    def redis_up(self) -> bool | None:
        """Whether the Redis tier answers (as last seen; no round trip); None without one."""
        if self.redis is None:
            return None
        return bool(self.redis.stats.available)

    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            out = StoreStats(hits=s.hits, misses=s.misses, hit_tokens=s.hit_tokens, puts=s.puts,
                             entries=len(self.registry), evictions=dict(s.evictions),
                             lost_entries=s.lost_entries, expired_entries=s.expired_entries)
            out.bytes_used = {"device": sum(p.bytes_used for p in self.pools.values()),
                              "cpu": self.cpu.bytes_used if self.cpu else 0}
            out.bytes_capacity = {"device": self.capacity_bytes, "cpu": self.config.cpu_capacity_bytes}
            if self.redis is not None:
                out.redis = self.redis.stats.as_dict()
            return out

    def check(self) -> list[str]:
        """Every violated invariant, in words; [] when the store is consistent."""
        with self._lock:
            return check_store(self.budget, self.registry, self.residency)
