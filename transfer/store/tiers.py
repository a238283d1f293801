"""Tiers below the device pool: a CPU tier (LRU, bounded in bytes) and a Redis/Valkey tier shared by replicas, on one
server or a Redis Cluster (`redis+cluster://host:port[,host:port...]`: redis_url; its commands: redis_commands and
redis_cluster, where a write is acknowledged once a replica confirms it).

Both hold single blocks `[L, 2, H_kv, block_size, D]` keyed by block hash. Redis values are block blobs (`block_blob`:
safetensors with the layout key, a sum64 checksum and a tag in the metadata; redis_auth: the tag is a keyed BLAKE3
under the replicas' secret, over the value and its Redis key). What is read back is served only when its tag checks
out, then its checksum, then its layout, dtype and shape against the layout its entry's record states; anything else
is a miss, counted in `RedisStats.rejected` by kind (block, record, derived) and logged once per read; a rejected block
is deleted (a replica's write puts it back). The same checks hold on one server and on a cluster. With a Redis tier
below, the CPU tier takes each copy's sum64 as it writes it (`block_sums`), for the put that may follow. The entry
records of shared entries, in the same Redis: redis_records.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.store.block_blob import (
    BlockSums,
    block_parts,
    block_sums,
    decode_block,
    encode_block,
    fitting,
)
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.kv_blocks import BlockHash
from kvbridge.transfer.store.redis_auth import RedisAuth
from kvbridge.transfer.store.redis_cluster import ClusterCommands
from kvbridge.transfer.store.redis_commands import BLOCK_PREFIX, Commands, NodeCommands
from kvbridge.transfer.store.redis_records import RedisRecords
from kvbridge.transfer.store.redis_url import check_redis_url, is_cluster_url, parse_cluster_url, shown_url

__all__ = ["CpuTier", "RedisTier", "RedisStats", "BlockReads",  # and, from block_blob, what callers import from here:
           "BlockSums", "block_sums", "block_parts", "encode_block", "decode_block"]

log = logging.getLogger(__name__)


class CpuTier:
    """Blocks in host memory (pinned when CUDA is present), least recently used evicted first. With `checksums`
    (a Redis tier below), each copy's sum64 is taken as it is written, for the put that may follow."""

    def __init__(self, capacity_bytes: int, pin_memory: bool = False, checksums: bool = False):
        if capacity_bytes < 0:
            raise ValueError(f"cpu tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self.checksums = checksums
        self._blocks: OrderedDict[BlockHash, tuple[str, torch.Tensor]] = OrderedDict()
        self.bytes_used = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self):
        return self._blocks.keys()

    def put(self, block_hash: BlockHash, layout_key: str,
            block: torch.Tensor) -> list[tuple[BlockHash, str, torch.Tensor]]:
        """Store a copy of block ([L, 2, H, bs, D]); returns the blocks evicted to make room (LRU first).
        A block larger than the whole tier is returned as evicted at once."""
        nbytes = block.numel() * block.element_size()
        if nbytes > self.capacity_bytes:
            return [(block_hash, layout_key, block.to("cpu"))]
        evicted = []
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return evicted
        while self.bytes_used + nbytes > self.capacity_bytes:
            h, (key, old) = self._blocks.popitem(last=False)
            self.bytes_used -= old.numel() * old.element_size()
            evicted.append((h, key, old))
        copy = torch.empty(block.shape, dtype=block.dtype, pin_memory=self.pin_memory)
        copy.copy_(block)
        if self.checksums:
            block_sums.take(copy)
        self._blocks[block_hash] = (layout_key, copy)
        self.bytes_used += nbytes
        return evicted

    def copy_of(self, block_hash: BlockHash) -> tuple[str, torch.Tensor] | None:
        """(layout key, the tier's copy) of a block held here, left in place and in its LRU place (read it, never
        write into it)."""
        return self._blocks.get(block_hash)

    def pop(self, block_hash: BlockHash) -> tuple[str, torch.Tensor] | None:
        item = self._blocks.pop(block_hash, None)
        if item is not None:
            self.bytes_used -= item[1].numel() * item[1].element_size()
        return item

    def check(self) -> list[str]:
        total = sum(t.numel() * t.element_size() for _, t in self._blocks.values())
        problems = []
        if total != self.bytes_used:
            problems.append(f"cpu tier counts {self.bytes_used} bytes, holds {total}")
        if self.bytes_used > self.capacity_bytes:
            problems.append(f"cpu tier holds {self.bytes_used} bytes, over its capacity {self.capacity_bytes}")
        return problems


@dataclass
class RedisStats:
    puts: int = 0
    refreshes: int = 0  # blocks not sent again: Redis still had them, their TTL restarted
    gets: int = 0
    hits: int = 0
    # values read and not served, by kind: failed authentication (forged, moved from another key, another secret),
    # checksum, or the layout their record states
    rejected: dict = field(default_factory=lambda: {"block": 0, "record": 0, "derived": 0})
    corrupt: int = 0  # rejected blocks, deleted from Redis
    errors: int = 0
    unreplicated: int = 0  # writes a primary answered and no replica confirmed in time (a cluster): not stored
    available: bool = True
    down_since: float | None = None
    last_error: str = ""

    def as_dict(self) -> dict:
        return {**vars(self), "rejected": dict(self.rejected)}


def _error_text(exc: Exception) -> str:
    """An error in a line of printable text (redis-py's may quote a command's arguments: block bytes), cut short."""
    text = "".join(c if c.isprintable() else "?" for c in f"{type(exc).__name__}: {exc}")
    return text if len(text) <= 240 else text[:240] + "..."


class BlockReads(dict):
    """RedisTier.get_many's answer: the blocks served, by hash. `answered` is False when Redis gave no answer (the tier
    down, or the read failed): a block missing from it may still be there. When True, the blocks missing from it are
    not there to serve (absent, or rejected and deleted)."""

    def __init__(self, found=(), answered: bool = True):
        super().__init__(found)
        self.answered = answered


class RedisTier(RedisRecords):
    """Blocks in Redis/Valkey under `kvbridge:2:blk:<hash>` with a TTL, on one server or a cluster (by the URL's scheme:
    redis_url). When Redis is unreachable, every call degrades to a miss / no-op, the tier reports itself down, and a
    reconnect is tried every `retry_s` seconds. Any other redis-py error (an error reply: OOM, READONLY, NOPERM, ...;
    a reply it cannot parse; an argument it cannot send) fails that one call only, never raised: a write is not
    stored, a read is a miss (counted in `errors`, logged); the tier stays up, so reads go on while writes are refused.

    Every value is tagged with `secret` (at least 32 bytes, the same in every replica that shares the Redis) and
    checked when read (redis_auth). secret=None tags values under a public key, which catches corruption and values
    moved to another key but not forgeries: the tier then logs a warning once, as it is made."""

    PREFIX = BLOCK_PREFIX

    def __init__(self, url: str, ttl_s: int = 3600, retry_s: float = 2.0, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, secret: bytes | None = None):
        if ttl_s <= 0:
            raise ValueError(f"redis tier ttl must be > 0 seconds, got {ttl_s}")
        check_redis_url(url)
        self.url = url
        self.shown_url = shown_url(url)  # for logs: no password
        self.ttl_s = int(ttl_s)
        self.retry_s = retry_s
        self.clock = clock
        self.commands: Commands = (ClusterCommands(parse_cluster_url(url), timeout_s) if is_cluster_url(url)
                                   else NodeCommands(url, timeout_s))
        self._errors = self.commands.errors
        self._refusals = self.commands.refusals
        self._troubles = self._errors + self._refusals  # what a call may raise that `trouble` handles
        self.stats = RedisStats()
        self._next_try = 0.0
        self._falling_short = False  # the last write's replicas fell short (logged once until they confirm again)
        self.auth = RedisAuth(secret)
        if secret is None:
            log.warning("redis tier %s has no secret: anyone who can write to it can plant KV and entry records for "
                        "any tenant (values are checked for corruption and placement only)", self.shown_url)

    def _rejected(self, kind: str, found: list[tuple[bytes, str]]) -> None:
        """Count values not served, with one log line for them (the kind and first key, never the secret)."""
        self.stats.rejected[kind] += len(found)
        log.warning("redis tier: not serving %d %s value(s) read back; first %s: %s", len(found), kind,
                    found[0][0].decode(errors="replace")[:80], found[0][1])

    def _send_sets(self, items: list[tuple[bytes, bytes, memoryview]]) -> list[bytes]:
        """SET key (head + data) EX ttl for each (key, head, the block's bytes), pipelined, each head sealed
        (redis_auth) as the blocks before it are sent; the keys whose writes replicas did not confirm (a cluster's
        WAIT: redis_cluster)."""
        return self.commands.send_sets(items, self.ttl_s, self.auth.seal_block)

    def _short(self, unconfirmed: list[bytes]) -> int:
        """How many writes replicas did not confirm, counted and logged once until writes are confirmed again."""
        short = len(unconfirmed)
        if short:
            self.stats.unreplicated += short
            if not self._falling_short:
                log.warning("redis tier %s: %d write(s) a primary answered were not confirmed by its replicas in "
                            "time; reported as not stored", self.shown_url, short)
        self._falling_short = bool(short)
        return short

    def _key(self, block_hash: BlockHash) -> bytes:
        return self.PREFIX + block_hash.hex().encode()

    def usable(self) -> bool:
        """Up, or due for another try (no round trip)."""
        return self._usable()

    def _usable(self) -> bool:
        return self.stats.available or self.clock() >= self._next_try

    def _ok(self) -> None:
        if not self.stats.available:
            log.warning("redis tier %s is reachable again", self.shown_url)
        self.stats.available = True
        self.stats.down_since = None

    def failed(self, exc: Exception) -> None:
        """A round trip that failed (Redis out of reach): counted, logged when the tier goes down, and the tier down
        until its next try."""
        self.stats.errors += 1
        self.stats.last_error = _error_text(exc)
        if self.stats.available:
            log.warning("redis tier %s is down (%s); serving from local tiers", self.shown_url, self.stats.last_error)
            self.stats.down_since = self.clock()
        self.stats.available = False
        self._next_try = self.clock() + self.retry_s

    def trouble(self, exc: Exception) -> None:
        """A call that raised one of `_troubles`: `failed` when Redis is out of reach, `refused` otherwise."""
        (self.failed if isinstance(exc, self._errors) else self.refused)(exc)

    def refused(self, exc: Exception) -> None:
        """A command that failed without the connection (an error reply, a reply or an argument redis-py could not
        handle): counted and logged (once while the same error repeats); that call's write is not stored, its read a
        miss, and the tier stays up."""
        self.stats.errors += 1
        text = _error_text(exc)
        if text != self.stats.last_error:
            log.warning("redis tier %s: a command failed (%s); that call only: a write not stored, a read a miss",
                        self.shown_url, text)
        self.stats.last_error = text

    def put_many(self, items: list[tuple[BlockHash, str, torch.Tensor]]) -> bool:
        """SET with TTL for each (hash, layout_key, block). False when the tier is down (nothing stored) or, on a
        cluster, when replicas did not confirm them all (redis_cluster)."""
        if not items or not self._usable():
            return False if items else True
        try:
            sets = [(self._key(h), *block_parts(layout_key, block)) for h, layout_key, block in items]
            short = self._short(self._send_sets(sets))
        except self._troubles as exc:
            self.trouble(exc)
            return False
        self._ok()
        self.stats.puts += len(items) - short
        return not short

    def refresh_many(self, hashes: list[BlockHash]) -> list[bool] | None:
        """EXPIRE each block's key with the tier's TTL, as a SET of it would: for each hash, whether Redis still had
        it (False: expired, evicted or deleted there; send it again). None when the tier is down."""
        if not hashes or not self._usable():
            return [] if not hashes else None
        try:
            pipe = self.commands.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.expire(self._key(block_hash), self.ttl_s)
            found = [bool(x) for x in pipe.execute()]
        except self._troubles as exc:
            self.trouble(exc)
            return None
        self._ok()
        self.stats.refreshes += sum(found)
        return found

    def exists_many(self, hashes: list[BlockHash]) -> list[bool]:
        if not hashes or not self._usable():
            return [False] * len(hashes)
        try:
            pipe = self.commands.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self._key(block_hash))
            found = [bool(x) for x in pipe.execute()]
        except self._troubles as exc:
            self.trouble(exc)
            return [False] * len(hashes)
        self._ok()
        return found

    def get_many(self, hashes: list[BlockHash], layout: PoolLayout | str) -> BlockReads:
        """The blocks found whose tag, checksum, layout key, dtype and shape ([L, 2, H_kv, block_size, D] of
        `layout`) check out: views of the received bytes (read them, never write into them). The others are misses,
        counted and deleted. A bare layout key (a caller without the layout, e.g. a benchmark) checks the key only.
        Nothing (answered False) when the tier is down or the read fails."""
        if not hashes:
            return BlockReads()
        if not self._usable():
            return BlockReads(answered=False)
        keys = [self._key(h) for h in hashes]
        try:
            blobs = self.commands.mget(keys)
        except self._troubles as exc:
            self.trouble(exc)
            return BlockReads(answered=False)
        self._ok()
        self.stats.gets += len(hashes)
        found = BlockReads()
        rejected, bad = [], []
        there = [(h, key, blob) for h, key, blob in zip(hashes, keys, blobs) if blob is not None]
        checked = self.commands.both_ways(lambda key, blob: self._checked(key, blob, layout),
                                          [(key, blob) for _, key, blob in there])
        for (block_hash, key, _), block in zip(there, checked):
            if isinstance(block, ValueError):  # ForgedValue among them
                rejected.append((key, str(block)))
                bad.append(block_hash)
            else:
                found[block_hash] = block
        self.stats.hits += len(found)
        if bad:  # deleted, not left to be refreshed as if held (a replica's write puts the block back)
            self._rejected("block", rejected)
            self.stats.corrupt += len(bad)
            self.delete_many(bad)
        return found

    def _checked(self, key: bytes, blob: bytes, layout: PoolLayout | str) -> torch.Tensor:
        self.auth.open_block(key, blob)  # nothing else is parsed before it checks out
        # the sum64 too, though the tag covers every byte: the tag was taken over the bytes as they were sent, the
        # sum where the CPU tier copied them; a write between the two (one torch's version counter misses) leaves a
        # blob whose tag checks out and whose sum does not (tests/test_store_redis_sums.py)
        return fitting(*decode_block(blob), layout)

    def delete_many(self, hashes: list[BlockHash]) -> None:
        if not hashes or not self._usable():
            return
        try:
            self.commands.client.delete(*[self._key(h) for h in hashes])
        except self._troubles as exc:
            self.trouble(exc)
            return
        self._ok()

    def ping(self) -> bool:
        """Probe the server now (ignores the retry interval); updates availability."""
        try:
            self.commands.ping()
        except self._troubles as exc:
            self.trouble(exc)
            return False
        self._ok()
        return True
