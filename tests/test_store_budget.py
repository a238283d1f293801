"""One device byte budget for every layout (issue 35, item 3): a layout may fill the whole capacity, gives its least
recently used bytes up when another layout needs room, and a mix of layouts fills the capacity before the first
eviction. check() == [] after every step."""

from __future__ import annotations

import random

import pytest
import torch
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.store.block_pool import BlockPool, PoolLayout
from test_store import BLOCK_BYTES, OTHER, Clock, D, H, L, M, ok, seg

WIDE = 4  # OTHER's entries have 4 KV heads: blocks twice M's bytes (the projection side of the pair, in miniature)


def wide(tokens, seed=None):
    return seg(tokens, model=OTHER, heads=WIDE, seed=seed)


def by_token(tokens, heads=H):
    """A prefix segment whose KV at each position depends on that token and position only: entries that share a
    prefix share its KV, as a model's would."""
    t = torch.as_tensor(tokens, dtype=torch.int64)
    pos = torch.arange(len(t))
    grid = torch.arange(L * 2 * heads * D, dtype=torch.float32).view(L, 2, heads, 1, D)
    kv = torch.sin(grid * 0.37 + t.view(1, 1, 1, -1, 1) * 0.011 + pos.view(1, 1, 1, -1, 1) * 0.5)
    return KVSegment(kv=kv, token_ids=t, positions=pos, model=OTHER if heads == WIDE else M, rotated=True)


def pool_of(st, info):
    return st.pools[st.registry.entries[info.key].layout.key]


def budget_store(capacity_blocks, slab_blocks=1, cpu_blocks=0):
    """A store of capacity_blocks of M's blocks in all, for every layout, growing by slabs of slab_blocks."""
    cfg = StoreConfig(capacity_bytes=capacity_blocks * BLOCK_BYTES, max_layouts=2, slab_bytes=slab_blocks * BLOCK_BYTES,
                      cpu_capacity_bytes=cpu_blocks * BLOCK_BYTES, device="cpu")
    return PagedStore(cfg, clock=Clock())


def device_bytes(st):
    return st.stats().bytes_used["device"]


def test_one_layout_may_fill_the_whole_capacity_then_yields_it_to_another():
    st = budget_store(capacity_blocks=16, cpu_blocks=64)
    keys = [st.put(seg(range(100 * i, 100 * i + 32)), "t").key for i in range(8)]  # 8 entries x 2 blocks
    ok(st)
    assert st.stats().evictions["device"] == 0, "one layout alone uses all 16 blocks (not a share of them)"
    assert device_bytes(st) == 16 * BLOCK_BYTES
    w = st.put(wide(range(64)), "t")  # 4 blocks of twice the bytes: M gives up 8 blocks, its least recent first
    ok(st)
    assert st.stats().evictions["device"] == 8
    pool = st.pools[st.registry.entries[keys[0]].layout.key]
    on_device = [all(pool.lookup(h) is not None for h in st.registry.entries[k].hashes) for k in keys]
    assert on_device == [False] * 4 + [True] * 4, "the four least recently used entries went down"
    assert device_bytes(st) == 16 * BLOCK_BYTES and st.budget.reserved_bytes == 16 * BLOCK_BYTES
    # and back: reading the demoted entries promotes them (bit-exact), the wide entry now least recent goes down
    for i, key in enumerate(keys[:4]):
        assert torch.equal(st.get(key, "t").kv, seg(range(100 * i, 100 * i + 32)).kv)
        ok(st)
    assert torch.equal(st.get(w.key, "t").kv, wide(range(64)).kv)
    ok(st)


def test_the_least_recently_used_layout_gives_up_room_whichever_asks():
    st = budget_store(capacity_blocks=16, cpu_blocks=64)
    a1 = st.put(seg(range(64)), "t")  # 4 blocks
    b1 = st.put(wide(range(1000, 1032)), "t")  # 2 wide blocks = 4
    a2 = st.put(seg(range(2000, 2064)), "t")  # 4
    b2 = st.put(wide(range(3000, 3032)), "t")  # 4: full
    st.get(a1.key, "t")  # LRU order now: b1, a2, b2, a1
    assert st.stats().evictions["device"] == 0
    st.put(seg(range(4000, 4032)), "t")  # M needs 2 blocks' bytes: OTHER's b1 is least recent, its tail goes
    ok(st)
    wide_pool, pool = pool_of(st, b1), pool_of(st, a1)
    assert [wide_pool.lookup(h) is not None for h in st.registry.entries[b1.key].hashes] == [True, False]
    assert all(pool.lookup(h) is not None for e in (a1, a2) for h in st.registry.entries[e.key].hashes)
    assert all(wide_pool.lookup(h) is not None for h in st.registry.entries[b2.key].hashes)
    st.put(wide(range(5000, 5016)), "t")  # OTHER needs 1 wide block: its own b1 head is now least recent
    ok(st)
    assert wide_pool.lookup(st.registry.entries[b1.key].hashes[0]) is None
    assert all(pool.lookup(h) is not None for e in (a1, a2) for h in st.registry.entries[e.key].hashes)
    assert torch.equal(st.get(b1.key, "t").kv, wide(range(1000, 1032)).kv)
    ok(st)


def test_get_prefix_holds_its_blocks_while_promoting_loses_the_entry_they_belong_to():
    """get_prefix promotes a CPU block; the room comes from the wide layout, whose evicted block overflows the CPU
    tier and loses the entry's tail (no Redis), so the entry goes. The blocks get_prefix holds stay until it is
    done: it returns their KV, then they go with the lost entry; no block is left held, check() == []."""
    st = budget_store(capacity_blocks=5, cpu_blocks=2)
    x = seg(range(48))
    info = st.put(x, "t")  # 3 blocks
    st.put(wide(range(1000, 1016)), "t")  # 1 wide block (2 M blocks' bytes): the device is full
    st.put(wide(range(2000, 2016)), "t")  # X's blocks 2 and 3 go down to the CPU tier, which is full then
    pool = pool_of(st, info)
    hashes = st.registry.entries[info.key].hashes
    assert [st.residency.tier_of(pool, h) for h in hashes] == ["device", "cpu", "cpu"]
    got = st.get_prefix(torch.arange(48), "t", M, torch.float32, 32)  # blocks 1 and 2: block 2 comes up
    assert torch.equal(got.kv, x.kv[:, :, :, :32])
    assert info.key not in st.registry.entries and st.stats().lost_entries == 1, "block 3 was lost meanwhile"
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free == pool.num_blocks
    assert st.lookup(torch.arange(48), "t", M, torch.float32).num_tokens == 0, "dropped with their entry"
    ok(st)


def test_mixed_layouts_fill_95_percent_of_the_bytes_before_the_first_eviction():
    rng = random.Random(1)
    st = budget_store(capacity_blocks=512, slab_blocks=8)
    filled, i = 0.0, 0
    while st.stats().evictions["device"] == 0:
        filled = device_bytes(st) / st.capacity_bytes
        n = rng.randrange(1, 200)
        st.put((wide if i % 2 else seg)(range(10_000 * i, 10_000 * i + n)), "t")
        i += 1
        ok(st)
    assert filled >= 0.95, f"only {filled:.1%} of the device bytes held KV before the first eviction"


def test_pinned_blocks_move_when_their_slab_is_given_up_and_stay_pinned():
    st = budget_store(capacity_blocks=128, slab_blocks=8)  # slabs of 4 M blocks (capacity / 32), 2 wide ones
    pinned = [st.put(wide(range(100 * i, 100 * i + 16)), "t", pin=True) for i in range(0, 40, 4)]
    rest = [st.put(wide(range(100 * i + 50, 100 * i + 66)), "t") for i in range(40)]
    ok(st)
    for i in range(60):  # M takes nearly everything the pins leave
        st.put(seg(range(100_000 + 100 * i, 100_000 + 100 * i + 30)), "t")
        ok(st)
    wide_pool = pool_of(st, pinned[0])
    assert wide_pool.num_blocks <= 12, "the wide layout gave up its unpinned slabs (10 pinned blocks left)"
    for i, info in zip(range(0, 40, 4), pinned):
        assert torch.equal(st.get(info.key, "t").kv, wide(range(100 * i, 100 * i + 16)).kv)
    assert sum(st.info(r.key, "t").tier == "device" for r in rest if r.key in st.registry.entries) <= 2
    with pytest.raises(CapacityError, match="need 125 free blocks"):
        st.put(seg(range(2000)), "t")  # more than the pins leave: refused before anything changes
    ok(st)


def test_random_traffic_over_two_layouts_keeps_every_invariant_and_every_byte():
    rng = random.Random(7)
    st = budget_store(capacity_blocks=48, slab_blocks=4, cpu_blocks=24)
    made = {}
    done = {"put": 0, "get": 0}  # the calls that succeeded, so refusals and misses cannot be all the traffic did
    for step in range(250):
        op = rng.random()
        if op < 0.55 or not made:
            heads = WIDE if rng.random() < 0.4 else H
            base = rng.randrange(3) * 10_000
            tokens = list(range(base, base + rng.randrange(0, 40))) + [rng.randrange(50_000) for _ in
                                                                         range(rng.randrange(1, 60))]
            try:
                key = st.put(by_token(tokens, heads), "t", pin=rng.random() < 0.05).key
                made[key] = (heads, tokens)
                done["put"] += 1
            except CapacityError:
                pass
        elif op < 0.85:
            key = rng.choice(list(made))
            heads, tokens = made[key]
            try:
                assert torch.equal(st.get(key, "t").kv, by_token(tokens, heads).kv), f"step {step}"
                done["get"] += 1
            except NotFound:
                del made[key]
            except CapacityError:
                pass
        elif op < 0.95:
            key = rng.choice(list(made))
            del made[key]
            st.delete(key, "t")
        else:
            try:
                st.pin(rng.choice(list(made)), "t", False)
            except NotFound:
                pass
        assert st.budget.reserved_bytes <= st.capacity_bytes
        assert st.check() == [], f"step {step}"
    assert done["put"] >= 60 and done["get"] >= 15, done  # seed 7: 136 puts, 32 gets


def test_a_pool_reserves_nothing_until_kv_arrives_and_grows_by_slabs():
    st = budget_store(capacity_blocks=256, slab_blocks=8)
    info = st.put(seg(range(20)), "t")
    pool = pool_of(st, info)
    assert pool.num_blocks == 8 and st.budget.reserved_bytes == 8 * BLOCK_BYTES  # one slab, not a quarter
    layout = PoolLayout("m", "float32", 1, 1, 4, 16)
    assert BlockPool(layout, 0, torch.device("cpu"), slab_blocks=4).slabs == []
    with pytest.raises(ValueError, match="slab_bytes must be >= 1"):
        StoreConfig(slab_bytes=0)


def test_a_refused_put_leaves_no_layout_behind():
    """A put refused for its size or by a tenant's quota created its layout's (empty) pool first, which then held
    one of max_layouts for good: a later put of another model was refused with nothing stored."""
    from kvbridge.transfer.store import QuotaExceeded

    st = PagedStore(StoreConfig(capacity_bytes=4 * BLOCK_BYTES, max_layouts=1, device="cpu",
                                tenant_max_pinned_bytes=0), clock=Clock())
    with pytest.raises(CapacityError, match="needs 3 blocks"):
        st.put(wide(range(48)), "t")  # the store holds 2 of OTHER's blocks in all
    with pytest.raises(QuotaExceeded):
        st.put(wide(range(16)), "t", pin=True)  # no pinned bytes for any tenant
    assert len(st.registry) == 0 and not st.pools
    st.put(seg(range(16)), "u")  # another tenant, another layout: the store's one layout slot is free
    ok(st)
