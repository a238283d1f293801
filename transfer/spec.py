"""ModelSpec: what kvbridge needs to know about a causal LM's KV cache, read from its config and modules.

Nothing here is a per-model table: layer count, KV heads, head_dim, per-layer attention type and window, and
per-layer RoPE all come from the HF config (through transformers' own helpers where they exist) and from the
model's rotary module, so a new model class works as soon as transformers supports it.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

# Config fields that change with how a checkpoint was saved or loaded, not with what the model computes.
# `quantization_config` is not one of them: a 4-bit load of a checkpoint computes other KV than its bf16 load, and
# replicas sharing a Redis tier must not serve one's cache for the other.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
     "_attn_implementation_autoset", "_commit_hash", "use_cache", "output_attentions", "output_hidden_states",
     "return_dict", "architectures", "_experts_implementation"}
)


def config_hash(config: PretrainedConfig) -> str:
    """sha256 over the config fields that determine the computation (stable across processes and saves)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Which model a KV cache belongs to. Caches of two models with different identities never mix."""

    name: str  # human-readable model name (preset name, repo id or folder)
    config_hash: str  # config_hash() of the model's config

    def __post_init__(self):
        if not self.name:
            raise ValueError("ModelIdentity.name must be non-empty")
        if len(self.config_hash) != 64:
            raise ValueError(f"ModelIdentity.config_hash must be a sha256 hex digest, got {self.config_hash!r}")

    @property
    def key(self) -> str:
        return f"{self.name}@{self.config_hash[:16]}"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE table family. Layers with equal RopeSpecs share cos/sin."""

    rope_type: str  # transformers' name: "default", "linear", "dynamic", "yarn", "longrope", "llama3", ...
    base: float  # rope_theta
    rotary_dim: int  # dims that rotate: head_dim * partial_rotary_factor (read off the module's cos table)
    attention_scaling: float  # multiplier the module applies to cos and sin (yarn/longrope mscale; else 1.0)
    original_max_positions: int  # where dynamic/longrope switch tables; max_position_embeddings otherwise
    module_key: str | None  # layer-type argument of the rotary module (Gemma3: "sliding_attention"), or None
    parameters: tuple[tuple[str, str], ...]  # the rest of rope_parameters (factors ...), for the record

    @property
    def position_dependent(self) -> bool:
        """True when the tables depend on the longest position of the call (dynamic NTK, longrope)."""
        return self.rope_type in ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    index: int
    attention_type: str  # "full_attention", "sliding_attention" or "chunked_attention"
    sliding_window: int | None  # tokens a query may see on sliding layers (transformers' convention), else None
    rope: RopeSpec | None  # None: this layer applies no RoPE (e.g. SmolLM3's no_rope_layers)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The KV layout and position scheme of one model. Every layer has the same KV heads and head_dim."""

    identity: ModelIdentity
    model_type: str  # config.model_type
    architecture: str  # the model class name
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    vocab_size: int
    dtype: str  # parameter dtype, e.g. "float32"
    layers: tuple[LayerSpec, ...]

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> list[str]:
        """Human-readable lines: the model, then one line per run of layers with the same attention and RoPE."""
        lines = [
            f"{self.name} [{self.architecture}, {self.model_type}] config {self.identity.config_hash[:16]}: "
            f"{self.num_layers} layers, {self.num_attention_heads} q / {self.num_kv_heads} kv heads x "
            f"{self.head_dim}, {self.dtype}, {self.kv_bytes_per_token} KV bytes/token"
        ]
        runs: list[tuple[int, int, LayerSpec]] = []
        for layer in self.layers:
            if runs and (runs[-1][2].attention_type, runs[-1][2].sliding_window, runs[-1][2].rope) == (
                layer.attention_type, layer.sliding_window, layer.rope
            ):
                runs[-1] = (runs[-1][0], layer.index, runs[-1][2])
            else:
                runs.append((layer.index, layer.index, layer))
        for first, last, layer in runs:
            window = f" window {layer.sliding_window}" if layer.sliding_window else ""
            if layer.rope is None:
                rope = "no RoPE"
            else:
                r = layer.rope
                rope = (f"RoPE {r.rope_type} base {r.base:g} rotary_dim {r.rotary_dim}"
                        + (f" scale {r.attention_scaling:g}" if r.attention_scaling != 1.0 else ""))
            span = f"{first}" if first == last else f"{first}-{last}"
            lines.append(f"  layers {span}: {layer.attention_type}{window}, {rope}")
        return lines


def find_rotary_module(model: nn.Module, name: str) -> nn.Module:
    """The model's rotary embedding module (one per model in transformers 5.x)."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        raise ValueError(
            f"model {name!r} (model_type={model_type!r}) has no rotary embedding module: kvbridge needs a RoPE "
            "causal LM (absolute or ALiBi position schemes cannot be re-positioned)"
        )
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ValueError(
            f"model {name!r} has several rotary embedding modules ({names}); kvbridge supports one model-level "
            "rotary module (with per-layer-type tables) only"
        )
    return found[0][1]


def _rope_parameters(config: PretrainedConfig, layer_type: str, per_type: bool) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        return {}
    if per_type:
        params = params.get(layer_type) or {}
    return dict(params)


def _read_rope(config: PretrainedConfig, name: str, layer: int, layer_type: str,
               rotary: nn.Module, takes_layer_type: bool) -> RopeSpec:
    per_type = takes_layer_type
    params = _rope_parameters(config, layer_type, per_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise ValueError(f"model {name!r} layer {layer}: no rope_theta in the config's rope_parameters")
    key = layer_type if takes_layer_type else None
    # The cos table itself tells how many dims rotate and the attention scale it carries.
    dummy = torch.empty(0, dtype=torch.float32, device=next(iter(rotary.buffers()), torch.empty(0)).device)
    probe = copy.deepcopy(rotary).float()
    with torch.no_grad():
        pos = torch.zeros(1, 1, dtype=torch.long, device=dummy.device)
        cos, _ = probe(dummy, pos, key) if takes_layer_type else probe(dummy, pos)
    rotary_dim = int(cos.shape[-1])
    scaling = float(cos[0, 0, 0])  # cos(0) * attention_scaling
    if rotary_dim % 2:
        raise ValueError(f"model {name!r} layer {layer}: odd rotary dimension {rotary_dim}")
    default_max = getattr(config, "max_position_embeddings", 0) or 0
    original_max = int(params.get("original_max_position_embeddings", default_max))
    rest = tuple(sorted((k, json.dumps(v, default=str)) for k, v in params.items()
                        if k not in ("rope_type", "type", "rope_theta")))
    return RopeSpec(rope_type=str(rope_type), base=float(base), rotary_dim=rotary_dim,
                    attention_scaling=round(scaling, 7), original_max_positions=original_max,
                    module_key=key, parameters=rest)


def read_spec(model: nn.Module, name: str | None = None) -> ModelSpec:
    """Read the ModelSpec of a loaded transformers causal LM. Raises ValueError naming what is unsupported."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no HF config: kvbridge reads models through transformers")
    text_config = config.get_text_config(decoder=True)
    name = name or getattr(config, "_name_or_path", "") or type(model).__name__
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    num_layers = text_config.num_hidden_layers
    supported = ("full_attention", "sliding_attention", "chunked_attention")
    for i, lt in enumerate(layer_types):
        if lt not in supported:
            raise ValueError(f"model {name!r} layer {i}: attention type {lt!r} is not supported (only {supported})")
    num_heads = text_config.num_attention_heads
    num_kv = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads

    rotary = find_rotary_module(model, name)
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    no_rope = getattr(text_config, "no_rope_layers", None)  # SmolLM3 convention: 1 = RoPE, 0 = none
    rope_by_type: dict[str, RopeSpec] = {}
    layers = []
    for i in range(num_layers):
        lt = layer_types[i]
        if no_rope is not None and not no_rope[i]:
            rope = None
        else:
            if lt not in rope_by_type:
                rope_by_type[lt] = _read_rope(text_config, name, i, lt, rotary, takes_layer_type)
            rope = rope_by_type[lt]
        window = layer_kwargs[i].get("sliding_window") if lt != "full_attention" else None
        layers.append(LayerSpec(index=i, attention_type=lt, sliding_window=window, rope=rope))

    param = next(model.parameters())
    return ModelSpec(
        identity=ModelIdentity(name=name, config_hash=config_hash(text_config)),
        model_type=text_config.model_type,
        architecture=type(model).__name__,
        num_layers=num_layers,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        num_attention_heads=num_heads,
        vocab_size=text_config.vocab_size,
        dtype=str(param.dtype).removeprefix("torch."),
        layers=tuple(layers),
    )
