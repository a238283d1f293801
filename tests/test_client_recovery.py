"""The client where servers go away and come back, and its errors and uploads within its own limits: a same-host
fetch to replicas listed by address goes on to the next replica when one is down (it used to spend a retry and a
backoff on each, and failed with retries=0 though a replica was up); a server back on its port is reached within
the client's retries (gRPC's reconnect backoff grew to minutes); KVBridgeError survives pickling (a process pool);
put_kv cuts its chunks to the client's own max_message_mb."""

from __future__ import annotations

import copy
import pickle
import time

import grpc
import served
import torch
from kvbridge.server.client import KVBridgeClient, KVBridgeError


def test_a_same_host_fetch_goes_on_to_a_replica_that_is_up(tiny_source, tiny_target, adapters_dir):
    replicas = [served.start_on_cpu(tiny_source, [tiny_target], adapters_dir) for _ in range(3)]
    try:
        addresses = ",".join(r.address for r in replicas)
        for r in replicas[1:]:
            r.stop(0)
        with KVBridgeClient(addresses, token=served.ALICE, retries=0, transport="shared_memory") as client:
            fetched = [client.fetch_source(text=served.TEXT) for _ in range(6)]
        assert all(f.segment.num_tokens == fetched[0].segment.num_tokens > 0 for f in fetched)
        assert all(f.wire_bytes == 0 for f in fetched)  # through shared memory, every one
    finally:
        replicas[0].stop(0)


def test_a_client_reaches_its_server_back_on_its_port_within_its_retries(tiny_source, tiny_target, adapters_dir):
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir)
    port = running.port
    client = KVBridgeClient(running.address, token=served.ALICE)  # the default retries: 1.5 s of backoff in all
    try:
        assert client.list_models()
        running.stop(0)
        down = time.monotonic()
        while time.monotonic() - down < 12:  # calls while it is down (a health poll): the channel's backoff grows
            try:
                client.list_models()
            except KVBridgeError as exc:
                assert exc.code == grpc.StatusCode.UNAVAILABLE
        running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir, listen=f"127.0.0.1:{port}")
        assert client.list_models()  # gRPC waited up to 120 s between reconnects: this failed for seconds
    finally:
        client.close()
        running.stop(0)


def test_kvbridge_error_pickles_and_copies_with_its_fields():
    error = KVBridgeError(grpc.StatusCode.NOT_FOUND, "no entry", "GetSourceCache")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert (type(again), again.code, again.details, again.method, str(again)) == \
            (KVBridgeError, error.code, "no entry", "GetSourceCache", "GetSourceCache: NOT_FOUND: no entry")


def test_put_kv_cuts_its_chunks_to_the_clients_message_limit(server, tiny_source):
    spec = tiny_source.spec
    tokens = 2 * (1 << 18) // (2 * spec.num_kv_heads * spec.head_dim * 4) + 1  # one layer: past two limits' worth
    kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, tokens, spec.head_dim)
    ids = [i % 150 + 250 for i in range(tokens)]  # tokens no other test uploads (the store keeps a block's first KV)
    with KVBridgeClient(server.address, token=served.ALICE, max_message_mb=0.25) as client:
        entry = client.put_kv(kv, ids)  # 1 MiB chunks by default: refused by the client's own channel
        assert entry.num_tokens == tokens
        fetched = client.fetch_source(key=entry.key)
    assert torch.equal(fetched.segment.kv, kv)
