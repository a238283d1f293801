"""A streamed fetch's first message without gRPC (server/chunk_wire.py, server/chunks.py): the header with every
token id rides with a first chunk cut to fit the message limit; the messages still cover the KV exactly once."""

from __future__ import annotations

import pytest
import torch
from kvbridge.proto import pb2
from kvbridge.server.chunk_wire import chunk_message, first_messages, fit_header
from kvbridge.server.chunks import (
    CHUNK_FRAMING,
    ChunkAssembler,
    ChunkRange,
    MessageLimit,
    MessageTooLarge,
    cut_first,
    encode_parts,
    plan_chunks,
)

MIB = 1 << 20


def _header(kv: torch.Tensor, text: str = "") -> pb2.CacheHeader:
    n_layers, _, h, t, d = kv.shape
    return pb2.CacheHeader(dtype="float32", num_layers=n_layers, num_kv_heads=h, head_dim=d,
                           token_ids=[100_000 + i for i in range(t)], positions=list(range(t)), text=text)


def _stream(kv: torch.Tensor, header: pb2.CacheHeader, limit: MessageLimit, chunk_bytes: int) -> list[bytes]:
    """What the servicer sends: the plan's chunks, the first one fitted to the header."""
    n_layers, _, h, t, d = kv.shape
    per_token = 2 * h * d * kv.element_size()
    ranges = plan_chunks(n_layers, t, per_token, chunk_bytes)
    header.num_chunks = len(ranges)
    fit_header(header, limit, per_token)
    chunks = [chunk_message(r, *encode_parts(kv, r)) for r in ranges]
    return [*first_messages(header, chunks[0], ranges[0], per_token, limit), *chunks[1:]]


def _received(messages: list[bytes]) -> tuple[pb2.CacheHeader, torch.Tensor]:
    first = pb2.CacheChunk.FromString(messages[0])
    h = first.header
    assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim, torch.float32)
    for raw in messages:
        c = pb2.CacheChunk.FromString(raw).chunk
        assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
    assert assembler.complete and h.num_chunks == len(messages)
    return h, assembler.kv


@pytest.mark.parametrize("shape", [(2, 2, 2, 100_000, 8), (6, 2, 4, 20_000, 4)])
def test_a_100k_token_header_rides_with_a_cut_first_chunk_under_the_servers_limit(shape):
    """The header alone is ~0.6-0.8 MB (100k ids of 3 bytes, positions of up to 3); with a 1 MiB chunk it would be
    ~1.8 MB, more than the server's 1.5 MiB."""
    kv = torch.randn(*shape)
    limit = MessageLimit(server=int(1.5 * MIB), client=8 * MIB)
    chunk = limit.bytes - CHUNK_FRAMING - 256 * 1024
    header = _header(kv, text="x" * 150_000)
    messages = _stream(kv, header, limit, chunk)
    assert max(map(len, messages)) <= limit.bytes
    h, got = _received(messages)
    assert torch.equal(got, kv) and h.text == "x" * 150_000 and len(h.token_ids) == shape[3]


def test_a_header_that_only_fits_without_its_text_goes_without_it():
    kv = torch.randn(2, 2, 2, 30_000, 8)
    limit = MessageLimit(server=MIB, client=256 * 1024)  # the ids and positions: ~150 KB; with the text ~450 KB
    messages = _stream(kv, _header(kv, text="y" * 300_000), limit, 64 * 1024)
    assert max(map(len, messages)) <= limit.bytes
    h, got = _received(messages)
    assert torch.equal(got, kv) and h.text == ""


def test_a_header_no_message_holds_names_its_size_and_both_limits():
    kv = torch.randn(2, 2, 2, 30_000, 8)
    limit = MessageLimit(server=MIB, client=64 * 1024)
    with pytest.raises(MessageTooLarge) as info:
        _stream(kv, _header(kv, text="z" * 1000), limit, 32 * 1024)
    message = str(info.value)
    assert "30000 tokens" in message and str(64 * 1024) in message and str(MIB) in message, message


@pytest.mark.parametrize("r,budget,want", [
    (ChunkRange(0, 4, 0, 10), 4 * 10 * 8, [ChunkRange(0, 4, 0, 10)]),  # fits
    (ChunkRange(0, 4, 0, 10), 250, [ChunkRange(0, 3, 0, 10), ChunkRange(3, 4, 0, 10)]),  # whole layers
    (ChunkRange(2, 5, 0, 10), 50, [ChunkRange(2, 3, 0, 6), ChunkRange(2, 3, 6, 10), ChunkRange(3, 5, 0, 10)]),
    (ChunkRange(1, 2, 40, 60), 80, [ChunkRange(1, 2, 40, 50), ChunkRange(1, 2, 50, 60)]),  # one layer's tokens
])
def test_cut_first_covers_the_range_once_with_a_first_part_in_the_budget(r, budget, want):
    assert cut_first(r, 8, budget) == want
    with pytest.raises(ValueError, match="no token"):
        cut_first(r, 8, 7)
