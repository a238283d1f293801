"""Kept streamed fetches (server/wire_cache.py, issue 16 part 4): the next streamed fetch of the same projection by
the same tenant sends the messages the first one sent, bit-identical, without gathering; never another tenant's, never
a re-made entry's. The cache alone with a fake clock, then an in-process server over the tiny pair."""

from __future__ import annotations

import shutil

import pytest
import torch
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.wire_cache import WireCache

ALICE = "alice-token-0123456789abcdef0"
BOB = "bob-token-0123456789abcdef012"
TEXT = ("Each record holds a name and a value; readers skip the fields they do not know and keep the rest. "
        "Writers keep the order of the fields they were given, and a reader may stop at any field.")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_keeps_by_tenant_and_tag_within_its_bytes_and_forgets_what_is_not_used():
    clock = FakeClock()
    cache = WireCache(max_bytes=100, keep_s=10.0, clock=clock)
    assert cache.put("alice", ("e", 1), [b"x" * 30, b"y" * 10]) and cache.held_bytes == 40
    assert cache.get("alice", ("e", 1)) == (b"x" * 30, b"y" * 10) and cache.hits == 1
    assert cache.get("bob", ("e", 1)) is None and cache.get("alice", ("e", 2)) is None
    assert not cache.put("alice", ("e", 1), [b"z"])  # already kept: the first stays
    assert not cache.put("alice", ("big", 1), [b"b" * 101])  # larger than the cache: not kept
    clock.now = 5.0
    assert cache.put("alice", ("e", 2), [b"2" * 40])
    cache.get("alice", ("e", 1))  # now the most recently used
    assert cache.put("alice", ("e", 3), [b"3" * 40])  # no room: ("e", 2), the least recently used, goes
    assert cache.get("alice", ("e", 2)) is None and cache.get("alice", ("e", 1)) is not None
    assert cache.held_bytes == 80 and len(cache) == 2
    clock.now = 5.0 + 10.0  # ("e", 1) and ("e", 3) unused for keep_s
    assert cache.get("alice", ("e", 3)) is None and len(cache) == 0 and cache.held_bytes == 0
    off = WireCache(max_bytes=100, keep_s=0)
    assert not off.put("alice", ("e", 1), [b"x"]) and off.get("alice", ("e", 1)) is None
    with pytest.raises(ValueError, match=">= 0"):
        WireCache(max_bytes=-1)


@pytest.fixture(scope="module")
def running(tiny_source, tiny_target, tiny_adapter_file, tmp_path_factory):
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    folder = tmp_path_factory.mktemp("adapters")
    shutil.copy(tiny_adapter_file, folder / "tiny-pair.safetensors")
    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(folder), store_capacity_mb=64,
                         max_message_mb=2, chunk_kb=16, store_device="cpu")
    service = build_service(config, source=tiny_source, targets=[tiny_target])
    server = start_server(service, config, tokens={ALICE: "alice", BOB: "bob"})
    yield server
    server.stop(1)


def test_the_next_streamed_fetch_of_a_projection_sends_the_same_messages_until_the_entry_is_made_again(running):
    with KVBridgeClient(running.address, token=ALICE) as alice, KVBridgeClient(running.address, token=BOB) as bob:
        key = alice.ingest(TEXT).entries[0].key
        first = alice.fetch_projected(key=key, transport="stream")  # projects: not from the store, not kept
        hits = running.wire.hits
        second = alice.fetch_projected(key=key, transport="stream")  # gathered from the store, then kept
        assert running.wire.hits == hits and len(running.wire) == 1
        third = alice.fetch_projected(key=key, transport="stream")  # the kept messages
        assert running.wire.hits == hits + 1
        assert first.num_chunks == second.num_chunks == third.num_chunks > 1  # several chunks of 16 KiB
        for fetched in (second, third):
            assert torch.equal(fetched.segment.kv, first.segment.kv)
            assert torch.equal(fetched.segment.token_ids, first.segment.token_ids)
            assert (fetched.entry_key, fetched.wire_bytes) == (first.entry_key, first.wire_bytes)
        in_bf16 = alice.fetch_projected(key=key, dtype="bfloat16", transport="stream")  # another tag
        assert running.wire.hits == hits + 1 and in_bf16.segment.kv.dtype == torch.bfloat16
        assert torch.equal(alice.fetch_projected(key=key, dtype="bfloat16", transport="stream").segment.kv,
                           in_bf16.segment.kv)
        assert running.wire.hits == hits + 2

        bob_key = bob.ingest(TEXT).entries[0].key  # the same text: bob's own entries, never alice's messages
        bob.fetch_projected(key=bob_key, transport="stream")
        assert torch.equal(bob.fetch_projected(key=bob_key, transport="stream").segment.kv, first.segment.kv)
        assert running.wire.hits == hits + 2

        assert alice.delete(key) >= 2  # the source entry and its projection
        assert alice.ingest(TEXT).entries[0].key == key
        alice.fetch_projected(key=key, transport="stream")  # projected again: a new entry, the same key
        again = alice.fetch_projected(key=key, transport="stream")  # a new serial: gathered, not the old messages
        assert running.wire.hits == hits + 2 and torch.equal(again.segment.kv, first.segment.kv)


def test_a_kept_fetch_whose_entry_goes_before_its_touch_sends_the_new_projection(running, monkeypatch, tiny_source,
                                                                                 tiny_target):
    """The race between the store's derived() and touch(): the entry expires (or is deleted) after the fetch found
    kept messages for it; the fetch projects again and must send that KV, in the dtype asked for, not the kept
    messages under a header of the new KV. The adapter's biases move while the entry goes, so the new projection
    differs from the kept one (resending the kept messages would be seen)."""
    from kvbridge.transfer.store import NotFound

    with KVBridgeClient(running.address, token=ALICE) as alice:
        key = alice.ingest(TEXT + " Readers never reorder the fields.").entries[0].key
        for _ in range(3):  # projected, gathered and kept, sent from the cache
            kept = alice.fetch_projected(key=key, dtype="bfloat16", transport="stream")
        store = running.service.store
        adapter = running.service.adapters.resolve("", tiny_source.spec, tiny_target.spec, "alice")[1]
        biases = adapter.bk.clone(), adapter.bv.clone()
        real_touch = store.touch
        gone = []

        def touch_after_the_entry_went(entry_key, tenant, *args, **kwargs):
            if not gone:
                gone.append(entry_key)
                store.delete(entry_key, tenant)  # the projection goes for real ...
                with torch.inference_mode():  # ... and the next one is made by an adapter that moved
                    adapter.bk.add_(1.0)
                    adapter.bv.add_(1.0)
                raise NotFound("expired between derived() and touch()")
            return real_touch(entry_key, tenant, *args, **kwargs)

        monkeypatch.setattr(store, "touch", touch_after_the_entry_went)
        try:
            fetched = alice.fetch_projected(key=key, dtype="bfloat16", transport="stream")
        finally:
            with torch.inference_mode():
                adapter.bk.copy_(biases[0])
                adapter.bv.copy_(biases[1])
        monkeypatch.setattr(store, "touch", real_touch)
        assert gone == [fetched.entry_key] and fetched.segment.kv.dtype == torch.bfloat16
        assert not torch.equal(fetched.segment.kv, kept.segment.kv)  # the new projection, not the kept messages
        stored = alice.fetch_projected(key=key, dtype="bfloat16", transport="stream")  # what the store holds now
        assert stored.entry_key == fetched.entry_key and torch.equal(fetched.segment.kv, stored.segment.kv)
        assert torch.equal(fetched.segment.token_ids, kept.segment.token_ids)
