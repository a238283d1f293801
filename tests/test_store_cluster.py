"""The store's Redis tier on a real Redis Cluster (tests/redis_cluster.py: six local redis-server processes, 3
primaries with a replica each, a password on every node; started once for this file). The cluster URL and its
mistakes; replicas sharing entries through it, their keys spread over the shards; Redis AUTH/ACL; every read-back
check of the one-server tier holding on the cluster path; and failovers.

The window a failover can lose (the cluster tier's module docstring, transfer/store/redis_cluster.py): a primary
answers a write before its replica has it. With `wait_replicas=0` the tier acknowledges that answer, and a write
acknowledged while its replica lags is lost when the primary dies and the replica is promoted: shown here
deterministically (the replica's link cut and the replica stopped, so the window stays open). With the default
`wait_replicas=1` an acknowledged write is one a replica confirmed (WAIT): the same write is reported as not stored,
and every write acknowledged before a primary is SIGKILLed mid-run is still served after its replica takes over. The
window's length on a healthy cluster (what WAIT costs a put) is measured by bench/bench_store.py's cluster rows.
Never, in any of it, is a wrong KV served: lost or tampered values are misses.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
import redis
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig
from kvbridge.transfer.store.block_blob import block_parts
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.redis_auth import RedisAuth
from kvbridge.transfer.store.redis_url import ClusterUrl, check_redis_url, parse_cluster_url, shown_url
from kvbridge.transfer.store.tiers import RedisTier
from redis_cluster import PASSWORD, LocalCluster, cluster_available
from redisproc import TEST_SECRET
from shared_store import assert_found_by_another_replica

if not cluster_available():
    pytest.skip("no redis-server and redis-cli (or valkey-server and valkey-cli) on PATH: a local Redis Cluster "
                "cannot be started (apt-get install redis-server)", allow_module_level=True)

pytestmark = pytest.mark.integration

M = ModelIdentity("model-c", "c" * 64)
P = ModelIdentity("model-p", "p" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4  # [L=2, 2, H=2, 16, D=8] float32
LAYOUT = PoolLayout(model=M.key, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def url(cluster) -> str:
    """The cluster's URL, the cluster healthy and empty."""
    cluster.heal()
    cluster.flush()
    return cluster.url()


def _client(cluster):
    """redis-py's cluster client, to look at and tamper with what the tier wrote."""
    from redis.cluster import RedisCluster

    return RedisCluster(host="127.0.0.1", port=cluster.primary_ports()[0], password=PASSWORD)


def _seg(first: int, n: int = 40, model: ModelIdentity = M, layers: int = 2) -> KVSegment:
    gen = torch.Generator().manual_seed(first)
    return KVSegment(kv=torch.randn(layers, 2, 2, n, 8, generator=gen), token_ids=torch.arange(first, first + n),
                     positions=torch.arange(n), model=model, rotated=True)


def _sharing(url: str, **config) -> PagedStore:
    """A replica: entries shared through the cluster, room for two layouts (a source and a projection)."""
    return PagedStore(StoreConfig(capacity_bytes=256 * BLOCK_BYTES, max_layouts=2, redis_url=url,
                                  redis_secret=TEST_SECRET, device="cpu", share_entries=True, **config))


def _keys_by_primary(cluster, pattern: str) -> dict[int, list[bytes]]:
    out = {}
    for port in cluster.primary_ports():
        with cluster.node(port).client() as c:
            out[port] = list(c.scan_iter(match=pattern))
    return out


# ------------------------------------------------------------------------------------------------ the URL


def test_a_cluster_url_names_its_nodes_credentials_and_wait_and_mistakes_are_named():
    got = parse_cluster_url("rediss+cluster://kv:p%40ss@10.0.0.1:7000,[::1]:7001, node3?wait_replicas=2"
                            "&wait_timeout_ms=100")
    assert got == ClusterUrl(nodes=(("10.0.0.1", 7000), ("::1", 7001), ("node3", 6379)), username="kv",
                             password="p@ss", tls=True, wait_replicas=2, wait_timeout_ms=100)
    plain = parse_cluster_url("redis+cluster://:secret@h:1/0")
    assert (plain.username, plain.password, plain.tls, plain.wait_replicas, plain.wait_timeout_ms) == (
        None, "secret", False, 1, 250)
    assert shown_url("redis+cluster://kv:hunter2@h:1,h:2") == "redis+cluster://kv:***@h:1,h:2"
    assert shown_url("redis://:hunter2@h:1/0") == "redis://:***@h:1/0"
    assert shown_url("redis://h:1/0?password=hunter2&db=0") == "redis://h:1/0?password=***&db=0"
    for bad, says in [("redis+cluster://", "names no node"), ("redis+cluster://h:0", "port in 1..65535"),
                      ("redis+cluster://h:x", "port in 1..65535"), ("redis+cluster://h:1/2", "one database"),
                      ("redis+cluster://h:1?cluster=1", "unknown option 'cluster'"),
                      ("redis+cluster://h:1?wait_timeout_ms=0", "wait_timeout_ms must be an integer >= 1"),
                      ("redis+cluster://:hunter2@h:1?wait_replicas=-1", "wait_replicas must be an integer >= 0"),
                      ("cluster://h:1", "has scheme 'cluster'"), ("127.0.0.1:6379", "has scheme 'none'")]:
        with pytest.raises(ValueError, match=says) as caught:
            check_redis_url(bad)
        assert "hunter2" not in str(caught.value)
    with pytest.raises(ValueError, match="redis\\+cluster://host:port"):
        StoreConfig(redis_url="rediscluster://h:1", redis_insecure=True)
    with pytest.raises(ValueError, match="below the redis tier's socket timeout"):
        RedisTier("redis+cluster://h:1?wait_timeout_ms=500", timeout_s=0.5, secret=TEST_SECRET)


# ------------------------------------------------------------------------------------------------ sharing


def test_replicas_share_entries_through_the_cluster_whose_shards_all_hold_some(cluster, url):
    """As tests/test_store_redis_io.py's replicas on one Redis: an entry put in one is found (by key and by its
    tokens) and read exactly, with its text, in another, never by another tenant; a Delete in the second removes it
    and what derives from it for every replica. On a cluster, its blocks land on more than one shard, and an entry's
    record and derived set share a slot (one DEL takes both)."""
    first, second, third = _sharing(url), _sharing(url), _sharing(url)
    a = _seg(0)
    info = first.put(a, "t", text="forty tokens")  # 2 full blocks + a partial tail, all written through
    projection = first.put(_seg(500, model=P, layers=3), "t", adapter="a", source_key=info.key).key
    others = [first.put(_seg(1000 * i), "t").key for i in range(2, 6)]
    assert_found_by_another_replica(second, info, a, "forty tokens", M)

    blocks = _keys_by_primary(cluster, "kvbridge:2:blk:*")
    assert sum(len(k) for k in blocks.values()) == 6 * 3
    assert sum(1 for k in blocks.values() if k) == 3, {p: len(k) for p, k in blocks.items()}  # every shard has some
    client = _client(cluster)
    record, derived = first.redis.commands.entry_key(info.key), first.redis.commands.derived_key(info.key)
    assert (record, derived) == (b"kvbridge:2:entry:{%s}" % info.key.encode(), b"kvbridge:2:derived:{%s}" %
                                 info.key.encode())
    assert client.keyslot(record) == client.keyslot(derived) and client.exists(record, derived) == 2

    assert second.delete(info.key, "t") == 2  # the source and the projection the first made
    assert second.delete(others[0], "t") == 1
    assert sum(len(k) for k in _keys_by_primary(cluster, "kvbridge:2:entry:*").values()) == len(others) - 1
    assert sum(len(k) for k in _keys_by_primary(cluster, "kvbridge:2:derived:*").values()) == 0
    for key in (info.key, projection, others[0]):
        with pytest.raises(NotFound):
            third.get(key, "t")
    assert torch.equal(third.get(others[1], "t").kv, _seg(3000).kv)
    assert all(s.check() == [] for s in (first, second, third))
    assert first.stats().redis["unreplicated"] == 0 and first.stats().redis["errors"] == 0


def test_an_entrys_deadline_travels_with_its_record_through_the_cluster(cluster, url):
    """The write's confirmation (an EXPIRE, then WAIT) keeps the record's TTL at its entry's deadline, not the
    tier's; a replica that adopts it expires it then."""
    writer, reader = _sharing(url), _sharing(url)
    key = writer.put(_seg(0, 32), "t", ttl_s=10).key
    assert 0 < _client(cluster).pttl(writer.redis.commands.entry_key(key)) <= 10_000
    reader.get(key, "t")
    assert reader.info(key, "t").expires_at <= reader.clock() + 10
    assert writer.stats().redis["unreplicated"] == 0 and writer.stats().redis["errors"] == 0


def _shared_entry_with_a_block_gone(cluster, url):
    """A writer and a reader sharing through the cluster; the writer's entry of 40 tokens, its second block deleted
    from its shard: (writer, reader, client, segment, key, record key, block key)."""
    writer, reader = _sharing(url), _sharing(url)
    client = _client(cluster)
    a = _seg(0)
    key = writer.put(a, "t").key
    record, block = writer.redis.commands.entry_key(key), writer.redis._key(writer.registry.get(key).hashes[1])
    client.delete(block)
    return writer, reader, client, a, key, record, block


def test_a_record_whose_blocks_are_gone_is_deleted_through_the_cluster_and_published_again(cluster, url):
    """A block of a shared entry gone from its shard: the reader that finds out deletes that very record (a script on
    the record's slot, compared by its tag); the writer's next record sends the block again, then itself."""
    writer, reader, client, a, key, record, block = _shared_entry_with_a_block_gone(cluster, url)
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert not client.exists(record)
    writer.refresh(key, "t", ttl_s=600)
    assert client.exists(block) and client.exists(record)
    assert torch.equal(reader.get(key, "t").kv, a.kv)
    assert reader.stats().redis["errors"] == 0 and writer.stats().redis["errors"] == 0


def test_a_reader_leaves_a_record_whose_block_the_writer_sent_again_through_the_cluster(cluster, url):
    """Same block gone; the reader reads the blocks and finds it gone, then the writer sends it again as a block of a
    longer entry (the first entry's record unchanged). The reader checks the blocks (on their shards) before its
    compare-and-delete on the record's: they are all there, so the record stays for every replica."""
    writer, reader, client, a, key, record, block = _shared_entry_with_a_block_gone(cluster, url)
    real = reader.redis.get_many

    def then_sent_again(*args, **kwargs):
        got = real(*args, **kwargs)  # without block 1
        reader.redis.get_many = real
        longer = _seg(0, 48)
        longer.kv[:, :, :, :40] = a.kv
        writer.put(longer, "t")
        assert client.exists(block)
        return got

    reader.redis.get_many = then_sent_again
    with pytest.raises(NotFound):
        reader.get(key, "t")
    assert client.exists(record)
    assert torch.equal(reader.get(key, "t").kv, a.kv)
    assert reader.stats().redis["errors"] == 0 and writer.stats().redis["errors"] == 0


def test_an_acl_user_held_to_the_tiers_keys_works_from_one_node_and_a_wrong_password_is_a_tier_down(cluster, url):
    for node in cluster.nodes:  # ACLs are per node
        with node.client() as c:
            c.execute_command("ACL", "SETUSER", "kvtier", "reset", "on", ">tier pass", "~kvbridge:*", "+@all")
    try:
        one_node = f"redis+cluster://kvtier:{quote('tier pass')}@127.0.0.1:{cluster.primary_ports()[1]}"
        tier = RedisTier(one_node, secret=TEST_SECRET)  # the client learns the other nodes from this one
        blocks = {bytes([i]) * 16: torch.randn(LAYOUT.block_shape) for i in range(12)}
        assert tier.put_many([(h, LAYOUT.key, b) for h, b in blocks.items()])
        back = tier.get_many(list(blocks), LAYOUT)
        assert set(back) == set(blocks) and all(torch.equal(back[h], b) for h, b in blocks.items())
        with pytest.raises(redis.exceptions.NoPermissionError):
            tier.commands.client.set("elsewhere", b"x")  # the user reaches the tier's keys only

        wrong = RedisTier(one_node.replace("tier%20pass", "not%20it"), secret=TEST_SECRET)
        assert wrong.put_many([(h, LAYOUT.key, b) for h, b in blocks.items()]) is False
        assert wrong.get_many(list(blocks), LAYOUT) == {}
        assert wrong.stats.available is False and "not it" not in wrong.stats.last_error
        assert "invalid username-password" in wrong.stats.last_error or "WRONGPASS" in wrong.stats.last_error
    finally:
        for node in cluster.nodes:
            with node.client() as c:
                c.execute_command("ACL", "DELUSER", "kvtier")


def test_error_replies_from_the_cluster_are_a_failed_write_not_an_exception(cluster, url):
    """Nodes at maxmemory (noeviction) answer every SET with OOM, on the packed path and on redis-py's pipeline that
    sends the writes again: the tier reports them not stored (counted) and stays up (the nodes answered: reads go
    on), and a store sharing entries through it keeps serving its own, nothing left pending."""
    for node in cluster.nodes:
        with node.client() as c:
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", 1)
    try:
        tier = RedisTier(url, secret=TEST_SECRET)
        blocks = {bytes([i]) * 16: torch.randn(LAYOUT.block_shape) for i in range(6)}
        assert tier.put_many([(h, LAYOUT.key, b) for h, b in blocks.items()]) is False
        assert tier.stats.available is True and "OutOfMemoryError" in tier.stats.last_error
        store = _sharing(url)
        a = _seg(0, 40)
        key = store.put(a, "t").key  # its blocks and record, written through to the cluster: refused
        assert torch.equal(store.get(key, "t").kv, a.kv)
        assert store.stats().redis["errors"] >= 1 and store.residency.pending == {} and store.check() == []
    finally:
        for node in cluster.nodes:
            with node.client() as c:
                c.config_set("maxmemory", 0)


# ------------------------------------------------------------------------------------------------ read-back checks


def _tamper(kind: str, client, tier: RedisTier, hashes: list) -> bytes:
    """Change what the cluster holds for one of an entry's blocks; returns that block's key."""
    target = tier._key(hashes[1])
    if kind == "flipped byte":
        value = client.get(target)
        client.setrange(target, len(value) - 1, bytes([value[-1] ^ 1]))
    elif kind == "another block's value":  # signed, but for another key
        client.set(target, client.get(tier._key(hashes[0])))
    else:  # "another model's block, signed": its tag and checksum hold, its layout is not its record's
        other = PoolLayout(model=P.key, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
        head, data = block_parts(other.key, torch.randn(other.block_shape))
        client.set(target, RedisAuth(TEST_SECRET).seal_block(target, head, data) + bytes(data))
    return target


@pytest.mark.parametrize("kind", ["flipped byte", "another block's value", "another model's block, signed"])
def test_a_tampered_block_on_the_cluster_is_a_miss_counted_and_deleted(cluster, url, kind):
    """The one-server tier's read-back checks on the cluster path: tag (key and secret), checksum, layout."""
    writer, reader = _sharing(url), _sharing(url)
    a = _seg(0, 48)  # 3 full blocks
    key = writer.put(a, "t").key
    client = _client(cluster)
    target = _tamper(kind, client, writer.redis, writer.registry.get(key).hashes)
    with pytest.raises(NotFound):
        reader.get(key, "t")  # never the tampered KV
    assert reader.stats().redis["rejected"]["block"] == 1 and reader.stats().redis["corrupt"] == 1
    assert client.exists(target) == 0  # deleted: a replica's write puts it back
    assert torch.equal(writer.get(key, "t").kv, a.kv)  # the writer still holds it
    assert writer.check() == [] and reader.check() == []


def test_a_forged_or_moved_entry_record_on_the_cluster_is_ignored(cluster, url):
    writer = _sharing(url)
    info = writer.put(_seg(0, 32), "t")
    moved = writer.put(_seg(7000, 32), "t")
    client = _client(cluster)
    redis_key = writer.redis.commands.entry_key(info.key)
    tag, _, blob = client.get(redis_key).partition(b" ")
    record = json.loads(blob)
    record["token_ids"][0] += 1  # contents that do not hash to the key, under the old tag
    client.set(redis_key, tag + b" " + json.dumps(record).encode())
    client.set(writer.redis.commands.entry_key(moved.key), client.get(redis_key))
    other = _sharing(url)
    for key in (info.key, moved.key):
        with pytest.raises(NotFound):
            other.get(key, "t")
    assert other.stats().redis["rejected"]["record"] == 2 and other.keys("t") == [] and other.check() == []


# ------------------------------------------------------------------------------------------------ failovers


def _hashes_on(client, port: int, n: int, salt: int) -> list[bytes]:
    """n block hashes whose keys the primary at `port` holds."""
    found, i = [], 0
    while len(found) < n:
        h = (salt * 1_000_003 + i).to_bytes(16, "little")
        if client.get_node_from_key(RedisTier.PREFIX + h.hex().encode()).port == port:
            found.append(h)
        i += 1
    return found


def test_a_write_only_a_primary_holds_is_what_a_failover_loses_and_the_tier_does_not_acknowledge_it(cluster, url):
    """The window, held open: the victim's replica is stopped and its link cut, then two tiers write blocks to the
    victim. `wait_replicas=0` acknowledges its write; the default (WAIT for 1 replica, 250 ms) reports it not stored.
    The victim is SIGKILLed and its replica promoted: both writes are gone, the one written before the window is
    there, and a reader gets misses, never other KV."""
    client = _client(cluster)
    victim = cluster.primary_ports()[0]
    replica = cluster.replica_of(victim)
    confirmed = RedisTier(url, secret=TEST_SECRET, retry_s=0)
    primary_only = RedisTier(cluster.url(wait_replicas=0), secret=TEST_SECRET, retry_s=0)
    before, during_confirmed, during_primary_only = _hashes_on(client, victim, 3, salt=1)
    blocks = {h: torch.randn(LAYOUT.block_shape) for h in (before, during_confirmed, during_primary_only)}
    assert confirmed.put_many([(before, LAYOUT.key, blocks[before])])
    cluster.node(replica).pause()
    try:
        with cluster.node(victim).client() as c:
            assert c.execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
        assert confirmed.put_many([(during_confirmed, LAYOUT.key, blocks[during_confirmed])]) is False
        assert confirmed.stats.unreplicated == 1 and confirmed.stats.available
        assert primary_only.put_many([(during_primary_only, LAYOUT.key, blocks[during_primary_only])]) is True
        assert client.exists(*[RedisTier.PREFIX + h.hex().encode() for h in blocks]) == 3  # the victim has all
        cluster.kill(victim)
    finally:
        cluster.node(replica).resume()
    cluster.takeover(replica)
    reader = RedisTier(url, secret=TEST_SECRET)
    back = reader.get_many(list(blocks), LAYOUT)
    assert set(back) == {before} and torch.equal(back[before], blocks[before])
    assert reader.stats.rejected == {"block": 0, "record": 0, "derived": 0}
    cluster.restart(victim)  # back as the new primary's replica


def test_entries_acknowledged_before_a_primary_is_killed_mid_run_are_all_served_after_its_replica_takes_over(
        cluster, url):
    """A writer puts entries (write-through: blocks and records, each write confirmed by a replica). Mid-run a
    primary is SIGKILLed; puts go on while it is dead, after its replica is promoted (a primary with no replica yet:
    its writes cannot be confirmed) and after the dead node is back as that one's replica. A put counts as
    acknowledged when every one of its Redis writes was. A replica that never held any of them then serves every
    acknowledged entry exactly, and the others exactly or not at all."""
    # every call tries the cluster again; a WAIT has 400 ms (below the tier's 0.5 s socket timeout) on a busy machine
    writer = _sharing(cluster.url(wait_timeout_ms=400), redis_retry_s=0)
    victim = cluster.primary_ports()[1]
    replica = cluster.replica_of(victim)
    puts = []  # (key, segment, acknowledged)
    for i in range(20):
        before = writer.stats().redis
        segment = _seg(100 * i, 40)
        key = writer.put(segment, "t").key
        after = writer.stats().redis
        puts.append((key, segment, after["errors"] == before["errors"]
                     and after["unreplicated"] == before["unreplicated"]))
        if i == 5:
            cluster.kill(victim)
        elif i == 9:
            cluster.takeover(replica)
        elif i == 13:
            cluster.restart(victim)
    acked = "".join("A" if ok else "-" for _, _, ok in puts)  # A: acknowledged
    assert acked[:6] == "A" * 6 and acked[14:] == "A" * 6, acked  # before the kill, once the shard has a replica
    assert "-" in acked[6:14], acked  # while it had none, puts that touched it were not acknowledged
    reader = _sharing(url)
    for key, segment, ok in puts:
        try:
            got = reader.get(key, "t").kv
        except NotFound:
            assert not ok, f"an acknowledged entry ({key}) was lost in the failover"
            continue
        assert torch.equal(got, segment.kv)
    assert reader.stats().redis["rejected"] == {"block": 0, "record": 0, "derived": 0}
    assert writer.check() == [] and reader.check() == []


def test_a_primary_that_moved_under_the_tier_is_followed_through_redis_py(cluster, url):
    """A graceful failover the tier has not seen: its slot map names the old primary, which answers MOVED; the
    writes go again through redis-py, which follows it, and the new primary's replica (the old one) confirms them."""
    client = _client(cluster)
    old = cluster.primary_ports()[2]
    new = cluster.replica_of(old)
    tier = RedisTier(url, secret=TEST_SECRET)
    first, second = _hashes_on(client, old, 2, salt=3), _hashes_on(client, old, 2, salt=4)
    blocks = {h: torch.randn(LAYOUT.block_shape) for h in first + second}
    assert tier.put_many([(h, LAYOUT.key, blocks[h]) for h in first])  # the tier's map: `old` holds these slots
    cluster.failover(new)
    assert tier.commands.client.get_node_from_key(tier._key(second[0])).port == old  # not seen yet
    assert tier.put_many([(h, LAYOUT.key, blocks[h]) for h in second])  # MOVED, followed, confirmed
    assert tier.commands.client.get_node_from_key(tier._key(second[0])).port == new
    back = RedisTier(url, secret=TEST_SECRET).get_many(list(blocks), LAYOUT)
    assert set(back) == set(blocks) and all(torch.equal(back[h], blocks[h]) for h in blocks)
    assert tier.stats.errors == 0 and tier.stats.unreplicated == 0


def test_a_slot_being_migrated_is_followed_through_redis_py_and_never_acknowledged_unconfirmed(cluster, url):
    """Slot S half-way from primary A to B (MIGRATING / IMPORTING): A answers ASK for a key it does not hold, redis-py
    follows it to B. Without a wait the write is acknowledged and reads back; with one, the confirmation asks A, meets
    ASK, and reports the write not stored (a migration's writes are retried by the store, never acknowledged
    unconfirmed). The slot is handed to B after."""
    client = _client(cluster)
    a, b = cluster.primary_ports()[:2]
    h = _hashes_on(client, a, 1, salt=5)[0]
    slot = client.keyslot(RedisTier.PREFIX + h.hex().encode())
    h2 = next(x for x in (i.to_bytes(16, "little") for i in range(10**6))  # a second key of the slot
              if client.keyslot(RedisTier.PREFIX + x.hex().encode()) == slot and x != h)
    ids = {port: cluster.node_id(port) for port in (a, b)}
    with cluster.node(b).client() as c:
        c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[a])
    with cluster.node(a).client() as c:
        c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[b])
    try:
        blocks = {x: torch.randn(LAYOUT.block_shape) for x in (h, h2)}
        assert RedisTier(cluster.url(wait_replicas=0), secret=TEST_SECRET).put_many([(h, LAYOUT.key, blocks[h])])
        waiting = RedisTier(url, secret=TEST_SECRET)
        assert waiting.put_many([(h2, LAYOUT.key, blocks[h2])]) is False and waiting.stats.unreplicated == 1
        with cluster.node(b).client() as c:
            assert c.execute_command("ASKING") and c.execute_command("EXISTS", RedisTier.PREFIX + h.hex().encode())
        back = RedisTier(url, secret=TEST_SECRET).get_many([h, h2], LAYOUT)  # GET meets ASK too
        assert set(back) == {h, h2} and all(torch.equal(back[x], blocks[x]) for x in back)
    finally:
        for port in cluster.primary_ports():  # the slot is B's now, on every primary
            with cluster.node(port).client() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[b])
        cluster.wait_healthy()
