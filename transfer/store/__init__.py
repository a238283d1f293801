"""kvbridge.transfer.store: the paged KV store of many models and tenants, with CPU and Redis/Valkey tiers.
Owns block hashing and the free queue, the block pools, the tiers, the entry registry (TTL, pins, texts, links)."""

from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.store.config import NO_TTL, LookupResult, QuotaExceeded, StoreConfig, StoreStats, TenantUsage
from kvbridge.transfer.store.paged_store import PagedStore
from kvbridge.transfer.store.redis_auth import read_secret_file
from kvbridge.transfer.store.registry import EntryInfo

__all__ = ["NO_TTL", "PagedStore", "StoreConfig", "EntryInfo", "LookupResult", "StoreStats", "TenantUsage",
           "QuotaExceeded", "CapacityError", "NotFound", "read_secret_file"]
