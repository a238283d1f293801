"""Store ref accounting no other test pins down (mutations of each got past the suite): pins of stored entries,
promotions refused or failed, a failed put that shares CPU-tier blocks, a same-host touch."""

import pytest
import torch
from kvbridge.transfer.store import NotFound, pool_data
from kvbridge.transfer.store.block_pool import CapacityError
from test_store import BS, ok, seg, store


def _fill(st, first, n, pin=False):
    return [st.put(seg(range(1000 * (first + i), 1000 * (first + i) + 2 * BS)), "t", pin=pin) for i in range(n)]


@pytest.mark.parametrize("how", ["pin", "refresh", "put"])
def test_pinning_a_stored_entry_holds_its_blocks_on_the_device(how):
    """kills pin_without_ref (PagedStore._pin_entry keep_ref=False) and store_repin_no_ref (put(pin=True) of an
    existing unpinned entry without pool.ref)."""
    st = store(blocks=4)
    a = st.put(seg(range(2 * BS)), "t")
    if how == "pin":
        st.pin(a.key, "t")
    elif how == "refresh":
        st.refresh(a.key, "t", pin=True)
    else:
        st.put(seg(range(2 * BS)), "t", pin=True)
    ok(st)  # a pinned entry's blocks hold one ref each
    _fill(st, 1, 3)  # 6 blocks of others through a 4-block store: the pinned 2 must stay
    assert a.key in st.keys("t")
    assert torch.equal(st.get(a.key, "t").kv, seg(range(2 * BS)).kv)
    ok(st)


def test_a_same_host_touch_makes_the_entry_the_most_recently_used():
    """kills pool_touch_noop (BlockPool.touch does nothing): PagedStore.touch must count as a use for eviction."""
    st = store(blocks=4)
    a, b = _fill(st, 0, 2)  # a is the least recently used
    kv = seg(range(0, 2 * BS)).kv
    st.touch(a.key, "t", kv, st.info(a.key, "t").serial)  # now b is
    _fill(st, 5, 1)  # 2 more blocks: one entry must go
    keys = st.keys("t")
    assert a.key in keys and b.key not in keys
    ok(st)


def test_a_put_whose_block_write_fails_puts_the_cpu_tiers_copies_back(monkeypatch):
    """kills put_giveback_cpu_not_restored: a failed put that took shared blocks out of the CPU tier must put them
    back (else the entry that uses them is left with blocks in no tier)."""
    st = store(blocks=4, cpu_blocks=8)
    a = st.put(seg(range(2 * BS)), "t")
    _fill(st, 1, 2)  # evicts a's 2 blocks to the CPU tier
    assert st.info(a.key, "t").tier == "cpu"

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory (injected)")

    with monkeypatch.context() as patched:
        patched.setattr(pool_data.PoolData, "write_segment", out_of_memory)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            st.put(seg(range(3 * BS)), "t")  # a's 2 blocks, then one more: a's leave the CPU tier for the device
    ok(st)
    assert torch.equal(st.get(a.key, "t").kv, seg(range(2 * BS)).kv)
    ok(st)


def test_a_get_refused_for_room_holds_nothing_and_loses_nothing():
    """kills resident_fail_no_unref (make_resident keeps the refs of the present blocks when promotion fails) and
    promote_capacity_no_restore (the blocks taken out of the CPU tier are not put back on CapacityError)."""
    st = store(blocks=4, cpu_blocks=8)
    a = st.put(seg(range(2 * BS)), "t")  # a0 a1
    st.put(seg(range(5000, 5000 + BS)), "t", pin=True)  # 1 pinned, 1 empty left
    c = st.put(seg(range(7000, 7000 + 2 * BS)), "t", pin=True)  # the empty one and a's tail: a1 to the CPU tier
    assert st.info(a.key, "t").tier == "mixed"
    with pytest.raises(CapacityError):
        st.get(a.key, "t")  # a1 needs a block; the only unpinned one is a0, which a get holds
    ok(st)
    st.pin(c.key, "t", False)
    assert torch.equal(st.get(a.key, "t").kv, seg(range(2 * BS)).kv)
    ok(st)


def test_a_get_that_finds_blocks_gone_from_redis_puts_the_cpu_tiers_back(redis_url):
    """kills promote_notfound_no_restore: a get whose blocks Redis no longer has is NotFound, and the blocks it took
    out of the CPU tier go back there (another entry uses them)."""
    import redis
    st = store(blocks=4, cpu_blocks=2, redis_url=redis_url)
    a_seg = seg(range(4 * BS))
    a = st.put(a_seg, "t")  # a0..a3
    head = st.put(seg(range(2 * BS)), "t")  # a0 a1, shared
    st.put(seg(range(9000, 9000 + 4 * BS)), "t")  # evicts a0..a3: a0 a1 to the CPU tier, a2 a3 on to Redis
    assert st.info(head.key, "t").tier == "cpu" and st.info(a.key, "t").tier == "mixed"
    redis.Redis.from_url(redis_url).flushall()  # Redis lost a2 a3 (expired, evicted, restarted)
    with pytest.raises(NotFound):
        st.get(a.key, "t")
    assert torch.equal(st.get(head.key, "t").kv, a_seg.kv[:, :, :, :2 * BS])
    ok(st)
