"""An entry record and the blocks it names (entries shared through Redis, a real redis-server): a record never outlives
the blocks it reuses from older entries (their TTL restarts with it, and a block Redis no longer has is sent again
before it); a replica that finds a record's blocks gone takes a miss and deletes that very record, never one a writer
published since; a record write that fails is sent again, from the entry as it is then, and the writer never adopts
back the record it could not replace."""

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

M = ModelIdentity("model-r", "r" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4


def _seg(first: int, n: int) -> KVSegment:
    return seeded_segment(first, n, M)


def _longer(base: KVSegment, n: int) -> KVSegment:
    """`base`'s tokens and KV, then more: its full blocks are base's."""
    longer = _seg(int(base.token_ids[0]), n)
    longer.kv[:, :, :, :base.num_tokens] = base.kv
    return longer


def _sharing(redis_url: str, clock=None) -> PagedStore:
    config = StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                         redis_secret=TEST_SECRET, device="cpu", share_entries=True)
    return PagedStore(config) if clock is None else PagedStore(config, clock=clock)


def _block_keys(store: PagedStore, key: str) -> list[bytes]:
    return [store.redis._key(h) for h in store.registry.get(key).hashes]


@pytest.mark.parametrize("ttl_s", [None, 600])
def test_a_record_restarts_the_ttl_of_the_blocks_it_reuses(redis_url, ttl_s):
    """A longer entry reuses the full blocks of an entry written long ago (their TTL nearly out): its record, written
    now, must not outlive them, or a replica adopting it finds them gone. Its refresh too."""
    writer = _sharing(redis_url)
    client = redis.Redis.from_url(redis_url)
    base = _seg(0, 32)
    reused = _block_keys(writer, writer.put(base, "t").key)  # 2 full blocks
    for k in reused:
        client.pexpire(k, 2000)  # written long ago: 2 s left
    key = writer.put(_longer(base, 48), "t", ttl_s=ttl_s).key
    record = writer.redis.commands.entry_key(key)
    blocks_ms = [client.pttl(k) for k in _block_keys(writer, key)]  # (read first: each deadline >= the record's)
    assert min(blocks_ms) >= client.pttl(record) > 2000
    if ttl_s is not None:  # (an entry without a deadline is not written again by a refresh that gives it none)
        for k in reused:
            client.pexpire(k, 2000)
        writer.refresh(key, "t", ttl_s=ttl_s)  # the record again, with its deadline: the blocks' TTL again
        blocks_ms = [client.pttl(k) for k in reused]
        assert min(blocks_ms) >= client.pttl(record) > 2000


def test_a_reused_block_redis_no_longer_has_is_sent_again_with_the_record(redis_url):
    """Redis evicted (or expired) a block of the older entry; the writer still holds it. The new record that names it
    brings it back, so that another replica reads the new entry whole."""
    writer = _sharing(redis_url)
    client = redis.Redis.from_url(redis_url)
    base = _seg(0, 32)
    first_block = _block_keys(writer, writer.put(base, "t").key)[0]
    client.delete(first_block)
    longer = _longer(base, 48)
    key = writer.put(longer, "t").key
    assert client.exists(first_block)
    assert torch.equal(_sharing(redis_url).get(key, "t").kv, longer.kv)
    assert writer.check() == [] and not writer.residency.outbox


def test_a_record_whose_blocks_are_gone_is_deleted_by_the_replica_that_finds_them_gone(redis_url):
    """Redis answered that a block of the record is not there: the record is useless to every replica (a lookup
    would report an entry no get can serve), and the reader that found out deletes it."""
    writer, reader = _sharing(redis_url), _sharing(redis_url)
    client = redis.Redis.from_url(redis_url)
    key = writer.put(_seg(0, 40), "t").key
    client.delete(_block_keys(writer, key)[1])  # evicted by Redis
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert not client.exists(writer.redis.commands.entry_key(key))
    assert _sharing(redis_url).lookup(torch.arange(0, 40), "t", M, torch.float32).key is None
    assert reader.keys("t") == [] and reader.check() == []


def test_a_reader_that_finds_the_blocks_gone_leaves_a_record_published_again_meanwhile(redis_url):
    """The record key is every replica's that stores these tokens: while a reader finds the blocks of the record it
    read gone, the writer publishes the entry again (a refresh: the missing block first, then a new record). The
    reader's miss must not take the new record from the other replicas."""
    writer, reader = _sharing(redis_url), _sharing(redis_url)
    client = redis.Redis.from_url(redis_url)
    a = _seg(0, 40)
    key = writer.put(a, "t").key
    client.delete(_block_keys(writer, key)[1])  # evicted by Redis
    real = reader.redis.get_many

    def then_published_again(*args, **kwargs):
        got = real(*args, **kwargs)  # without block 1
        writer.refresh(key, "t", ttl_s=600)
        return got

    reader.redis.get_many = then_published_again
    with pytest.raises(NotFound):
        reader.get(key, "t")
    reader.redis.get_many = real
    assert client.exists(writer.redis.commands.entry_key(key)), "the record published again stays"
    assert torch.equal(_sharing(redis_url).get(key, "t").kv, a.kv)
    assert torch.equal(reader.get(key, "t").kv, a.kv)
    assert reader.check() == [] and writer.check() == []


def test_a_record_write_that_fails_is_sent_again_with_the_deadline_the_refresh_gave(redis_url):
    """A refresh shortens the entry's TTL; Redis refuses the record's write (OOM). The older record, with the older
    deadline, is withdrawn (tests/test_store_shared_refusals.py): once Redis takes writes again, the record goes
    again, from the entry as it is then."""
    clock = Clock()
    writer = _sharing(redis_url, clock)
    client = redis.Redis.from_url(redis_url)
    key = writer.put(_seg(0, 32), "t", ttl_s=100).key
    record = writer.redis.commands.entry_key(key)
    refusing_writes(client)
    try:
        writer.refresh(key, "t", ttl_s=5)
        assert not client.exists(record)  # the older record: withdrawn
    finally:
        taking_writes(client)
    clock.now += 3  # past the tier's retry interval; 2 s of the entry left
    writer.keys("t")  # any call sends what is owed
    assert 0 < client.pttl(record) <= 2_000
    reader = _sharing(redis_url, clock)
    reader.get(key, "t")
    assert reader.info(key, "t").expires_at <= clock.now + 2


@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_a_writer_does_not_adopt_back_the_older_record_a_failed_refresh_left(redis_url, how):
    """Same refused write, and Redis refuses writes until the entry's new deadline passes here. Under READONLY the
    record in Redis is the older one (not even withdrawn), which the writer itself must not adopt back and serve past
    the deadline it was given."""
    clock = Clock()
    writer = _sharing(redis_url, clock)
    client = redis.Redis.from_url(redis_url)
    key = writer.put(_seg(0, 32), "t", ttl_s=100).key
    refusing_writes(client, how)
    try:
        writer.refresh(key, "t", ttl_s=5)
        clock.now += 5
        with pytest.raises(NotFound):
            writer.get(key, "t")
        assert writer.lookup(torch.arange(0, 32), "t", M, torch.float32).key is None
        assert client.exists(writer.redis.commands.entry_key(key)) == (how == "readonly")
    finally:
        taking_writes(client, how)
    assert writer.keys("t") == [] and writer.check() == []


def _writer_sends_the_block_again(writer: PagedStore, base: KVSegment, how: str) -> None:
    """The writer brings back the block Redis evicted, without a new record of `base`'s entry: a longer entry that
    reuses it (its record sends it first), or `base`'s blocks demoted off a full device (a keep sends what Redis
    lacks)."""
    if how == "longer":
        writer.put(_longer(base, 48), "t")
    else:
        writer.put(_seg(500, 64 * 16), "t")  # fills the device: base's blocks go down to Redis


@pytest.mark.parametrize("how", ["longer", "demoted"])
def test_a_reader_that_finds_a_block_gone_leaves_the_record_once_the_block_is_back(redis_url, how):
    """Redis evicts a block of a record; a reader reads the record, then the blocks, and finds it gone; before the
    reader acts on that, the writer sends the block again (the record unchanged: same tag). The record names blocks
    that are all there again: the reader's miss must not delete it from every replica."""
    writer, reader = _sharing(redis_url), _sharing(redis_url)
    client = redis.Redis.from_url(redis_url)
    a = _seg(0, 40)
    key = writer.put(a, "t").key
    record = writer.redis.commands.entry_key(key)
    tag = client.get(record)[:64]
    gone = _block_keys(writer, key)[1]
    client.delete(gone)  # evicted by Redis
    real = reader.redis.get_many

    def then_sent_again(*args, **kwargs):
        got = real(*args, **kwargs)  # without block 1
        reader.redis.get_many = real
        _writer_sends_the_block_again(writer, a, how)
        assert client.exists(gone) and client.get(record)[:64] == tag
        return got

    reader.redis.get_many = then_sent_again
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert client.exists(record), "a record whose blocks are all there stays"
    assert torch.equal(_sharing(redis_url).get(key, "t").kv, a.kv)
    assert torch.equal(reader.get(key, "t").kv, a.kv)
    assert reader.check() == [] and writer.check() == []
