"""Cross-tokenizer alignment: the rules on hand-built offsets, the tiny tokenizer pair, and the real small pair."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbridge.transfer.align import AlignKind, Alignment, TokenizedText, align_text, align_tokens, tokenize
from kvbridge.transfer.data import data_path
from kvbridge.transfer.tiny_pair import build_tiny_tokenizer
from tokenizers import Tokenizer, normalizers
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

EXACT, FALLBACK, SPECIAL, UNMAPPED = AlignKind.EXACT, AlignKind.FALLBACK, AlignKind.SPECIAL, AlignKind.UNMAPPED
PYDOC_SUMMARIES = data_path("pydoc_heldout.jsonl")

# Spacing, byte pieces, combining marks, ZWJ sequences and literal special-token text, mixed in more often than
# st.text() alone would find them.
FRAGMENTS = [" ", "  ", "\n", "\t", "a", "The", " value", "é", "e\u0301", "日本語", "😀", "👩\u200d💻", "▁",
             "ﬁ", "<s>", "</s>", "<|endoftext|>", "<bos>", "<eos>", "<|im_start|>"]  # fmt: skip
texts = st.one_of(st.text(max_size=80), st.lists(st.sampled_from(FRAGMENTS), max_size=16).map("".join))


def tokenized(offsets, roles=None) -> TokenizedText:
    """A hand-built TokenizedText; roles[i] set marks token i as a structural special."""
    roles = tuple(roles) if roles is not None else (None,) * len(offsets)
    return TokenizedText(
        ids=torch.arange(len(offsets), dtype=torch.int64),
        offsets=torch.tensor(offsets, dtype=torch.int64).reshape(-1, 2),
        special=torch.tensor([role is not None for role in roles], dtype=torch.bool),
        roles=roles,
    )


def as_lists(alignment: Alignment) -> tuple[list[int], list[int]]:
    return alignment.source_index.tolist(), alignment.kind.tolist()


def reference_alignment(source: TokenizedText, target: TokenizedText) -> tuple[list[int], list[int]]:
    """The rules of `align_tokens`, written as plain loops over tokens, for comparison."""
    s_offsets, s_special = source.offsets.tolist(), source.special.tolist()
    t_offsets = target.offsets.tolist()
    leading = -1
    for j, special in enumerate(s_special):
        if not special:
            break
        leading = j

    def char_rule(i: int) -> tuple[int, int]:
        start, end = t_offsets[i]
        if end > start:
            c = end - 1
            containing = [j for j, (s, e) in enumerate(s_offsets) if not s_special[j] and s <= c < e]
            if containing:
                j = containing[-1]
                no_further = [j for j, (s, e) in enumerate(s_offsets) if not s_special[j] and e <= end]
                if no_further:
                    latest = max(no_further, key=lambda j: (s_offsets[j][1], j))
                    if latest in containing:
                        j = latest
                later_pieces = 0  # following target tokens that end on c too: later pieces of a split character
                for next_start, next_end in t_offsets[i + 1 :]:
                    if next_end != end or next_start == next_end:
                        break
                    later_pieces += 1
                while later_pieces and j - 1 in containing:
                    j, later_pieces = j - 1, later_pieces - 1
                return j, EXACT
            position = c
        else:
            position = start
        before = [j for j, (s, e) in enumerate(s_offsets) if not s_special[j] and e <= position]
        if before:
            return max(before, key=lambda j: (s_offsets[j][1], j)), FALLBACK
        return (leading, FALLBACK) if leading >= 0 else (-1, UNMAPPED)

    indices, kinds = [], []
    for i, role in enumerate(target.roles):
        if role is None:
            j, kind = char_rule(i)
        else:
            matches = [j for j, r in enumerate(source.roles) if r == role]
            if matches:
                j, kind = (matches[0] if role == "bos" else matches[-1]), SPECIAL
            elif t_offsets[i][1] > t_offsets[i][0]:
                j, kind = char_rule(i)
            else:
                j, kind = -1, UNMAPPED
        indices.append(j)
        kinds.append(int(kind))
    return indices, kinds


def check_alignment(text: str, source: TokenizedText, target: TokenizedText, alignment: Alignment) -> None:
    """Invariants every alignment of one text must satisfy, checked token by token."""
    num_source, num_target = len(source), len(target)
    assert alignment.num_source_tokens == num_source and alignment.num_target_tokens == num_target
    assert torch.equal(alignment.target_special, target.special)
    for tokens in (source, target):
        if len(tokens):
            assert int(tokens.offsets.max()) <= len(text)
    index, kind = as_lists(alignment)
    assert sum(alignment.counts.values()) == num_target
    if num_target:
        assert sum(alignment.fractions.values()) == pytest.approx(1.0)
    s_offsets, s_special, t_offsets = source.offsets.tolist(), source.special.tolist(), target.offsets.tolist()
    leading_specials = set()
    for j, special in enumerate(s_special):
        if not special:
            break
        leading_specials.add(j)
    for i in range(num_target):
        j = index[i]
        assert -1 <= j < num_source
        assert (j == -1) == (kind[i] == UNMAPPED)
        start, end = t_offsets[i]
        c = end - 1 if end > start else None
        position = c if c is not None else start
        containing = [k for k, (s, e) in enumerate(s_offsets) if not s_special[k] and c is not None and s <= c < e]
        preceding = [k for k, (s, e) in enumerate(s_offsets) if not s_special[k] and e <= position]
        if kind[i] == EXACT:
            assert c is not None and not s_special[j]
            assert s_offsets[j][0] <= c < s_offsets[j][1], (i, j)
        elif kind[i] == FALLBACK:
            assert not containing  # EXACT whenever some source token contains the last character
            if j in leading_specials:
                assert not preceding
            else:
                assert not s_special[j] and s_offsets[j][1] <= position  # no look-ahead
                assert s_offsets[j][1] == max(s_offsets[k][1] for k in preceding)  # the nearest one
        elif kind[i] == SPECIAL:
            assert target.special[i] and source.special[j] and target.roles[i] == source.roles[j]
        elif not target.special[i]:
            assert not containing and not preceding and not leading_specials
    mapped_text = [index[i] for i in range(num_target) if not target.special[i] and index[i] >= 0]
    assert mapped_text == sorted(mapped_text), "source indices must not decrease along the target's text tokens"
    assert as_lists(alignment) == reference_alignment(source, target)


@pytest.fixture(scope="module")
def byte_bpe():
    return build_tiny_tokenizer("byte_bpe")


@pytest.fixture(scope="module")
def sentencepiece():
    return build_tiny_tokenizer("sentencepiece")


# --- the rules, on hand-built offsets -------------------------------------------------------------------------


def test_target_tokens_take_the_source_token_covering_their_last_character():
    source = tokenized([(0, 5), (5, 11)])  # "Hello", " world"
    target = tokenized([(0, 2), (2, 5), (5, 8), (8, 11)])  # "He", "llo", " wo", "rld"
    assert as_lists(align_tokens(source, target)) == ([0, 0, 1, 1], [EXACT] * 4)


def test_byte_pieces_of_one_character_are_matched_from_the_right():
    one = tokenized([(0, 1)])
    three = tokenized([(0, 1), (0, 1), (0, 1)])
    two = tokenized([(0, 1), (0, 1)])
    assert as_lists(align_tokens(three, one)) == ([2], [EXACT])  # the last piece has read the whole character
    assert as_lists(align_tokens(one, three)) == ([0, 0, 0], [EXACT] * 3)
    assert as_lists(align_tokens(three, two)) == ([1, 2], [EXACT] * 2)
    assert as_lists(align_tokens(two, three)) == ([0, 0, 1], [EXACT] * 3)
    assert as_lists(align_tokens(three, three)) == ([0, 1, 2], [EXACT] * 3)
    # A byte-level token spanning the space and the first byte of "ü", then one with the second byte.
    source = tokenized([(0, 1), (1, 3), (2, 3)])  # "a", " \xc3", "\xbc"
    target = tokenized([(0, 1), (1, 2), (2, 3), (2, 3)])  # "a", "▁", "<0xC3>", "<0xBC>"
    assert as_lists(align_tokens(source, target)) == ([0, 1, 1, 2], [EXACT] * 4)
    assert as_lists(align_tokens(target, source)) == ([0, 2, 3], [EXACT] * 3)
    assert as_lists(align_tokens(source, source)) == ([0, 1, 2], [EXACT] * 3)


def test_uncovered_characters_fall_back_to_the_preceding_source_token():
    source = tokenized([(0, 5), (6, 11)])  # offsets that leave the space at 5 out, as trim_offsets does
    target = tokenized([(0, 5), (5, 6), (6, 11)])
    assert as_lists(align_tokens(source, target)) == ([0, 0, 1], [EXACT, FALLBACK, EXACT])


def test_fallback_never_looks_ahead():
    with_bos = tokenized([(0, 0), (2, 5)], roles=["bos", None])  # characters 0-1 dropped by a normalizer
    without_bos = tokenized([(2, 5)])
    target = tokenized([(0, 2), (2, 5)])
    assert as_lists(align_tokens(with_bos, target)) == ([0, 1], [FALLBACK, EXACT])
    assert as_lists(align_tokens(without_bos, target)) == ([-1, 0], [UNMAPPED, EXACT])


def test_empty_span_text_tokens_fall_back_from_their_start():
    source = tokenized([(0, 3), (3, 6)])
    target = tokenized([(0, 3), (3, 3), (3, 6), (6, 6)])
    assert as_lists(align_tokens(source, target)) == ([0, 0, 1, 1], [EXACT, FALLBACK, EXACT, FALLBACK])
    assert as_lists(align_tokens(source, tokenized([(0, 0)]))) == ([-1], [UNMAPPED])


def test_special_tokens_match_by_role():
    source = tokenized([(0, 0), (0, 0), (0, 4), (0, 0), (0, 0)], roles=["bos", "bos", None, "eos", "eos"])
    target = tokenized([(0, 0), (0, 4), (0, 0), (0, 0)], roles=["bos", None, "eos", "pad"])
    assert as_lists(align_tokens(source, target)) == ([0, 2, 4, -1], [SPECIAL, EXACT, SPECIAL, UNMAPPED])


def test_a_special_token_with_a_span_and_no_role_match_uses_its_characters():
    source = tokenized([(0, 3), (3, 8)])
    target = tokenized([(0, 3), (3, 8)], roles=[None, "other_special"])
    assert as_lists(align_tokens(source, target)) == ([0, 1], [EXACT, EXACT])


def test_source_specials_are_never_character_matches():
    source = tokenized([(0, 0), (0, 4), (0, 0)], roles=["bos", None, "eos"])
    target = tokenized([(0, 2), (2, 4)])
    assert as_lists(align_tokens(source, target)) == ([1, 1], [EXACT, EXACT])


def test_tokenized_text_checks_its_fields():
    with pytest.raises(ValueError, match="offsets must be an int64 tensor of shape"):
        TokenizedText(torch.zeros(2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64),
                      torch.zeros(2, dtype=torch.bool), (None, None))  # fmt: skip
    with pytest.raises(ValueError, match="start <= end"):
        tokenized([(3, 2)])
    with pytest.raises(ValueError, match="roles must be set exactly for the special tokens"):
        TokenizedText(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64),
                      torch.ones(1, dtype=torch.bool), (None,))  # fmt: skip


def test_coverage_statistics():
    source = tokenized([(0, 0), (0, 5)], roles=["bos", None])
    target = tokenized([(0, 0), (0, 2), (2, 5), (5, 6)], roles=["bos", None, None, None])
    alignment = align_tokens(source, target)
    assert alignment.counts == {"EXACT": 2, "FALLBACK": 1, "SPECIAL": 1, "UNMAPPED": 0}
    assert alignment.fractions == {"EXACT": 0.5, "FALLBACK": 0.25, "SPECIAL": 0.25, "UNMAPPED": 0.0}
    assert alignment.exact_coverage == pytest.approx(2 / 3)
    assert str(alignment) == alignment.summary()
    assert "4 target tokens -> 2 source tokens" in str(alignment) and "EXACT 2 (50.0%)" in str(alignment)


# --- tokenize() and the tiny tokenizers ------------------------------------------------------------------------


def test_tokenize_refuses_non_strings_and_slow_tokenizers(byte_bpe):
    with pytest.raises(TypeError, match="bytes"):
        tokenize(byte_bpe, b"hello")
    slow = ByT5Tokenizer()
    assert not slow.is_fast
    with pytest.raises(ValueError, match="ByT5Tokenizer.*fast"):
        tokenize(slow, "hello")
    with pytest.raises(ValueError, match="ByT5Tokenizer"):
        align_text("hello", byte_bpe, slow)


def test_tokenize_marks_inserted_specials_with_roles(sentencepiece, byte_bpe):
    tokens = tokenize(sentencepiece, "a b")
    assert tokens.special.tolist()[0] and not any(tokens.special.tolist()[1:])
    assert tokens.roles[0] == "bos" and tokens.offsets[0].tolist() == [0, 0]
    assert not tokenize(sentencepiece, "a b", add_special_tokens=False).special.any()
    # Special-token text written in the text covers characters: it is aligned as text.
    literal = tokenize(byte_bpe, "a<|endoftext|>b")
    assert literal.ids.tolist()[1] == byte_bpe.eos_token_id and literal.offsets[1].tolist() == [1, 14]
    assert not literal.special.any() and literal.roles == (None, None, None)


def test_identical_tokenizers_align_to_the_identity(byte_bpe, sentencepiece):
    text = "Hello  world,\tünïcode e\u0301 日本語 😀👩\u200d💻 — fin\n"
    for tokenizer in (byte_bpe, sentencepiece):
        _, target, alignment = align_text(text, tokenizer, tokenizer)
        assert alignment.source_index.tolist() == list(range(len(target)))
        expected = [SPECIAL if special else EXACT for special in target.special.tolist()]
        assert alignment.kind.tolist() == expected
        assert alignment.exact_coverage == 1.0


def test_known_string_between_the_tiny_tokenizers(byte_bpe, sentencepiece):
    text = "Hello world, ü 😀!"
    source, target, alignment = align_text(text, byte_bpe, sentencepiece)
    source_tokens = byte_bpe.convert_ids_to_tokens(source.ids.tolist())
    target_tokens = sentencepiece.convert_ids_to_tokens(target.ids.tolist())
    assert source_tokens == ["H", "e", "l", "lo", "Ġwor", "l", "d", ",", "Ġ", "Ã", "¼", "Ġ", "ð", "Ł", "ĺ", "Ģ", "!"]
    assert target_tokens[:9] == ["<s>", "▁", "H", "e", "l", "l", "o", "▁w", "or"]
    assert target_tokens[-7:] == ["<0xBC>", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"]
    index = alignment.source_index.tolist()
    assert index[0] == -1 and alignment.kind[0] == UNMAPPED  # the target's BOS: the source adds none
    assert index[1:9] == [0, 0, 1, 2, 3, 3, 4, 4]  # "▁"+"H" -> "H"; "l","o" -> "lo"; "▁w","or" -> "Ġwor"
    assert index[-7:] == [10, 11, 12, 13, 14, 15, 16]  # byte pieces of 😀 matched piece by piece
    assert alignment.exact_coverage == 1.0
    check_alignment(text, source, target, alignment)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_empty_text(byte_bpe, sentencepiece, add_special_tokens):
    for source_tokenizer, target_tokenizer in [(byte_bpe, sentencepiece), (sentencepiece, byte_bpe),
                                               (sentencepiece, sentencepiece)]:  # fmt: skip
        source, target, alignment = align_text("", source_tokenizer, target_tokenizer, add_special_tokens)
        check_alignment("", source, target, alignment)
        assert alignment.exact_coverage == 1.0 and "target tokens" in alignment.summary()
    source, target, alignment = align_text("", byte_bpe, sentencepiece, add_special_tokens)
    assert as_lists(alignment) == (([-1], [UNMAPPED]) if add_special_tokens else ([], []))
    source, target, alignment = align_text("", sentencepiece, sentencepiece, add_special_tokens)
    assert as_lists(alignment) == (([0], [SPECIAL]) if add_special_tokens else ([], []))


def test_emoji_cjk_and_combining_marks_align_exactly(byte_bpe, sentencepiece):
    text = "日本語のテキスト 😀👍🏽 👩\u200d💻 e\u0301\u0302 한국어 ∑x²"
    for source_tokenizer, target_tokenizer in [(byte_bpe, sentencepiece), (sentencepiece, byte_bpe)]:
        source, target, alignment = align_text(text, source_tokenizer, target_tokenizer)
        check_alignment(text, source, target, alignment)
        assert alignment.exact_coverage == 1.0


def test_a_normalizer_that_drops_characters_gives_fallbacks(byte_bpe, sentencepiece):
    # The source strips accents (NFD, then drops combining marks): "\u0301" is in no source token's span.
    backend = Tokenizer.from_str(byte_bpe.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    stripping = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    text = "cafe\u0301 ﬁne"
    source, target, alignment = align_text(text, stripping, sentencepiece)
    check_alignment(text, source, target, alignment)
    accent = [i for i, (s, e) in enumerate(target.offsets.tolist()) if (s, e) == (4, 5)]
    assert accent and all(alignment.kind[i] == FALLBACK for i in accent)
    assert all(source.offsets[alignment.source_index[i], 1] == 4 for i in accent)  # "cafe" ends at 4
    # NFKC turns the one character "ﬁ" into "fi": both normalized characters keep the original span.
    backend = Tokenizer.from_str(byte_bpe.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFKC()
    nfkc = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    source, target, alignment = align_text(text, sentencepiece, nfkc)
    check_alignment(text, source, target, alignment)
    assert alignment.exact_coverage == 1.0


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_tiny_pair_alignment_properties(byte_bpe, sentencepiece, text):
    for source_tokenizer, target_tokenizer in [(byte_bpe, sentencepiece), (sentencepiece, byte_bpe)]:
        source, target, alignment = align_text(text, source_tokenizer, target_tokenizer)
        check_alignment(text, source, target, alignment)


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_identity_on_random_text(sentencepiece, text):
    source, target, alignment = align_text(text, sentencepiece, sentencepiece)
    check_alignment(text, source, target, alignment)
    assert alignment.source_index.tolist() == list(range(len(target)))


# --- the real small pair: Gemma-3-270M and SmolLM2-135M ------------------------------------------------------


def pydoc_documents(count: int) -> list[str]:
    with PYDOC_SUMMARIES.open(encoding="utf-8") as lines:
        return [json.loads(line)["document"] for _, line in zip(range(count), lines, strict=False)]


@pytest.mark.slow
def test_real_pair_covers_pydoc_documents_exactly(gemma_tokenizer, smollm2_tokenizer):
    documents = pydoc_documents(20)
    for source_tokenizer, target_tokenizer in [(gemma_tokenizer, smollm2_tokenizer),
                                               (smollm2_tokenizer, gemma_tokenizer)]:  # fmt: skip
        exact = text_tokens = 0
        for document in documents:
            _, target, alignment = align_text(document, source_tokenizer, target_tokenizer)
            assert not [i for i, j in enumerate(alignment.source_index.tolist()) if j < 0 and not target.special[i]]
            exact += alignment.counts["EXACT"]
            text_tokens += int((~target.special).sum())
        assert exact / text_tokens >= 0.95


@pytest.mark.slow
def test_real_pair_special_tokens(gemma_tokenizer, smollm2_tokenizer):
    source, target, alignment = align_text("Hello world", gemma_tokenizer, smollm2_tokenizer)
    assert source.roles[0] == "bos" and not target.special.any()  # SmolLM2 adds no BOS
    source, target, alignment = align_text("Hello world", smollm2_tokenizer, gemma_tokenizer)
    assert target.roles[0] == "bos" and as_lists(alignment)[1][0] == UNMAPPED
    source, target, alignment = align_text("Hello world", gemma_tokenizer, gemma_tokenizer)
    assert as_lists(alignment) == (list(range(len(target))), [SPECIAL] + [EXACT] * (len(target) - 1))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_real_pair_alignment_properties(gemma_tokenizer, smollm2_tokenizer, text):
    for source_tokenizer, target_tokenizer in [(gemma_tokenizer, smollm2_tokenizer),
                                               (smollm2_tokenizer, gemma_tokenizer)]:  # fmt: skip
        source, target, alignment = align_text(text, source_tokenizer, target_tokenizer)
        check_alignment(text, source, target, alignment)
