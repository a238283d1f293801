"""What every pair of store replicas sharing a Redis tier (one server or a cluster) must show; the store tests of
both call it."""

from __future__ import annotations

import pytest
import torch
from kvbridge.transfer.errors import NotFound


def assert_found_by_another_replica(second, info, segment, text: str, model) -> None:
    """`segment` ([L, 2, H, 40, D], tokens 0..39, put by another replica as entry `info` of tenant "t" with `text`)
    is found by `second` by key and by its tokens, read exactly with its text, never for tenant "u"; a longer text
    finds its whole blocks only."""
    assert second.lookup(torch.arange(0, 40), "t", model, torch.float32).key == info.key
    got = second.get(info.key, "t")
    assert torch.equal(got.kv, segment.kv) and torch.equal(got.token_ids, segment.token_ids)
    assert second.info(info.key, "t").text == text
    with pytest.raises(NotFound):
        second.get(info.key, "u")  # another tenant: a miss, like any unknown key
    assert second.lookup(torch.arange(0, 40), "u", model, torch.float32).key is None
    longer = second.lookup(torch.arange(0, 60), "t", model, torch.float32)  # a prefix of a longer text: whole blocks
    assert longer.num_tokens == 32 and longer.key is None
