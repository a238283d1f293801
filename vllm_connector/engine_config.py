"""What the connector reads of a vLLM engine's configuration (`EngineConfig.read`), checked once at its construction:
the model's KV shape and dtype, its KV cache group's block size and kind, and why the connector cannot load into or
save from that cache ("" when it can). Tensor or pipeline parallelism is refused there, a ValueError: one worker
loads and saves every KV head of every layer (with tensor parallelism each worker holds a share of the heads, with
pipeline parallelism a share of the layers), so an engine that splits them would refuse every request.

KV cache groups: the connector loads into an engine with one group, full attention or sliding window. vLLM 0.32
gives a model whose every layer has the same window (Phi-3: 2047) one `SlidingWindowSpec` group, its block size the
group's own (`Attention.get_kv_cache_spec`; --block-size here); a model that mixes windowed and global layers gets
one `FullAttentionSpec` group, since vLLM turns its hybrid manager off for a connector without `SupportsHMA`
(`VllmConfig`, `unify_hybrid_kv_cache_specs`). For N tokens loaded into a window W, `SlidingWindowManager` puts the
shared null block (id 0) at the first (N - W + 1) // block_size places of the request's block table
(`add_local_computed_blocks`) and real blocks after them (`allocate_external_computed_blocks`); the forward never
reads the null ones (the CPU kernel skips blocks out of the window). `loading.write` writes the positions that have a
real block and never block 0, and the connector still reports all N tokens loaded: vLLM would have dropped the others
itself. More than one group (the hybrid manager on), another kind of group (MLA, Mamba), a KV cache in another dtype
than the model's (--kv-cache-dtype fp8: quantized bytes): nothing loaded nor saved, one warning at the connector's
start (`refusal`) and one per request naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.vllm.params import cache_dtype_refusal
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class EngineConfig:
    shape: tuple[int, int, int]  # the model's (layers, KV heads, head dim)
    # the block size of the engine's one KV cache group (one block table for every layer: what the loads' block ids
    # are); the group's own (vLLM may pick a sliding-window group's apart from --block-size)
    block_size: int
    # KV crosses the wire in the model's dtype (bf16: half of float32's bytes); the cast is the server's
    wire_dtype: str
    refusal: str  # why the connector can neither load into nor save from this KV cache ("": it can)
    # loads written before their step's forward. A failed load in a sliding-window group must be recomputed from the
    # request's first token (the blocks before a failed one are null blocks): only an asynchronous load can say so
    sync_loads: bool
    prefix_caching: bool
    # a step is scheduled while the previous one runs: an empty one is not an idle engine
    async_scheduling: bool

    @classmethod
    def read(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> EngineConfig:
        """ValueError (naming tensor_parallel_size / pipeline_parallel_size) for an engine that splits the KV."""
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size is {parallel.tensor_parallel_size} and pipeline_parallel_size "
                             f"{parallel.pipeline_parallel_size}: the kvbridge connector needs 1 and 1 (one worker "
                             "loads and saves every KV head of every layer)")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        specs = [group.kv_cache_spec for group in groups]
        named = [type(spec).__name__ + (f" (sliding window {spec.sliding_window})"
                                        if getattr(spec, "sliding_window", None) else "") for spec in specs]
        refusal = ""
        if len(specs) > 1:
            refusal = (f"the engine has {len(specs)} KV cache groups ({', '.join(named)}: hybrid attention with "
                       "vLLM's hybrid KV cache manager on); the connector loads into one")
        elif specs and (isinstance(specs[0], MLAAttentionSpec)
                        or not isinstance(specs[0], (FullAttentionSpec, SlidingWindowSpec))):
            refusal = f"the engine's KV cache is {named[0]}; the connector loads into full or sliding-window attention"
        wire_dtype = str(model.dtype).removeprefix("torch.")
        # a quantized KV cache (--kv-cache-dtype fp8) would need vLLM's quantization: refused
        refusal = refusal or cache_dtype_refusal(vllm_config.cache_config.cache_dtype, wire_dtype)
        return cls(shape=(model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size()),
                   block_size=specs[0].block_size if len(specs) == 1 else vllm_config.cache_config.block_size,
                   wire_dtype=wire_dtype, refusal=refusal,
                   sync_loads=len(specs) == 1 and not isinstance(specs[0], SlidingWindowSpec),
                   prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                   async_scheduling=bool(vllm_config.scheduler_config.async_scheduling))
