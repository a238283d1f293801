"""The whole system's cost of a projected context beside the target's own: the source's prefill, the projection, and
the bytes moved, amortised over the N requests that reuse one projected context; and the FLOP ceiling of a pair
(the target's own prefill over the projection, per token), computed from the two configs instead of quoted.

Counts are FLOPs (multiply-adds × 2) from `eval.flops.FlopModel` for the models and from the adapter's shapes for the
projection: per target layer j and token, the convex mix of k source layers (k·d_s, K and V apart) and the two maps
d_s -> d_t; un-rotation and rotation are elementwise and left out (as norms are in FlopModel).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.eval.flops import FlopModel


@dataclass(frozen=True)
class PairCost:
    source: FlopModel
    target: FlopModel
    target_layers: int  # L_t of the adapter
    d_s: int  # width of the maps' source input (a source layer's kv heads × head_dim, or the source basis's rank)
    d_t: int  # target KV width per layer
    mix: int  # source layers mixed per target layer (k)
    extra_per_token: int = 0  # FLOPs per token of anything the adapter adds beyond the linear maps

    @classmethod
    def of(cls, source_config, target_config, adapter) -> "PairCost":
        meta = adapter.meta
        d_s = int(adapter.wk.shape[1])  # the maps' source input: a source layer, or a source basis's rank
        d_t = meta.target["num_kv_heads"] * meta.target["head_dim"]
        extra = int(adapter.extra_flops_per_token()) if hasattr(adapter, "extra_flops_per_token") else 0
        return cls(FlopModel.from_config(source_config), FlopModel.from_config(target_config),
                   meta.target["num_layers"], d_s, d_t, int(adapter.layer_map.shape[1]), extra)

    def projection(self, tokens: int) -> int:
        """FLOPs of projecting `tokens` target tokens (K and V: mix, then map)."""
        per_layer = 2 * 2 * (self.mix * self.d_s + self.d_s * self.d_t)
        return tokens * (self.target_layers * per_layer + self.extra_per_token)

    def ceiling(self, tokens: int) -> float:
        """How many times cheaper projecting a context is than the target prefilling it: the bound on TTFT savings."""
        return self.target.prefill(tokens) / max(self.projection(tokens), 1)

    def system(self, target_flops: int, source_tokens: int, target_tokens: int, uses: int) -> float:
        """FLOPs per request of a mode that projects a context read once and reused `uses` times: the target's own
        work in that request plus its share of the source prefill and the projection."""
        if uses < 1:
            raise ValueError(f"uses must be >= 1, got {uses}")
        once = self.source.prefill(source_tokens) + self.projection(target_tokens)
        return target_flops + once / uses
