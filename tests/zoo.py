"""Tiny seeded random configs of several RoPE causal LM classes (hidden 64, 2-4 layers), built in seconds."""

from __future__ import annotations

from functools import cache

from kvbridge.transfer.models import LoadedModel, random_model
from transformers import (
    CohereConfig,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.2)


def configs() -> dict:
    return {
        "qwen2": Qwen2Config(**COMMON, num_hidden_layers=2, max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "phi3-partial": Phi3Config(**{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                   max_position_embeddings=4096, partial_rotary_factor=0.5, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2),
        "llama3": LlamaConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=8192,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 1024}),
        "llama-linear": LlamaConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=8192,
                                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "llama-yarn": LlamaConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=8192,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 2048}),
        "llama-dynamic": LlamaConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=2048,
                                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                      "factor": 2.0}),
        "phi3-longrope": Phi3Config(**{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                    max_position_embeddings=8192, original_max_position_embeddings=256,
                                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                     "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                                     "original_max_position_embeddings": 256},
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gemma3": Gemma3TextConfig(**{**COMMON, "num_key_value_heads": 1}, num_hidden_layers=4, head_dim=32,
                                   sliding_window=16, max_position_embeddings=4096,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        # Phi-3-mini-4k's shape of attention: a sliding window on every layer (2047 there, 20 here)
        "phi3-sliding": Phi3Config(**{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, sliding_window=20,
                                   max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "mistral-sliding": MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=24,
                                         max_position_embeddings=4096),
        "qwen3": Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=16, max_position_embeddings=4096),
    }


def non_rope_configs() -> dict:
    return {"gpt2": GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=512),
            "cohere-interleaved": CohereConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=4096)}


@cache
def build(name: str, seed: int = 0) -> LoadedModel:
    return random_model(configs()[name], name, seed=seed, device="cpu")
