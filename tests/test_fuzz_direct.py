"""Fuzzing what the server relies on, directly (no server): the chunk decoder (only ChunkError, and nothing changed
by a chunk it refuses; headers refused before allocating) and the alignment of a text's source and target tokens
on arbitrary text (control characters, bidi overrides, private use, ZWJ sequences). The requests over gRPC:
tests/test_fuzz.py.
"""

from __future__ import annotations

import pytest
import torch
from fuzz_requests import CASES, FRAGMENTS, FUZZ, bad_blob, int32s, int64s
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.server.chunks import WIRE_DTYPES, ChunkAssembler, ChunkError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_align import check_alignment  # the invariants of one alignment, token by token

# ------------------------------------------------------------------------------------------------ direct: chunks


@settings(FUZZ, max_examples=300)
@given(data=st.data(), layers=st.integers(1, 3), heads=st.integers(1, 2), tokens=st.integers(1, 6),
       dim=st.integers(1, 4), dtype=st.sampled_from(sorted(WIRE_DTYPES)))
def test_the_chunk_decoder_raises_only_chunk_errors_and_changes_nothing_on_one(data, layers, heads, tokens, dim,
                                                                               dtype):
    dtype = WIRE_DTYPES[dtype]
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    assembler = ChunkAssembler(layers, heads, tokens, dim, dtype)
    for _ in range(data.draw(st.integers(1, 6))):
        CASES["ChunkAssembler.add"] += 1
        l0, l1 = sorted(data.draw(st.lists(st.integers(0, layers), min_size=2, max_size=2)))
        t0, t1 = sorted(data.draw(st.lists(st.integers(0, tokens), min_size=2, max_size=2)))
        part = kv[l0:l1, :, :, t0:t1].contiguous()
        blob = st_save({"kv": part})
        if data.draw(st.booleans()):
            blob = bad_blob(data, blob, part) if part.numel() else data.draw(st.binary(max_size=200))
        if data.draw(st.integers(0, 3)) == 0:
            l0, l1, t0, t1 = data.draw(st.tuples(int32s, int32s, int64s, int64s))
        cells, missing = assembler.kv.clone(), assembler.missing()
        try:
            assembler.add(l0, l1, t0, t1, blob)
        except ChunkError as exc:
            assert str(exc)
            assert torch.equal(assembler.kv.view(-1).view(torch.uint8), cells.view(-1).view(torch.uint8))
            assert assembler.missing() == missing
        else:
            assert torch.equal(assembler.kv[l0:l1, :, :, t0:t1], st_load(blob)["kv"])
            assert assembler.missing() != missing
    if assembler.complete:
        assert bool(assembler.kv.isfinite().all())


def test_property_tests_draw_the_same_examples_on_every_run(request):
    """conftest's profile: derandomized (a failure in CI reproduces), no example database, the blob printed."""
    chosen = request.config.getoption("hypothesis_profile", None)
    if chosen not in (None, "kvbridge"):
        pytest.skip(f"--hypothesis-profile {chosen} chose other settings")
    assert settings.default.derandomize and settings.default.database is None and settings.default.print_blob
    assert FUZZ.derandomize and FUZZ.database is None  # the fuzz tests' settings build on it


class _ForcedWay:
    """Hypothesis' data, except that bad_blob's first draw (which way the blob goes wrong) is `way`."""

    def __init__(self, data, way: str):
        self.data, self.way, self.forced = data, way, False

    def draw(self, strategy):
        if self.forced:
            return self.data.draw(strategy)
        self.forced = True
        ways = getattr(strategy, "elements", ())
        assert self.way in ways, f"{self.way!r} is not among the ways bad_blob's first draw picks from ({ways!r})"
        return self.way


BLOB_WAYS = ["truncate", "random", "empty", "flip", "name", "extra", "dtype", "shape", "scalar", "crafted"]


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("way", BLOB_WAYS)
@settings(FUZZ, max_examples=10)
@given(data=st.data())
def test_every_way_of_a_bad_blob_works_on_a_part_of_no_tokens(way, dtype, data):
    """A chunk of 0 tokens (1 layer, 1 head, head_dim 4) gone wrong in each way bad_blob has (but "nonfinite": no
    element to make so): the blob is made, and the decoder refuses it or takes it as the empty part it is."""
    part = torch.zeros(1, 2, 1, 0, 4, dtype=WIRE_DTYPES[dtype])
    blob = bad_blob(_ForcedWay(data, way), st_save({"kv": part}), part)
    assert isinstance(blob, bytes)
    assembler = ChunkAssembler(1, 1, 3, 4, WIRE_DTYPES[dtype])
    cells, missing = assembler.kv.clone(), assembler.missing()
    try:
        assembler.add(0, 1, 0, 0, blob)
    except ChunkError as exc:
        assert str(exc)
    assert torch.equal(assembler.kv.view(-1).view(torch.uint8), cells.view(-1).view(torch.uint8))
    assert assembler.missing() == missing


def test_a_bad_blob_of_no_tokens_is_never_made_non_finite():
    part = torch.zeros(1, 2, 1, 0, 4)
    with pytest.raises(AssertionError, match="'nonfinite' is not among the ways"):
        bad_blob(_ForcedWay(None, "nonfinite"), st_save({"kv": part}), part)


@settings(FUZZ, max_examples=200)
@given(dims=st.tuples(int64s, int64s, int64s, int64s), dtype=st.sampled_from(sorted(WIRE_DTYPES)))
def test_chunk_headers_are_refused_before_allocating(dims, dtype):
    CASES["ChunkAssembler()"] += 1
    limit = 1 << 20
    try:
        assembler = ChunkAssembler(*dims, WIRE_DTYPES[dtype], max_bytes=limit)
    except ChunkError as exc:
        assert str(exc)
    else:
        assert all(d > 0 for d in dims) and assembler.kv.numel() * assembler.kv.element_size() <= limit


# ------------------------------------------------------------------------------------------------ direct: alignment
# tests/test_align.py checks align_text with specials on both sides; the server pairs a text with the source's
# specials and the target's text tokens behind its start token (pair_text), and tokenizes pieces without specials.

control_heavy = st.one_of(
    st.text(st.characters(categories=["Cc", "Cf", "Co", "Cn", "So", "Sk", "Mn", "Zs", "Zl", "Zp"]), max_size=60),
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.text(max_size=300),
)


@settings(FUZZ, max_examples=150)
@given(text=control_heavy)
def test_pair_text_alignment_on_arbitrary_text(tiny_source, tiny_target, text):
    from kvbridge.adapters.pairs import pair_text, start_token_id
    from kvbridge.transfer.align import AlignKind, align_text, tokenize

    CASES["align"] += 1
    for source_tokenizer, target_tokenizer in [(tiny_source.tokenizer, tiny_target.tokenizer),
                                               (tiny_target.tokenizer, tiny_source.tokenizer)]:  # fmt: skip
        source, target, alignment = align_text(text, source_tokenizer, target_tokenizer, add_special_tokens=False)
        check_alignment(text, source, target, alignment)
        if not text.strip():
            continue
        paired = pair_text(text, source_tokenizer, target_tokenizer)
        a = paired.alignment
        assert a.num_target_tokens == paired.target_ids.numel() == paired.target_offsets.shape[0]
        assert a.num_source_tokens == paired.source_ids.numel()
        assert int(paired.target_ids[0]) == start_token_id(target_tokenizer) and int(a.kind[0]) == AlignKind.UNMAPPED
        index, kind = a.source_index.tolist(), a.kind.tolist()
        source = tokenize(source_tokenizer, text)
        for i in range(1, a.num_target_tokens):
            j = index[i]
            assert -1 <= j < a.num_source_tokens and (j == -1) == (kind[i] == AlignKind.UNMAPPED)
            start, end = paired.target_offsets[i].tolist()
            if kind[i] == AlignKind.EXACT:  # the source token really covers the target token's last character
                assert end > start and not source.special[j]
                assert int(source.offsets[j, 0]) <= end - 1 < int(source.offsets[j, 1])
            elif kind[i] == AlignKind.FALLBACK and not source.special[j]:
                assert int(source.offsets[j, 1]) <= max(end - 1, start)  # no look-ahead
