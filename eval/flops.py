"""Prefill FLOPs of a decoder-only transformer, counted from its config: what a target forward of `new` tokens
over `past` cached tokens costs (multiply-adds × 2). Matmuls of the attention projections and the MLP per token,
the attention itself (QKᵀ and AV, causal: query i sees past + i + 1 keys), and the LM head once (only the last
position's logits are needed to pick the next token). Sliding windows are not discounted (SmolLM2 and Phi-3 have
none); norms, RoPE and softmax are left out (a few percent at most)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopModel:
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "FlopModel":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=text.intermediate_size,
                   q_heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=text.vocab_size)

    @property
    def matmul_params_per_layer(self) -> int:
        qo = 2 * self.hidden * self.q_heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate  # gate, up and down (gated MLPs: Llama, Phi-3, Qwen2, Gemma)
        return qo + kv + mlp

    def prefill(self, new: int, past: int = 0, layers: int | None = None) -> int:
        """FLOPs of one forward of `new` tokens after `past` cached ones, ending in one position's logits; with
        `layers`, a forward stopped after that many layers (no logits: a selection pass)."""
        if new < 0 or past < 0:
            raise ValueError(f"token counts must be >= 0, got new={new}, past={past}")
        if layers is not None and not 0 < layers <= self.layers:
            raise ValueError(f"layers must be in [1, {self.layers}], got {layers}")
        if new == 0:
            return 0
        depth = self.layers if layers is None else layers
        linear = 2 * new * depth * self.matmul_params_per_layer
        keys_seen = new * past + new * (new + 1) // 2  # summed over the new queries
        attention = 4 * depth * self.q_heads * self.head_dim * keys_seen
        return linear + attention + (2 * self.hidden * self.vocab if layers is None else 0)
