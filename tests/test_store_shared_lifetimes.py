"""How long a shared entry lives (entries shared through Redis, a real redis-server): its TTL travels with its record,
so no replica serves it past the deadline its writer gave it, the writer included; and a record read while a delete of
its key runs on the same replica is never adopted after that delete."""

from __future__ import annotations

import pytest
import redis
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from redisproc import TEST_SECRET
from shared_store import Clock, seeded_segment

pytestmark = pytest.mark.integration

M = ModelIdentity("model-r", "r" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4


def _seg(first: int, n: int) -> KVSegment:
    return seeded_segment(first, n, M)


def _sharing(redis_url: str, clock=None) -> PagedStore:
    config = StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                         redis_secret=TEST_SECRET, device="cpu", share_entries=True)
    return PagedStore(config) if clock is None else PagedStore(config, clock=clock)


def _record_ttl_ms(store: PagedStore, key: str, redis_url: str) -> int:
    return redis.Redis.from_url(redis_url).pttl(store.redis.commands.entry_key(key))


def test_a_block_aligned_entry_past_its_ttl_is_not_adopted_back_by_the_replica_that_stored_it(redis_url):
    """32 tokens (two full blocks, no tail: nothing of it leaves Redis at expiry in share mode). Once its TTL ran out
    on the writer, a get or lookup there finds its record still in Redis (Redis keeps time of its own) and must not
    serve it again."""
    clock = Clock()
    store = _sharing(redis_url, clock)
    a = _seg(0, 32)
    key = store.put(a, "t", ttl_s=10).key
    assert torch.equal(store.get(key, "t").kv, a.kv)
    clock.now += 10
    with pytest.raises(NotFound):
        store.get(key, "t")
    assert store.lookup(torch.arange(0, 32), "t", M, torch.float32).key is None
    assert store.keys("t") == [] and store.check() == []
    assert 0 < _record_ttl_ms(store, key, redis_url) <= 10_000  # the record leaves Redis at the entry's deadline


def test_a_replica_that_adopted_an_entry_expires_it_at_its_writers_deadline(redis_url):
    """The writer gave a TTL; a reader that adopted the entry (default_ttl_s None: it would keep it for good) holds
    it until that deadline only."""
    clock = Clock()
    writer, reader = _sharing(redis_url, clock), _sharing(redis_url, clock)
    a = _seg(0, 32)
    key = writer.put(a, "t", ttl_s=10).key
    assert torch.equal(reader.get(key, "t").kv, a.kv)  # adopted
    expires_at = reader.info(key, "t").expires_at
    assert expires_at is not None and clock.now < expires_at <= clock.now + 10
    clock.now += 10
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert reader.keys("t") == [] and reader.check() == []


def test_a_refresh_carries_the_new_deadline_to_redis_and_an_entry_without_ttl_keeps_the_tiers(redis_url):
    clock = Clock()
    store = _sharing(redis_url, clock)
    key = store.put(_seg(0, 32), "t", ttl_s=100).key
    assert 10_000 < _record_ttl_ms(store, key, redis_url) <= 100_000
    store.refresh(key, "t", ttl_s=5)  # shorter: other replicas must not keep it longer
    assert 0 < _record_ttl_ms(store, key, redis_url) <= 5_000
    other = store.put(_seg(1000, 32), "t").key  # no TTL: the record lives as long as the tier keeps values
    assert _record_ttl_ms(store, other, redis_url) > 3_000_000
    reader = _sharing(redis_url, clock)
    reader.get(other, "t")
    assert reader.info(other, "t").expires_at is None


def test_an_entry_stored_again_elsewhere_after_it_expired_here_is_adopted(redis_url):
    """What expired here is the record this replica wrote; another replica's put of the same tokens afterwards is a
    new record, and served here."""
    clock = Clock()
    first, second = _sharing(redis_url, clock), _sharing(redis_url, clock)
    a = _seg(0, 32)
    key = first.put(a, "t", ttl_s=10).key
    clock.now += 10
    with pytest.raises(NotFound):
        first.get(key, "t")
    assert second.put(a, "t", ttl_s=60).key == key
    assert torch.equal(first.get(key, "t").kv, a.kv)


def _delete_while_reading(store: PagedStore, key: str) -> list[int]:
    """Make the store's next read of entry records run delete(key) on the same store after Redis answered, before
    the records are used (a delete on another thread that completes in that window). The delete's answers."""
    real = store.redis.get_entries
    deleted: list[int] = []

    def racing(keys):
        records = real(keys)
        if not deleted:
            deleted.append(-1)  # the delete's own read of the record goes through as it is
            deleted[0] = store.delete(key, "t")
        return records

    store.redis.get_entries = racing
    return deleted


@pytest.mark.parametrize("call", ["get", "lookup", "delete"])
def test_a_record_read_before_a_delete_of_its_key_is_not_adopted_after_it(redis_url, call):
    """A replica that does not hold the entry (another replica stored it, or this server before a restart) reads its
    record without the lock; a delete of the key completes meanwhile (its forget sent: nothing of it pending); the
    record read before it must not bring the entry back. 32 tokens: its full blocks stay in Redis after the delete
    (other entries may share them), so an entry adopted back would be served."""
    writer, reader = _sharing(redis_url), _sharing(redis_url)
    a = _seg(0, 32)
    key = writer.put(a, "t").key
    deleted = _delete_while_reading(reader, key)
    if call == "get":
        with pytest.raises(NotFound):
            reader.get(key, "t")
    elif call == "lookup":
        assert reader.lookup(torch.arange(0, 32), "t", M, torch.float32).key is None
    else:
        assert reader.delete(key, "t") == 0  # the other delete took it
    assert deleted == [1]
    assert reader.keys("t") == [] and reader.check() == []
    with pytest.raises(NotFound):
        reader.get(key, "t")  # its record is gone from Redis: nothing to adopt
    assert not reader._stale._removed  # nothing kept once no read is under way
