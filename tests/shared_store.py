"""What every pair of store replicas sharing a Redis tier (one server or a cluster) must show; the store tests of
both call it."""

from __future__ import annotations

import pytest
import redis
import torch
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.segment import KVSegment


class Clock:
    """A store's clock the test moves (`clock.now += s`)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seeded_segment(first: int, n: int, model) -> KVSegment:
    """Tokens first..first+n-1 of `model` with KV [2, 2, 2, n, 8] drawn from seed `first`."""
    gen = torch.Generator().manual_seed(first)
    return KVSegment(kv=torch.randn(2, 2, 2, n, 8, generator=gen), token_ids=torch.arange(first, first + n),
                     positions=torch.arange(n), model=model, rotated=True)


def refusing_writes(client: redis.Redis, how: str = "oom") -> None:
    """Make the test's own Redis answer every write with an error reply: OOM (at maxmemory, noeviction; a DEL still
    goes: it takes no memory) or READONLY (a replica of a primary that is not there, as a demoted primary answers)."""
    if how == "oom":
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
    else:
        client.execute_command("REPLICAOF", "127.0.0.1", "1")


def taking_writes(client: redis.Redis, how: str = "oom") -> None:
    """Undo refusing_writes."""
    if how == "oom":
        client.config_set("maxmemory", 0)
    else:
        client.execute_command("REPLICAOF", "NO", "ONE")


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
