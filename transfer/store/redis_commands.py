"""How the Redis tier's commands reach one Redis server (`NodeCommands`), and what that shares with a Redis Cluster
(`Commands`; the cluster's own: redis_cluster.ClusterCommands): the tier's key names, the packed SETs that send each
block from its tensor while the blocks' tags are computed by the caller and the Redis tiers' one thread together
(`Sealing`; the thread also checks every other block read back), and redis-py's client behind a few calls, so that
RedisTier reads the same on both.

Keys: a block is `kvbridge:blk:<hash hex>`, an entry's record `kvbridge:entry:<entry key>`, the set of the entries
derived from an entry `kvbridge:derived:<entry key>`. On a cluster the entry key is a hash tag
(`kvbridge:entry:{<key>}`, `kvbridge:derived:{<key>}`): an entry's record and its derived set share a slot, so the
DEL of both is one command, atomic, on one shard. Blocks stand alone and spread over the shards by their hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

# "2": the values' format (their tags are keyed BLAKE3; format 1, before 2026-12-04, HMAC-SHA256). A tier shared with
# replicas of the other format is two disjoint key spaces (each misses the other's values), not a forgery alarm.
BLOCK_PREFIX = b"kvbridge:2:blk:"
ENTRY_PREFIX = b"kvbridge:2:entry:"  # entry records (registry.entry_record), so replicas find each other's entries
DERIVED_PREFIX = b"kvbridge:2:derived:"  # a set per source entry: the keys of the entries derived from it

_worker: ThreadPoolExecutor | None = None  # the Redis tiers' thread (sealing, checking), one per process
_worker_made = threading.Lock()

Item = tuple[bytes, bytes, memoryview]  # (key, the blob's header, the block's bytes)
Seal = Callable[[bytes, bytes, memoryview], bytes]  # (key, header, data) -> the header with its tag (redis_auth)


class Commands:
    """What RedisTier asks of Redis. `client` is redis-py's client; `errors` the exceptions that mean Redis cannot
    be reached now (a connection lost or timed out, a cluster down: the tier then reports itself down and degrades
    to misses and no-ops until its next try); `refusals` those that fail one command only (any other redis-py error:
    an error reply such as OOM at maxmemory under noeviction, READONLY from a demoted primary, NOPERM from an ACL;
    a reply redis-py cannot parse; an argument it cannot send): that operation fails, the tier stays up. Caught in
    that order: `errors` first."""

    tagged = False  # entry keys in hash tags (a cluster)
    errors: tuple[type[BaseException], ...] = ()
    refusals: tuple[type[BaseException], ...] = ()
    client = None

    def entry_key(self, key: str) -> bytes:
        return ENTRY_PREFIX + (b"{%s}" % key.encode() if self.tagged else key.encode())

    def derived_key(self, key: str) -> bytes:
        return DERIVED_PREFIX + (b"{%s}" % key.encode() if self.tagged else key.encode())

    def mget(self, keys: list[bytes]) -> list[bytes | None]:
        return self.client.mget(keys)

    def send_sets(self, items: list[Item], ttl_s: int, seal: Seal) -> list[bytes]:
        """SET key (seal(key, head, data) + data) EX ttl_s for each item; the keys whose writes replicas did not
        confirm."""
        raise NotImplementedError

    def confirm(self, written: list[tuple[bytes, int]]) -> list[bytes]:
        """After writes of these (key, its TTL in milliseconds): the keys not confirmed to have reached as many
        replicas as the tier waits for (none on one server: it has no replicas to wait for)."""
        return []

    def ping(self) -> None:
        self.client.ping()

    def both_ways(self, check: Callable, items: list[tuple]) -> list:
        """check(*item) for each item, every other one on the tiers' thread while this one does the rest (the tags
        and checksums of blocks read back, two at a time: hashing releases the GIL); each result, or the ValueError
        it raised."""
        def run(item):
            try:
                return check(*item)
            except ValueError as exc:
                return exc

        theirs = [_thread().submit(run, item) for item in items[1::2]]
        results = [None] * len(items)
        results[0::2] = [run(item) for item in items[0::2]]
        results[1::2] = [future.result() for future in theirs]
        return results



def _thread() -> ThreadPoolExecutor:
    global _worker
    if _worker is None:
        with _worker_made:
            if _worker is None:
                _worker = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-redis")
    return _worker


class Sealing:
    """The items' headers sealed (seal(key, head, data): a block's tag, keyed BLAKE3, ~37 us for 295 kB; HMAC-SHA256,
    ~190 us, when the figures below were taken) by the caller and the Redis tiers' thread together, while blocks are
    sent (hashing and sending release the GIL). The caller seals items in the order it sends them (`head(i)` seals item
    i unless the thread took it), the thread from the last one back, until they meet: the caller waits for the thread at
    most once per call to `sealed`. Where the thread gets no core of its own (a loaded machine) the caller seals most
    blocks itself, as one thread would, instead of handing every block over and back; with a core free, both seal. The
    single-server put, 512 blocks of 295 kB on a 2-core VM (AVX512, 3 alternating runs each): pinned to one core 669
    MB/s, against 625 with the thread sealing every block and 677 sealing all inline before sending; on both cores
    1,188, against 990 and 849."""

    def __init__(self, items: list[Item], seal: Seal):
        self.items = items
        self._seal = seal
        self._heads: list = [None] * len(items)  # the sealed header, or the exception sealing raised
        self._taken = [False] * len(items)
        self._back = len(items) - 1  # the thread's next item: those after it are all taken
        self._stopped = False
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        if len(items) > 1:  # a single item is sealed by the caller
            _thread().submit(self._run)

    def _take(self, i: int | None = None) -> int | None:
        """Take item i (the caller), or the last item nobody has taken (the thread); None when there is none."""
        with self._lock:
            if i is None:
                while self._back >= 0 and self._taken[self._back]:
                    self._back -= 1
                if self._stopped or self._back < 0:
                    return None
                i = self._back
            elif self._taken[i]:
                return None
            self._taken[i] = True
            return i

    def _fill(self, i: int) -> None:
        try:
            head = self._seal(*self.items[i])
        except BaseException as exc:  # raised to the caller by head(i)
            head = exc
        with self._done:
            self._heads[i] = head
            self._done.notify_all()

    def _run(self) -> None:
        while (i := self._take()) is not None:
            self._fill(i)

    def head(self, i: int) -> bytes:
        """Item i's sealed header: sealed here if the thread has not taken it, else when the thread is done."""
        if self._take(i) is not None:
            self._fill(i)
        with self._done:
            self._done.wait_for(lambda: self._heads[i] is not None)
            head = self._heads[i]
        if isinstance(head, BaseException):
            raise head
        return head

    def sealed(self, indices: Iterable[int]) -> Iterator[Item]:
        """The items at these indices with their sealed headers, in that order, each as soon as it is ready."""
        for i in indices:
            key, _, data = self.items[i]
            yield key, self.head(i), data

    def stop(self) -> None:
        """The thread takes no more items (a send failed: what is left is not needed)."""
        with self._lock:
            self._stopped = True


class NodeCommands(Commands):
    """One Redis server (a redis-py URL). A cluster node given by a plain URL answers MOVED / CROSSSLOT for keys of
    other shards: counted as errors, never raised (use a redis+cluster:// URL)."""

    def __init__(self, url: str, timeout_s: float):
        import redis  # imported here: the store works without the package when no Redis tier is configured

        exc = redis.exceptions
        self.errors = (exc.ConnectionError, exc.TimeoutError, OSError)
        # RedisError: every other redis-py error, error replies among them (MOVED, ASK, CROSSSLOT from a cluster node;
        # OOM, READONLY, NOPERM, ...)
        self.refusals = (exc.RedisError,)
        self._response_error = exc.ResponseError
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)

    def send_sets(self, items: list[Item], ttl_s: int, seal: Seal) -> list[bytes]:
        """Pipelined on one connection (packed_sets), the headers sealed as the blocks go (Sealing)."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        sealing = Sealing(items, seal)
        try:
            conn.send_packed_command(packed_sets(sealing.sealed(range(len(items))), ttl_s))
            replies = [conn.read_response() for _ in items]
        except BaseException:
            conn.disconnect()  # replies left unread would answer the next command
            raise
        finally:
            pool.release(conn)
            sealing.stop()
        bad = [r for r in replies if r != b"OK"]
        if bad:  # (an error reply raises in read_response)
            raise self._response_error(f"SET answered {bad[0]!r}")
        return []


def packed_sets(items: Iterable[Item], ttl_s: int, wait: tuple[int, int] | None = None) -> Iterator[bytes]:
    """The RESP of `SET key (head + data) EX ttl_s` for each (key, head, data), then of `WAIT replicas timeout_ms`
    when `wait` gives them: buffers to send in order, each value as its two parts, the block's bytes straight from
    its tensor (redis-py would need them joined into one bytes object: a copy of every block, and on a fresh
    allocation its page faults, which cost more than the copy). Items are taken as they are sent."""
    ttl = str(ttl_s).encode()
    tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    glue = b""
    for key, head, data in items:
        yield glue + b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(head) + len(data)) + head
        yield data
        glue = tail
    if wait is not None:
        args = [b"%d" % n for n in wait]
        glue += b"*3\r\n$4\r\nWAIT\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    yield glue
