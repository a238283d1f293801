"""PagedStore: hashing, sharing, eviction order, TTL, pins, capacity, tenants, threads, bad input. Every scenario ends
with check() == []. Its tiers below the device pool (CPU, a real Redis): tests/test_store_redis_tier.py; the
builders here (`seg`, `store`, `Clock`, `ok`) serve the other tests/test_store_*.py too.
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import NotFound, PagedStore, QuotaExceeded, StoreConfig
from kvbridge.transfer.store.block_pool import CapacityError
from kvbridge.transfer.store.kv_blocks import Block, FreeBlockQueue, Namespace, chain_root, hash_block, hash_chain
from redisproc import TEST_SECRET

M = ModelIdentity("model-a", "a" * 64)
OTHER = ModelIdentity("model-b", "b" * 64)
L, H, D, BS = 2, 2, 8, 16
BLOCK_BYTES = L * 2 * H * BS * D * 4  # float32


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def seg(tokens, model=M, dtype=torch.float32, start=0, seed=None, heads=H):
    t = torch.as_tensor(tokens, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed if seed is not None else int(t.sum()) + len(t))
    kv = torch.randn(L, 2, heads, len(t), D, generator=gen).to(dtype)
    return KVSegment(kv=kv, token_ids=t, positions=torch.arange(start, start + len(t)), model=model, rotated=True)


def store(blocks=32, cpu_blocks=0, redis_url=None, clock=None, max_layouts=1, **kw):
    # capacity: `blocks` blocks per layout allowed (max_layouts), one byte budget the layouts share
    cfg = StoreConfig(capacity_bytes=blocks * BLOCK_BYTES * max_layouts, max_layouts=max_layouts,
                      cpu_capacity_bytes=cpu_blocks * BLOCK_BYTES, redis_url=redis_url, device="cpu",
                      redis_secret=TEST_SECRET if redis_url else None, **kw)
    return PagedStore(cfg, clock=clock or Clock())


def ok(st):
    assert st.check() == []


def device_blocks_used(st):
    return sum(1 for p in st.pools.values() for b in p.blocks if b.block_hash is not None)


# ---------------------------------------------------------------------------------------------------- hashing


def test_hashes_are_stable_and_namespaced():
    ns = Namespace("tenant", "m@1", "bfloat16")
    root = chain_root(ns.digest(), "prefix")
    h = hash_block(root, torch.arange(16), ns.digest())
    # a fixed value: replicas and restarts must agree (no salted hash())
    assert h.hex() == hash_block(root, torch.arange(16), Namespace("tenant", "m@1", "bfloat16").digest()).hex()
    assert len(h) == 16
    assert h != hash_block(root, torch.arange(16), Namespace("tenant2", "m@1", "bfloat16").digest())
    assert h != hash_block(root, torch.arange(16), Namespace("tenant", "m@1", "float32").digest())
    assert h != hash_block(root, torch.arange(16), Namespace("tenant", "m@1", "bfloat16", "ad@1").digest())
    chain = hash_chain(torch.arange(40), 16, root, ns.digest())
    assert len(chain) == 3 and chain[0] == h
    assert chain[1] == hash_block(h, torch.arange(16, 32), ns.digest())
    assert hash_chain(torch.arange(40), 16, root, ns.digest(), full_only=True) == chain[:2]
    with pytest.raises(ValueError, match="tenant"):
        Namespace("", "m", "f")


def test_free_queue_is_lru_with_o1_removal():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    q.appendleft(q.popleft())
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2] and len(q) == 5
    assert q.popleft() is blocks[0] and not q.contains(blocks[0])
    for b in list(q):
        q.remove(b)
    with pytest.raises(IndexError):
        q.popleft()


# ---------------------------------------------------------------------------------------------------- basics


def test_put_get_round_trip_is_bit_exact_for_several_dtypes():
    st = store()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cfg = StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=3, device="cpu")
        st = PagedStore(cfg)
        s = seg(range(37), dtype=dtype)
        info = st.put(s, "t")
        out = st.get(info.key, "t")
        assert out.kv.dtype == dtype and torch.equal(out.kv, s.kv)
        assert out.kv.is_contiguous()
        assert torch.equal(out.token_ids, s.token_ids) and torch.equal(out.positions, s.positions)
        assert out.model == M and out.rotated
        ok(st)


def test_common_prefix_blocks_are_stored_once():
    st = store()
    a = seg(list(range(64)) + [1000, 1001, 1002])
    b = seg(list(range(64)) + [2000] * 20, seed=1)
    b.kv[:, :, :, :64] = a.kv[:, :, :, :64]  # same prefix -> same KV
    ia = st.put(a, "t")
    ib = st.put(b, "t")
    assert (ia.num_blocks, ia.new_blocks) == (5, 5)
    assert (ib.num_blocks, ib.new_blocks) == (6, 2), "the 4 blocks of the common 64 tokens are shared"
    assert device_blocks_used(st) == 7
    assert torch.equal(st.get(ia.key, "t").kv, a.kv) and torch.equal(st.get(ib.key, "t").kv, b.kv)
    # deleting one keeps the shared blocks for the other
    assert st.delete(ia.key, "t")
    assert device_blocks_used(st) == 6
    assert torch.equal(st.get(ib.key, "t").kv, b.kv)
    ok(st)


def test_put_is_idempotent_and_refreshes():
    clock = Clock()
    st = store(clock=clock)
    s = seg(range(20))
    first = st.put(s, "t", ttl_s=10)
    clock.now += 5
    again = st.put(s, "t", ttl_s=10)
    assert again.key == first.key and again.new_blocks == 0 and again.expires_at == clock.now + 10
    assert st.stats().entries == 1
    ok(st)


def test_lookup_longest_prefix_and_exact():
    st = store()
    s = seg(range(50))
    info = st.put(s, "t")
    exact = st.lookup(torch.arange(50), "t", M, torch.float32)
    assert (exact.key, exact.num_tokens, exact.tier) == (info.key, 50, "device")
    longer = st.lookup(torch.cat([torch.arange(50), torch.tensor([7, 7, 7])]), "t", M, torch.float32)
    assert longer.key is None and longer.num_tokens == 48 and longer.tier == "device"
    prefix = st.get_prefix(torch.arange(60), "t", M, torch.float32, longer.num_tokens)
    assert torch.equal(prefix.kv, s.kv[:, :, :, :48])
    diverging = torch.arange(50)
    diverging[20] = 999
    assert st.lookup(diverging, "t", M, torch.float32).num_tokens == 16
    miss = st.lookup(torch.arange(100, 150), "t", M, torch.float32)
    assert (miss.key, miss.num_tokens, miss.tier) == (None, 0, None)
    assert st.lookup(torch.arange(50), "t", OTHER, torch.float32).num_tokens == 0
    assert st.lookup(torch.arange(50), "t", M, torch.bfloat16).num_tokens == 0
    s = st.stats()
    assert s.hits >= 3 and s.misses >= 3 and s.hit_tokens >= 50 + 48 + 16
    ok(st)


def test_segments_are_position_independent_and_share_nothing():
    st = store()
    a = seg(range(40), start=100)
    ia = st.put(a, "t", kind="segment")
    found = st.lookup(torch.arange(40), "t", M, torch.float32, kind="segment")
    assert found.key == ia.key and found.num_tokens == 40
    out = st.get(ia.key, "t")
    assert out.positions.tolist() == list(range(100, 140)) and torch.equal(out.kv, a.kv)
    b = seg(list(range(32)) + [9] * 8, start=5, seed=3)
    ib = st.put(b, "t", kind="segment")
    assert ib.new_blocks == ib.num_blocks == 3, "segments never share blocks (their KV depends on context)"
    assert st.lookup(torch.arange(40), "t", M, torch.float32).num_tokens == 0, "segments are not prefixes"
    with pytest.raises(ValueError, match="prefix entry must hold positions 0..T-1"):
        st.put(a, "t", kind="prefix")
    ok(st)


# ---------------------------------------------------------------------------------------------------- eviction


def test_eviction_is_lru_and_takes_chain_tails_first():
    st = store(blocks=8, cpu_blocks=16)
    a = st.put(seg(range(48)), "t")  # 3 blocks
    b = st.put(seg(range(100, 148)), "t")  # 3 blocks, more recent
    pool = next(iter(st.pools.values()))
    a_hashes = st.registry.entries[a.key].hashes
    st.put(seg(range(200, 232)), "t")  # 2 blocks: 2 unused blocks remain, no eviction yet
    assert st.stats().evictions["device"] == 0
    st.put(seg(range(300, 332)), "t")  # 2 more: evicts the two least recent blocks, A's tail first
    on_device = [pool.lookup(h) is not None for h in a_hashes]
    assert on_device == [True, False, False], "A's chain lost its tail blocks, kept its head"
    assert all(h in st.cpu for h in a_hashes[1:])
    assert all(pool.lookup(h) is not None for h in st.registry.entries[b.key].hashes)
    assert st.stats().evictions["device"] == 2
    ok(st)
    # reading A promotes its blocks back, bit-exact; the now least recent blocks (B's tail) go down
    assert torch.equal(st.get(a.key, "t").kv, seg(range(48)).kv)
    assert all(pool.lookup(h) is not None for h in a_hashes)
    ok(st)


def test_without_a_lower_tier_evicted_entries_are_lost_cleanly():
    st = store(blocks=4)
    a = st.put(seg(range(48)), "t")
    st.put(seg(range(100, 148)), "t")  # evicts 2 of A's blocks with nowhere to go
    with pytest.raises(NotFound):
        st.get(a.key, "t")
    assert st.stats().lost_entries == 1 and st.stats().entries == 1
    ok(st)


def test_a_put_does_not_evict_the_cpu_copies_of_the_blocks_it_writes_itself():
    """A put whose first blocks sit in the CPU tier (another entry's, demoted) writes them onto the device from its
    segment; the room it makes there must not push those very copies out of the CPU tier first (with no tier below,
    the entry that uses them would be lost for nothing)."""
    st = store(blocks=4, cpu_blocks=2)
    x_seg = seg(range(32))
    x = st.put(x_seg, "t")  # 2 blocks
    st.put(seg(range(1000, 1064)), "t")  # 4 blocks: X's 2 go down to the CPU tier, filling it
    assert all(h in st.cpu for h in st.registry.entries[x.key].hashes)
    z_seg = seg(range(48))
    z_seg.kv[:, :, :, :32] = x_seg.kv  # X's tokens first, with X's KV: X's two blocks and one more
    z = st.put(z_seg, "t")  # 3 blocks to allocate: 3 of Y's go down to the CPU tier, which has room for 2
    assert z.new_blocks == 3
    assert torch.equal(st.get(x.key, "t").kv, x_seg.kv), "X's blocks are on the device now"
    assert torch.equal(st.get(z.key, "t").kv, z_seg.kv)
    assert st.stats().lost_entries == 1  # Y only: one of its blocks had nowhere to go
    ok(st)


def test_pinned_entries_are_never_evicted():
    st = store(blocks=6)
    pinned = st.put(seg(range(48)), "t", pin=True)
    for i in range(5):
        st.put(seg(range(1000 * (i + 1), 1000 * (i + 1) + 40)), "t")
        ok(st)
    assert torch.equal(st.get(pinned.key, "t").kv, seg(range(48)).kv)
    with pytest.raises(CapacityError, match="need 4 free blocks, 3 of 6 are free"):
        st.put(seg(range(7000, 7064)), "t")
    ok(st)
    st.pin(pinned.key, "t", False)
    st.put(seg(range(7000, 7064)), "t")
    ok(st)


def test_capacity_is_never_exceeded_under_random_traffic():
    rng = random.Random(0)
    st = store(blocks=12, cpu_blocks=6)
    keys = []  # what was stored, less what is known gone (deleted, or found evicted)
    done = {"put": 0, "get": 0, "refused": 0}  # so that refusals and misses cannot be all the traffic did
    for step in range(300):
        op = rng.random()
        if op < 0.6 or not keys:
            base = rng.randrange(4) * 10_000
            n = rng.randrange(1, 90)
            tokens = list(range(base, base + rng.randrange(0, 40))) + [rng.randrange(50_000) for _ in range(n)]
            try:
                keys.append(st.put(seg(tokens), "t", pin=rng.random() < 0.05).key)
                done["put"] += 1
            except CapacityError:
                done["refused"] += 1
        elif op < 0.85:
            key = rng.choice(keys)
            try:
                st.get(key, "t")
                done["get"] += 1
            except NotFound:
                keys.remove(key)
            except CapacityError:
                pass
        elif op < 0.95:
            key = rng.choice(keys)
            keys.remove(key)
            st.delete(key, "t")
        else:
            key = rng.choice(keys)
            try:
                st.pin(key, "t", False)
            except NotFound:
                keys.remove(key)
        s = st.stats()
        assert s.bytes_used["device"] <= 12 * BLOCK_BYTES and s.bytes_used["cpu"] <= 6 * BLOCK_BYTES
        assert st.check() == [], f"step {step}"
    # the store took most of the traffic and was full at times (seed 0: 110 puts, 24 gets, 65 refused puts)
    assert done["put"] >= 50 and done["get"] >= 10 and done["refused"] >= 1, done


# ---------------------------------------------------------------------------------------------------- TTL, tenants


def test_ttl_expiry_with_an_injected_clock():
    clock = Clock()
    st = store(clock=clock, default_ttl_s=60)
    short = st.put(seg(range(20)), "t", ttl_s=5)
    default = st.put(seg(range(100, 120)), "t")
    assert default.expires_at == clock.now + 60
    clock.now += 4.9
    st.get(short.key, "t")
    clock.now += 0.2
    with pytest.raises(NotFound):
        st.get(short.key, "t")
    assert st.lookup(torch.arange(20), "t", M, torch.float32).num_tokens == 0, "expired KV is gone"
    clock.now += 60
    st.purge_expired()
    assert st.stats().entries == 0 and st.stats().expired_entries == 2
    assert device_blocks_used(st) == 0
    ok(st)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        st.put(seg(range(3)), "t", ttl_s=0)


def test_get_prefix_serves_nothing_of_an_expired_entry():
    clock = Clock()
    st = store(clock=clock)
    st.put(seg(range(40)), "t", ttl_s=5)
    clock.now += 6  # no other call runs expiry first
    with pytest.raises(NotFound):
        st.get_prefix(torch.arange(40), "t", M, torch.float32, 32)
    assert st.stats().expired_entries == 1 and device_blocks_used(st) == 0
    ok(st)


def test_tenants_never_see_each_other_even_for_identical_tokens():
    st = store()
    s = seg(range(40))
    a = st.put(s, "alice")
    b = st.put(s, "bob")
    assert a.key != b.key and b.new_blocks == b.num_blocks, "no block is shared across tenants"
    with pytest.raises(NotFound) as exc:
        st.get(a.key, "bob")
    assert "alice" not in str(exc.value)
    assert st.delete(a.key, "bob") == 0 and st.get(a.key, "alice") is not None
    assert st.lookup(torch.arange(40), "carol", M, torch.float32).num_tokens == 0
    with pytest.raises(NotFound):
        st.pin(a.key, "bob")
    assert st.keys("alice") == [a.key] and st.keys("carol") == []
    ok(st)


# ---------------------------------------------------------------------------------------------------- bad input


def test_bad_input_leaves_the_store_unchanged():
    st = store(blocks=8)
    good = st.put(seg(range(30)), "t")
    before = (st.stats().entries, device_blocks_used(st))
    with pytest.raises(ValueError, match=r"layout mismatch for model-a@aaaaaaaaaaaaaaaa/float32: .*H_kv=2.*H_kv=3"):
        st.put(seg(range(30), heads=3), "t")
    with pytest.raises(CapacityError, match="needs 9 blocks of 16 tokens, the store holds 8 of them"):
        st.put(seg(range(140)), "t")
    with pytest.raises(CapacityError, match="already holds 1 layouts"):
        st.put(seg(range(30), model=OTHER), "t")
    with pytest.raises(ValueError, match="kind must be one of"):
        st.put(seg(range(30)), "t", kind="blob")
    with pytest.raises(ValueError, match="empty segment"):
        st.put(seg([]), "t")
    with pytest.raises(ValueError, match="tenant must be a non-empty string"):
        st.put(seg(range(30)), "")
    with pytest.raises(ValueError, match="put takes a KVSegment"):
        st.put({"kv": 1}, "t")
    with pytest.raises(ValueError, match="multiple of 16"):
        st.get_prefix(torch.arange(30), "t", M, torch.float32, 20)
    with pytest.raises(NotFound):
        st.get("0" * 32, "t")
    assert (st.stats().entries, device_blocks_used(st)) == before
    assert torch.equal(st.get(good.key, "t").kv, seg(range(30)).kv)
    ok(st)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        StoreConfig(block_size=0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        StoreConfig(capacity_bytes=0)
    with pytest.raises(CapacityError, match="one block needs"):
        PagedStore(StoreConfig(capacity_bytes=100, device="cpu")).put(seg(range(3)), "t")


def test_block_size_is_configurable():
    cfg = StoreConfig(capacity_bytes=64 * BLOCK_BYTES, max_layouts=1, block_size=4, device="cpu")
    st = PagedStore(cfg)
    info = st.put(seg(range(10)), "t")
    assert info.num_blocks == 3
    assert st.lookup(torch.arange(9), "t", M, torch.float32).num_tokens == 8
    ok(st)


# ---------------------------------------------------------------------------------------------------- threads


def test_concurrent_put_get_delete_from_8_threads():
    st = store(blocks=40, cpu_blocks=20)
    errors = []
    originals = {}
    lock = threading.Lock()
    done = {"put": 0, "get": 0}  # the calls that succeeded, so refusals and misses cannot be all the threads did

    def worker(n):
        rng = random.Random(n)
        for _ in range(60):
            tokens = [rng.randrange(3) * 1000 + i for i in range(rng.randrange(10, 70))]
            s = seg(tokens)
            try:
                op = rng.random()
                if op < 0.5:
                    info = st.put(s, f"tenant{n % 3}")
                    with lock:
                        originals[(info.key, f"tenant{n % 3}")] = s.kv
                        done["put"] += 1
                elif op < 0.85:
                    with lock:
                        items = list(originals.items())
                    if items:
                        (key, tenant), kv = rng.choice(items)
                        try:
                            got = st.get(key, tenant)
                            if not torch.equal(got.kv, kv):
                                errors.append(f"wrong KV for {key}")
                            with lock:
                                done["get"] += 1
                        except NotFound:
                            pass
                else:
                    with lock:
                        items = list(originals)
                    if items:
                        st.delete(*rng.choice(items))
            except CapacityError:
                pass
            except Exception as exc:  # noqa: BLE001 - any other error is a failure
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert done["put"] >= 100 and done["get"] >= 10, done  # about 240 puts and 40 gets take place
    ok(st)


    ok(st)


def test_model_kv_through_the_store_continues_exactly(tiny_source):
    """extract -> put -> (evicted to CPU, promoted back) -> get -> to_cache -> generate == plain generate."""
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.selfcheck import check_tokens

    lm = tiny_source
    ids = check_tokens(lm, 100)
    segment = kvcache.extract(lm.model, lm.spec, ids[:-2])
    layout_bytes = segment.nbytes // segment.num_tokens * BS
    st = PagedStore(StoreConfig(capacity_bytes=8 * layout_bytes, max_layouts=1, cpu_capacity_bytes=16 * layout_bytes,
                                device="cpu"))
    info = st.put(segment, "t")
    st.put(kvcache.extract(lm.model, lm.spec, ids[:40].flip(0)), "t")  # pushes part of it down to the CPU tier
    assert st.info(info.key, "t").tier == "mixed"
    back = st.get(info.key, "t")
    assert torch.equal(back.kv, segment.kv)
    out = kvcache.generate(lm.model, lm.spec, back, ids[-2:], max_new_tokens=8, min_new_tokens=8)
    assert torch.equal(out, kvcache.generate_plain(lm.model, lm.spec, ids, max_new_tokens=8, min_new_tokens=8))
    ok(st)


def test_a_ttl_past_ten_years_or_nan_is_refused_by_name():
    """NaN passed `ttl <= 0` and stopped every later entry's expiry (the expiry heap compared nothing past it); a TTL
    near the float's largest overflowed the Redis tier's milliseconds and took the tier down for every tenant."""
    from kvbridge.transfer.store import NO_TTL

    clock = Clock()
    st = store(clock=clock)
    for bad in (math.nan, 1e306, 11 * 365 * 86400.0, -1.0):
        with pytest.raises(ValueError, match=r"ttl_s must be > 0 and at most 315360000 s"):
            st.put(seg(range(3)), "t", ttl_s=bad)
    kept = st.put(seg(range(40, 43)), "t", ttl_s=NO_TTL)  # never: as before
    with pytest.raises(ValueError, match="ttl_s must be > 0 and at most"):
        st.refresh(kept.key, "t", ttl_s=math.nan)
    with pytest.raises(ValueError, match="default_ttl_s must be > 0 and at most"):
        StoreConfig(capacity_bytes=BLOCK_BYTES, default_ttl_s=math.nan)
    short = st.put(seg(range(3)), "t", ttl_s=1.0)
    clock.now += 2
    st.purge_expired()
    assert st.keys("t") == [kept.key] and short.key not in st.keys("t") and st.check() == []


def test_pinned_entries_sharing_a_prefix_count_its_blocks_once_against_the_quota():
    st = store(tenant_max_pinned_bytes=4 * BLOCK_BYTES)
    st.put(seg(range(3 * BS)), "t", pin=True)  # 3 blocks
    st.put(seg(range(4 * BS)), "t", pin=True)  # the same 3 and one more: 4 distinct blocks, the quota
    assert st.tenant_usage("t").bytes_used == {"device": 4 * BLOCK_BYTES}
    with pytest.raises(QuotaExceeded, match="pinning 4096 more bytes would take this tenant.s pinned KV to 20480"):
        st.put(seg(range(100, 100 + BS)), "t", pin=True)
    assert st.check() == []
