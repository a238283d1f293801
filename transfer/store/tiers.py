"""Tiers below the device pool: a CPU tier (LRU, bounded in bytes) and a Redis/Valkey tier shared by replicas.

Both hold single blocks `[L, 2, H_kv, block_size, D]` keyed by block hash. Redis values are safetensors blobs with
the layout key and a sum64 checksum of the tensor bytes in the metadata, written and read without safetensors'
own copies; a blob that fails to parse or to match its checksum is deleted and treated as a miss. Nothing is ever
unpickled. A block's sum64 is taken where the store writes the block's CPU copy, while it is in cache
(`block_sums`), and a put reuses it; a put of a block without one sums it then.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from kvbridge.transfer import tensor_blob
from kvbridge.transfer.checksum import sum64
from kvbridge.transfer.store.kv_blocks import BlockHash

log = logging.getLogger(__name__)


class BlockSums:
    """sum64s of CPU blocks, taken when the store wrote their bytes (in cache: ~15 us for a 295 kB block just
    copied, against ~37 us once it is out of cache), so that a Redis put sends the block without reading it again.

    A sum belongs to one tensor object and counts only while that object lives and its version counter stands where
    it stood when the sum was taken: any in-place torch write to the tensor, or through a view of its storage, bumps
    the counter, and the put then sums the bytes afresh (a stale sum would make every reader drop the blob as
    corrupt). Inference tensors have no version counter: their sums are not kept. Writes that bypass torch
    (through `.numpy()`) are not seen; the store makes none to these copies."""

    def __init__(self):
        self._sums: dict[int, tuple[weakref.ref, int, int]] = {}  # id(block) -> (block, its _version, sum64)

    def take(self, block: torch.Tensor) -> int:
        """Sum a contiguous CPU block's bytes now and keep the sum with the block."""
        assert block.device.type == "cpu" and block.is_contiguous(), "sums are taken of contiguous CPU blocks"
        total = sum64(block.view(torch.uint8).reshape(-1).numpy())
        if not block.is_inference():
            key = id(block)
            ref = weakref.ref(block, functools.partial(self._forget, key))
            self._sums[key] = (ref, block._version, total)
        return total

    def get(self, block: torch.Tensor) -> int | None:
        """The sum taken of this very tensor, if its bytes have not been written since; else None."""
        item = self._sums.get(id(block))
        if item is None or item[0]() is not block or item[1] != block._version:
            return None
        return item[2]

    def _forget(self, key: int, ref: weakref.ref) -> None:
        item = self._sums.get(key)
        if item is not None and item[0] is ref:  # not a newer tensor's sum under a reused id
            self._sums.pop(key, None)

    def __len__(self) -> int:
        return len(self._sums)


block_sums = BlockSums()  # one per process: a tensor's identity is process-wide


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


def block_checksum(data) -> str:
    """sum64 of the block's bytes (a bytes-like object): catches corruption and truncation at memory speed. It is
    not a MAC: whoever can write to Redis is trusted as much as the servers sharing it."""
    return f"{sum64(data):016x}"


def encode_block(layout_key: str, block: torch.Tensor) -> bytes:
    """A safetensors blob holding one block, its layout key and checksum: a small header, then the block's bytes."""
    return b"".join(block_parts(layout_key, block))


def block_parts(layout_key: str, block: torch.Tensor) -> tuple[bytes, memoryview]:
    """encode_block's blob in two parts, without copying the block: (header, a view of the block's bytes). The
    block's sum64 is the one `block_sums` holds for it, or taken now."""
    total = block_sums.get(block)
    block = block.detach().to("cpu").contiguous()
    data = block.view(torch.uint8).reshape(-1).numpy()
    checksum = f"{total:016x}" if total is not None else block_checksum(data)
    head, at = _block_header(layout_key, block.dtype, tuple(block.shape))
    return head[:at] + checksum.encode() + head[at + 16:], memoryview(data)


@functools.lru_cache(maxsize=64)
def _block_header(layout_key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """(the blob's header with a zero checksum, where the checksum's 16 hex digits start in it)."""
    head = tensor_blob.header("kv", dtype, shape, {"layout": layout_key, "sum64": "0" * 16})
    return head, head.index(b'"sum64":"') + len(b'"sum64":"')


def decode_block(blob: bytes) -> tuple[str, torch.Tensor]:
    """Inverse of encode_block: (layout key, the block as a view of the blob's bytes, no copy: read it, never write
    into it). Raises ValueError for a blob that is not one (bad bytes, wrong checksum). Blobs written with a CRC-32
    (before sum64) are still read."""
    try:
        dtype, shape, offset, meta = tensor_blob.parse(blob, "kv")
    except ValueError as exc:
        raise ValueError(f"not a kvbridge block blob: {exc}") from None
    if "layout" not in meta:
        raise ValueError(f"not a kvbridge block blob: no layout in its metadata {sorted(meta)}")
    data = np.frombuffer(blob, dtype=np.uint8, offset=offset)
    if "sum64" in meta:
        ok = block_checksum(data) == meta["sum64"]
    elif "crc32" in meta:
        ok = f"{zlib.crc32(data):08x}" == meta["crc32"]
    else:
        raise ValueError(f"not a kvbridge block blob: no checksum in its metadata {sorted(meta)}")
    if not ok:
        raise ValueError("block blob checksum mismatch: the stored bytes are corrupt")
    return meta["layout"], _read_only_view(blob, dtype, data.size // dtype.itemsize, offset).view(shape)


def _read_only_view(blob: bytes, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    # torch.frombuffer warns (once per process, TORCH_WARN_ONCE) that bytes are not writable: these views are only
    # read (the store copies them into a pool), so that one warning is taken here, at import, and not shown
    return torch.frombuffer(blob, dtype=dtype, count=count, offset=offset)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    _read_only_view(bytes(8), torch.uint8, 8, 0)


@dataclass
class RedisStats:
    puts: int = 0
    refreshes: int = 0  # blocks not sent again: Redis still had them, their TTL restarted
    gets: int = 0
    hits: int = 0
    corrupt: int = 0
    errors: int = 0
    available: bool = True
    down_since: float | None = None
    last_error: str = ""


class RedisTier:
    """Blocks in Redis/Valkey under `kvbridge:blk:<hash>` with a TTL. When the server is unreachable every call
    degrades to a miss / no-op, the tier reports itself down, and a reconnect is tried every `retry_s` seconds."""

    PREFIX = b"kvbridge:blk:"
    ENTRY_PREFIX = b"kvbridge:entry:"  # entry records (registry.entry_record), so replicas find each other's entries
    DERIVED_PREFIX = b"kvbridge:derived:"  # a set per source entry: the keys of the entries derived from it

    def __init__(self, url: str, ttl_s: int = 3600, retry_s: float = 2.0, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        import redis  # imported here: the store works without the package when no Redis tier is configured

        if ttl_s <= 0:
            raise ValueError(f"redis tier ttl must be > 0 seconds, got {ttl_s}")
        self.url = url
        self.ttl_s = int(ttl_s)
        self.retry_s = retry_s
        self.clock = clock
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False)
        self.stats = RedisStats()
        self._next_try = 0.0
        self._redis = redis

    def _send_sets(self, items: list[tuple[bytes, bytes, memoryview]]) -> None:
        """SET key (head + data) EX ttl for each item, pipelined on one connection. The commands are packed here so
        that each value goes out as its two parts, the block's bytes straight from its tensor (redis-py would need
        them joined into one bytes object: a copy of every block)."""
        ttl = str(self.ttl_s).encode()
        tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
        parts, glue = [], b""
        for key, head, data in items:
            command = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(head) + len(data))
            parts += [glue + command + head, data]
            glue = tail
        parts.append(glue)
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(parts)
            replies = [conn.read_response() for _ in items]
        except BaseException:
            conn.disconnect()  # replies left unread would answer the next command
            raise
        finally:
            pool.release(conn)
        bad = [r for r in replies if r != b"OK"]
        if bad:  # (an error reply raises in read_response)
            raise self._redis.exceptions.ResponseError(f"SET answered {bad[0]!r}")

    def _key(self, block_hash: BlockHash) -> bytes:
        return self.PREFIX + block_hash.hex().encode()

    def usable(self) -> bool:
        """Up, or due for another try (no round trip)."""
        return self._usable()

    def _usable(self) -> bool:
        return self.stats.available or self.clock() >= self._next_try

    def _ok(self) -> None:
        if not self.stats.available:
            log.warning("redis tier %s is reachable again", self.url)
        self.stats.available = True
        self.stats.down_since = None

    def _failed(self, exc: Exception) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        if self.stats.available:
            log.warning("redis tier %s is down (%s); serving from local tiers", self.url, self.stats.last_error)
            self.stats.down_since = self.clock()
        self.stats.available = False
        self._next_try = self.clock() + self.retry_s

    def put_many(self, items: list[tuple[BlockHash, str, torch.Tensor]]) -> bool:
        """SET with TTL for each (hash, layout_key, block). False when the tier is down (nothing stored)."""
        if not items or not self._usable():
            return False if items else True
        try:
            self._send_sets([(self._key(h), *block_parts(layout_key, block)) for h, layout_key, block in items])
        except self._errors as exc:
            self._failed(exc)
            return False
        self._ok()
        self.stats.puts += len(items)
        return True

    def refresh_many(self, hashes: list[BlockHash]) -> list[bool] | None:
        """EXPIRE each block's key with the tier's TTL, as a SET of it would: for each hash, whether Redis still had
        it (False: expired, evicted or deleted there; send it again). None when the tier is down."""
        if not hashes or not self._usable():
            return [] if not hashes else None
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.expire(self._key(block_hash), self.ttl_s)
            found = [bool(x) for x in pipe.execute()]
        except self._errors as exc:
            self._failed(exc)
            return None
        self._ok()
        self.stats.refreshes += sum(found)
        return found

    def exists_many(self, hashes: list[BlockHash]) -> list[bool]:
        if not hashes or not self._usable():
            return [False] * len(hashes)
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self._key(block_hash))
            found = [bool(x) for x in pipe.execute()]
        except self._errors as exc:
            self._failed(exc)
            return [False] * len(hashes)
        self._ok()
        return found

    def get_many(self, hashes: list[BlockHash], layout_key: str) -> dict[BlockHash, torch.Tensor]:
        """The blocks found, valid and of this layout (views of the received bytes: read them, never write into
        them); corrupt ones are deleted and counted."""
        if not hashes or not self._usable():
            return {}
        try:
            blobs = self._client.mget([self._key(h) for h in hashes])
        except self._errors as exc:
            self._failed(exc)
            return {}
        self._ok()
        self.stats.gets += len(hashes)
        found: dict[BlockHash, torch.Tensor] = {}
        bad = []
        for block_hash, blob in zip(hashes, blobs):
            if blob is None:
                continue
            try:
                key, block = decode_block(blob)
            except ValueError as exc:
                log.warning("redis tier: dropping block %s: %s", block_hash.hex(), exc)
                self.stats.corrupt += 1
                bad.append(block_hash)
                continue
            if key != layout_key:
                self.stats.corrupt += 1
                bad.append(block_hash)
                continue
            found[block_hash] = block
        self.stats.hits += len(found)
        if bad:
            self.delete_many(bad)
        return found

    def delete_many(self, hashes: list[BlockHash]) -> None:
        if not hashes or not self._usable():
            return
        try:
            self._client.delete(*[self._key(h) for h in hashes])
        except self._errors as exc:
            self._failed(exc)
            return
        self._ok()

    def put_entries(self, items: list[tuple[str, bytes, str | None]]) -> bool:
        """SET with TTL for each (entry key, record, source entry key or None), and the key added to its source's
        derived set. False when the tier is down."""
        if not items or not self._usable():
            return False if items else True
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, record, source_key in items:
                pipe.set(self.ENTRY_PREFIX + key.encode(), record, ex=self.ttl_s)
                if source_key is not None:
                    pipe.sadd(self.DERIVED_PREFIX + source_key.encode(), key)
                    pipe.expire(self.DERIVED_PREFIX + source_key.encode(), self.ttl_s)
            pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return False
        self._ok()
        return True

    def get_entries(self, keys: list[str]) -> dict[str, bytes]:
        """The records found (a miss when the tier is down)."""
        if not keys or not self._usable():
            return {}
        try:
            blobs = self._client.mget([self.ENTRY_PREFIX + k.encode() for k in keys])
        except self._errors as exc:
            self._failed(exc)
            return {}
        self._ok()
        return {k: b for k, b in zip(keys, blobs) if b is not None}

    def derived_entries(self, keys: list[str]) -> list[str]:
        """The keys of the entries recorded as derived from these (none when the tier is down)."""
        if not keys or not self._usable():
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.smembers(self.DERIVED_PREFIX + k.encode())
            sets = pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return []
        self._ok()
        return sorted({m.decode() for members in sets for m in members})

    def delete_entries(self, keys: list[str]) -> None:
        """The records of these entries, and their derived sets."""
        if not keys or not self._usable():
            return
        try:
            self._client.delete(*[prefix + k.encode() for k in keys
                                  for prefix in (self.ENTRY_PREFIX, self.DERIVED_PREFIX)])
        except self._errors as exc:
            self._failed(exc)
            return
        self._ok()

    def ping(self) -> bool:
        """Probe the server now (ignores the retry interval); updates availability."""
        try:
            self._client.ping()
        except self._errors as exc:
            self._failed(exc)
            return False
        self._ok()
        return True
