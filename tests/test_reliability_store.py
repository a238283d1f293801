"""Reliability of the store behind the service (issue 8): Redis killed and restarted while clients run (local tiers
serve, the tier reports itself down and comes back on the store's clock), corrupt blocks in Redis (a miss, never
bad data), a store filled to capacity (eviction by policy, pinned entries kept, polite refusals). In-process servers
on loopback, the tiny pair, a real redis-server. Load: tests/test_reliability.py; server and client faults:
tests/test_reliability_server.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import pytest
import served
import torch
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer import kvcache
from redisproc import TEST_SECRET, write_secret_file
from served import ALICE, BOB, Tally

pytestmark = pytest.mark.integration

OK, NOT_FOUND, EXHAUSTED = "OK", grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------------------------------------------------------ faults: Redis


def _redis_client(address: str, token: str, texts: list[str], expected: dict, tally: Tally, stop: threading.Event,
                  phase: list[str], cycles: Counter) -> None:
    """Ingest, fetch by key and by text, look up, over and over on its own few texts. A miss (NOT_FOUND) is allowed
    only for fetches by key once Redis has been killed (their blocks may have been in Redis, or lost on the way
    down); anything answered must be exact."""
    def miss_after_kill(code) -> bool:
        return code == NOT_FOUND and phase[0] != "up"

    with KVBridgeClient(address, token=token, timeout_s=60, retries=0) as client:
        i = 0
        while not stop.is_set():
            text = texts[i % len(texts)]
            i += 1
            source_kv, projected = expected[text]
            reply = tally.call("Ingest", client.ingest, text)
            if reply is not None:
                key = reply.entries[0].key
                got = tally.call("GetSourceCache(key)", client.fetch_source, key=key, tolerate=miss_after_kill)
                tally.check(got is None or torch.equal(got.segment.kv, source_kv.kv),
                            f"GetSourceCache by key: wrong KV for text {i % len(texts)}")
                got = tally.call("GetProjectedCache(key)", client.fetch_projected, key=key,
                                 tolerate=miss_after_kill)
                tally.check(got is None or torch.equal(got.segment.kv, projected.kv),
                            f"GetProjectedCache by key: wrong KV for text {i % len(texts)}")
            got = tally.call("GetProjectedCache(text)", client.fetch_projected, text=text)
            tally.check(got is None or torch.equal(got.segment.kv, projected.kv),
                        f"GetProjectedCache by text: wrong KV for text {i % len(texts)}")
            tally.call("Lookup", client.lookup, text)
            cycles[phase[0]] += 1


def test_redis_killed_and_restarted_while_clients_run(tiny_source, tiny_target, adapters_dir, adapter, redis_server):
    """Clients keep going while Redis is killed (local tiers serve; the tier reports itself down; only fetches by
    key may miss) and restarted (the tier comes back after its retry interval, on the store's clock)."""
    from kvbridge.transfer.store import PagedStore, StoreConfig

    clock = served.ManualClock()
    retry_s = 30.0  # on the injected clock: the tier tries Redis again only when the test moves the clock
    # 4 MB: pools of 64 source blocks (16 KB) and 14 target blocks (72 KB); a 256 KB CPU tier under them: the
    # clients' projections alone need ~80 target blocks, so blocks go down to Redis and come back all the time.
    store = PagedStore(StoreConfig(capacity_bytes=4 << 20, cpu_capacity_bytes=256 << 10, redis_url=redis_server.url,
                                   redis_secret=TEST_SECRET,
                                   redis_retry_s=retry_s, device="cpu"), clock=clock)
    # No kept wire messages or same-host files: a repeated fetch would be answered from them without reading a
    # block, and this test is about blocks going down to Redis and coming back.
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir, store=store, stream_keep_mb=0,
                                  shm_keep_s=0)
    n_clients, texts_each = 4, 5
    texts = [[served.text(100 + c * texts_each + j, count=15) for j in range(texts_each)] for c in range(n_clients)]
    expected = {t: served.expected_projection(t, tiny_source, tiny_target, adapter) for ts in texts for t in ts}
    stop, phase, cycles = threading.Event(), ["up"], Counter()
    tallies = [Tally() for _ in range(n_clients)]
    for tally in tallies:
        tally.where = lambda: f"Redis {phase[0]}"
    tokens = [ALICE, BOB]
    threads = [threading.Thread(target=tallies[c].run, name=f"redis-load-{c}",
                                args=(_redis_client, running.address, tokens[c % 2], texts[c], expected, tallies[c],
                                      stop, phase, cycles))
               for c in range(n_clients)]

    def redis_stats() -> dict:
        return store.stats().redis

    def more_cycles(n: int):
        target = sum(cycles.values()) + n
        return lambda: sum(cycles.values()) >= target

    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        served.wait_for(lambda: redis_stats()["puts"] > 0 and redis_stats()["hits"] > 0,
                        "blocks to go down to Redis and come back")
        served.wait_for(more_cycles(8), "more client cycles with Redis up")

        phase[0] = "down"
        redis_server.kill()
        served.wait_for(lambda: not redis_stats()["available"], "the store to report the Redis tier down")
        with KVBridgeClient(running.address, token=ALICE, retries=0) as client:
            tiers = {t.tier: t.up for t in client.stats().tiers}
        assert tiers == {"device": True, "cpu": True, "redis": False}
        served.wait_for(more_cycles(8), "client cycles with Redis down")

        phase[0] = "back"
        redis_server.restart()

        def tier_back() -> bool:
            if redis_stats()["available"]:
                return True
            clock.advance(retry_s)  # the retry interval passes: the next call to the tier tries Redis again
            return False

        served.wait_for(tier_back, "the store to report the Redis tier up again")
        puts = redis_stats()["puts"]
        served.wait_for(lambda: redis_stats()["puts"] > puts, "blocks to go down to the restarted Redis")
        served.wait_for(more_cycles(8), "client cycles with Redis back")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        running.stop(1)
    assert not any(t.is_alive() for t in threads)

    tally = Tally.merged(tallies)
    served.report(f"redis kill/restart: {n_clients} clients, cycles by phase {dict(cycles)}", tally,
                  time.monotonic() - t0)
    stats = store.stats()
    print(f"  store: redis {stats.redis}, lost entries {stats.lost_entries}, evictions {stats.evictions}",
          flush=True)
    assert tally.wrong == [], tally.wrong[:5]
    assert not tally.errors, (dict(tally.errors), tally.samples)
    assert set(m for m, _ in tally.tolerated) <= {"GetSourceCache(key)", "GetProjectedCache(key)"}
    assert cycles["up"] > 0 and cycles["down"] >= 8 and cycles["back"] >= 8
    assert stats.redis["available"] and stats.redis["errors"] > 0 and stats.redis["down_since"] is None
    assert store.check() == []
    assert served.internal_errors(running) == {}


def _block_keys(store, lm, tenant: str, token_ids: torch.Tensor) -> list[bytes]:
    """The Redis keys of a source prefix entry's blocks: `kvbridge:2:blk:<block hash hex>` (transfer/tiers.py)."""
    from kvbridge.transfer.store.kv_blocks import Namespace, chain_root, hash_chain

    ns = Namespace(tenant=tenant, model=lm.spec.identity.key, dtype=lm.spec.dtype, adapter="")
    digest = ns.digest()
    hashes = hash_chain(token_ids, store.config.block_size, chain_root(digest, "prefix"), digest)
    return [b"kvbridge:2:blk:" + h.hex().encode() for h in hashes]


def test_a_corrupt_block_in_redis_is_a_miss_never_bad_data(tiny_source, tiny_target, adapters_dir, adapter,
                                                           redis_server):
    """Blocks demoted to Redis, two of one entry's overwritten (garbage; one flipped bit under a valid header):
    fetching that entry by key is NOT_FOUND, the tier counts both as corrupt and deletes them; by text it is
    computed again, exactly; an intact entry read back from Redis is exact."""
    import redis

    # 4 MB, no CPU tier: a source pool of 64 blocks; evicted blocks go straight to Redis
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=4, cpu_tier_mb=0,
                                  redis_url=redis_server.url,
                                  redis_secret_file=str(write_secret_file(redis_server.workdir)))
    store = running.service.store
    r = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            a_text, c_text = served.text(30), served.text(31)
            a = alice.ingest(a_text)
            c = alice.ingest(c_text)
            ka, kc = a.entries[0].key, c.entries[0].key
            for i in range(40):  # other texts until both are wholly in Redis
                if store.info(ka, "alice").tier == "redis" and store.info(kc, "alice").tier == "redis":
                    break
                alice.ingest(served.text(32 + i))
            assert store.info(ka, "alice").tier == "redis" and store.info(kc, "alice").tier == "redis"

            keys = _block_keys(store, tiny_source, "alice", a.source_token_ids)
            assert len(keys) >= 3 and all(r.exists(k) for k in keys)
            r.set(keys[0], b"\x00garbage, not a safetensors blob", keepttl=True)
            flipped = bytearray(r.get(keys[-1]))
            flipped[-1] ^= 0x01  # the last byte of the tensor data: the header still parses, the CRC does not match
            r.set(keys[-1], bytes(flipped), keepttl=True)
            corrupt = store.stats().redis["corrupt"]

            a_kv, _ = served.expected_projection(a_text, tiny_source, tiny_target, adapter)
            c_kv, _ = served.expected_projection(c_text, tiny_source, tiny_target, adapter)
            assert torch.equal(alice.fetch_source(key=kc).segment.kv, c_kv.kv)  # intact blocks come back exact

            code, details = served.code(lambda: alice.fetch_source(key=ka))
            assert code == NOT_FOUND, details
            assert store.stats().redis["corrupt"] == corrupt + 2
            assert not r.exists(keys[0]) and not r.exists(keys[-1])  # dropped from Redis
            code, _ = served.code(lambda: alice.fetch_projected(key=ka))
            assert code == NOT_FOUND  # the entry is gone, not served in part
            assert alice.lookup(a_text).key is None

            again = alice.fetch_source(text=a_text)  # by text: computed again
            assert again.entry_key == ka and torch.equal(again.segment.kv, a_kv.kv)
            _, projected = served.expected_projection(a_text, tiny_source, tiny_target, adapter)
            assert torch.equal(alice.fetch_projected(text=a_text).segment.kv, projected.kv)
        stats = store.stats()
        assert stats.redis["corrupt"] == corrupt + 2 and stats.redis["available"]
        assert store.check() == []
        assert served.internal_errors(running) == {}
    finally:
        r.close()
        running.stop(1)


# ------------------------------------------------------------------------------------------------ faults: capacity


def test_a_full_store_evicts_by_policy_keeps_pinned_entries_and_refuses_politely(tiny_source, tiny_target,
                                                                                adapters_dir):
    """A 2 MB store (one byte budget: 128 of the tiny source's 16 KB blocks, shared with projections; no lower
    tier): distinct texts until eviction; every call is OK or RESOURCE_EXHAUSTED; the oldest unpinned entries are
    gone (NOT_FOUND), the pinned one stays exact; pinning until full ends in RESOURCE_EXHAUSTED with a sentence,
    leaving the store as it was."""
    # the tenant may pin past the pool: this is about the store filling
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=2, cpu_tier_mb=0,
                                  tenant_max_pinned_mb=4)
    store = running.service.store
    codes = Counter()

    def attempt(call, *args, **kwargs):
        try:
            out = call(*args, **kwargs)
        except KVBridgeError as exc:
            codes[exc.code.name] += 1
            return None
        codes[OK] += 1
        return out

    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            texts = [served.text(100 + i, count=15) for i in range(140)]  # ~3 blocks of 16 KB each
            pinned = alice.ingest(texts[0], pin=True)
            keys = []
            for text in texts[1:26]:  # ~3 blocks each: twice what the source pool holds
                reply = attempt(alice.ingest, text)
                if reply is not None:
                    keys.append(reply.entries[0].key)
                    attempt(alice.fetch_projected, key=reply.entries[0].key)  # evicts older projections
            stats = store.stats()
            assert set(codes) <= {OK, "RESOURCE_EXHAUSTED"} and codes[OK] > 0, codes
            assert stats.evictions["device"] > 0 and stats.lost_entries > 0
            assert len(keys) == 25 and len(set(keys) & set(store.keys("alice"))) < 15  # some source entries went
            code, _ = served.code(lambda: alice.fetch_source(key=keys[0]))  # least recently used: evicted
            assert code == NOT_FOUND
            assert alice.lookup(texts[1]).key is None
            assert alice.fetch_source(key=keys[-1]).entry_key == keys[-1]  # the newest is there
            pinned_kv = kvcache.extract(tiny_source.model, tiny_source.spec, pinned.source_token_ids)
            assert torch.equal(alice.fetch_source(key=pinned.entries[0].key).segment.kv, pinned_kv.kv)

            # more blocks than the whole pool (one byte budget for every layout: ~2,500 tokens of 1 KB against 2 MB)
            code, details = served.code(lambda: alice.ingest(" ".join(served.words()[:800])))
            assert code == EXHAUSTED and "the store is full" in details and "in all" in details, details

            pins = [pinned.entries[0].key]
            for text in texts[26:]:  # pin until the pool is all pinned
                before = served.snapshot(store, "alice")
                try:
                    pins.append(alice.ingest(text, pin=True).entries[0].key)
                except KVBridgeError as exc:
                    assert exc.code == EXHAUSTED, exc
                    assert "the store is full" in exc.details and "pinned" in exc.details, exc.details
                    assert served.snapshot(store, "alice") == before  # a refused put changes nothing
                    break
            else:
                pytest.fail(f"{len(pins)} pinned entries and the store never refused one")
            assert len(pins) > 2
            for key in pins:  # every pinned entry survived everything
                assert alice.fetch_source(key=key).entry_key == key
            assert store.check() == []
            assert alice.stats().tenant_entries == len(store.keys("alice"))  # still answering

            for key in pins:  # unpinned by deletion: room again
                alice.delete(key)
            assert alice.ingest(texts[-1]).entries[0].new_blocks > 0
        assert store.check() == []
        assert served.internal_errors(running) == {}
    finally:
        running.stop(1)
