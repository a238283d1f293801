"""The reused buffers streamed fetches gather their KV into (server.gather_buffers)."""

from __future__ import annotations

import torch
from kvbridge.server.gather_buffers import GatherBuffers

SHAPE = (3, 2, 2, 17, 8)


def test_a_buffer_is_lent_to_one_fetch_at_a_time_and_reused_after_it_is_given_back():
    pool = GatherBuffers(max_bytes=1 << 20)
    first, second = pool.lend(), pool.lend()
    a = first.tensor(SHAPE, torch.float32)
    b = second.tensor(SHAPE, torch.float32)
    assert a.shape == SHAPE and a.is_contiguous() and a.data_ptr() != b.data_ptr()  # both lent at once
    assert first.tensor(SHAPE, torch.float32) is None  # one buffer per fetch
    first.discard()
    again = pool.lend().tensor((3, 2, 2, 16, 8), torch.bfloat16)  # smaller, another dtype: the same memory
    assert again.data_ptr() == a.data_ptr() and again.dtype == torch.bfloat16
    second.discard()
    assert pool.kept_bytes == b.numel() * 4


def test_the_buffers_kept_stay_under_max_bytes_and_other_dtypes_are_refused():
    nbytes = torch.Size(SHAPE).numel() * 4
    pool = GatherBuffers(max_bytes=nbytes + 100)
    lends = [pool.lend() for _ in range(3)]
    for lent in lends:
        lent.tensor(SHAPE, torch.float32)
    for lent in lends:
        lent.discard()
    assert pool.kept_bytes == nbytes  # one kept: two would pass max_bytes
    assert pool.lend(torch.bfloat16).tensor(SHAPE, torch.float32) is None  # the wire wants bf16: not this one
    assert pool.lend().tensor((1000, 2, 2, 17, 8), torch.float32) is None  # bigger than anything kept


def test_taking_one_of_several_kept_buffers_of_different_sizes():
    """Kept buffers of two sizes, the smallest fitting one taken: it leaves the pool by position (list.remove
    compared tensors elementwise and raised on two sizes: INTERNAL in the load test and bench_all)."""
    pool = GatherBuffers(max_bytes=1 << 20)
    small, large = pool.lend(), pool.lend()
    a = small.tensor((1, 2, 1, 10, 8), torch.float32)
    b = large.tensor((1, 2, 1, 40, 8), torch.float32)
    small.discard()
    large.discard()
    got = pool.lend().tensor((1, 2, 1, 20, 8), torch.float32)  # only the large one fits
    assert got.data_ptr() == b.data_ptr()
    assert pool.lend().tensor((1, 2, 1, 10, 8), torch.float32).data_ptr() == a.data_ptr()
    assert pool.kept_bytes == 0
