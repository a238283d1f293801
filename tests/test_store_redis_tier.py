"""PagedStore's tiers below the device pool: demotion to the CPU and to a real Redis and promotion back, bit-exact;
replicas sharing blocks through Redis; Redis down then back (on the store's clock); Redis blobs that are
safetensors with every byte checked; a corrupt block is a miss. Every scenario ends with check() == []. The store
itself: tests/test_store.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from kvbridge.transfer.store import NotFound
from test_store import Clock, M, device_blocks_used, ok, seg, store


@pytest.mark.integration
def test_demotion_to_cpu_and_redis_and_promotion_back_bit_exact(redis_url):
    st = store(blocks=4, cpu_blocks=2, redis_url=redis_url)
    a_seg = seg(range(64))
    a = st.put(a_seg, "t")  # 4 blocks: fills the pool
    b_seg = seg(range(100, 164))
    b = st.put(b_seg, "t")  # evicts all of A: 2 to the CPU tier, 2 on to Redis
    assert st.info(a.key, "t").tier == "mixed"
    assert st.stats().redis["puts"] == 2
    ok(st)
    assert st.lookup(torch.arange(64), "t", M, torch.float32).tier == "redis"
    assert torch.equal(st.get(a.key, "t").kv, a_seg.kv)
    assert torch.equal(st.get(b.key, "t").kv, b_seg.kv)
    ok(st)
    # deleting leaves the blocks in Redis to their TTL: another replica's entries of the same tokens may use them
    st.delete(a.key, "t")
    st.delete(b.key, "t")
    import redis

    client = redis.Redis.from_url(redis_url)
    left = client.keys("kvbridge:2:blk:*")
    assert left and all(0 < client.ttl(k) <= 3600 for k in left)
    assert st.keys("t") == [] and st.cpu.bytes_used == 0 and device_blocks_used(st) == 0
    ok(st)


@pytest.mark.integration
def test_replicas_share_blocks_through_redis(redis_url):
    first = store(blocks=4, redis_url=redis_url)  # no CPU tier: evictions go straight to Redis
    a_seg = seg(range(64))
    first.put(a_seg, "t")
    first.put(seg(range(100, 164)), "t")  # all 4 of A's blocks go to Redis
    other = store(blocks=8, redis_url=redis_url)  # another replica on the same Redis
    other.put(seg(range(5000, 5010)), "t")  # creates the layout's pool there
    found = other.lookup(torch.arange(70), "t", M, torch.float32)
    assert (found.num_tokens, found.tier) == (64, "redis")
    assert torch.equal(other.get_prefix(torch.arange(70), "t", M, torch.float32, 64).kv, a_seg.kv)
    assert other.lookup(torch.arange(70), "t", M, torch.float32).tier == "device", "promoted"
    assert other.lookup(torch.arange(70), "u", M, torch.float32).num_tokens == 0, "tenant u sees nothing"
    ok(first)
    ok(other)


@pytest.mark.integration
def test_redis_down_then_back(redis_server):
    clock = Clock()
    st = store(blocks=4, cpu_blocks=1, redis_url=redis_server.url, clock=clock, redis_retry_s=5)
    st.put(seg(range(32)), "t")
    redis_server.kill()
    far = st.put(seg(range(100, 164)), "t")  # evicts local's blocks; Redis is down
    s = st.stats()
    assert s.redis["available"] is False and s.redis["errors"] >= 1 and "Error" in s.redis["last_error"]
    assert torch.equal(st.get(far.key, "t").kv, seg(range(100, 164)).kv), "local hits keep being served"
    assert st.stats().lost_entries >= 1  # what could not be demoted is gone, cleanly
    ok(st)
    redis_server.restart()
    clock.now += 1  # within the retry interval the tier stays marked down (no hammering)
    st.put(seg(range(200, 264)), "t")
    clock.now += 10
    st.put(seg(range(300, 364)), "t")  # demotion to Redis works again
    s = st.stats()
    assert s.redis["available"] is True and s.redis["puts"] >= 1
    ok(st)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_redis_blobs_are_safetensors_whose_every_byte_is_checked(dtype):
    import zlib

    from kvbridge.transfer.store.tiers import decode_block, encode_block
    from safetensors.torch import load, save

    block = torch.randn(3, 2, 1, 16, 5, generator=torch.Generator().manual_seed(1)).to(dtype)  # odd byte count
    blob = encode_block("layout-a", block)
    assert torch.equal(load(blob)["kv"], block)  # any safetensors reader reads it
    layout, back = decode_block(blob)
    assert layout == "layout-a" and torch.equal(back, block)
    for at in (8, len(blob) - 1, len(blob) - block.numel() * block.element_size()):  # header, last and first byte
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(ValueError):
            decode_block(bytes(bad))
    with pytest.raises(ValueError):
        decode_block(blob[:-1])  # truncated
    crc = f"{zlib.crc32(block.view(torch.uint8).numpy()):08x}"  # a blob written before sum64
    old = save({"kv": block}, metadata={"layout": "layout-a", "crc32": crc})
    assert torch.equal(decode_block(old)[1], block)
    with pytest.raises(ValueError, match="corrupt"):
        decode_block(old[:-1] + bytes([old[-1] ^ 1]))
    # a header whose metadata is no object (the checksum covers the data only): refused, not a TypeError
    head = json.dumps({"__metadata__": "layout sum64", "kv": {"dtype": "BF16" if dtype == torch.bfloat16 else "F32",
                       "shape": list(block.shape), "data_offsets": [0, block.numel() * block.element_size()]}})
    head += " " * (-len(head) % 8)
    with pytest.raises(ValueError, match="__metadata__ is not an object of strings"):
        decode_block(len(head).to_bytes(8, "little") + head.encode() + block.view(torch.uint8).numpy().tobytes())


@pytest.mark.integration
def test_corrupt_redis_block_is_a_miss(redis_url):
    import redis

    st = store(blocks=2, redis_url=redis_url)
    a = st.put(seg(range(32)), "t")
    st.put(seg(range(100, 132)), "t")  # A goes to Redis
    client = redis.Redis.from_url(redis_url)
    for key in client.keys("kvbridge:2:blk:*"):
        blob = bytearray(client.get(key))
        blob[-1] ^= 0xFF  # flip bits in the tensor data
        client.set(key, bytes(blob))
    with pytest.raises(NotFound):
        st.get(a.key, "t")
    assert st.stats().redis["corrupt"] >= 1


@pytest.mark.integration
@pytest.mark.parametrize("how", ["delete", "expiry"])
def test_removing_an_entry_keeps_the_redis_blocks_another_replica_serves(redis_url, how):
    """Without shared entries, blocks in Redis are still content-addressed: another replica's entry of the same tokens
    may live on those very blocks (demoted there). A delete or expiry here must not take them from under it."""
    other = store(blocks=4, redis_url=redis_url)
    a_seg = seg(range(64))
    key = other.put(a_seg, "t").key
    other.put(seg(range(100, 164)), "t")  # A's 4 blocks leave the other replica's device for Redis
    clock = Clock()
    mine = store(blocks=8, redis_url=redis_url, clock=clock)
    assert mine.put(a_seg, "t", ttl_s=10).key == key  # the same tokens here: the same block hashes
    if how == "delete":
        assert mine.delete(key, "t") == 1
    else:
        clock.now += 10
        mine.purge_expired()
    assert mine.keys("t") == []
    assert torch.equal(other.get(key, "t").kv, a_seg.kv), "the other replica still serves A from Redis"
    ok(mine)
    ok(other)
