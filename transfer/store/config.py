"""The store's configuration and the plain results its methods return."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.errors import CapacityError
from kvbridge.transfer.store.redis_auth import MIN_SECRET_BYTES
from kvbridge.transfer.store.redis_url import check_redis_url

NO_TTL = math.inf  # put's and refresh's ttl_s: the entry never expires, whatever default_ttl_s says
MAX_TTL_S = 10 * 365 * 86400.0  # the longest finite TTL taken (ten years); NO_TTL for longer


def check_ttl(name: str, value: float | None) -> None:
    """ValueError naming `name` unless value is None, NO_TTL or in (0, MAX_TTL_S]: NaN passed `<= 0` and stopped
    every later entry's expiry (the expiry heap compared nothing past it), and a TTL near the float's largest made
    the Redis tier's milliseconds overflow, which took the tier down for every tenant."""
    if value is not None and value != NO_TTL and not 0 < value <= MAX_TTL_S:
        raise ValueError(f"{name} must be > 0 and at most {MAX_TTL_S:.0f} s (ten years), or None or infinite "
                         f"(never), got {value}")


@dataclass(frozen=True)
class StoreConfig:
    capacity_bytes: int | None = None  # device pool budget over all layouts; None: capacity_fraction of free memory
    capacity_fraction: float = 0.5  # of free CUDA memory (or of RAM on a CPU-only store) when capacity_bytes is None
    block_size: int = 16  # tokens per block (vLLM's default)
    max_layouts: int = 4  # layouts (model, dtype) held at once (source + a few projected models); they share all of
    # capacity_bytes (budget: one byte count, no per-layout share)
    slab_bytes: int = 256 << 20  # a pool grows and shrinks by slabs of about this size (at most capacity / 32): big
    # enough that a gather touches few of them, small enough that the last, partly used one wastes little
    cpu_capacity_bytes: int = 0  # 0: no CPU tier
    # None: no Redis tier. One server (redis://host:port/db, rediss://, unix://) or a Redis Cluster
    # (redis+cluster://host:port[,host:port...][?wait_replicas=1&wait_timeout_ms=250]: redis_url)
    redis_url: str | None = None
    # the secret every replica on that Redis signs and checks its values with (redis_auth.read_secret_file; at least
    # 32 bytes). A Redis tier needs one, or redis_insecure: an explicit opt-out (a warning is logged) for a Redis no
    # one else can write to, where values are checked for corruption and placement only, not forgery
    redis_secret: bytes | None = field(default=None, repr=False)
    redis_insecure: bool = False
    redis_ttl_s: int = 3600
    redis_retry_s: float = 2.0
    default_ttl_s: float | None = None  # entry TTL when put() gives none; None: until evicted or deleted
    device: str = "auto"
    share_entries: bool = False  # with Redis: entry records and new blocks written through, so replicas find them
    tenant_max_entries: int | None = None  # entries one tenant may hold; None: no quota
    tenant_max_pinned_bytes: int | None = None  # device bytes one tenant's pinned entries may hold; None: no quota

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if not 0 < self.capacity_fraction <= 1:
            raise ValueError(f"capacity_fraction must be in (0, 1], got {self.capacity_fraction}")
        if self.max_layouts < 1:
            raise ValueError(f"max_layouts must be >= 1, got {self.max_layouts}")
        if self.slab_bytes < 1:
            raise ValueError(f"slab_bytes must be >= 1, got {self.slab_bytes}")
        if self.cpu_capacity_bytes < 0:
            raise ValueError(f"cpu_capacity_bytes must be >= 0, got {self.cpu_capacity_bytes}")
        for name in ("tenant_max_entries", "tenant_max_pinned_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)}")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        if self.redis_url is not None and self.redis_secret is None and not self.redis_insecure:
            raise ValueError("redis_url is set without redis_secret: whoever can write to that Redis could plant KV "
                             "and entry records for any tenant. Give the secret the replicas share "
                             "(redis_auth.read_secret_file), or set redis_insecure=True to accept that")
        if self.redis_secret is not None and self.redis_insecure:
            raise ValueError("redis_secret and redis_insecure contradict each other: give one")
        if self.redis_secret is not None and len(self.redis_secret) < MIN_SECRET_BYTES:
            raise ValueError(f"redis_secret needs at least {MIN_SECRET_BYTES} bytes, got {len(self.redis_secret)}")
        check_ttl("default_ttl_s", self.default_ttl_s)


class QuotaExceeded(CapacityError):
    """A tenant's quota (entries, pinned bytes) would be exceeded; the store is unchanged."""


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


def default_capacity(device: torch.device, fraction: float) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * fraction)


@dataclass
class TenantUsage:
    entries: int = 0
    tokens: int = 0  # tokens held in the tenant's entries
    bytes_used: dict = field(default_factory=dict)  # tier -> bytes of the tenant's distinct blocks there
