"""The service end to end: a real gRPC server on a loopback port (port 0), real clients, the tiny pair
(tiny-qwen2 -> tiny-phi3) with a fitted adapter, and an identity server (tiny-phi3 -> itself) for exactness.

(One file of ~500 lines: every scenario runs against the same two module-scoped servers.)
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer import kvcache

pytestmark = pytest.mark.integration

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
TOKENS = {ALICE: "alice", BOB: "bob"}
TEXT = ("The module provides a way to read and write data in a portable format. Each record holds a name, "
        "a value and an optional comment, and readers skip what they do not understand.")


def _text(n: int) -> str:
    from kvbridge.transfer.selfcheck import sample_text

    words = sample_text().split()
    return " ".join(words[n * 40:(n + 1) * 40])


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, tiny_adapter_file):
    folder = tmp_path_factory.mktemp("adapters")
    shutil.copy(tiny_adapter_file, folder / "tiny-pair.safetensors")
    (folder / "notes.txt").write_text("not an adapter")
    return folder


def _start(source, targets, adapters_dir, tokens=TOKENS, **overrides):
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    fields = dict(preset="tiny", listen="127.0.0.1:0", adapters=str(adapters_dir), store_capacity_mb=64,
                  metrics_listen="127.0.0.1:0", max_message_mb=2, chunk_kb=64,
                  correction="replace")  # these tests are the projection's: test_corrections has the served modes
    fields.update(overrides)
    config = ServeConfig(**fields)
    service = build_service(config, source=source, targets=targets)
    return start_server(service, config, tokens=tokens)


@pytest.fixture(scope="module")
def server(tiny_source, tiny_target, adapters_dir):
    running = _start(tiny_source, [tiny_target], adapters_dir)
    yield running
    running.stop(1)


@pytest.fixture(scope="module")
def identity_server(tiny_target, tmp_path_factory):
    from kvbridge.adapters.identity import identity_adapter

    running = _start(tiny_target, [tiny_target], tmp_path_factory.mktemp("no-adapters"), tokens=None)
    running.service.adapters.add("identity", identity_adapter(tiny_target), make_default=True)
    yield running
    running.stop(1)


@pytest.fixture()
def alice(server):
    with KVBridgeClient(server.address, token=ALICE, timeout_s=60) as client:
        yield client


@pytest.fixture()
def bob(server):
    with KVBridgeClient(server.address, token=BOB, timeout_s=60) as client:
        yield client


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVBridgeError) as info:
        call()
    return info.value.code, info.value.details


def _snapshot(server):
    store = server.service.store
    stats = store.stats()
    return stats.entries, stats.bytes_used["device"], sorted(store.keys("alice")), sorted(store.keys("bob"))


def _prompt(lm, text=" In short,"):
    return torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------------ transfer


def test_ingest_then_projected_fetch_then_target_generate(server, alice, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text

    reply = alice.ingest(TEXT, session_id="s1")
    (entry,) = reply.entries
    paired = pair_text(TEXT, tiny_source.tokenizer, tiny_target.tokenizer)
    assert torch.equal(reply.source_token_ids, paired.source_ids) and entry.num_tokens == paired.source_ids.numel()
    assert entry.kind == "prefix" and entry.tier == "device" and entry.model == tiny_source.name

    fetched = alice.fetch_projected(key=entry.key)
    source_kv = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    expected = project(adapter, source_kv, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    assert fetched.segment.model == tiny_target.spec.identity
    assert torch.equal(fetched.segment.token_ids, paired.target_ids)
    assert torch.equal(fetched.segment.positions, torch.arange(paired.target_ids.numel()))
    assert torch.equal(fetched.segment.kv, expected.kv)  # the wire and the store change no bit
    assert fetched.dtype == tiny_target.spec.dtype == "float32"  # the target's dtype unless asked otherwise
    assert fetched.adapter == "tiny-pair@1" and fetched.source_key == entry.key and fetched.text == TEXT
    assert fetched.num_chunks > 1  # 64 KB chunks: never one giant message
    assert 0 < fetched.wire_bytes - expected.kv.numel() * 4 <= 128 * fetched.num_chunks  # + safetensors headers

    cache, target_ids = alice.projected_cache(tiny_target, key=entry.key)
    prompt = _prompt(tiny_target)
    ids = torch.cat((target_ids, prompt))[None]
    out = tiny_target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                     max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert out.numel() == 8
    assert torch.equal(out, kvcache.generate(tiny_target.model, tiny_target.spec, expected, prompt, max_new_tokens=8))

    entries = server.service.store.stats().entries
    again = alice.fetch_projected(text=TEXT)  # by text: the same source entry, the cached projection
    assert again.entry_key == fetched.entry_key and torch.equal(again.segment.kv, fetched.segment.kv)
    assert server.service.store.stats().entries == entries


def test_identity_transfer_gives_the_targets_own_tokens(identity_server, tiny_target):
    with KVBridgeClient(identity_server.address) as client:  # an open server: no token
        text = _text(1)
        client.ingest(text)
        fetched = client.fetch_projected(text=text, require_cached=True)
        own = kvcache.extract(tiny_target.model, tiny_target.spec, fetched.segment.token_ids)
        torch.testing.assert_close(fetched.segment.kv, own.kv, atol=2e-5, rtol=1e-5)
        prompt = _prompt(tiny_target)
        got = kvcache.generate(tiny_target.model, tiny_target.spec, fetched.segment, prompt, max_new_tokens=16)
        ref = kvcache.generate_plain(tiny_target.model, tiny_target.spec,
                                     torch.cat((fetched.segment.token_ids, prompt)), max_new_tokens=16)
        assert torch.equal(got, ref)
        # placed after 7 tokens of the target's own: keys rotated for positions 7.., still its own KV there
        shifted = client.fetch_projected(text=text, offset=7)
        assert torch.equal(shifted.segment.positions, torch.arange(7, 7 + own.num_tokens))
        own_at_7 = kvcache.extract(tiny_target.model, tiny_target.spec, own.token_ids, start_position=7)
        # the model's own prefill at 7.. differs from shifted keys by float rounding only (its selfcheck: ~4e-6)
        assert (shifted.segment.kv - own_at_7.kv).norm() / own_at_7.kv.norm() < 1e-5


def test_projection_on_the_server_and_on_the_client_agree(alice, tiny_source, tiny_target, adapter):
    text = _text(2)
    on_server = alice.fetch_projected(text=text)
    local = alice.fetch_projected_locally(tiny_source, tiny_target, adapter, text=text)
    assert torch.equal(local.segment.kv, on_server.segment.kv)
    assert torch.equal(local.segment.token_ids, on_server.segment.token_ids)
    assert local.source_key == on_server.source_key
    assert local.wire_bytes < on_server.wire_bytes  # the source KV is the smaller one here (as in production)
    shifted = alice.fetch_projected(text=text, offset=5)
    local5 = alice.fetch_projected_locally(tiny_source, tiny_target, adapter, text=text, offset=5)
    torch.testing.assert_close(shifted.segment.kv, local5.segment.kv, atol=5e-5, rtol=1e-5)
    assert torch.equal(shifted.segment.positions, local5.segment.positions)


def test_bfloat16_on_the_wire(alice):
    text = _text(3)
    full = alice.fetch_projected(text=text)
    half = alice.fetch_projected(text=text, dtype="bfloat16")
    assert half.segment.dtype == torch.bfloat16 and abs(half.wire_bytes * 2 / full.wire_bytes - 1) < 0.01
    assert torch.equal(half.segment.kv, full.segment.kv.to(torch.bfloat16))


def test_a_bfloat16_target_gets_bfloat16_on_the_wire_by_default(tmp_path):
    """The wire dtype defaults to the target's own (issue 16, part 4): a target run in bf16 streams half the bytes,
    and a same-host fetch maps the same bf16 KV."""
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.transfer.tiny_pair import tiny_target

    target = tiny_target(device="cpu", dtype="bfloat16")
    running = _start(target, [target], tmp_path, tokens=None, selfcheck=False)  # its RoPE checks are float32-tight
    running.service.adapters.add("identity", identity_adapter(target), make_default=True)
    try:
        with KVBridgeClient(running.address) as client:
            text = _text(2)
            default = client.fetch_projected(text=text)
            wide = client.fetch_projected(text=text, dtype="float32")
            shared = client.fetch_projected(text=text, transport="shared_memory")
        assert default.dtype == "bfloat16" and abs(default.wire_bytes * 2 / wide.wire_bytes - 1) < 0.01
        assert shared.transport == "shared_memory" and shared.dtype == "bfloat16"
        assert torch.equal(shared.segment.kv, default.segment.kv)
    finally:
        running.stop(1)


@pytest.mark.parametrize("transport", ["stream", "shared_memory"])
def test_a_fetched_cache_writes_the_next_tokens_after_the_fetched_kv_without_a_copy(server, alice, tiny_target,
                                                                                    transport):
    """The first cache made of a fetch takes the prompt's tokens into the slots the fetch left after each row (a
    same-host segment's file mapped copy-on-write, or the stream's buffer): the layers still begin at the fetched
    KV, which is unchanged, and the logits are those of a cache of a plain copy. A second cache of the same fetch
    copies at its first forward."""
    key = alice.ingest(_text(7)).entries[0].key
    fetched = alice.fetch_projected(key=key, transport=transport)
    assert fetched.transport == transport
    kept = fetched.segment.kv.clone()
    t, prompt = fetched.segment.num_tokens, _prompt(tiny_target)
    positions = torch.arange(t, t + prompt.numel())[None]

    def forward(cache):
        return tiny_target.model(input_ids=prompt[None], position_ids=positions, cache=cache, use_cache=True).logits

    with torch.no_grad():
        cache = fetched.to_cache(tiny_target)
        logits = forward(cache)
        plain = forward(kvcache.to_cache(dataclasses.replace(fetched.segment, kv=kept.clone()), tiny_target.model,
                                         tiny_target.spec))
        for i, layer in enumerate(cache.layers):
            assert layer.keys.data_ptr() == fetched.segment.kv[i, 0].data_ptr()  # in place, after the fetched KV
            assert layer.values.data_ptr() == fetched.segment.kv[i, 1].data_ptr()
            assert layer.get_seq_length() == t + prompt.numel()
        assert torch.equal(fetched.segment.kv, kept) and torch.equal(logits, plain)
        again = fetched.to_cache(tiny_target)
        assert torch.equal(forward(again), plain)
        assert again.layers[0].keys.data_ptr() != fetched.segment.kv[0, 0].data_ptr()


def test_a_same_host_fetch_returns_before_its_release_is_answered_and_close_waits_for_it(server, alice,
                                                                                         monkeypatch):
    """The file is mapped before ReleaseSegment goes out, so the fetch does not wait for its answer (a release held
    in the server stays pending after the fetch returns); the client's close() waits, and the file is gone."""
    segments, gate, arrived, released = server.segments, threading.Event(), [], threading.Event()
    real = segments.release

    def held_release(tenant, name):
        arrived.append(name)
        gate.wait(10)
        try:
            return real(tenant, name)
        finally:
            released.set()

    monkeypatch.setattr(segments, "release", held_release)
    key = alice.ingest(_text(8)).entries[0].key
    expected = alice.fetch_projected(key=key, transport="stream").segment.kv
    with KVBridgeClient(server.address, token=ALICE) as client:
        fetched = client.fetch_projected(key=key, transport="shared_memory")
        assert fetched.transport == "shared_memory" and torch.equal(fetched.segment.kv, expected)
        assert not released.is_set()  # the fetch did not wait for its release
        deadline = time.monotonic() + 10
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        path = segments.folder / f"{arrived[0]}.safetensors"
        assert path.exists()
        gate.set()
    assert released.is_set() and not path.exists()  # close() waited for the release
    assert torch.equal(fetched.segment.kv, expected)  # the map outlives the file


# ------------------------------------------------------------------------------------------------ uploads


def test_uploaded_source_kv_round_trips(server, alice, tiny_source):
    ids = torch.tensor(tiny_source.tokenizer(_text(4))["input_ids"])
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

    ids = torch.tensor(tiny_source.tokenizer(_text(5))["input_ids"])
    segment = kvcache.extract(tiny_source.model, tiny_source.spec, ids)
    spec = tiny_source.spec
    header = pb2.KVHeader(model=pb2.ModelRef(name=spec.name, config_hash=spec.identity.config_hash),
                          dtype="float32", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, token_ids=ids.tolist(), rotated=True)
    chunks = [pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                       token_start=r.token_start, token_end=r.token_end, data=blob))
              for r, blob in iter_chunks(segment.kv, 4096)]
    first = pb2.PutSourceKVRequest(header=header)
    before = _snapshot(server)

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
        assert _snapshot(server) == before

    def broken():  # the client's side fails mid-upload: the call is cancelled
        yield first
        yield chunks[0]
        raise RuntimeError("client crashed")

    code, _ = _upload(server, broken())
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    assert _snapshot(server) == before and server.service.store.check() == []


def test_a_client_cut_off_mid_stream_leaks_no_blocks(server, alice):
    text = _text(6)
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
    deadline = time.monotonic() + 20  # the server notices between chunks
    while cancelled._value.get() == seen and time.monotonic() < deadline:
        time.sleep(0.02)
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
                code, details = _code(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED, details
                assert ("missing" in details) if token is None else ("not valid" in details)
    code, _ = _upload(server, [pb2.PutSourceKVRequest(header=pb2.KVHeader())], token=None)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_tenants_neither_read_nor_detect_each_others_entries(server, alice, bob):
    text = _text(7)
    key = alice.ingest(text).entries[0].key
    projected = alice.fetch_projected(key=key).entry_key
    for k in (key, projected):
        calls = (lambda k=k: bob.fetch_source(key=k), lambda k=k: bob.fetch_projected(key=k), lambda k=k: bob.delete(k))
        for call in calls:
            code, details = _code(call)
            unknown_code, unknown = _code(lambda k=k: bob.fetch_source(key="f" * len(k)))
            assert code == unknown_code == grpc.StatusCode.NOT_FOUND
            assert details.replace(k, "K") == unknown.replace("f" * len(k), "K")  # a miss, word for word
    found = bob.lookup(text)
    assert found.key is None and found.num_tokens == 0 and found.tier is None
    code, _ = _code(lambda: bob.fetch_projected(text=text, require_cached=True))
    assert code == grpc.StatusCode.NOT_FOUND
    own = bob.ingest(text).entries[0]
    assert own.key != key and own.new_blocks > 0  # identical tokens, separate blocks
    assert alice.fetch_source(key=key).entry_key == key  # alice's entry untouched
    stats = bob.stats()
    assert stats.tenant_entries == len(server.service.store.keys("bob")) and stats.tenant_tokens >= own.num_tokens


# ------------------------------------------------------------------------------------------------ errors


def test_bad_requests_get_the_right_code_and_leave_the_store_alone(server, alice):
    key = alice.ingest(TEXT).entries[0].key
    before = _snapshot(server)
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
        got, details = _code(call)
        assert got == code and message in details, (message, got, details)
        assert _snapshot(server) == before, message
    assert server.service.store.check() == []


def test_load_and_list_adapters(server, alice, adapters_dir):
    names = {a.name: a for a in alice.list_adapters()}
    assert set(names) == {"tiny-pair"} and names["tiny-pair"].is_default and names["tiny-pair"].loaded
    shutil.copy(adapters_dir / "tiny-pair.safetensors", adapters_dir / "tiny-copy.safetensors")
    info = alice.load_adapter("tiny-copy")
    assert info.loaded and not info.is_default and info.source_model == "tiny-qwen2"
    fetched = alice.fetch_projected(text=TEXT, adapter="tiny-copy")
    assert fetched.adapter == "tiny-copy@1"
    assert fetched.entry_key != alice.fetch_projected(text=TEXT).entry_key  # the adapter is in the namespace


# ------------------------------------------------------------------------------------------------ plumbing


def test_health_and_reflection_answer(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:  # no token: probes and tools stay open
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvbridge.v1.KVBridge"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvbridge.v1.KVBridge")]
        listed, files = list(reflect.ServerReflectionInfo(iter(requests), timeout=10))
        services = {s.name for s in listed.list_services_response.service}
        assert {"kvbridge.v1.KVBridge", "grpc.health.v1.Health"} <= services
        from google.protobuf import descriptor_pb2

        proto = descriptor_pb2.FileDescriptorProto.FromString(files.file_descriptor_response.file_descriptor_proto[0])
        assert proto.name == "kvbridge/v1/kvbridge.proto" and proto.package == "kvbridge.v1"


def test_metrics_endpoint_counts_requests_bytes_and_store(server, alice):
    alice.ingest(TEXT)  # its own Ingest, so the test does not lean on an earlier one
    alice.fetch_projected(text=TEXT)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvbridge_requests_total{code="OK",method="GetProjectedCache"}' in body
    assert 'kvbridge_request_seconds_bucket{le="0.001",method="Ingest"}' in body
    assert 'kvbridge_streamed_bytes_total{direction="out",method="GetProjectedCache"}' in body
    assert 'kvbridge_store_bytes{tier="device"}' in body and "kvbridge_store_hits_total" in body
    assert "\nkvbridge_store_check_problems 0.0\n" in body  # store.check() on every scrape: consistent


def test_client_retries_unavailable_with_backoff_then_reports_it(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = KVBridgeClient(f"127.0.0.1:{port}", retries=3, backoff_s=0.001, timeout_s=5)
    waits = []
    monkeypatch.setattr(client, "_sleep", lambda attempt: waits.append(attempt))
    for call in (client.stats, lambda: client.fetch_source(text=TEXT)):
        waits.clear()
        code, _ = _code(call)
        assert code == grpc.StatusCode.UNAVAILABLE and waits == [0, 1, 2]
    client.close()


def test_every_call_has_a_deadline(server):
    with KVBridgeClient(server.address, token=ALICE, timeout_s=1e-4, retries=0) as client:
        code, _ = _code(lambda: client.fetch_projected(text=_text(8)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_shutdown_drains_streams_in_flight(tiny_source, tiny_target, adapters_dir):
    from kvbridge.server.chunks import ChunkAssembler, wire_dtype

    running = _start(tiny_source, [tiny_target], adapters_dir, chunk_kb=4)
    channel = grpc.insecure_channel(running.address)
    stream = pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
        pb2.GetProjectedCacheRequest(text=TEXT), metadata=(("authorization", f"Bearer {ALICE}"),), timeout=30)
    first = next(stream)
    h = first.header
    assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim, wire_dtype(h.dtype))
    stopper = threading.Thread(target=running.stop, args=(20,))
    stopper.start()
    for message in [first, *stream]:
        c = message.chunk
        assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
    assert assembler.complete and h.num_chunks > 3
    stopper.join(30)
    channel.close()
    with KVBridgeClient(running.address, token=ALICE, retries=0, timeout_s=5) as client:
        code, _ = _code(client.stats)
        assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_a_self_signed_pair(tmp_path, tiny_source, tiny_target, adapters_dir):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    running = _start(tiny_source, [tiny_target], adapters_dir, tls_cert=str(cert), tls_key=str(key),
                     metrics_listen=None)
    try:
        with KVBridgeClient(f"localhost:{running.port}", token=ALICE, tls_root_cert=cert) as client:
            fetched = client.fetch_projected(text=TEXT)
            assert fetched.segment.num_tokens > 0
        with KVBridgeClient(f"localhost:{running.port}", token=ALICE, retries=0, timeout_s=5) as plain:
            code, _ = _code(plain.stats)
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(1)


def test_the_generator_takes_projected_context_through_the_service(identity_server, tiny_target):
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator

    doc = _text(9)
    with KVBridgeClient(identity_server.address) as client:
        source = ProjectedContext(client, tiny_target)
        gen = SuffixReuseGenerator(tiny_target, context_source=source)
        out, metrics = gen.generate("s", [Part(doc, "document", projected=True), Part(" In short,")],
                                    max_new_tokens=12)
    ids = torch.cat((torch.tensor([gen.start_token]), gen.tokens(doc), gen.tokens(" In short,")))
    # identity adapter: the projected document is the target's own KV, so the tokens are those of its own prefill
    assert torch.equal(out, kvcache.generate_plain(tiny_target.model, tiny_target.spec, ids, max_new_tokens=12))
    assert metrics.parts == ["projected", "prefilled"] and metrics.tokens_projected == gen.tokens(doc).numel()
    assert source.calls == 1 and source.first is source.last and source.last.first_position == 0
    assert not any(isinstance(v, list) for v in vars(source).values())  # nothing that grows with a session


def test_ingest_with_segment_detection_over_the_wire(server, alice):
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    previous = server.service.detector
    server.service.detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))
    try:
        text = " ".join(_text(i) for i in range(10, 14))
        reply = alice.ingest(text, detect_segments=True)
    finally:
        server.service.detector = previous
    prefix, *segments = reply.entries
    assert prefix.kind == "prefix" and prefix.num_tokens == reply.source_token_ids.numel()
    assert segments and all(e.kind == "segment" and e.start > 0 for e in segments[1:])
    starts = [e.start for e in segments]
    assert starts == sorted(starts) and starts[-1] + segments[-1].num_tokens <= prefix.num_tokens
    back = alice.fetch_source(key=segments[-1].key)
    assert int(back.segment.positions[0]) == segments[-1].start and back.text
    assert alice.fetch_source(text=back.text, require_cached=True).entry_key == segments[-1].key
