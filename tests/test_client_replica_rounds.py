"""The client over replicas listed by address: every retry goes through every replica again; put_kv's chunks
leave room for their message's framing."""

from __future__ import annotations

import grpc
import pytest
import served
import torch
from kvbridge.server.client import KVBridgeClient, KVBridgeError


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "down"


class _Replica:
    def __init__(self, name, calls):
        def download(request, timeout=None, metadata=None):
            calls.append(name)
            raise _Down()
        self.downloads = {"GetSourceCache": download}


def test_each_retry_tries_every_replica_again():
    """With retries=1 and two replicas down, the fetch tries each replica once per try
    (A B, then after the backoff A B), not A B A."""
    calls = []
    with KVBridgeClient("127.0.0.1:1,127.0.0.1:2", retries=1, backoff_s=0.01) as client:
        with pytest.raises(KVBridgeError):
            client._fetch_once("GetSourceCache", object(), 1.0, [_Replica("A", calls), _Replica("B", calls)])
    assert calls == ["A", "B", "A", "B"]


def test_put_kv_chunks_leave_room_for_their_framing(server, tiny_source):
    """A layer of exactly max_message_mb of KV (1024 tokens x 256 bytes = 256 KiB)
    would be one chunk whose message (KV + header) passes the client's own send limit."""
    spec = tiny_source.spec
    tokens = (1 << 18) // (2 * spec.num_kv_heads * spec.head_dim * 4)
    assert tokens * 2 * spec.num_kv_heads * spec.head_dim * 4 == 1 << 18
    kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, tokens, spec.head_dim)
    ids = [i % 200 + 5 for i in range(tokens)]
    with KVBridgeClient(server.address, token=served.ALICE, max_message_mb=0.25) as client:
        entry = client.put_kv(kv, ids)
        assert entry.num_tokens == tokens


def test_every_channel_reconnects_at_least_every_second():
    """gRPC's reconnect backoff grows to 120 s by default: a server back on its port was refused by the client's
    retries (1.5 s in all) for seconds to minutes (tests/test_client_recovery.py restarts one)."""
    from kvbridge.server.channel import RECONNECT_BACKOFF_S

    with KVBridgeClient("127.0.0.1:1,127.0.0.1:2") as client:
        options = dict(client._channels._options)
    assert RECONNECT_BACKOFF_S <= 1.0
    assert options["grpc.max_reconnect_backoff_ms"] == int(RECONNECT_BACKOFF_S * 1000)
    assert options["grpc.initial_reconnect_backoff_ms"] == 100
    # gRPC gives a connection attempt at least min_reconnect_backoff_ms (20 s by default): set to 100 ms, a server slow
    # to send its first frames (tests/test_vllm.py's slow server, a loaded host) was never reached
    assert "grpc.min_reconnect_backoff_ms" not in options
