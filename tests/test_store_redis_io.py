"""The store's lock is never held across a Redis round trip (issue 16, part 5): every Redis call is made without
it, and a call stuck in Redis does not hold up another thread's work on the local tiers. A real redis-server."""

from __future__ import annotations

import threading

import pytest
import redis
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from redisproc import TEST_SECRET
from shared_store import assert_found_by_another_replica, refusing_writes, seeded_segment, taking_writes

pytestmark = pytest.mark.integration

M = ModelIdentity("model-r", "r" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4


def _seg(first: int, n: int = 64) -> KVSegment:
    return seeded_segment(first, n, M)


def _store(redis_url: str, blocks: int = 4) -> PagedStore:
    return PagedStore(StoreConfig(capacity_bytes=blocks * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                  redis_secret=TEST_SECRET, device="cpu"))


def test_no_redis_call_is_made_under_the_store_lock(redis_url):
    store = _store(redis_url)
    calls = []
    for name in ("put_many", "refresh_many", "get_many", "exists_many", "delete_many"):
        real = getattr(store.redis, name)

        def watched(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, store._lock._is_owned()))
            return _real(*args, **kwargs)

        setattr(store.redis, name, watched)
    a, b = _seg(0), _seg(1000)
    ka = store.put(a, "t").key
    kb = store.put(b, "t").key  # evicts A to Redis
    found = store.lookup(torch.arange(0, 80), "t", M, torch.float32)  # a longer text: the prefix path
    assert found.tier == "redis" and found.num_tokens == 64
    assert torch.equal(store.get(ka, "t").kv, a.kv)  # back from Redis (and B down to it)
    assert torch.equal(store.get(kb, "t").kv, b.kv)  # B back, A down again: already in Redis (refresh_many)
    store.pin(ka, "t")
    store.refresh(kb, "t", pin=False)
    assert store.delete(ka, "t") == 1 and store.delete(kb, "t") == 1  # (Redis blocks are left to their TTL)
    assert {name for name, _ in calls} == {"put_many", "refresh_many", "get_many", "exists_many"}
    assert [c for c in calls if c[1]] == []  # not one of them with the lock held
    assert store.check() == [] and store.residency.pending == {} and not store.residency.outbox


def test_a_call_stuck_in_redis_does_not_block_local_work(redis_url):
    store = _store(redis_url, blocks=8)
    a = _seg(0)
    ka = store.put(a, "t").key
    store.put(_seg(1000), "t")
    store.put(_seg(2000), "t")  # A's blocks are in Redis now
    inside, release = threading.Event(), threading.Event()
    real = store.redis.get_many

    def slow_get_many(*args, **kwargs):
        inside.set()
        release.wait(30)
        return real(*args, **kwargs)

    store.redis.get_many = slow_get_many
    got = {}
    reader = threading.Thread(target=lambda: got.update(kv=store.get(ka, "t").kv))
    reader.start()
    try:
        assert inside.wait(30)
        local = store.put(_seg(3000, 16), "t")  # the lock is free while the reader waits on Redis
        assert store.info(local.key, "t").tier == "device"
        assert store.lookup(torch.arange(3000, 3016), "t", M, torch.float32).key == local.key
    finally:
        release.set()
        reader.join(30)
    assert torch.equal(got["kv"], a.kv) and store.check() == []


def test_a_failed_redis_write_loses_its_blocks_cleanly(redis_url, redis_server):
    store = _store(redis_url)
    ka = store.put(_seg(0), "t").key
    store.redis.put_many = lambda items: False  # the tier answers "not stored" (as when it goes down mid-write)
    store.put(_seg(1000), "t")  # A's blocks leave the device for Redis, and the write fails
    assert store.keys("t") != [] and ka not in store.keys("t")
    assert store.residency.pending == {} and store.check() == []


@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_a_redis_error_reply_fails_its_write_and_loses_its_blocks_cleanly(redis_url, how):
    """Redis answers writes with an error (OOM, READONLY): the put whose evictions were to go there still returns
    (it committed), the tier counts the failure and stays up (that write failed, not the connection: reads go on,
    tests/test_store_redis_refusals.py), the blocks not written go as for a connection lost (their entry is lost),
    nothing stays pending; a replica sharing entries through the same Redis keeps serving its own; once Redis takes
    writes again, so does the tier."""
    clock = {"now": 0.0}
    store = PagedStore(StoreConfig(capacity_bytes=4 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                   redis_secret=TEST_SECRET, device="cpu", redis_retry_s=5),
                       clock=lambda: clock["now"])
    sharing = _sharing_small(redis_url)
    client = redis.Redis.from_url(redis_url)
    ka = store.put(_seg(0), "t").key  # A: 4 blocks, the device full
    refusing_writes(client, how)
    try:
        b = _seg(1000)
        kb = store.put(b, "t").key  # A's blocks leave the device for Redis, whose answer is an error
        stats = store.stats()
        assert stats.redis["available"] is True and stats.redis["errors"] >= 1
        assert ("OutOfMemoryError" if how == "oom" else "ReadOnlyError") in stats.redis["last_error"]
        assert store.keys("t") == [kb] and stats.lost_entries == 1
        with pytest.raises(NotFound):
            store.get(ka, "t")  # a miss, not an error
        assert store.residency.pending == {} and not store.residency.outbox and store.check() == []
        assert torch.equal(store.get(kb, "t").kv, b.kv)  # local hits keep being served
        c = _seg(2000, 40)
        kc = sharing.put(c, "u", text="written through to a Redis that refuses it").key  # blocks and record
        assert torch.equal(sharing.get(kc, "u").kv, c.kv) and sharing.stats().redis["errors"] >= 1
        assert sharing.residency.pending == {} and not sharing.residency.outbox and sharing.check() == []
    finally:
        taking_writes(client, how)
    store.put(_seg(3000), "t")  # B goes down to Redis now (no retry interval to wait for: the tier stayed up)
    assert store.stats().redis["available"] is True and store.stats().redis["puts"] == 4
    assert torch.equal(store.get(kb, "t").kv, b.kv)  # back from Redis
    assert store.residency.pending == {} and store.check() == []


def test_a_flush_that_raises_fails_no_caller_and_leaves_nothing_pending(redis_url):
    """Whatever goes wrong sending queued writes (here an exception the tier does not expect) is logged and counted
    as a tier failure: the writes count as failed, and the call that happened to send them gets its own result."""
    store = _store(redis_url)
    ka = store.put(_seg(0), "t").key

    def broken(items):
        raise RuntimeError("a bug in the sender")

    store.redis.put_many = broken
    b = _seg(1000)
    kb = store.put(b, "t").key  # A's blocks leave the device; their put raises
    assert store.keys("t") == [kb] and ka not in store.keys("t")
    assert store.stats().redis["errors"] == 1 and "a bug in the sender" in store.stats().redis["last_error"]
    assert store.residency.pending == {} and store.check() == []


def _sharing(redis_url: str) -> PagedStore:
    return PagedStore(StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                  redis_secret=TEST_SECRET, device="cpu", share_entries=True))


def _sharing_small(redis_url: str) -> PagedStore:
    """Shared entries, a 4-block device pool, no CPU tier."""
    return PagedStore(StoreConfig(capacity_bytes=4 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                  redis_secret=TEST_SECRET, device="cpu", share_entries=True))


def test_replicas_find_fetch_and_delete_each_others_entries(redis_url):
    """Two stores on one Redis (two replicas): an entry put in one is found (by key and by its tokens), read
    exactly and with its text in the other, never by another tenant; a Delete in the second makes it gone for any
    replica that did not hold it yet."""
    first, second, third = _sharing(redis_url), _sharing(redis_url), _sharing(redis_url)
    a = _seg(0, 40)
    info = first.put(a, "t", text="forty tokens")  # 2 full blocks + a partial tail, all written through
    assert_found_by_another_replica(second, info, a, "forty tokens", M)
    assert second.delete(info.key, "t") == 1
    with pytest.raises(NotFound):
        third.get(info.key, "t")
    assert first.check() == [] and second.check() == [] and third.check() == []


def test_a_forged_entry_record_is_ignored(redis_url):
    import json

    import redis

    store = _sharing(redis_url)
    info = store.put(_seg(0, 32), "t")
    client = redis.Redis.from_url(redis_url)
    tag, _, blob = client.get(b"kvbridge:2:entry:" + info.key.encode()).partition(b" ")  # `<tag> <record>`
    record = json.loads(blob)
    record["token_ids"][0] += 1  # contents that do not hash to the key
    client.set(b"kvbridge:2:entry:" + info.key.encode(), tag + b" " + json.dumps(record).encode())
    other = _sharing(redis_url)
    with pytest.raises(NotFound):
        other.get(info.key, "t")
    assert other.keys("t") == [] and other.check() == []


def test_a_deleted_entry_is_not_adopted_back_while_its_forget_waits_to_be_sent(redis_url):
    """Delete returns while another thread is still sending the queued Redis writes (its own "forget" among them);
    a get or lookup of the key right after must not adopt the entry back from its record, still in Redis. (Found
    by bench/load_test.py: GetSourceCache answered a key just deleted, and the entry stayed.)"""
    store = _sharing(redis_url)
    a = _seg(0, 40)
    key = store.put(a, "t", text="forty tokens").key  # record and blocks written through
    assert store._sending.acquire(timeout=30)  # another thread is sending: Delete leaves its writes queued
    try:
        assert store.delete(key, "t") == 1
        assert store.residency.outbox  # the forget has not been sent yet
        with pytest.raises(NotFound):
            store.get(key, "t")
        assert store.lookup(torch.arange(0, 40), "t", M, torch.float32).key is None
        assert store.keys("t") == []
    finally:
        store._sending.release()
    store.delete("0" * 32, "t")  # any public call sends what is queued
    assert not store.residency.outbox and store.redis.get_entries([key]) == {}
    with pytest.raises(NotFound):
        _sharing(redis_url).get(key, "t")  # another replica: gone too
    assert store.keys("t") == [] and store.check() == []


def test_a_delete_reaches_entries_only_redis_holds_and_what_derives_from_them(redis_url):
    """A replica that never held an entry (or a server restarted on the same Redis) deletes it, and the entries
    derived from it, from Redis too: Delete counts them, and no record or block of theirs is left. (Found by
    bench/load_test.py: projections made before a restart stayed in Redis after their sources were deleted.)"""
    import redis

    def sharing() -> PagedStore:  # room for the source's layout and the projection's
        return PagedStore(StoreConfig(capacity_bytes=256 * BLOCK_BYTES, max_layouts=2, redis_url=redis_url,
                                      redis_secret=TEST_SECRET, device="cpu", share_entries=True))

    first, second = sharing(), sharing()
    source = first.put(_seg(0, 40), "t", text="forty tokens").key
    target = KVSegment(kv=torch.randn(3, 2, 2, 40, 8), token_ids=torch.arange(500, 540), positions=torch.arange(40),
                       model=ModelIdentity("model-p", "p" * 64), rotated=True)
    projection = first.put(target, "t", adapter="a", source_key=source).key
    other = first.put(_seg(7000, 24), "t").key
    assert second.delete(other, "u") == 0  # another tenant's key: nothing, and nothing adopted
    assert second.delete(other, "t") == 1  # never read by the second: found in Redis all the same
    assert second.delete(source, "t") == 2  # the source and the projection made by the first
    client = redis.Redis.from_url(redis_url)  # no record nor derived set left (full blocks expire by TTL)
    assert list(client.scan_iter(match="kvbridge:2:entry:*")) == []
    assert list(client.scan_iter(match="kvbridge:2:derived:*")) == []
    third = sharing()
    for key in (source, projection, other):
        with pytest.raises(NotFound):
            third.get(key, "t")
    assert second.keys("t") == [] and second.check() == [] and third.check() == []


def test_a_delete_keeps_the_redis_blocks_that_entries_it_does_not_hold_may_share(redis_url):
    """A replica (or a server restarted on the same Redis) cannot see which other entries use a block in Redis:
    deleting one entry must not take the full blocks another entry made elsewhere shares with it. (Found by
    bench/load_test.py: after a restart, deleting a text's entry made its longer version, ingested before the
    restart and not read since, answer NOT_FOUND.)"""
    first, second = _sharing(redis_url), _sharing(redis_url)
    base = first.put(_seg(0, 40), "t").key  # 2 full blocks + a tail
    longer = _seg(0, 72)
    longer.kv[:, :, :, :40] = _seg(0, 40).kv  # the same first 40 tokens and KV: its first 2 blocks are base's
    extended = first.put(longer, "t").key
    assert second.delete(base, "t") == 1  # the second holds neither
    third = _sharing(redis_url)
    assert torch.equal(third.get(extended, "t").kv, longer.kv)
    assert second.check() == [] and third.check() == []


def _sends(store: PagedStore) -> list[int]:
    """For each RedisTier SET the store sends from now on, its block's bytes."""
    sent: list[int] = []
    real = store.redis._send_sets

    def counted(items):
        sent.extend(len(data) for _, _, data in items)
        return real(items)

    store.redis._send_sets = counted
    return sent


def test_a_written_through_block_is_not_sent_again_when_the_device_evicts_it(redis_url):
    """Shared entries with no CPU tier (the server's defaults): a block written through to Redis is already there
    when the device evicts it; only its TTL is restarted (as its SET would have), and it reads back."""
    store = _sharing_small(redis_url)
    sent = _sends(store)
    a = _seg(0)
    ka = store.put(a, "t").key  # 4 blocks written through
    client = redis.Redis.from_url(redis_url)
    keys = [store.redis._key(h) for h in store.registry.get(ka).hashes]
    for k in keys:
        client.expire(k, 5)  # as if written through long ago
    store.put(_seg(1000), "t")  # B written through; A evicted from the device
    assert sent == [BLOCK_BYTES] * 8  # A's 4 and B's 4, each once
    assert all(client.ttl(k) > 5 for k in keys)  # A's TTLs restarted
    assert torch.equal(store.get(ka, "t").kv, a.kv)
    assert store.check() == [] and store.residency.pending == {} and not store.residency.outbox


def test_a_written_through_block_gone_from_redis_is_sent_again_on_eviction(redis_url):
    """The write-through may have expired (or been evicted by Redis) before the device evicts the block: then its
    bytes go again, and the entry still reads back."""
    store = _sharing_small(redis_url)
    sent = _sends(store)
    a = _seg(0)
    ka = store.put(a, "t").key
    client = redis.Redis.from_url(redis_url)
    hashes = store.registry.get(ka).hashes
    client.delete(*[store.redis._key(h) for h in hashes[:2]])  # two of its blocks expired
    store.put(_seg(1000), "t")
    assert sent == [BLOCK_BYTES] * 10  # A's 4 and B's 4 written through, A's 2 expired ones again
    assert torch.equal(store.get(ka, "t").kv, a.kv)
    assert store.check() == [] and store.residency.pending == {}


def test_a_block_read_back_from_redis_is_not_sent_again_when_evicted(redis_url):
    """Without shared entries: a block demoted to Redis, read back, then evicted again is already there."""
    store = _store(redis_url)
    sent = _sends(store)
    a, b = _seg(0), _seg(1000)
    ka, kb = store.put(a, "t").key, store.put(b, "t").key  # A to Redis
    assert torch.equal(store.get(ka, "t").kv, a.kv)  # A back from Redis, B down to it
    assert torch.equal(store.get(kb, "t").kv, b.kv)  # B back, A evicted again: already in Redis
    assert sent == [BLOCK_BYTES] * 8
    assert torch.equal(store.get(ka, "t").kv, a.kv)
    assert store.check() == [] and store.residency.pending == {}


def test_a_failed_ttl_restart_loses_its_blocks_cleanly(redis_url):
    store = _sharing_small(redis_url)
    ka = store.put(_seg(0), "t").key
    store.redis.refresh_many = lambda hashes: None  # the tier went down before the keep was sent
    store.put(_seg(1000), "t")
    assert store.keys("t") != [] and ka not in store.keys("t")
    assert store.residency.pending == {} and store.check() == []
    assert store.residency.in_redis <= set(store.registry.users)


def test_a_deleted_block_stored_again_is_sent_again_on_eviction(redis_url):
    """A Delete takes the block from Redis (no shared entries): the same tokens stored again with other KV go down
    with their own bytes, not a TTL restart of a key that is gone."""
    store = _store(redis_url)
    sent = _sends(store)
    ka = store.put(_seg(0), "t").key
    store.put(_seg(1000), "t")  # A to Redis
    assert store.delete(ka, "t") == 1
    again = _seg(0)
    again.kv.mul_(2)  # same tokens, other KV
    assert store.put(again, "t").key == ka
    store.put(_seg(2000), "t")  # the new A to Redis
    assert sent == [BLOCK_BYTES] * 12  # A, B, the new A
    assert torch.equal(store.get(ka, "t").kv, again.kv)
    assert store.check() == [] and store.residency.in_redis <= set(store.registry.users)
