"""The `production-shaped` preset: random-init Qwen2ForCausalLM -> Phi3ForCausalLM with the production pair's
attention shapes and RoPE (read from transfer/data/production_shapes.json: Qwen2-7B-Instruct 28 q / 4 kv heads × 128,
rope base 1e6; Phi-3-mini-4k-instruct 32 / 32 heads × 96, rope base 1e4, no rope scaling, a sliding window on every
layer), so every code path of the real pair runs on a CPU in seconds. What shrinks: the layers (2 and 3, so layer
maps are one-to-many as 28 -> 32 are), the MLP width, the vocabulary (the tiny tokenizers), and Phi-3's window
(2047 -> SHAPED_WINDOW, so tests can run contexts longer than it). Attention shapes and RoPE never shrink.
"""

from __future__ import annotations

import json
from functools import cache

import torch
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel, random_model
from kvbridge.transfer.tiny_pair import build_tiny_tokenizer
from transformers import Phi3Config, Qwen2Config

SHAPED_LAYERS = (2, 3)  # source, target
SHAPED_MLP = 512  # intermediate size of both (18944 and 8192 in production)
SHAPED_WINDOW = 256  # Phi-3-mini-4k's sliding window is 2047
SHAPED_SEED = 7


@cache
def production_shapes() -> dict:
    """The production configs' shapes as shipped data: {"source": {"name", "from", "config"}, "target": ...}."""
    return json.loads(data_path("production_shapes.json").read_text())


def shaped_source_config(vocab_size: int) -> Qwen2Config:
    c = production_shapes()["source"]["config"]
    return Qwen2Config(vocab_size=vocab_size, hidden_size=c["hidden_size"], intermediate_size=SHAPED_MLP,
                       num_hidden_layers=SHAPED_LAYERS[0], num_attention_heads=c["num_attention_heads"],
                       num_key_value_heads=c["num_key_value_heads"],
                       max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
                       rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                       use_sliding_window=c["use_sliding_window"], tie_word_embeddings=c["tie_word_embeddings"])


def shaped_target_config(vocab_size: int, bos: int, eos: int, pad: int) -> Phi3Config:
    c = production_shapes()["target"]["config"]
    if c["rope_scaling"] is not None:
        raise ValueError("production_shapes.json gives Phi-3 a rope_scaling; the shaped preset builds none")
    return Phi3Config(vocab_size=vocab_size, hidden_size=c["hidden_size"], intermediate_size=SHAPED_MLP,
                      num_hidden_layers=SHAPED_LAYERS[1], num_attention_heads=c["num_attention_heads"],
                      num_key_value_heads=c["num_key_value_heads"],
                      max_position_embeddings=c["max_position_embeddings"],
                      original_max_position_embeddings=c["original_max_position_embeddings"],
                      rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                      sliding_window=SHAPED_WINDOW, rms_norm_eps=c["rms_norm_eps"],
                      tie_word_embeddings=c["tie_word_embeddings"], bos_token_id=bos, eos_token_id=eos,
                      pad_token_id=pad)


def shaped_source(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> LoadedModel:
    tok = build_tiny_tokenizer("byte_bpe")
    return random_model(shaped_source_config(len(tok)), "shaped-qwen2-7b", seed=SHAPED_SEED, tokenizer=tok,
                        dtype=dtype, device=device)


def shaped_target(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> LoadedModel:
    tok = build_tiny_tokenizer("sentencepiece")
    cfg = shaped_target_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id or tok.eos_token_id)
    return random_model(cfg, "shaped-phi-3-mini", seed=SHAPED_SEED + 1, tokenizer=tok, dtype=dtype, device=device)


def kv_bytes_per_token(config: dict, itemsize: int = 2) -> int:
    """KV bytes per token of a model from its config fields (bf16 by default)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * itemsize


def parameter_count(config: dict) -> int:
    """Parameters of a decoder-only transformer from its config fields: embeddings, attention (q, k, v, o), a gated
    MLP, norms, the LM head when untied. Biases are left out (Qwen2's q/k/v biases are 0.01% of it)."""
    hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * config["intermediate_size"]
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


STORE_BLOCK_TOKENS = 16  # StoreConfig.block_size's default: the store holds whole blocks of this many tokens
STORE_SLAB_BYTES = 256 << 20  # StoreConfig.slab_bytes's default: a layout's last slab may be partly empty


def capacity_lines(gpu_gb: float, store_fraction: float = 0.5) -> list[str]:
    """What one GPU of `gpu_gb` GB holds for the production pair in bf16: the weights of both models, then the
    store's share (`store_fraction` of the rest, one byte budget for every layout) in tokens of source KV alone, and
    of source KV with its projection kept (as many target tokens), in whole 16-token blocks with a partly empty slab
    per layout left out; then what a fixed quarter per layout (the store before issue 35) held of the same."""
    shapes = production_shapes()
    s, t = shapes["source"]["config"], shapes["target"]["config"]
    weights = 2 * (parameter_count(s) + parameter_count(t))
    free = gpu_gb * 1e9 - weights
    if free <= 0:
        return [f"{gpu_gb:g} GB GPU: the two models' bf16 weights ({weights / 1e9:.1f} GB) do not fit"]
    store = free * store_fraction
    bs, bt = kv_bytes_per_token(s), kv_bytes_per_token(t)
    block = STORE_BLOCK_TOKENS
    source_only = (store - STORE_SLAB_BYTES) // (bs * block) * block
    with_projections = (store - 2 * STORE_SLAB_BYTES) // ((bs + bt) * block) * block
    return [f"{gpu_gb:g} GB GPU: weights {weights / 1e9:.1f} GB (bf16, both models); the store's "
            f"{store_fraction:.0%} of the remaining {free / 1e9:.1f} GB = {store / 1e9:.1f} GB, one budget for both "
            f"layouts, holds {source_only / 1e6:.2f} M source tokens, or {with_projections / 1e6:.3f} M tokens with "
            f"their projection kept ({bs + bt:,} B/token)",
            f"{gpu_gb:g} GB GPU, before (a fixed quarter of the store per layout): {store / 4 / bs / 1e6:.2f} M source "
            f"tokens, {store / 4 / bt / 1e6:.3f} M with their projection kept (the projections' quarter is the limit)"]
