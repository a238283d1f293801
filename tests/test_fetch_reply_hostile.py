"""A rogue or buggy replica's fetch reply cannot hurt the client: FetchReply checks a header's sizes before it
allocates anything (against its byte limit, the header's own token ids and totals, and the model it was told to
expect), every chunk lands inside the announced buffer and all of them fill it exactly once, and every error raised
while the stream still runs cancels the call. Hand-made message sequences fed to the reader, then the same through a
real gRPC call to a rogue server (port 0, no models)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch
from kvbridge.proto import pb2
from kvbridge.server.chunk_wire import chunk_message
from kvbridge.server.chunks import ChunkRange, encode_parts, plan_chunks
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.fetch_reply import FetchReply
from kvbridge.server.replies import KVBridgeError

BIG = 2**31 - 1  # the largest int32 a header field holds
HASH = "c0" * 32  # a config hash (sha256 hex)


class Stream:
    """A response stream: hands out `messages`, then (endless) the last one again and again, as a server that goes
    on sending would; records cancel()."""

    def __init__(self, messages: list[bytes], endless: bool = False):
        self.messages, self.endless = messages, endless
        self.pulled = 0
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        if self.cancelled:
            raise AssertionError("read after cancel()")
        if self.pulled >= len(self.messages) and not self.endless:
            raise StopIteration
        self.pulled += 1
        return self.messages[min(self.pulled, len(self.messages)) - 1]

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _kv(layers=2, heads=1, tokens=20, dim=64) -> torch.Tensor:
    return torch.randn(layers, 2, heads, tokens, dim, generator=torch.Generator().manual_seed(0))  # [L, 2, H, T, D]


def _header(kv: torch.Tensor, chunks: int, **fields) -> pb2.CacheHeader:
    n_layers, _, h, t, d = kv.shape
    values = dict(model=pb2.ModelRef(name="tiny-target", config_hash=HASH), dtype="float32", num_layers=n_layers,
                  num_kv_heads=h, head_dim=d, token_ids=list(range(100, 100 + t)), positions=list(range(t)),
                  rotated=True, num_chunks=chunks, total_bytes=kv.numel() * kv.element_size())
    values.update(fields)
    return pb2.CacheHeader(**values)


def _chunk(kv: torch.Tensor, r: ChunkRange) -> bytes:
    return chunk_message(r, *encode_parts(kv, r))


def _messages(kv: torch.Tensor, chunk_bytes: int = 4096, **header_fields) -> list[bytes]:
    """The server's messages for kv: the header joined to the first chunk, then one message per chunk (8 tokens of
    _kv's each)."""
    n_layers, _, h, t, d = kv.shape
    ranges = plan_chunks(n_layers, t, 2 * h * d * kv.element_size(), chunk_bytes)
    out = [_chunk(kv, r) for r in ranges]
    out[0] = pb2.CacheChunk(header=_header(kv, len(ranges), **header_fields)).SerializeToString() + out[0]
    return out


def _refused(stream, code: grpc.StatusCode, match: str, **reply_args) -> KVBridgeError:
    with pytest.raises(KVBridgeError, match=match) as info:
        FetchReply("GetSourceCache", **reply_args).read(stream)
    assert info.value.code == code, info.value
    return info.value


def test_a_well_formed_reply_reads_whole_without_a_cancel():
    kv = _kv()
    stream = Stream(_messages(kv))
    reply = FetchReply("GetSourceCache")
    reply.read(stream)
    fetched = reply.cache()
    assert torch.equal(fetched.segment.kv, kv) and fetched.num_chunks == stream.pulled > 2
    assert not stream.cancelled


@pytest.mark.parametrize("fields, match", [
    (dict(recomputed_positions=[3, 20]), "the header's recomputed positions are not the segment's"),
    (dict(document_position=20), "the header's document position 20 is not one of the segment's"),
    (dict(document_position=-1), "the header's document position -1 is not one of the segment's"),
])
def test_positions_the_segment_does_not_hold_are_refused_by_name(fields, match):
    reply = FetchReply("GetProjectedCache")
    reply.read(Stream(_messages(_kv(), **fields)))
    with pytest.raises(KVBridgeError, match=match) as info:
        reply.cache()
    assert info.value.code == grpc.StatusCode.DATA_LOSS


def test_the_document_position_reads_back_and_is_none_when_a_server_sends_none():
    """... and what an induction prior reads as projected: the document's positions, less the recomputed ones."""
    for fields, want, projected in ((dict(document_position=0), 0, [1, 2, 3] + list(range(5, 20))),
                                    (dict(document_position=19), 19, [19]),
                                    ({}, None, [1, 2, 3] + list(range(5, 20)))):  # after the start token
        reply = FetchReply("GetProjectedCache")
        reply.read(Stream(_messages(_kv(), recomputed_positions=[0, 4], adapter="fitted@1", **fields)))
        fetched = reply.cache()
        assert fetched.document_position == want and fetched.recomputed.tolist() == [0, 4]
        assert fetched.still_projected().nonzero()[:, 0].tolist() == projected
    source = FetchReply("GetSourceCache")
    source.read(Stream(_messages(_kv())))
    with pytest.raises(ValueError, match="source KV"):
        source.cache().still_projected()


@pytest.mark.parametrize("fields, code, match", [
    # terabytes: 4096 layers x 64 heads x 65536 dims of 20 tokens (27 TiB), and int32-max in every dimension
    (dict(num_layers=4096, num_kv_heads=64, head_dim=1 << 16), grpc.StatusCode.RESOURCE_EXHAUSTED,
     r"num_layers 4096 x num_kv_heads 64 x .*20 tokens.* more than the .* bytes"),
    (dict(num_layers=BIG, num_kv_heads=BIG, head_dim=BIG), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "num_layers 2147483647"),
    (dict(num_layers=0), grpc.StatusCode.DATA_LOSS, "num_layers must be > 0, got 0"),
    (dict(head_dim=-3), grpc.StatusCode.DATA_LOSS, "head_dim must be > 0, got -3"),
    (dict(token_ids=[]), grpc.StatusCode.DATA_LOSS, "no token ids"),
    (dict(positions=[0, 1]), grpc.StatusCode.DATA_LOSS, "2 positions for 20 token ids"),
    (dict(dtype="float64"), grpc.StatusCode.DATA_LOSS, "dtype must be one of"),
    (dict(total_bytes=1 << 40), grpc.StatusCode.DATA_LOSS, "total_bytes 1099511627776, its shape makes 20480"),
    (dict(recomputed_positions=list(range(21))), grpc.StatusCode.DATA_LOSS, "21 recomputed positions for 20 tokens"),
])
def test_an_implausible_header_is_refused_by_name_before_allocating_and_cancels(fields, code, match):
    stream = Stream(_messages(_kv(), **fields), endless=True)
    _refused(stream, code, match)
    assert stream.cancelled and stream.pulled == 1


def test_the_byte_limit_is_the_readers_argument():
    kv = _kv()  # 20480 bytes of KV; with 64 slots of headroom after each row 86016, and 40 bools of cells seen
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        FetchReply("GetSourceCache", max_bytes=0)
    stream = Stream(_messages(kv), endless=True)
    _refused(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, r"86056 bytes .* more than the 65536 bytes", max_bytes=1 << 16)
    assert stream.cancelled
    reply = FetchReply("GetSourceCache", max_bytes=86056)
    reply.read(Stream(_messages(kv)))
    assert torch.equal(reply.cache().segment.kv, kv)


@pytest.mark.parametrize("fields, match", [
    (dict(num_layers=3), "num_layers 3, 'tiny-target' has 2"),
    (dict(head_dim=8), "head_dim 8, 'tiny-target' has 64"),
    (dict(model=pb2.ModelRef(name="other", config_hash=HASH)), "KV of model 'other', expected 'tiny-target'"),
    (dict(model=pb2.ModelRef(name="tiny-target", config_hash="ba" * 32)),
     "config_hash 'baba.*', 'tiny-target' has 'c0c0"),
    (dict(token_ids=list(range(21)), positions=list(range(21))), "21 tokens, more than 'tiny-target''s 20 positions"),
])
def test_a_header_unlike_the_expected_model_is_refused(fields, match):
    expect = pb2.ModelInfo(name="tiny-target", config_hash=HASH, num_layers=2, num_kv_heads=1, head_dim=64,
                           max_positions=20)
    kv = _kv()
    stream = Stream(_messages(kv, **fields), endless=True)
    _refused(stream, grpc.StatusCode.DATA_LOSS, match, model=expect)
    assert stream.cancelled
    reply = FetchReply("GetSourceCache", model=expect)  # the model's own reply passes
    reply.read(Stream(_messages(kv)))
    assert torch.equal(reply.cache().segment.kv, kv)


def test_chunks_outside_the_buffer_twice_or_too_few_are_refused():
    kv = _kv()
    first, *rest = _messages(kv)
    outside = [chunk_message(ChunkRange(0, 1, 5, 2), *encode_parts(kv, ChunkRange(0, 1, 0, 2))),  # backwards
               chunk_message(ChunkRange(1, 3, 0, 20), *encode_parts(torch.cat([kv, kv]), ChunkRange(1, 3, 0, 20))),
               chunk_message(ChunkRange(0, 1, 16, 25), *encode_parts(_kv(tokens=25), ChunkRange(0, 1, 16, 25)))]
    for bad, match in zip(outside, ("token range outside", "layer range outside", "token range outside")):
        stream = Stream([first, bad], endless=True)
        _refused(stream, grpc.StatusCode.DATA_LOSS, match)
        assert stream.cancelled
    stream = Stream([first, *rest, rest[-1]], endless=True)  # the last chunk again: overlaps
    _refused(stream, grpc.StatusCode.DATA_LOSS, "overlaps a chunk received before")
    assert stream.cancelled
    _refused(Stream([first, *rest[:-1]]), grpc.StatusCode.DATA_LOSS, r"ended early: 6 \(layer, token\) cells missing")
    two = _messages(kv, chunk_bytes=1 << 20)  # one message holds it all, the header announced 3
    two[0] = pb2.CacheChunk(header=_header(kv, 3)).SerializeToString() + _chunk(kv, ChunkRange(0, 2, 0, 20))
    _refused(Stream(two), grpc.StatusCode.DATA_LOSS, "whole in 1 messages, the header announced 3")


def test_every_error_in_mid_stream_cancels_the_call():
    kv = _kv()
    first, *rest = _messages(kv)
    header = pb2.CacheChunk(header=_header(kv, 1 + len(rest))).SerializeToString()
    cases = [
        ([first, header], grpc.StatusCode.INTERNAL, "a second header"),
        ([rest[0]], grpc.StatusCode.INTERNAL, "a chunk arrived before the header"),
        ([first, b"\x0a\x02\xff\xff"], grpc.StatusCode.DATA_LOSS, "a bad message"),  # a header protobuf cannot read
        ([first, b"\x12\x05\x08"], grpc.StatusCode.DATA_LOSS, "a bad message"),  # runs past its end
        ([first, b""], grpc.StatusCode.DATA_LOSS, "a bad chunk"),  # neither header nor chunk
    ]
    shared = _header(kv, 0)
    shared.shared.name = "seg"
    cases.append(([pb2.CacheChunk(header=shared).SerializeToString(), rest[0]], grpc.StatusCode.INTERNAL,
                  "a message came after the header naming a shared-memory segment"))
    for messages, code, match in cases:
        stream = Stream(messages, endless=True)
        _refused(stream, code, match)
        assert stream.cancelled, match


def test_a_plain_iterator_without_cancel_gets_the_same_errors():
    kv = _kv()
    first, *rest = _messages(kv)
    for messages, match in (([first, first], "a second header"), ([first, b"\x12\x05\x08"], "a bad message"),
                            ([first, rest[0], rest[0]], "overlaps")):
        with pytest.raises(KVBridgeError, match=match):
            FetchReply("GetSourceCache").read(iter(messages))


# ------------------------------------------------------------------------------------------ through gRPC

class Rogue:
    """A server whose GetSourceCache sends `messages`, then the last one again until the call ends; `ended` is set
    when gRPC ends the call (the client cancelled, or the deadline passed), `sent` counts."""

    def __init__(self, messages: list[bytes]):
        self.messages = messages
        self.ended = threading.Event()
        self.sent = 0

    def fetch(self, request: bytes, context: grpc.ServicerContext):
        context.add_callback(self.ended.set)
        while context.is_active():
            yield self.messages[min(self.sent, len(self.messages) - 1)]
            self.sent += 1


@pytest.fixture
def rogue():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    holder = Rogue([b""])
    handler = grpc.unary_stream_rpc_method_handler(lambda request, context: holder.fetch(request, context),
                                                   request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvbridge.v1.KVBridge",
                                                                          {"GetSourceCache": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield holder, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("hostile, code", [("second header", grpc.StatusCode.INTERNAL),
                                           ("terabyte header", grpc.StatusCode.RESOURCE_EXHAUSTED)])
def test_a_rogue_server_is_cut_off_when_its_reply_is_refused(rogue, hostile, code):
    holder, address = rogue
    kv = _kv()
    first, *rest = _messages(kv)
    if hostile == "second header":
        holder.messages = [first, pb2.CacheChunk(header=_header(kv, 3)).SerializeToString()]
    else:
        holder.messages = _messages(kv, num_layers=4096, num_kv_heads=64, head_dim=1 << 16)
    with KVBridgeClient(address, retries=0, timeout_s=60) as client:
        with pytest.raises(KVBridgeError) as info:
            client.fetch_source(key="k")
        assert info.value.code == code, info.value
        # the call ends now (cancelled), not when its 60 s deadline passes; the error is still held here
        assert holder.ended.wait(20), f"the server still streams ({holder.sent} messages sent)"


def test_the_clients_max_fetch_gb_bounds_what_a_reply_may_allocate(rogue):
    """KVBridgeClient(max_fetch_gb=...) reaches the reader: a reply above it is refused before allocating."""
    holder, address = rogue
    holder.messages = _messages(_kv())  # 86,056 bytes to allocate (test_the_byte_limit_is_the_readers_argument)
    with pytest.raises(ValueError, match="max_fetch_gb must be > 0"):
        KVBridgeClient(address, max_fetch_gb=0)
    with KVBridgeClient(address, retries=0, timeout_s=60, max_fetch_gb=(1 << 16) / (1 << 30)) as client:
        with pytest.raises(KVBridgeError, match="more than the 65536 bytes") as info:
            client.fetch_source(key="k")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
