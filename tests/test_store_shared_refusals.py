"""Entries shared through a Redis that refuses writes (a real redis-server: OOM at maxmemory under noeviction, or
READONLY as a demoted primary answers): a writer whose change of an entry (a refresh, a new text, a delete) Redis
refuses never leaves other replicas the record that change replaced. A refused record write withdraws the record this
replica last wrote or read, where Redis lets it (a DEL takes no memory); a refused delete is sent again until Redis
takes it, and meanwhile the writer does not adopt the deleted entry back."""

from __future__ import annotations

import pytest
import redis
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from redisproc import TEST_SECRET
from shared_store import Clock, refusing_writes, seeded_segment, taking_writes

pytestmark = pytest.mark.integration

M = ModelIdentity("model-f", "f" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4
RETRY_S = 2.0


def _seg(first: int, n: int) -> KVSegment:
    return seeded_segment(first, n, M)


def _sharing(redis_url: str, clock: Clock) -> PagedStore:
    return PagedStore(StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                  redis_secret=TEST_SECRET, device="cpu", share_entries=True,
                                  redis_retry_s=RETRY_S), clock=clock)


@pytest.mark.parametrize("change", ["refresh", "text"])
def test_a_record_redis_refuses_to_replace_is_withdrawn_from_the_other_replicas(redis_url, change):
    """The writer gives its entry a shorter deadline (or a new text); Redis refuses the new record (OOM). The record
    Redis holds says what the writer no longer says: a replica that reads it now must not adopt it (its older
    deadline, its older text). Once Redis takes writes, the new record goes and replicas adopt that one."""
    clock = Clock()
    writer = _sharing(redis_url, clock)
    client = redis.Redis.from_url(redis_url)
    a = _seg(0, 40)
    key = writer.put(a, "t", ttl_s=100, text="old").key
    record = writer.redis.commands.entry_key(key)
    refusing_writes(client, "oom")
    try:
        if change == "refresh":
            writer.refresh(key, "t", ttl_s=5)
        else:
            writer.put(a, "t", ttl_s=100, text="new")
        assert "OutOfMemory" in writer.stats().redis["last_error"]
        assert not client.exists(record), "the replaced record is withdrawn"
        with pytest.raises(NotFound):
            _sharing(redis_url, clock).get(key, "t")
    finally:
        taking_writes(client, "oom")
    clock.now += RETRY_S  # the owed record goes with the next call
    writer.keys("t")
    reader = _sharing(redis_url, clock)
    assert torch.equal(reader.get(key, "t").kv, a.kv)
    info = reader.info(key, "t")
    if change == "refresh":
        assert info.expires_at <= clock.now + 5 - RETRY_S
    else:
        assert info.text == "new"
    assert writer.check() == [] and reader.check() == []


@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_a_delete_redis_refuses_is_sent_again_and_never_adopted_back_meanwhile(redis_url, how):
    """The writer deletes its entry while Redis refuses writes. The writer itself must not adopt the deleted entry
    back from the record Redis kept; the delete goes again once Redis takes writes, so that no replica adopts it
    after (without it, the record would stay until its deadline, an hour here)."""
    clock = Clock()
    writer = _sharing(redis_url, clock)
    client = redis.Redis.from_url(redis_url)
    key = writer.put(_seg(0, 40), "t").key
    record = writer.redis.commands.entry_key(key)
    refusing_writes(client, how)
    try:
        assert writer.delete(key, "t") == 1
        for _ in range(2):  # before and after the retry interval: Redis still refuses
            with pytest.raises(NotFound):
                writer.get(key, "t")
            assert writer.lookup(torch.arange(0, 40), "t", M, torch.float32).key is None
            clock.now += RETRY_S
    finally:
        taking_writes(client, how)
    writer.keys("t")  # any call sends what is owed
    assert not client.exists(record)
    with pytest.raises(NotFound):
        _sharing(redis_url, clock).get(key, "t")
    with pytest.raises(NotFound):
        writer.get(key, "t")
    assert writer.keys("t") == [] and writer.check() == []


def test_a_key_deleted_twice_while_redis_refuses_is_shared_again_once_the_delete_went(redis_url):
    """Deleted, stored again and deleted again while Redis refuses every write (READONLY): once Redis takes writes,
    the delete goes and the key is this replica's to adopt again: a record another replica publishes after is found."""
    clock = Clock()
    writer, other = _sharing(redis_url, clock), _sharing(redis_url, clock)
    client = redis.Redis.from_url(redis_url)
    a = _seg(0, 40)
    key = writer.put(a, "t").key
    refusing_writes(client, "readonly")
    try:
        writer.delete(key, "t")
        writer.put(a, "t")
        assert writer.delete(key, "t") == 1
    finally:
        taking_writes(client, "readonly")
    clock.now += RETRY_S
    writer.keys("t")  # the owed delete goes
    assert not client.exists(writer.redis.commands.entry_key(key))
    other.put(a, "t")
    assert torch.equal(writer.get(key, "t").kv, a.kv)
    assert writer.check() == [] and other.check() == []


def test_a_shared_entry_of_a_layout_the_store_has_no_room_for_is_a_miss_and_ends_its_read(redis_url):
    """lookup adopts another replica's record; when the store cannot take its layout (max_layouts), the lookup
    raised CapacityError and never ended its stale-record read, so every later deleted key was kept for good."""
    other = ModelIdentity("model-g", "g" * 64)
    cfg = dict(capacity_bytes=64 * BLOCK_BYTES, redis_url=redis_url, redis_secret=TEST_SECRET, device="cpu",
               share_entries=True)
    writer = PagedStore(StoreConfig(max_layouts=2, **cfg), clock=Clock())
    reader = PagedStore(StoreConfig(max_layouts=1, **cfg), clock=Clock())
    writer.put(seeded_segment(0, 40, other), "t")
    reader.put(_seg(0, 40), "t")  # the reader's one layout
    found = reader.lookup(torch.arange(40), "t", other, torch.float32)
    assert found.key is None  # a miss here, not an error
    assert not reader._stale._reads  # the lookup's read ended: deleted keys are not kept for it
    info = reader.put(_seg(100, 20), "t")
    reader.delete(info.key, "t")
    assert not reader._stale._removed
    assert reader.check() == []


def test_a_get_of_a_shared_entry_of_a_layout_the_store_has_no_room_for_is_not_found(redis_url):
    """get and info adopt too: they raised CapacityError where a miss is NotFound, as lookup's is a miss."""
    other = ModelIdentity("model-g", "g" * 64)
    cfg = dict(capacity_bytes=64 * BLOCK_BYTES, redis_url=redis_url, redis_secret=TEST_SECRET, device="cpu",
               share_entries=True)
    writer = PagedStore(StoreConfig(max_layouts=2, **cfg), clock=Clock())
    reader = PagedStore(StoreConfig(max_layouts=1, **cfg), clock=Clock())
    key = writer.put(seeded_segment(0, 40, other), "t").key
    reader.put(_seg(0, 40), "t")  # the reader's one layout
    for call in (lambda: reader.get(key, "t"), lambda: reader.info(key, "t")):
        with pytest.raises(NotFound):
            call()
    assert reader.delete(key, "t") == 0  # (raised CapacityError; the record stays in Redis: the writer's to delete)
    assert reader.check() == []


def test_an_entry_stored_again_through_a_replica_that_holds_it_is_published_again(redis_url):
    """A stores K, B adopts it, A deletes it (the record leaves Redis), the client stores K again through B: B found
    its copy and wrote no record (nothing about it had changed), so A never found K again; so too after a Redis
    restart (FLUSHALL) and a refresh (an Ingest of a known text). At most once a second, though: every record write
    restarts the TTL of each block it names."""
    from kvbridge.transfer.store.sharing import REPUBLISH_S

    clock = Clock()
    a, b = _sharing(redis_url, Clock()), _sharing(redis_url, clock)
    seg = _seg(0, 40)
    key = a.put(seg, "t").key
    b.get(key, "t")  # B holds it now
    assert a.delete(key, "t") == 1
    assert b.put(seg, "t").generation == 2
    assert torch.equal(a.get(key, "t").kv, seg.kv)  # NotFound before
    redis.Redis.from_url(redis_url).flushall()
    written, put_entries = [], b.redis.put_entries

    def counted(items):  # the records B wrote (not those held back until their blocks are sent again)
        missing = put_entries(items)
        written.extend(k for k, *_ in items if missing is not None and k not in missing)
        return missing

    b.redis.put_entries = counted
    for _ in range(20):  # a hot text's Ingests within a second: none, B published it just before
        b.refresh(key, "t")
    assert written == []
    clock.now += REPUBLISH_S
    for _ in range(20):
        b.refresh(key, "t")
    assert written == [key]  # once (after the blocks Redis lost, sent again)
    c = _sharing(redis_url, Clock())
    assert torch.equal(c.get(key, "t").kv, seg.kv)
    assert a.check() == b.check() == c.check() == []
