"""Message-size limits of streamed fetches, through gRPC: the first message (the header with every token id and the
text, then a chunk) fits the receiver's limit however long the document; a client receives chunks that fit its own
max_message_mb whatever the server's --chunk-kb; a limit nothing can fit is an error that names the sizes."""

from __future__ import annotations

import grpc
import pytest
import served
import torch
from kvbridge.adapters.identity import identity_adapter
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer.segment import KVSegment

pytestmark = pytest.mark.integration

MIB = 1 << 20
LONG = " ".join(served.words()[:1300])  # ~3,500 tokens of the tiny source: a header of ~21 KB with its text


@pytest.fixture(scope="module")
def small_chunks(tiny_source, tiny_target, adapters_dir):
    """The test servers' settings: 2 MiB messages, 64 KiB chunks."""
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir)
    yield running
    running.stop(1)


@pytest.fixture(scope="module")
def big_chunks(tiny_target, tmp_path_factory):
    """A server started with --max-message-mb 32 --chunk-kb 16384: chunks a default client (8 MiB) cannot take."""
    running = served.start_on_cpu(tiny_target, [tiny_target], tmp_path_factory.mktemp("no-adapters"),
                                  max_message_mb=32, chunk_kb=16384)
    running.service.adapters.add("identity", identity_adapter(tiny_target), make_default=True)
    yield running
    running.stop(1)


def _client(server, max_message_mb: float | None = None) -> KVBridgeClient:
    limit = {} if max_message_mb is None else {"max_message_mb": max_message_mb}
    return KVBridgeClient(server.address, token=served.ALICE, timeout_s=60, retries=0, **limit)


def test_a_long_documents_first_message_fits_the_clients_limit(small_chunks):
    """Header (~21 KB: 3,500 ids, positions, the text) + a 64 KiB chunk is more than the client's 80 KiB; every
    chunk alone fits it."""
    with _client(small_chunks) as default:
        key = default.ingest(LONG).entries[0].key
        want = default.fetch_source(key=key)
    assert want.segment.num_tokens > 3000
    with _client(small_chunks, max_message_mb=80 / 1024) as small:
        got = small.fetch_source(key=key)
    assert torch.equal(got.segment.kv, want.segment.kv) and torch.equal(got.segment.token_ids, want.segment.token_ids)
    assert got.text == LONG


def test_a_kept_fetchs_first_chunk_is_cut_for_the_header_too(small_chunks):
    """A projected fetch's messages are kept for the next fetch of the same KV (server/wire_cache.py) as planned, the
    first chunk whole: sent again, it is cut from its kept message as it was from the KV."""
    text = " ".join(served.words()[:650])  # ~2,650 target tokens: a header of ~14 KB
    with _client(small_chunks) as default:
        key = default.ingest(text).entries[0].key
        want = default.fetch_projected(key=key)
    with _client(small_chunks, max_message_mb=72 / 1024) as small:
        got = [small.fetch_projected(key=key) for _ in range(2)]
        hits = small_chunks.wire.hits
        got.append(small.fetch_projected(key=key))
    assert small_chunks.wire.hits == hits + 1  # the third sent the second's kept messages
    for fetched in got:
        assert torch.equal(fetched.segment.kv, want.segment.kv) and fetched.text == text
    assert got[0].num_chunks == got[2].num_chunks > want.num_chunks  # the first chunk in pieces


def test_a_header_no_message_can_hold_is_an_error_naming_the_sizes(small_chunks):
    with _client(small_chunks) as default:
        key = default.ingest(LONG).entries[0].key
    with _client(small_chunks, max_message_mb=12 / 1024) as tiny, pytest.raises(KVBridgeError) as info:
        tiny.fetch_source(key=key)
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "header" in err.details and "tokens" in err.details and str(12 * 1024) in err.details, err.details


def _upload(server, lm, tokens: int) -> str:
    """A random KV of `lm` (more than 8 MiB at 2,000 tokens of tiny-phi3), uploaded: its key."""
    gen = torch.Generator().manual_seed(tokens)
    spec = lm.spec
    kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, tokens, spec.head_dim, generator=gen)
    segment = KVSegment(kv=kv, token_ids=torch.randint(0, spec.vocab_size, (tokens,), generator=gen),
                        positions=torch.arange(tokens), model=spec.identity, rotated=True)
    with _client(server, max_message_mb=32) as client:
        return client.put_source_kv(segment).key, kv


def test_a_default_client_receives_a_big_chunk_servers_fetches(big_chunks, tiny_target):
    key, kv = _upload(big_chunks, tiny_target, 2000)
    assert kv.numel() * 4 > 8 * MIB
    with _client(big_chunks) as client:  # max_message_mb 8
        got = client.fetch_source(key=key)
    assert torch.equal(got.segment.kv, kv) and got.num_chunks > 1
    # a client that says nothing of its limit gets what gRPC's default one receives (4 MiB)
    with grpc.insecure_channel(big_chunks.address) as channel:
        stream = pb2_grpc.KVBridgeStub(channel).GetSourceCache(
            pb2.GetSourceCacheRequest(key=key), metadata=(("authorization", f"Bearer {served.ALICE}"),), timeout=60)
        sizes = [m.ByteSize() for m in stream]
    assert len(sizes) > 2 and max(sizes) <= 4 * MIB


def test_a_client_whose_limit_no_chunk_fits_gets_both_limits_named(big_chunks, tiny_target):
    key, _ = _upload(big_chunks, tiny_target, 64)
    limit = int(0.004 * MIB)
    with _client(big_chunks, max_message_mb=0.004) as client, pytest.raises(KVBridgeError) as info:
        client.fetch_source(key=key)
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert str(limit) in err.details and str(32 * MIB) in err.details and "max_message_mb" in err.details, err.details


def test_a_declared_limit_that_is_not_a_number_of_bytes_is_refused_by_name(small_chunks):
    with _client(small_chunks) as client:
        key = client.ingest(served.TEXT).entries[0].key
    with grpc.insecure_channel(small_chunks.address) as channel:
        stub = pb2_grpc.KVBridgeStub(channel)
        for bad in ("0", "-5", "1e6", "lots"):
            metadata = (("authorization", f"Bearer {served.ALICE}"), ("kvbridge-max-message-bytes", bad))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GetSourceCache(pb2.GetSourceCacheRequest(key=key), metadata=metadata, timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "kvbridge-max-message-bytes" in info.value.details(), info.value.details()
