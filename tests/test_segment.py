"""KVSegment: validation at construction, views, dtype/device conversion, concatenation."""

from __future__ import annotations

import pytest
import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity

A = ModelIdentity("a", "a" * 64)
B = ModelIdentity("b", "b" * 64)


def seg(t=5, start=0, model=A, rotated=True, layers=3, heads=2, dim=4):
    return KVSegment(kv=torch.randn(layers, 2, heads, t, dim), token_ids=torch.arange(t) + 100,
                     positions=torch.arange(start, start + t), model=model, rotated=rotated)


def test_views_and_properties():
    s = seg(t=6, start=3)
    assert (s.num_layers, s.num_kv_heads, s.num_tokens, s.head_dim) == (3, 2, 6, 4)
    assert s.keys.shape == s.values.shape == (3, 2, 6, 4)
    assert s.nbytes == 3 * 2 * 2 * 6 * 4 * 4
    assert s.is_contiguous_from(3) and not s.is_contiguous_from(0)
    part = s.slice(2, 5)
    assert part.token_ids.tolist() == [102, 103, 104] and part.positions.tolist() == [5, 6, 7]
    assert torch.equal(part.kv, s.kv[:, :, :, 2:5])
    assert part.kv.data_ptr() == s.kv[:, :, :, 2:5].data_ptr(), "slice is a view"


def test_to_changes_dtype_only_of_the_tensor():
    s = seg().to(dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16 and s.token_ids.dtype == torch.int64
    with pytest.raises(ValueError, match="floating point"):
        seg().to(dtype=torch.int32)


def test_concat_joins_in_order_and_checks_compatibility():
    a, b = seg(t=3), seg(t=4, start=3)
    c = KVSegment.concat([a, b])
    assert c.num_tokens == 7 and c.is_contiguous_from(0)
    assert torch.equal(c.kv[:, :, :, 3:], b.kv)
    with pytest.raises(ValueError, match="segment 1 belongs to b@"):
        KVSegment.concat([a, seg(model=B)])
    with pytest.raises(ValueError, match="rotated=False"):
        KVSegment.concat([a, seg(rotated=False)])
    with pytest.raises(ValueError, match="layout"):
        KVSegment.concat([a, seg(heads=3)])
    with pytest.raises(ValueError, match="at least one"):
        KVSegment.concat([])


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv=torch.randn(3, 2, 2, 5)), r"\[L, 2, H_kv, T, D\]"),
    (dict(kv=torch.randn(3, 3, 2, 5, 4)), r"\[L, 2, H_kv, T, D\]"),
    (dict(kv=torch.zeros(3, 2, 2, 5, 4, dtype=torch.int32)), "floating-point"),
    (dict(token_ids=torch.arange(4)), r"token_ids must be an int64 tensor of shape \[5\]"),
    (dict(positions=torch.arange(5).float()), r"positions must be an int64 tensor"),
    (dict(positions=torch.arange(-1, 4)), "positions must be >= 0"),
    (dict(token_ids=[1, 2, 3, 4, 5]), "token_ids must be an int64 tensor"),
])
def test_bad_segments_are_refused_with_the_field_named(kwargs, message):
    base = dict(kv=torch.randn(3, 2, 2, 5, 4), token_ids=torch.arange(5), positions=torch.arange(5), model=A,
                rotated=True)
    with pytest.raises(ValueError, match=message):
        KVSegment(**{**base, **kwargs})


def test_identity_is_validated():
    with pytest.raises(ValueError, match="name"):
        ModelIdentity("", "a" * 64)
    with pytest.raises(ValueError, match="sha256"):
        ModelIdentity("x", "abc")
