"""What the server refuses, end to end (a real gRPC server on a loopback port, the tiny pair): uploads that are
bad, broken or cut off store nothing; every RPC needs a valid token; tenants neither read nor detect each other's
entries; bad requests get the right code and a sentence and leave the store alone. The servers are the
session fixtures of tests/conftest.py; the transfers themselves: tests/test_server.py.
"""

from __future__ import annotations

import shutil

import grpc
import pytest
import served
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient
from kvbridge.transfer import kvcache
from served import ALICE, TEXT

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------------ uploads


def test_uploaded_source_kv_round_trips(server, alice, tiny_source):
    ids = torch.tensor(tiny_source.tokenizer(served.text(4))["input_ids"])
    segment = kvcache.extract(tiny_source.model, tiny_source.spec, ids)
    entry = alice.put_source_kv(segment, chunk_bytes=4096, ttl_s=600)
    assert entry.num_tokens == ids.numel() and entry.kind == "prefix"
    back = alice.fetch_source(key=entry.key)
    assert torch.equal(back.segment.kv, segment.kv) and torch.equal(back.segment.token_ids, ids)
    assert alice.lookup(token_ids=ids).key == entry.key
    # the same KV uploaded in bfloat16 is stored in the server's dtype (float32): the same entry
    again = alice.put_source_kv(segment.to(dtype=torch.bfloat16))
    assert again.key == entry.key and again.new_blocks == 0


def _stub_call(server, method, request, token=ALICE, timeout=30):
    channel = grpc.insecure_channel(server.address)
    stub = pb2_grpc.KVBridgeStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        return getattr(stub, method)(request, timeout=timeout, metadata=metadata)
    finally:
        channel.close()


def _upload(server, messages, token=ALICE):
    with pytest.raises(grpc.RpcError) as info:
        _stub_call(server, "PutSourceKV", iter(messages), token=token)
    return info.value.code(), info.value.details()


def test_bad_or_broken_uploads_store_nothing(server, tiny_source):
    from kvbridge.server.chunks import iter_chunks

    ids = torch.tensor(tiny_source.tokenizer(served.text(5))["input_ids"])
    segment = kvcache.extract(tiny_source.model, tiny_source.spec, ids)
    spec = tiny_source.spec
    header = pb2.KVHeader(model=pb2.ModelRef(name=spec.name, config_hash=spec.identity.config_hash),
                          dtype="float32", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, token_ids=ids.tolist(), rotated=True)
    chunks = [pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                       token_start=r.token_start, token_end=r.token_end, data=blob))
              for r, blob in iter_chunks(segment.kv, 4096)]
    first = pb2.PutSourceKVRequest(header=header)
    before = served.snapshot(server.service.store, "alice", "bob")

    def with_header(**changes):
        h = pb2.KVHeader()
        h.CopyFrom(header)
        for k, v in changes.items():
            if k == "model":
                h.model.CopyFrom(v)
            else:
                setattr(h, k, v)
        return pb2.PutSourceKVRequest(header=h)

    cases = [
        ([*chunks], "before the header"),
        ([first, *chunks[:-1]], "ended before all KV arrived"),
        ([first, first, *chunks], "sent twice"),
        ([with_header(num_layers=spec.num_layers + 1), *chunks], "does not match"),
        ([with_header(dtype="int8"), *chunks], "header.dtype must be one of"),
        ([with_header(model=pb2.ModelRef(name="gpt-9")), *chunks], "unknown model 'gpt-9'"),
        ([with_header(model=pb2.ModelRef(name=spec.name, config_hash="0" * 64)), *chunks], "another configuration"),
        ([with_header(rotated=False), *chunks], "header.rotated must be true"),
        ([with_header(kind="blob"), *chunks], "header.kind must be"),
        ([first, chunks[0], chunks[0], *chunks[1:]], "overlaps a chunk"),
        ([first, pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=0, layer_end=1, token_start=0, token_end=1,
                                                           data=b"\x00" * 64))], "not a valid safetensors"),
    ]
    for messages, message in cases:
        code, details = _upload(server, messages)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (message, details)
        assert served.snapshot(server.service.store, "alice", "bob") == before

    def broken():  # the client's side fails mid-upload: the call is cancelled
        yield first
        yield chunks[0]
        raise RuntimeError("client crashed")

    code, _ = _upload(server, broken())
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    assert served.snapshot(server.service.store, "alice", "bob") == before and server.service.store.check() == []


def test_a_client_cut_off_mid_stream_leaks_no_blocks(server, alice):
    text = served.text(6)
    alice.ingest(text)
    cancelled = server.metrics.requests.labels("GetProjectedCache", "CANCELLED")
    seen = cancelled._value.get()
    channel = grpc.insecure_channel(server.address)
    stream = pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
        pb2.GetProjectedCacheRequest(text=text, chunk_bytes=4096), metadata=(("authorization", f"Bearer {ALICE}"),),
        timeout=30)
    first = next(stream)
    assert first.header.num_chunks > 3
    stream.cancel()
    channel.close()
    served.wait_for(lambda: cancelled._value.get() != seen, "the server to count the cancelled stream",
                    timeout_s=20)  # it notices between chunks
    assert cancelled._value.get() == seen + 1
    assert server.service.store.check() == []  # ref counts: only pinned entries hold blocks


# ------------------------------------------------------------------------------------------------ auth


def test_every_rpc_needs_a_valid_token(server):
    for token in (None, "wrong-token-0123456789abcdef"):
        with KVBridgeClient(server.address, token=token, retries=0) as client:
            calls = [lambda c=client: c.ingest(TEXT), lambda c=client: c.lookup(TEXT),
                     lambda c=client: c.fetch_projected(text=TEXT), lambda c=client: c.fetch_source(text=TEXT),
                     lambda c=client: c.list_adapters(), lambda c=client: c.stats(),
                     lambda c=client: c.delete("0" * 32), lambda c=client: c.load_adapter("tiny-pair"),
                     lambda c=client: c.list_models()]
            for call in calls:
                code, details = served.code(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED, details
                assert ("missing" in details) if token is None else ("not valid" in details)
    code, _ = _upload(server, [pb2.PutSourceKVRequest(header=pb2.KVHeader())], token=None)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_tenants_neither_read_nor_detect_each_others_entries(server, alice, bob):
    text = served.text(7)
    key = alice.ingest(text).entries[0].key
    projected = alice.fetch_projected(key=key).entry_key
    for k in (key, projected):
        calls = (lambda k=k: bob.fetch_source(key=k), lambda k=k: bob.fetch_projected(key=k), lambda k=k: bob.delete(k))
        for call in calls:
            code, details = served.code(call)
            unknown_code, unknown = served.code(lambda k=k: bob.fetch_source(key="f" * len(k)))
            assert code == unknown_code == grpc.StatusCode.NOT_FOUND
            assert details.replace(k, "K") == unknown.replace("f" * len(k), "K")  # a miss, word for word
    found = bob.lookup(text)
    assert found.key is None and found.num_tokens == 0 and found.tier is None
    code, _ = served.code(lambda: bob.fetch_projected(text=text, require_cached=True))
    assert code == grpc.StatusCode.NOT_FOUND
    own = bob.ingest(text).entries[0]
    assert own.key != key and own.new_blocks > 0  # identical tokens, separate blocks
    assert alice.fetch_source(key=key).entry_key == key  # alice's entry untouched
    stats = bob.stats()
    assert stats.tenant_entries == len(server.service.store.keys("bob")) and stats.tenant_tokens >= own.num_tokens


# ------------------------------------------------------------------------------------------------ errors


def test_bad_requests_get_the_right_code_and_leave_the_store_alone(server, alice):
    key = alice.ingest(TEXT).entries[0].key
    before = served.snapshot(server.service.store, "alice", "bob")
    inv, nf = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    cases = [
        (lambda: alice.fetch_projected(key=key, target_model="nope"), inv, "unknown target model 'nope'"),
        (lambda: alice.fetch_projected(key=key, adapter="nope"), inv, "unknown adapter 'nope'"),
        (lambda: alice.fetch_projected(key=key, adapter="../tiny-pair"), inv, "not a bare name"),
        (lambda: alice.load_adapter("../../etc/passwd"), inv, "not a bare name"),
        (lambda: alice.load_adapter("/tmp/x.safetensors"), inv, "not a bare name"),
        (lambda: alice.load_adapter("notes"), nf, "no adapter 'notes'"),
        (lambda: alice.fetch_source(key="0" * 32), nf, "no entry"),
        (lambda: alice.delete("0" * 32), nf, "no entry"),
        (lambda: alice.ingest(token_ids=[10**9]), inv, "outside the vocabulary"),
        (lambda: alice.ingest(token_ids=[5] * 5000), inv, "more than 'tiny-qwen2' takes (4096)"),
        (lambda: alice.ingest(" \n "), inv, "text is empty"),
        (lambda: alice.ingest(TEXT, model="nope"), inv, "unknown source model 'nope'"),
        (lambda: alice.ingest(TEXT, ttl_s=-1), inv, "ttl_s must be > 0"),
        (lambda: alice.ingest(token_ids=[5, 6, 7], detect_segments=True), inv, "DETECT_SEGMENTS needs text"),
        (lambda: alice.fetch_projected(key=key, offset=-1), inv, "offset must be >= 0"),
        (lambda: alice.fetch_projected(key=key, offset=4090), inv, "exceeds 'tiny-phi3'"),
        (lambda: alice.fetch_projected(key=key, dtype="int8"), inv, "dtype must be one of"),
        (lambda: alice.fetch_projected(key=key, chunk_bytes=-5), inv, "chunk_bytes must be >= 0"),
        (lambda: alice.lookup(TEXT, kind="bogus"), inv, "kind must be 'prefix' or 'segment'"),
        (lambda: alice.ingest("x " * (1 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),  # > max_message_mb
    ]
    for call, code, message in cases:
        got, details = served.code(call)
        assert got == code and message in details, (message, got, details)
        assert served.snapshot(server.service.store, "alice", "bob") == before, message
    assert server.service.store.check() == []


def test_load_and_list_adapters(server, alice, server_adapters_dir):
    """On the session's server, which other tests may have given adapters of their own: membership, not equality;
    the adapter this test adds is taken away again (its file, and alice's load of it)."""
    names = {a.name: a for a in alice.list_adapters()}
    assert "tiny-pair" in names and names["tiny-pair"].is_default and names["tiny-pair"].loaded
    assert "tiny-copy" not in names
    copy = server_adapters_dir / "tiny-copy.safetensors"
    shutil.copy(server_adapters_dir / "tiny-pair.safetensors", copy)
    registry = server.service.adapters
    try:
        info = alice.load_adapter("tiny-copy")
        assert info.loaded and not info.is_default and info.source_model == "tiny-qwen2"
        listed = {a.name: a for a in alice.list_adapters()}
        assert listed["tiny-copy"].loaded and listed["tiny-pair"].is_default
        fetched = alice.fetch_projected(text=TEXT, adapter="tiny-copy")
        assert fetched.adapter == "tiny-copy@1"
        assert fetched.entry_key != alice.fetch_projected(text=TEXT).entry_key  # the adapter is in the namespace
    finally:  # the server has no unload call: its registry forgets alice's load, the folder the file
        copy.unlink(missing_ok=True)
        with registry._lock:
            registry._tenant_loaded.pop(("alice", "tiny-copy"), None)
    assert "tiny-copy" not in {a.name for a in alice.list_adapters()}
