"""KV chunks on the wire: plans cover every (layer, token) once within the size bound; assembly checks every
range, shape, dtype and blob, and a bad chunk changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.server.chunks import MIN_CHUNK_BYTES, ChunkAssembler, ChunkError, encode, iter_chunks, plan_chunks
from safetensors.torch import save as st_save


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 40), tokens=st.integers(1, 3000), per=st.integers(1, 4096),
       chunk=st.integers(MIN_CHUNK_BYTES, 1 << 22))
def test_plans_cover_every_cell_once_within_the_bound(layers, tokens, per, chunk):
    ranges = plan_chunks(layers, tokens, per, chunk)
    seen = torch.zeros(layers, tokens, dtype=torch.int32)
    for r in ranges:
        assert (r.layer_end - r.layer_start) * (r.token_end - r.token_start) * per <= chunk
        seen[r.layer_start:r.layer_end, r.token_start:r.token_end] += 1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunks_round_trip_bit_exactly(dtype):
    kv = torch.randn(5, 2, 3, 77, 8).to(dtype)  # [L, 2, H, T, D]
    asm = ChunkAssembler(5, 3, 77, 8, dtype)
    chunks = list(iter_chunks(kv, 4096))
    assert len(chunks) > 5  # small chunks: several per layer
    for r, blob in reversed(chunks):  # any order
        assert len(blob) < 4096 + 200  # tensor bytes within the bound, plus the safetensors header
        asm.add(r.layer_start, r.layer_end, r.token_start, r.token_end, blob)
    assert asm.complete and torch.equal(asm.kv, kv)


def test_bad_chunks_are_refused_and_change_nothing():
    kv = torch.randn(2, 2, 1, 10, 4)
    asm = ChunkAssembler(2, 1, 10, 4, torch.float32)
    asm.add(0, 1, 0, 10, encode(kv, _r(0, 1, 0, 10)))
    before = asm.kv.clone()
    good = encode(kv, _r(1, 2, 0, 10))
    cases = {
        "layer range outside": (1, 3, 0, 10, good),
        "token range outside": (1, 2, 0, 11, good),
        "overlaps": (0, 1, 0, 10, encode(kv, _r(0, 1, 0, 10))),
        "not a valid safetensors": (1, 2, 0, 10, good[: len(good) // 2]),
        "exactly one tensor named 'kv'": (1, 2, 0, 10, st_save({"kv": kv[1:2], "x": torch.zeros(1)})),
        "has shape": (1, 2, 0, 10, encode(kv, _r(1, 2, 0, 9))),
        "the header says float32": (1, 2, 0, 10, st_save({"kv": kv[1:2].to(torch.bfloat16).contiguous()})),
        "NaN": (1, 2, 0, 10, st_save({"kv": torch.full((1, 2, 1, 10, 4), float("nan"))})),
    }
    for message, args in cases.items():
        with pytest.raises(ChunkError, match=message):
            asm.add(*args)
        assert torch.equal(asm.kv[:1], before[:1]) and not asm.complete
    assert "cells missing, in layers [1]" in asm.missing()
    asm.add(1, 2, 0, 10, good)
    assert asm.complete and torch.equal(asm.kv, kv)


def test_headers_are_checked_before_allocating():
    with pytest.raises(ChunkError, match="num_tokens must be > 0"):
        ChunkAssembler(2, 1, 0, 4, torch.float32)
    with pytest.raises(ChunkError, match="more than the 1000000 allowed"):
        ChunkAssembler(10**6, 8, 10**6, 128, torch.float32, max_bytes=10**6)  # would be petabytes


def _r(l0, l1, t0, t1):
    from kvbridge.server.chunks import ChunkRange

    return ChunkRange(l0, l1, t0, t1)


def test_chunk_messages_are_cache_chunks_for_any_reader_and_read_back_without_copying_the_data():
    from kvbridge.proto import pb2
    from kvbridge.server.chunk_wire import WireError, chunk_message, read_chunk_message
    from kvbridge.server.chunks import ChunkRange, encode_parts

    kv = torch.randn(3, 2, 2, 300, 8)
    header = pb2.CacheHeader(model=pb2.ModelRef(name="m", config_hash="h"), num_layers=3, token_ids=range(300),
                             dtype="float32")
    for r, prefix in ((ChunkRange(1, 3, 0, 300), pb2.CacheChunk(header=header).SerializeToString()),
                      (ChunkRange(0, 1, 200, 300), b"")):
        head, data = encode_parts(kv, r)
        raw = chunk_message(r, head, data, prefix)
        expected = pb2.CacheChunk(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                    token_start=r.token_start, token_end=r.token_end,
                                                    data=encode(kv, r)))
        if prefix:
            expected.header.CopyFrom(header)
        assert pb2.CacheChunk.FromString(raw) == expected  # what protobuf itself reads
        for wire in (raw, expected.SerializeToString()):  # ours and protobuf's own serialisation
            got_header, chunk = read_chunk_message(wire)
            assert got_header == (header if prefix else None)
            assert (chunk.layer_start, chunk.layer_end, chunk.token_start, chunk.token_end) == (
                r.layer_start, r.layer_end, r.token_start, r.token_end)
            assert bytes(chunk.data) == encode(kv, r)
        assert read_chunk_message(raw)[1].data.obj is raw  # a view of the received bytes, not a copy
        asm = ChunkAssembler(3, 2, 300, 8, torch.float32)
        asm.add(r.layer_start, r.layer_end, r.token_start, r.token_end, read_chunk_message(raw)[1].data)
        assert torch.equal(asm.kv[r.layer_start:r.layer_end, :, :, r.token_start:r.token_end],
                           kv[r.layer_start:r.layer_end, :, :, r.token_start:r.token_end])
        with pytest.raises(WireError):
            read_chunk_message(raw[:-1])  # the chunk field runs past the end
    assert read_chunk_message(b"") == (None, None)


def test_an_assembly_missing_only_the_last_token_is_not_complete():
    kv = torch.randn(2, 2, 1, 10, 4)
    asm = ChunkAssembler(2, 1, 10, 4, torch.float32)
    asm.add(0, 2, 0, 9, encode(kv, _r(0, 2, 0, 9)))
    assert not asm.complete and "missing" in asm.missing()
    asm.add(0, 2, 9, 10, encode(kv, _r(0, 2, 9, 10)))
    assert asm.complete and torch.equal(asm.kv, kv)
