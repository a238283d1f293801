"""The `tiny` preset's pair: random-init Qwen2 -> Phi3 models in miniature (`tiny_source`, `tiny_target`) and their
deterministic tiny tokenizers, trained at call time on a shipped corpus.

Two kinds, each imitating the tokenization family of one production model so that the tiny Qwen2 -> Phi3 pair
exercises cross-tokenizer alignment the way Qwen2-7B -> Phi-3-mini does:

- ``"byte_bpe"`` (Qwen2): the Qwen2 split regex, then ByteLevel bytes -> BPE, ByteLevel decoder; 512 tokens
  (256 byte symbols, 255 merges, ``<|endoftext|>``); no BOS added; ``<|endoftext|>`` is eos and pad.
  Unlike Qwen2 there is no NFC normalizer, so decode(encode(text)) == text for every string.
- ``"sentencepiece"`` (Phi-3 / Llama, as transformers 5 builds them): Metaspace "▁" pre-tokenizer with
  prepend_scheme "first", BPE with byte fallback over ``<0x00>``..``<0xFF>``, decoder Replace("▁", " ") +
  ByteFallback + Fuse + Strip(one leading space); ``<s>`` added in front by a TemplateProcessing post-processor;
  ``<unk>``=0, ``<s>``=1, ``</s>``=2, bytes 3..258, then 125 trained characters and merges: 384 tokens.
  Like Llama, decoding drops one leading space and turns a literal "▁" into " "; every other string round-trips.

Training takes tens of milliseconds and is deterministic: the `tokenizers` BPE trainer numbers the alphabet in
character order and breaks ties between merges by pair id, so a server and a client that both call
`build_tiny_tokenizer` get byte-identical tokenizers. Tests compare the serialized form across processes with
different hash seeds and trainer thread counts.
"""

import functools
import json

import torch
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel, random_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Phi3Config, PreTrainedTokenizerFast, Qwen2Config

TINY_TOKENIZER_KINDS = ("byte_bpe", "sentencepiece")

BYTE_BPE_VOCAB_SIZE = 512
SENTENCEPIECE_VOCAB_SIZE = 384  # 3 specials + 256 byte tokens + 125 trained pieces
NUM_BYTE_TOKENS = 256

# Qwen2's pre-tokenization regex (contractions, letter runs, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
ENDOFTEXT = "<|endoftext|>"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
METASPACE = "▁"


def build_tiny_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A fresh `PreTrainedTokenizerFast` of the given kind ("byte_bpe" or "sentencepiece").

    Training runs once per process and kind (tens of milliseconds); every call returns a new object built
    from the cached serialization, so callers may mutate theirs (add tokens, change padding) without affecting
    anyone else's.
    """
    if kind not in TINY_TOKENIZER_KINDS:
        raise ValueError(f"unknown tiny tokenizer kind {kind!r}; expected one of {', '.join(TINY_TOKENIZER_KINDS)}")
    backend = Tokenizer.from_str(_trained_tokenizer_json(kind))
    if kind == "byte_bpe":
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token=ENDOFTEXT,
            pad_token=ENDOFTEXT,
            add_bos_token=False,
            clean_up_tokenization_spaces=False,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        add_bos_token=True,  # transformers writes the TemplateProcessing "<s> $A" post-processor from this
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )


def tiny_corpus_text() -> str:
    """The shipped training text: an excerpt of the Python 3.11 tutorial (PSF licence), about 26 KB."""
    return data_path("tiny_corpus.txt").read_text(encoding="utf-8")


@functools.cache
def _trained_tokenizer_json(kind: str) -> str:
    paragraphs = tiny_corpus_text().split("\n\n")
    if kind == "byte_bpe":
        tokenizer = _train_byte_bpe(paragraphs)
    else:
        tokenizer = _train_sentencepiece(paragraphs)
    return tokenizer.to_str()


def _train_byte_bpe(paragraphs: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_BPE_VOCAB_SIZE,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 byte symbols, seen in the corpus or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    assert tokenizer.get_vocab_size() == BYTE_BPE_VOCAB_SIZE, tokenizer.get_vocab_size()
    return tokenizer


def _train_sentencepiece(paragraphs: list[str]) -> Tokenizer:
    # Train pieces on "▁"-split words (as SentencePiece does, no piece crosses a space), then rebuild the model
    # with Llama's id layout: specials, the 256 byte-fallback tokens, then the trained pieces in trained order.
    specials = [UNK, BOS, EOS]
    byte_tokens = [f"<0x{b:02X}>" for b in range(NUM_BYTE_TOKENS)]
    num_pieces = SENTENCEPIECE_VOCAB_SIZE - NUM_BYTE_TOKENS
    draft = Tokenizer(models.BPE(unk_token=UNK))
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=num_pieces, special_tokens=specials, show_progress=False)
    draft.train_from_iterator(paragraphs, trainer=trainer)
    trained = json.loads(draft.to_str())["model"]
    pieces = sorted(trained["vocab"].items(), key=lambda item: item[1])
    assert [piece for piece, _ in pieces[: len(specials)]] == specials, pieces[:3]
    vocab = {token: i for i, token in enumerate(specials + byte_tokens)}
    for piece, _ in pieces[len(specials) :]:
        assert piece not in vocab, piece
        vocab[piece] = len(vocab)
    assert len(vocab) == SENTENCEPIECE_VOCAB_SIZE, len(vocab)
    merges = [tuple(merge) for merge in trained["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True))
    # split=False as in transformers' Llama tokenizer: no merge contains an inner "▁", so the pieces are the same.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(METASPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


TINY_SEED = 0


def tiny_source_config(vocab_size: int) -> Qwen2Config:
    # Qwen2 like Qwen2-7B in miniature: GQA (4 q / 2 kv heads), rope base 1e6, no tied embeddings.
    # initializer_range 0.2 (not 0.02): random logits spread enough that greedy decoding has no near-ties.
    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       initializer_range=0.2, tie_word_embeddings=False)


def tiny_target_config(vocab_size: int, bos: int, eos: int, pad: int) -> Phi3Config:
    # Phi3 like Phi-3-mini in miniature: MHA (kv heads = q heads), rope base 1e4, more and narrower layers than
    # the source (6 vs 4), so layer maps are one-to-many as in production (28 -> 32).
    return Phi3Config(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=4096,
                      original_max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                      initializer_range=0.2, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                      tie_word_embeddings=False)


def tiny_source(device: str | torch.device = "auto", dtype: str | torch.dtype = "float32") -> LoadedModel:
    tok = build_tiny_tokenizer("byte_bpe")
    return random_model(tiny_source_config(len(tok)), "tiny-qwen2", seed=TINY_SEED, tokenizer=tok, dtype=dtype,
                        device=device)


def tiny_target(device: str | torch.device = "auto", dtype: str | torch.dtype = "float32") -> LoadedModel:
    tok = build_tiny_tokenizer("sentencepiece")
    cfg = tiny_target_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id or tok.eos_token_id)
    return random_model(cfg, "tiny-phi3", seed=TINY_SEED + 1, tokenizer=tok, dtype=dtype, device=device)
