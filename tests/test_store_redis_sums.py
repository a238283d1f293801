"""Block sums taken where the store writes a block's CPU copy (issue 16, part 2): a Redis put sends the kept sum64
instead of reading the block again, never a sum gone stale, and the read side still checks every blob. The put and
store scenarios run against a real redis-server."""

from __future__ import annotations

import gc

import pytest
import torch
from kvbridge.transfer.checksum import sum64
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import PagedStore, StoreConfig, block_blob, tiers
from kvbridge.transfer.store.tiers import BlockSums, CpuTier, RedisTier, block_sums
from redisproc import TEST_SECRET

M = ModelIdentity("model-s", "s" * 64)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 4  # [L=2, 2, H=2, bs=16, D=8] float32


def _block(seed: int) -> torch.Tensor:
    # [L, 2, H_kv, bs, D]
    return torch.randn(3, 2, 1, 16, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _bytes_sum(block: torch.Tensor) -> int:
    return sum64(block.contiguous().view(torch.uint8).reshape(-1).numpy())


def _seg(first: int, n: int) -> KVSegment:
    gen = torch.Generator().manual_seed(first)
    return KVSegment(kv=torch.randn(2, 2, 2, n, 8, generator=gen), token_ids=torch.arange(first, first + n),
                     positions=torch.arange(n), model=M, rotated=True)


def _store(redis_url: str, blocks: int, cpu_blocks: int = 0, share: bool = False) -> PagedStore:
    return PagedStore(StoreConfig(capacity_bytes=blocks * BLOCK_BYTES, cpu_capacity_bytes=cpu_blocks * BLOCK_BYTES,
                                  max_layouts=1, redis_url=redis_url, redis_secret=TEST_SECRET, share_entries=share,
                                  device="cpu"))


@pytest.fixture
def sent(monkeypatch) -> list[bool]:
    """For each block a RedisTier put sends, in order: whether it went with a kept sum (not read again)."""
    seen: list[bool] = []
    real = tiers.block_parts

    def spy(layout_key: str, block: torch.Tensor):
        seen.append(block_sums.get(block) is not None)
        return real(layout_key, block)

    monkeypatch.setattr(tiers, "block_parts", spy)
    return seen


# ---------------------------------------------------------------------------------------------------- the sums


def test_a_sum_counts_for_its_own_tensor_only_until_its_bytes_are_written():
    sums = BlockSums()
    block = _block(0)
    assert sums.take(block) == sums.get(block) == _bytes_sum(block)
    assert sums.get(block.clone()) is None, "the same bytes in another tensor: no sum kept for it"
    block[1, 0].fill_(0.5)  # in place, through a view
    assert sums.get(block) is None
    sums.take(block)
    block.copy_(_block(1))
    assert sums.get(block) is None
    sums.take(block)
    block.add_(1)
    assert sums.get(block) is None


def test_a_row_sum_goes_stale_when_its_base_is_written():
    sums = BlockSums()
    data = torch.stack([_block(i) for i in range(3)])  # [3, L, 2, H, bs, D], like read_blocks' copy
    rows = list(data)
    for row in rows:
        sums.take(row)
    data.index_copy_(0, torch.tensor([2]), _block(9)[None])  # the base, in place: every row's counter moves
    assert [sums.get(row) for row in rows] == [None, None, None]


def test_no_sum_is_kept_for_an_inference_tensor_nor_for_a_dead_one():
    sums = BlockSums()
    with torch.inference_mode():
        block = _block(0)
    assert sums.take(block) == _bytes_sum(block)
    assert sums.get(block) is None and len(sums) == 0, "no version counter: a write could not be seen"
    block = _block(1)
    sums.take(block)
    assert len(sums) == 1
    del block
    gc.collect()
    assert len(sums) == 0


def test_the_cpu_tier_sums_its_copies_only_with_a_redis_tier_below():
    source = _block(0)
    with_sums, without = CpuTier(1 << 20, checksums=True), CpuTier(1 << 20)
    with_sums.put(b"a" * 16, "k", source)
    without.put(b"a" * 16, "k", source)
    assert block_sums.get(with_sums.pop(b"a" * 16)[1]) == _bytes_sum(source)
    assert block_sums.get(without.pop(b"a" * 16)[1]) is None


# ---------------------------------------------------------------------------------------------------- one tier


@pytest.mark.integration
def test_a_put_sends_the_kept_sum_and_the_blob_reads_back(redis_url, sent, monkeypatch):
    cpu = CpuTier(1 << 20, checksums=True)
    cpu.put(b"a" * 16, "k", _block(0))
    block = cpu.pop(b"a" * 16)[1]
    monkeypatch.setattr(block_blob, "sum64", lambda data: pytest.fail("the put read the block again"))
    tier = RedisTier(redis_url, secret=TEST_SECRET)
    assert tier.put_many([(b"a" * 16, "k", block)])
    monkeypatch.undo()  # the read side sums every blob
    assert sent == [True]
    assert torch.equal(tier.get_many([b"a" * 16], "k")[b"a" * 16], _block(0))


@pytest.mark.integration
def test_a_block_written_after_its_sum_was_taken_is_summed_again(redis_url, sent):
    cpu = CpuTier(1 << 20, checksums=True)
    cpu.put(b"a" * 16, "k", _block(0))
    block = cpu.pop(b"a" * 16)[1]
    block.copy_(_block(1))  # rewritten in place: the kept sum is stale
    tier = RedisTier(redis_url, secret=TEST_SECRET)
    assert tier.put_many([(b"a" * 16, "k", block)])
    assert sent == [False]
    got = tier.get_many([b"a" * 16], "k")  # a stale sum would make this blob corrupt: a miss
    assert torch.equal(got[b"a" * 16], _block(1)) and tier.stats.corrupt == 0


@pytest.mark.integration
def test_a_write_torch_cannot_see_sends_a_stale_sum_that_the_reader_refuses(redis_url):
    """The one stale sum the version counter misses (bytes written through numpy) still never yields wrong KV."""
    import redis

    cpu = CpuTier(1 << 20, checksums=True)
    cpu.put(b"a" * 16, "k", _block(0))
    block = cpu.pop(b"a" * 16)[1]
    block.view(torch.uint8).reshape(-1).numpy()[5] ^= 0x10  # not seen by torch's version counter
    assert block_sums.get(block) is not None
    tier = RedisTier(redis_url, secret=TEST_SECRET)
    assert tier.put_many([(b"a" * 16, "k", block)])
    assert tier.get_many([b"a" * 16], "k") == {}
    assert tier.stats.corrupt == 1
    assert redis.Redis.from_url(redis_url).exists(tier.PREFIX + (b"a" * 16).hex().encode()) == 0, "deleted"


# ---------------------------------------------------------------------------------------------------- the store


@pytest.mark.integration
def test_blocks_demoted_through_the_cpu_tier_go_with_their_sums(redis_url, sent):
    st = _store(redis_url, blocks=4, cpu_blocks=2)
    a = _seg(0, 64)
    info = st.put(a, "t")  # 4 blocks: the whole pool
    st.put(_seg(100, 64), "t")  # A: 2 blocks to the CPU tier, 2 through it on to Redis
    assert sent == [True, True]
    assert torch.equal(st.get(info.key, "t").kv, a.kv)  # 2 blocks read back from Redis, each blob checked
    assert (st.redis.stats.hits, st.redis.stats.corrupt) == (2, 0) and st.check() == []


@pytest.mark.integration
def test_blocks_written_through_for_replicas_go_with_their_sums(redis_url, sent):
    first, second = _store(redis_url, blocks=8, share=True), _store(redis_url, blocks=8, share=True)
    a = _seg(0, 40)  # 2 full blocks and a partial tail
    info = first.put(a, "t")
    assert sent == [True, True, True]
    assert torch.equal(second.get(info.key, "t").kv, a.kv)
    assert second.redis.stats.corrupt == 0 and first.check() == [] and second.check() == []


@pytest.mark.integration
def test_blocks_demoted_straight_from_the_device_go_with_their_sums(redis_url, sent):
    first = _store(redis_url, blocks=4)  # no CPU tier
    a = _seg(0, 64)
    first.put(a, "t")
    first.put(_seg(100, 64), "t")
    assert sent == [True] * 4  # summed as they were read from the device
    other = _store(redis_url, blocks=8)
    other.put(_seg(5000, 10), "t")
    assert torch.equal(other.get_prefix(torch.arange(70), "t", M, torch.float32, 64).kv, a.kv)


@pytest.mark.integration
def test_blocks_redis_holds_already_are_not_summed_on_eviction(redis_url, sent):
    """A written-through block the device evicts is only refreshed in Redis: no sum is taken for it then; one that
    Redis no longer has is summed in the put that sends it again."""
    import redis

    st = _store(redis_url, blocks=4, share=True)
    a = _seg(0, 64)
    info = st.put(a, "t")
    gone = st.registry.get(info.key).hashes[:1]
    redis.Redis.from_url(redis_url).delete(*[st.redis._key(h) for h in gone])  # expired there
    st.put(_seg(100, 64), "t")  # A evicted (3 refreshed, 1 sent again, summed then), B written through
    assert sent == [True] * 4 + [False] + [True] * 4
    assert st.redis.stats.refreshes == 3
    assert torch.equal(st.get(info.key, "t").kv, a.kv) and st.check() == []
