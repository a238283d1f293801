"""A Redis tier that verifies what it reads (issue 35, item 5): blocks, entry records and derived-set members are
tagged with the replicas' shared secret over the value and its Redis key, and block shapes are checked against the
record. Whoever can write to Redis but lacks the secret (a plain redis-py client here, who knows the formats and can
compute every key) plants nothing; a value moved to another key, a truncated or reshaped block, a replica under
another secret: each is a miss, counted and logged, never served and never an error to the caller. The secret file's
rules and the no-secret policy are checked here too. A real redis-server."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import redis
import torch
from kvbridge.server.config import SECRET_FILE_ENV, ServeConfig
from kvbridge.server.metrics import Metrics
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig, read_secret_file
from kvbridge.transfer.store.kv_blocks import Namespace, chain_root, content_key, hash_chain
from kvbridge.transfer.store.redis_auth import RedisAuth
from kvbridge.transfer.store.tiers import RedisTier, block_parts
from redisproc import TEST_SECRET, write_secret_file

M = ModelIdentity("model-a", "a" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4  # [L=2, 2, H=2, bs=16, D=8] float32
ATTACKER_SECRET = b"the attacker's guess at the secret, 32+ bytes"
OTHER_SECRET = b"another deployment's secret, at least 32 bytes"


def _seg(first: int, n: int = 40, scale: float = 1.0) -> KVSegment:
    gen = torch.Generator().manual_seed(first)
    return KVSegment(kv=scale * torch.randn(2, 2, 2, n, 8, generator=gen), token_ids=torch.arange(first, first + n),
                     positions=torch.arange(n), model=M, rotated=True)


def _replica(redis_url: str, secret: bytes | None = TEST_SECRET) -> PagedStore:
    """One server replica's store: entries shared through Redis, 64 device blocks."""
    return PagedStore(StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, redis_url=redis_url,
                                  redis_secret=secret, redis_insecure=secret is None, device="cpu",
                                  share_entries=True))


def _rejected(store: PagedStore) -> dict:
    return store.stats().redis["rejected"]


def _not_serving(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not serving" in r.getMessage()]


# ------------------------------------------------------------------------------------------------ the secret file


def test_a_secret_file_must_exist_be_a_private_file_and_hold_32_bytes(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_secret_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        read_secret_file(tmp_path)
    path = tmp_path / "secret"
    for content, mode, match in ((b"", 0o600, "holds 0 bytes"), (b"x" * 31 + b"\n", 0o600, "holds 31 bytes"),
                                 (TEST_SECRET, 0o644, "open to other users"), (TEST_SECRET, 0o602, "chmod 600")):
        path.write_bytes(content)
        path.chmod(mode)
        with pytest.raises(ValueError, match=match) as info:
            read_secret_file(path)
        assert str(path) in str(info.value) and TEST_SECRET.decode() not in str(info.value)
    path.write_bytes(b"  " + TEST_SECRET + b"\n")
    path.chmod(0o640)  # a group of its own may read it
    assert read_secret_file(path) == TEST_SECRET


def test_a_redis_tier_needs_a_secret_or_an_explicit_opt_out(tmp_path, monkeypatch):
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(ValueError, match="redis_url is set without redis_secret"):
        StoreConfig(redis_url=url)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        StoreConfig(redis_url=url, redis_secret=b"short")
    with pytest.raises(ValueError, match="contradict"):
        StoreConfig(redis_url=url, redis_secret=TEST_SECRET, redis_insecure=True)
    assert TEST_SECRET.decode() not in repr(StoreConfig(redis_url=url, redis_secret=TEST_SECRET))
    assert StoreConfig(redis_url=url, redis_insecure=True).redis_secret is None

    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    secret_file = str(write_secret_file(tmp_path))
    with pytest.raises(ValueError, match="no redis_secret_file"):
        ServeConfig(redis_url=url)
    with pytest.raises(ValueError, match="does not exist"):
        ServeConfig(redis_url=url, redis_secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="redis_url is not set"):
        ServeConfig(redis_secret_file=secret_file)
    assert ServeConfig(redis_url=url, redis_secret_file=secret_file).redis_secret_file == secret_file
    assert ServeConfig(redis_url=url, redis_insecure=True).redis_secret_file is None
    monkeypatch.setenv(SECRET_FILE_ENV, secret_file)  # the file's name from the environment, for the CLI
    assert ServeConfig.load(redis_url=url).redis_secret_file == secret_file
    assert ServeConfig.load().redis_secret_file is None  # no Redis tier: no secret wanted

    from kvbridge.server.cli import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(["serve", "--redis-url", url, "--redis-secret-file", secret_file, "--redis-insecure"])
    assert (args.redis_secret_file, args.redis_insecure) == (secret_file, True)
    assert not any(a.dest == "redis_secret" for a in parser._subparsers._group_actions[0].choices["serve"]._actions)


@pytest.mark.integration
def test_a_tier_without_a_secret_says_so(redis_url, caplog):
    caplog.set_level(logging.WARNING, logger="kvbridge.transfer.store.tiers")
    _replica(redis_url, secret=None)
    assert any("has no secret" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ attacks


@pytest.mark.integration
def test_an_attacker_without_the_secret_plants_no_kv_and_no_record_for_a_tenant(redis_url, caplog):
    """The attacker overwrites the victim's blocks with its own KV (a valid checksum, a tag under a guessed secret)
    and plants a whole entry (record and blocks, at the keys the victim's own text would have) for the victim."""
    caplog.set_level(logging.WARNING, logger="kvbridge.transfer.store.tiers")
    honest = _replica(redis_url)
    victim = _seg(0)
    stored = honest.put(victim, "victim", text="the victim's text")
    client, guess = redis.Redis.from_url(redis_url), RedisAuth(ATTACKER_SECRET)
    entry = honest.registry.get(stored.key)

    def plant_block(key: bytes, block: torch.Tensor) -> None:  # [L, 2, H, bs, D]
        head, data = block_parts(entry.layout.key, block)
        client.set(key, guess.seal_block(key, head, data) + bytes(data))

    for i, h in enumerate(entry.hashes):  # the victim's own blocks, with the attacker's KV
        plant_block(honest.redis._key(h), torch.full((2, 2, 2, 16, 8), 7.0 + i))
    planted = torch.arange(5000, 5040)  # a text the victim may ingest later: every key of it is computable
    digest = Namespace(tenant="victim", model=M.key, dtype="float32", adapter="").digest()
    planted_key = content_key(digest, "prefix", planted)
    record = json.loads(client.get(b"kvbridge:2:entry:" + stored.key.encode()).partition(b" ")[2])
    record.update(key=planted_key, token_ids=planted.tolist(), text="planted")
    entry_key = b"kvbridge:2:entry:" + planted_key.encode()
    client.set(entry_key, guess.seal_record(entry_key, json.dumps(record).encode()))
    for h in hash_chain(planted, 16, chain_root(digest, "prefix"), digest):
        plant_block(b"kvbridge:2:blk:" + h.hex().encode(), torch.full((2, 2, 2, 16, 8), 9.0))

    other = _replica(redis_url)  # another replica of the same deployment
    with pytest.raises(NotFound):
        other.get(stored.key, "victim")  # its blocks are the attacker's: none is served
    assert _rejected(other)["block"] >= 1
    assert other.lookup(planted, "victim", M, torch.float32).key is None
    with pytest.raises(NotFound):
        other.get(planted_key, "victim")
    assert _rejected(other)["record"] >= 1
    assert other.keys("victim") == [] and other.check() == []
    messages = _not_serving(caplog)
    assert any(" block value" in m for m in messages) and any(" record value" in m for m in messages)
    assert not any(TEST_SECRET.decode() in r.getMessage() for r in caplog.records)
    assert torch.equal(honest.get(stored.key, "victim").kv, victim.kv)  # the honest replica's own copy stands


@pytest.mark.integration
def test_a_value_moved_to_another_key_is_rejected(redis_url):
    """Values with a valid tag for the key they were written under, copied to another: a block to another block's
    key, a record over another entry's (another tenant's), a derived-set member into another entry's set."""
    writer = _replica(redis_url)
    one, two = _seg(0), _seg(1000)
    k1, k2 = writer.put(one, "t").key, writer.put(two, "u").key
    h1, h2 = writer.registry.get(k1).hashes, writer.registry.get(k2).hashes
    client = redis.Redis.from_url(redis_url)
    client.set(writer.redis._key(h2[0]), client.get(writer.redis._key(h1[0])))  # t's first block under u's key
    reader = _replica(redis_url)
    with pytest.raises(NotFound):
        reader.get(k2, "u")
    assert _rejected(reader) == {"block": 1, "record": 0, "derived": 0}
    assert torch.equal(reader.get(k1, "t").kv, one.kv)  # the original, where it belongs, still serves

    client.set(b"kvbridge:2:entry:" + k2.encode(), client.get(b"kvbridge:2:entry:" + k1.encode()))
    reader = _replica(redis_url)
    with pytest.raises(NotFound):
        reader.get(k2, "u")
    with pytest.raises(NotFound):
        reader.get(k2, "t")
    assert _rejected(reader)["record"] >= 1 and reader.keys("t") == reader.keys("u") == []

    projection = writer.put(_seg(2000), "t", adapter="a", source_key=k1).key
    three = writer.put(_seg(3000), "t").key
    members = client.smembers(b"kvbridge:2:derived:" + k1.encode())
    assert len(members) == 1 and next(iter(members)).startswith(projection.encode())
    client.sadd(b"kvbridge:2:derived:" + three.encode(), *members)  # "the projection derives from three"
    client.sadd(b"kvbridge:2:derived:" + three.encode(), k1.encode())  # an untagged member
    reader = _replica(redis_url)
    assert reader.delete(three, "t") == 1  # three alone: not k1, not the projection
    assert _rejected(reader)["derived"] == 2
    assert torch.equal(_replica(redis_url).get(k1, "t").kv, one.kv)


@pytest.mark.integration
def test_a_truncated_or_reshaped_block_is_a_miss_never_an_error(redis_url):
    """Truncated by whoever can write to Redis; or of another shape or dtype than the record says, though tagged
    under the right secret (a replica's bug): each is a miss, counted and deleted, never served, never raised."""
    writer = _replica(redis_url)
    seg = _seg(0)
    key = writer.put(seg, "t").key
    entry = writer.registry.get(key)
    block_key = writer.redis._key(entry.hashes[1])
    client = redis.Redis.from_url(redis_url)
    original, record = client.get(block_key), client.get(b"kvbridge:2:entry:" + key.encode())
    tier = RedisTier(redis_url, secret=TEST_SECRET)
    wrong = [torch.zeros(2, 2, 2, 16, 4), torch.zeros(2, 2, 2, 8, 8), torch.zeros(2, 2, 2, 16, 8, dtype=torch.bfloat16)]
    for n, tamper in enumerate([lambda: client.set(block_key, original[:-64]),
                                *[lambda b=b: tier.put_many([(entry.hashes[1], entry.layout.key, b)]) for b in wrong]]):
        tamper()
        reader = _replica(redis_url)
        with pytest.raises(NotFound):
            reader.get(key, "t")
        assert _rejected(reader)["block"] == 1 and reader.stats().redis["corrupt"] == 1, n
        assert not client.exists(block_key), "deleted: a replica's write puts it back"
        assert reader.check() == []
        client.set(block_key, original)
        client.set(b"kvbridge:2:entry:" + key.encode(), record)  # the reader deleted it: Redis answered, block gone
    assert torch.equal(_replica(redis_url).get(key, "t").kv, seg.kv)


# ------------------------------------------------------------------------------------------------ replicas


@pytest.mark.integration
def test_replicas_with_the_same_secret_share_entries(redis_url):
    first, second = _replica(redis_url), _replica(redis_url)
    seg = _seg(0)
    info = first.put(seg, "t", text="forty tokens")
    assert second.lookup(torch.arange(0, 40), "t", M, torch.float32).key == info.key
    assert torch.equal(second.get(info.key, "t").kv, seg.kv) and second.info(info.key, "t").text == "forty tokens"
    assert _rejected(second) == {"block": 0, "record": 0, "derived": 0}
    assert first.check() == [] and second.check() == []


@pytest.mark.integration
def test_replicas_with_different_secrets_do_not_serve_each_others_entries(redis_url):
    first = _replica(redis_url)
    seg = _seg(0)
    info = first.put(seg, "t")
    for stranger in (_replica(redis_url, OTHER_SECRET), _replica(redis_url, secret=None)):
        with pytest.raises(NotFound):
            stranger.get(info.key, "t")
        assert stranger.lookup(torch.arange(0, 40), "t", M, torch.float32).key is None
        assert _rejected(stranger)["record"] >= 1 and stranger.keys("t") == []
        registry = Metrics(store=stranger).registry
        assert registry.get_sample_value("kvbridge_store_redis_rejected_total", {"kind": "record"}) >= 1
    stranger = _replica(redis_url, OTHER_SECRET)
    stranger.put(_seg(5000, 10), "t")  # its pool of this layout
    # the prefix path reads blocks without a record (Lookup answers from their keys' existence alone; what is served
    # is always checked)
    with pytest.raises(NotFound):
        stranger.get_prefix(torch.arange(0, 60), "t", M, torch.float32, 32)
    assert _rejected(stranger)["block"] >= 1
    assert torch.equal(first.get(info.key, "t").kv, seg.kv)
