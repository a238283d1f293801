"""What a Redis error that is not a lost connection does to the store (a real redis-server): an error reply refuses that
one command (a write not stored, a read a miss) and the tier stays up, so the reads go on while writes are refused;
any other redis-py error on a read is a miss too, never raised to the caller."""

from __future__ import annotations

import pytest
import redis
import torch
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from redisproc import TEST_SECRET
from shared_store import refusing_writes, taking_writes
from test_store import BLOCK_BYTES, Clock, M, ok, seg, store

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_a_refused_write_fails_that_write_only_and_reads_go_on(redis_url, how):
    clock = Clock()
    st = store(blocks=4, redis_url=redis_url, clock=clock, redis_retry_s=5)
    client = redis.Redis.from_url(redis_url)
    a = seg(range(64))
    ka = st.put(a, "t").key
    kb = st.put(seg(range(100, 164)), "t").key  # A's 4 blocks down to Redis
    refusing_writes(client, how)
    try:
        st.put(seg(range(200, 264)), "t")  # B's blocks go down: refused, so B is lost
        stats = st.stats().redis
        assert stats["errors"] >= 1 and ("OutOfMemory" if how == "oom" else "ReadOnly") in stats["last_error"]
        assert stats["available"] is True and st.redis_up() is True, "Redis answered: it is up"
        assert kb not in st.keys("t")
        assert torch.equal(st.get(ka, "t").kv, a.kv), "reads go on while writes are refused"
        assert st.residency.pending == {} and not st.residency.outbox
        ok(st)
    finally:
        taking_writes(client, how)
    d = seg(range(300, 364))
    kd = st.put(d, "t").key  # A goes down again (Redis has it: its TTL restarts)
    st.put(seg(range(400, 464)), "t")  # D goes down: no retry interval to wait for, stored at once
    assert st.stats().redis["puts"] == 8 and torch.equal(st.get(kd, "t").kv, d.kv)
    ok(st)


def test_a_refused_read_is_a_miss_the_other_commands_still_answer(redis_url):
    """A replica whose ACL refuses MGET (NOPERM): reading an entry's blocks is a miss; its record, the lookups and
    the other replicas are untouched, and the tier is not taken down."""
    client = redis.Redis.from_url(redis_url)
    client.execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~*", "+@all", "-mget")
    host, port = client.connection_pool.connection_kwargs["host"], client.connection_pool.connection_kwargs["port"]
    sharing = dict(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_secret=TEST_SECRET, device="cpu",
                   share_entries=True)
    writer = PagedStore(StoreConfig(redis_url=redis_url, **sharing))
    reader = PagedStore(StoreConfig(redis_url=f"redis://reader:pw@{host}:{port}/0", **sharing))
    a = seg(range(40))
    key = writer.put(a, "t").key
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert "NoPermission" in reader.stats().redis["last_error"] and reader.redis_up() is True
    assert client.exists(writer.redis.commands.entry_key(key)), "the record stays"
    assert reader.lookup(torch.arange(40), "t", M, torch.float32).key == key, "records and EXISTS still answer"
    assert torch.equal(PagedStore(StoreConfig(redis_url=redis_url, **sharing)).get(key, "t").kv, a.kv)
    ok(reader)


class _Raising:
    """redis-py's client, but every read raises `exc` (as redis-py would from the reply parser or the arguments)."""

    def __init__(self, real, exc: Exception):
        self._real, self._exc = real, exc

    def mget(self, *args, **kwargs):
        raise self._exc

    def pipeline(self, *args, **kwargs):
        return _RaisingPipeline(self._exc)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _RaisingPipeline:
    def __init__(self, exc: Exception):
        self._exc = exc

    def __getattr__(self, name):
        return lambda *args, **kwargs: self

    def execute(self, *args, **kwargs):
        raise self._exc


class _OtherRedisError(redis.exceptions.RedisError):
    pass


@pytest.mark.parametrize("exc", [redis.exceptions.InvalidResponse("Protocol Error: b'?'"),
                                 redis.exceptions.DataError("Invalid input of type"), _OtherRedisError("other")],
                         ids=["InvalidResponse", "DataError", "RedisError"])
def test_any_redis_py_error_on_a_read_is_a_miss_never_raised(redis_url, exc):
    sharing = dict(capacity_bytes=4 * BLOCK_BYTES, max_layouts=1, redis_secret=TEST_SECRET, device="cpu",
                   redis_url=redis_url)
    writer = PagedStore(StoreConfig(share_entries=True, **sharing))
    shared = seg(range(500, 540))
    shared_key = writer.put(shared, "t").key
    reader = PagedStore(StoreConfig(share_entries=True, **sharing))
    local = store(blocks=4, redis_url=redis_url)
    a = seg(range(64))
    ka = local.put(a, "t").key
    local.put(seg(range(100, 164)), "t")  # A's blocks down to Redis
    for st in (reader, local):
        st.redis.commands.client = _Raising(st.redis.commands.client, exc)
    with pytest.raises(NotFound):
        local.get(ka, "t")  # its blocks: MGET
    assert local.lookup(torch.arange(70), "t", M, torch.float32).num_tokens == 0  # the rest of a prefix: EXISTS
    with pytest.raises(NotFound):
        local.get_prefix(torch.arange(70), "t", M, torch.float32, 64)
    with pytest.raises(NotFound):
        reader.get(shared_key, "t")  # its record: GET and PTTL
    assert reader.lookup(torch.arange(500, 540), "t", M, torch.float32).key is None
    assert reader.delete(shared_key, "t") == 0  # its record and derived set
    for st in (reader, local):
        assert type(exc).__name__ in st.stats().redis["last_error"]
        ok(st)
    assert torch.equal(writer.get(shared_key, "t").kv, shared.kv)
