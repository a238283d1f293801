"""PagedStore's prefix matching, `lookup` and `get_prefix`; a mixin of PagedStore.

`lookup`: the entry holding exactly a token sequence, else the longest cached full-block prefix of it across the
device, CPU and Redis tiers (Redis asked without the store's lock: the answer is a hint). `get_prefix`: the KV of such
a prefix. It uses the store's lock, registry, pools, residency, config and stats.
"""

from __future__ import annotations

import itertools

import torch
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store.config import LookupResult
from kvbridge.transfer.store.kv_blocks import chain_root, content_key, hash_chain
from kvbridge.transfer.store.registry import KINDS
from kvbridge.transfer.store.residency import lowest
from kvbridge.transfer.store.sharing import _sends_redis_writes, log

_READS = itertools.count(1)  # get_prefix's claims on the blocks it reads: one key per read


class PrefixLookup:
    """PagedStore's prefix matching (see the module docstring)."""

    @_sends_redis_writes
    def lookup(self, token_ids: torch.Tensor, tenant: str, model: ModelIdentity, dtype: torch.dtype | str,
               adapter: str = "", kind: str = "prefix") -> LookupResult:
        """The entry holding exactly these tokens, else (prefix kind) the longest cached full-block prefix."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().reshape(-1)
        ns = self._namespace(tenant, model, dtype, adapter)
        key = content_key(ns.digest(), kind, token_ids)
        if self.config.share_entries and self.redis is not None:  # an entry another replica stored?
            with self._lock:
                local = self.registry.get(key) is not None or key in self._forgetting  # being deleted: no record
                read = None if local else self._stale.begin_read()
            if read is not None:
                records = {}
                try:
                    records = self.redis.get_entries([key])  # no lock held
                finally:
                    with self._lock:
                        try:
                            if key in records:
                                self._adopt(records[key], tenant, read)
                        except CapacityError as exc:  # a layout this store has no room for: a miss here
                            log.warning("redis: not adopting entry %s... (%s)", key[:16], exc)
                        finally:
                            self._stale.end_read(read)
        with self._lock:
            self._expire()
            entry = self.registry.get(key)
            pool = self._pool_of(ns)
            if entry is not None:
                tiers = {self.residency.tier_of(pool, h) or "redis" for h in entry.hashes}
                self._stats.hits += 1
                self._stats.hit_tokens += token_ids.numel()
                return LookupResult(key, token_ids.numel(), lowest(tiers))
            if kind == "segment" or token_ids.numel() < self.config.block_size:
                self._stats.misses += 1
                return LookupResult(None, 0, None)
            digest = ns.digest()
            hashes = hash_chain(token_ids, self.config.block_size, chain_root(digest, "prefix"), digest,
                                full_only=True)
            found, tiers = 0, set()
            on_device = pool.hash_to_block if pool is not None else {}
            cpu = self.cpu
            for h in hashes:  # the hot loop: a dict probe per block, the CPU tier only on a device miss
                if h in on_device:
                    tiers.add("device")
                elif cpu is not None and h in cpu:
                    tiers.add("cpu")
                else:
                    break
                found += 1
            pending = self.residency.pending
            while found < len(hashes) and hashes[found] in pending:
                tiers.add("redis")
                found += 1
            if found == len(hashes) or self.redis is None:
                return self._counted_lookup(found, tiers)
        # the rest may be in Redis: asked without the lock (a lookup is a hint: blocks may move meanwhile)
        for ok in self.redis.exists_many(hashes[found:]):
            if not ok:
                break
            tiers.add("redis")
            found += 1
        with self._lock:
            return self._counted_lookup(found, tiers)

    def _counted_lookup(self, found_blocks: int, tiers: set) -> LookupResult:
        if found_blocks == 0:
            self._stats.misses += 1
            return LookupResult(None, 0, None)
        self._stats.hits += 1
        self._stats.hit_tokens += found_blocks * self.config.block_size
        return LookupResult(None, found_blocks * self.config.block_size, lowest(tiers))

    def get_prefix(self, token_ids: torch.Tensor, tenant: str, model: ModelIdentity, dtype: torch.dtype | str,
                   num_tokens: int, adapter: str = "") -> KVSegment:
        """KV of the first num_tokens (a multiple of block_size, as `lookup` reports) of a cached prefix."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().reshape(-1)
        bs = self.config.block_size
        if num_tokens <= 0 or num_tokens % bs or num_tokens > token_ids.numel():
            raise ValueError(f"num_tokens must be a positive multiple of {bs} and at most {token_ids.numel()}, "
                             f"got {num_tokens}")
        ns = self._namespace(tenant, model, dtype, adapter)
        def locked(prefetched):
            self._expire()
            pool = self._pool_of(ns)
            if pool is None:
                raise NotFound(f"nothing stored for {ns.model} in {ns.dtype}")
            digest = ns.digest()
            hashes = hash_chain(token_ids[:num_tokens], bs, chain_root(digest, "prefix"), digest)
            # Claim the chain while it is read, as put does: promoting its missing blocks may lose entries (_lose),
            # whose blocks must not be dropped while held here. Blocks of entries that went meanwhile are dropped
            # once released, as their removal would have; blocks no entry used (another replica's, read from
            # Redis) stay cached.
            reader = f"get_prefix#{next(_READS)}"  # never an entry key (those are hex)
            used = [h for h in hashes if h in self.registry.users]
            self.registry.claim(reader, hashes)
            try:
                blocks = self._make_resident(pool, hashes, keep_ref=True, prefetched=prefetched)
                try:
                    kv = pool.gather(torch.tensor([b.block_id for b in blocks]), num_tokens)
                finally:
                    pool.unref(blocks)
            finally:
                orphans = set(self.registry.release(reader, hashes))
                self.residency.drop(pool, [h for h in used if h in orphans])
            self._stats.hits += 1
            self._stats.hit_tokens += num_tokens
            return KVSegment(kv=kv, token_ids=token_ids[:num_tokens].clone(),
                             positions=torch.arange(num_tokens, dtype=torch.int64), model=model, rotated=True)

        return self._run(locked)
