"""The client's own checks and retry rules, with no server (an address nothing listens at): bad put_kv arguments are
refused by name before a stream starts, the backoff between tries is bounded, and Delete is sent once."""

from __future__ import annotations

import json

import pytest
import torch
from kvbridge.server.channel import MAX_BACKOFF_S, service_config
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.replies import KVBridgeError

NOWHERE = "127.0.0.1:1"


@pytest.mark.parametrize("kv, ids, chunk_bytes, message", [
    (torch.zeros(2, 2, 1, 4, 8, dtype=torch.float64), 4, 1 << 20, "kv must be one of"),
    (torch.zeros(2, 1, 4, 8), 4, 1 << 20, r"kv must be \[L, 2, H, T, D\]"),
    (torch.zeros(2, 2, 1, 4, 8), 5, 1 << 20, "kv holds 4 tokens and token_ids 5"),
    (torch.zeros(2, 2, 8, 4, 512), 4, 16 << 10, "one token of one layer takes 32768 bytes"),
    (torch.zeros(2, 2, 1, 4, 8), 4, 1000, "chunk_bytes must be >="),
])
def test_bad_put_kv_arguments_are_refused_by_name_before_any_call(kv, ids, chunk_bytes, message):
    with KVBridgeClient(NOWHERE, retries=0) as client:
        with pytest.raises(ValueError, match=message):
            client.put_kv(kv, list(range(ids)), chunk_bytes=chunk_bytes)


def test_the_backoff_is_bounded_and_delete_is_tried_once(monkeypatch):
    with pytest.raises(ValueError, match="backoff_s must be >= 0"):
        KVBridgeClient(NOWHERE, backoff_s=-1)
    slept = []
    monkeypatch.setattr("kvbridge.server.client.time.sleep", slept.append)
    with KVBridgeClient(NOWHERE, retries=12, backoff_s=0.5, timeout_s=2) as client:
        with pytest.raises(KVBridgeError):
            client.stats()
        assert len(slept) == 12 and max(slept) == MAX_BACKOFF_S and slept[:3] == [0.5, 1.0, 2.0]
        slept.clear()
        with pytest.raises(KVBridgeError):
            client.delete("0" * 64)
        assert slept == []  # a lost answer may hide a delete that happened: never sent again
    # to replicas, the channel's retry policy leaves Delete out too
    configs = json.loads(service_config(retries=3, backoff_s=0.1))["methodConfig"]
    delete = [c for c in configs if {"service": "kvbridge.v1.KVBridge", "method": "Delete"} in c["name"]]
    assert len(delete) == 1 and "retryPolicy" not in delete[0]
