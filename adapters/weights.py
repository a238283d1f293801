"""The adapter's weights and what they were fitted for: `Adapter`, `AdapterMeta` and the saved format's versions.

`Adapter` holds the tensors (shapes as adapter.py's docstring states them, checked when it is made), its maps
converted once to a compute dtype, a content digest, a move to a device and a check against the models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.spec import ModelSpec

FORMAT_VERSION = 1  # an adapter of the source maps only; version 2 adds token features (TOKENS_FORMAT_VERSION)
TOKENS_FORMAT_VERSION = 2
BASIS_FORMAT_VERSION = 3  # a source basis over all source layers (src_basis)
CONTEXT_FORMAT_VERSION = 4  # a context branch over the tokens before (ctx_*: context.py)
LINEAR_CONTEXT_FORMAT_VERSION = 5  # the same tensors, the branch without its norm (AdapterMeta.context_norm False)
READ_VERSIONS = (1, 2, 3, 4, 5)
CONTEXT = ("ctx_lags", "ctx_mu", "ctx_g", "ctx_a", "ctx_b")


def rope_record(spec: ModelSpec) -> list[dict | None]:
    """Per-layer RoPE of a spec as plain data (for the adapter's metadata and its compatibility check)."""
    out = []
    for layer in spec.layers:
        r = layer.rope
        out.append(None if r is None else {
            "type": r.rope_type, "base": r.base, "rotary_dim": r.rotary_dim, "scaling": r.attention_scaling,
            "parameters": [list(p) for p in r.parameters]})
    return out


@dataclass
class AdapterMeta:
    """What an adapter maps between and how it was made; saved as JSON beside the tensors."""

    source: dict  # {"name", "config_hash", "num_layers", "num_kv_heads", "head_dim", "rope": [...]}
    target: dict  # the same for the target
    layer_map: str  # strategy name ("proportional", "nearest", "last-aligned", "mix")
    start_token: int | None  # target token whose exact KV is start_kv (prepended to every projected context)
    format_version: int = FORMAT_VERSION
    lambdas: dict = field(default_factory=dict)  # {"k": [L_t], "v": [L_t]} ridge λ chosen per layer
    corpus: dict = field(default_factory=dict)  # {"sha256", "windows", "tokens", "files"}
    metrics: dict = field(default_factory=dict)  # held-out R², cosine, recovery, ...
    version: str = "1"  # bumped by whoever retrains under the same name
    training: dict = field(default_factory=dict)  # how it was made: commands, stages, wall time, machine


MODEL_FIELDS = {"name": str, "config_hash": str, "num_layers": int, "num_kv_heads": int, "head_dim": int,
                "rope": list}  # a model's record in the metadata (model_record), each field's type
META_FIELDS = ("source", "target", "layer_map", "start_token")  # AdapterMeta's fields without a default


def check_meta(meta: AdapterMeta) -> None:
    """Raise ValueError naming the field when the metadata is not what an adapter's reads assume: a record of each
    model (MODEL_FIELDS, sizes >= 1), a layer map's name, a start token id or None."""
    for side in ("source", "target"):
        record = getattr(meta, side)
        if not isinstance(record, dict):
            raise ValueError(f"adapter metadata field {side!r} must be a record of the {side} model (name, "
                             f"config_hash, num_layers, num_kv_heads, head_dim, rope), got {type(record).__name__}")
        for key, kind in MODEL_FIELDS.items():
            value = record.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
                raise ValueError(f"adapter metadata field '{side}.{key}' must be "
                                 f"{'a positive integer' if kind is int else 'a ' + kind.__name__}, got {value!r}")
    if not isinstance(meta.layer_map, str):
        raise ValueError(f"adapter metadata field 'layer_map' must be a layer map's name, got {meta.layer_map!r}")
    if meta.start_token is not None and (not isinstance(meta.start_token, int) or isinstance(meta.start_token, bool)):
        raise ValueError(f"adapter metadata field 'start_token' must be a token id or null, got {meta.start_token!r}")


def model_record(spec: ModelSpec) -> dict:
    return {"name": spec.name, "config_hash": spec.identity.config_hash, "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rope": rope_record(spec)}


@dataclass
class Adapter:
    meta: AdapterMeta
    layer_map: torch.Tensor  # [L_t, k] int64
    mix_k: torch.Tensor  # [L_t, k] float32, convex weights of the source layers for the K map
    mix_v: torch.Tensor  # [L_t, k] float32, the same for the V map
    wk: torch.Tensor  # [L_t, d_s, d_t]
    bk: torch.Tensor  # [L_t, d_t]
    wv: torch.Tensor  # [L_t, d_s, d_t]
    bv: torch.Tensor  # [L_t, d_t]
    start_kv: torch.Tensor | None = None  # [L_t, 2, H_t, D_t]
    tok_table: torch.Tensor | None = None  # [V_t, r] the target's token features (adapter.py's docstring)
    wk_tok: torch.Tensor | None = None  # [L_t, r, d_t]
    wv_tok: torch.Tensor | None = None  # [L_t, r, d_t]
    src_basis: torch.Tensor | None = None  # [2 · L_s · d_s, r_s]: the maps read r_s features of every source layer
    ctx_lags: torch.Tensor | None = None  # [w] int64 on the host: the context branch (context.py) reads the tokens
    #                                       these lags back
    ctx_mu: torch.Tensor | None = None  # [L_t, 2 d_in]: the mean of the maps' inputs (K then V, with token features)
    ctx_g: torch.Tensor | None = None  # [L_t, w, 2 d_in]: per-feature filter over the lags
    ctx_a: torch.Tensor | None = None  # [L_t, 2 d_in, r_c]
    ctx_b: torch.Tensor | None = None  # [L_t, r_c, 2 d_t]: K then V
    # the maps converted to a compute dtype by `maps_in`, kept while the tensors are the same objects, unchanged
    _converted: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # values derived from the tensors by `cached`, kept while the tensors are the same objects, unchanged
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (the tensors' identities and versions, `digest`) of the last digest computed, carried over by `to`
    _digest: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        check_meta(self.meta)
        self._check_dtypes()
        s, t = self.meta.source, self.meta.target
        d_s = s["num_kv_heads"] * s["head_dim"]
        d_t = t["num_kv_heads"] * t["head_dim"]
        lt = t["num_layers"]
        source_layers = s["num_layers"]
        if self.src_basis is not None:
            width = 2 * s["num_layers"] * d_s
            if self.src_basis.ndim != 2 or self.src_basis.shape[0] != width:
                raise ValueError(f"adapter src_basis has shape {tuple(self.src_basis.shape)}, expected "
                                 f"({width}, r): the keys and values of all {s['num_layers']} source layers")
            d_s, source_layers = int(self.src_basis.shape[1]), 1  # the maps read one "layer" of r_s features
        k = self.layer_map.shape[1] if self.layer_map.ndim == 2 else -1
        expect = {"layer_map": (lt, k), "mix_k": (lt, k), "mix_v": (lt, k), "wk": (lt, d_s, d_t), "wv": (lt, d_s, d_t),
                  "bk": (lt, d_t), "bv": (lt, d_t)}
        for name, shape in expect.items():
            if tuple(getattr(self, name).shape) != shape:
                got = tuple(getattr(self, name).shape)
                raise ValueError(f"adapter tensor {name} has shape {got}, expected {shape} "
                                 f"for {s['name']} -> {t['name']}")
        toks = (self.tok_table, self.wk_tok, self.wv_tok)
        if any(x is not None for x in toks):
            if any(x is None for x in toks) or self.tok_table.ndim != 2:
                raise ValueError("adapter token features need tok_table [V_t, r], wk_tok and wv_tok [L_t, r, d_t]")
            r = self.tok_table.shape[1]
            for name in ("wk_tok", "wv_tok"):
                if tuple(getattr(self, name).shape) != (lt, r, d_t):
                    raise ValueError(f"adapter tensor {name} has shape {tuple(getattr(self, name).shape)}, expected "
                                     f"{(lt, r, d_t)} for token features of rank {r}")
        if self.layer_map.device.type != "meta" and (  # meta tensors (device checks) hold no values
                int(self.layer_map.min()) < 0 or int(self.layer_map.max()) >= source_layers):
            raise ValueError(f"adapter layer_map refers to source layers outside [0, {source_layers})"
                             + (" (with a source basis the maps read one layer of features)" if source_layers == 1
                                and self.src_basis is not None else ""))
        self._check_context(lt, 2 * (d_s + self.token_rank), d_t)
        if self.start_kv is not None and tuple(self.start_kv.shape) != (lt, 2, t["num_kv_heads"], t["head_dim"]):
            raise ValueError(f"adapter start_kv has shape {tuple(self.start_kv.shape)}, expected "
                             f"{(lt, 2, t['num_kv_heads'], t['head_dim'])}")

    def _check_dtypes(self) -> None:
        """The layer map holds integers, every map and the start KV floats (the context's lags: _check_context)."""
        if self.layer_map.dtype != torch.int64:
            raise ValueError(f"adapter layer_map must hold integers (int64), got {self.layer_map.dtype}")
        for name in (*self.MAPS, "start_kv", "tok_table"):
            t = getattr(self, name)
            if t is not None and not t.dtype.is_floating_point:
                raise ValueError(f"adapter tensor {name} must be floating point, got {t.dtype}")

    def _check_context(self, lt: int, d_in: int, d_t: int) -> None:
        ctx = [getattr(self, n) for n in CONTEXT]
        if all(x is None for x in ctx):
            return
        if any(x is None for x in ctx) or self.ctx_lags.ndim != 1 or self.ctx_a.ndim != 3:
            raise ValueError("an adapter's context branch needs ctx_lags [w], ctx_mu [L_t, 2 d_in], ctx_g "
                             "[L_t, w, 2 d_in], ctx_a [L_t, 2 d_in, r] and ctx_b [L_t, r, 2 d_t]")
        w, r = self.ctx_lags.shape[0], self.ctx_a.shape[2]
        expect = {"ctx_mu": (lt, d_in), "ctx_g": (lt, w, d_in), "ctx_a": (lt, d_in, r), "ctx_b": (lt, r, 2 * d_t)}
        for name, shape in expect.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"adapter tensor {name} has shape {tuple(getattr(self, name).shape)}, expected "
                                 f"{shape} for a context branch over {w} lags of rank {r}")
        if self.ctx_lags.dtype != torch.int64 or (self.ctx_lags.device.type != "meta" and (
                w < 1 or int(self.ctx_lags.min()) < 0 or int(self.ctx_lags.max()) > 4096)):
            raise ValueError("adapter ctx_lags must hold one or more int64 lags in [0, 4096]")

    @property
    def context_norm(self) -> bool:
        """Whether the context branch normalises its filter before A (format 4; format 5: not)."""
        return self.meta.format_version != LINEAR_CONTEXT_FORMAT_VERSION

    @property
    def context_halo(self) -> int:
        """Tokens before a tile that its context branch reads (0 without one)."""
        return 0 if self.ctx_lags is None else int(self.ctx_lags.max())

    @property
    def name(self) -> str:
        return f"{self.meta.source['name']}->{self.meta.target['name']}"

    @property
    def token_rank(self) -> int:
        """r of the token features; 0 when the maps read the source features only."""
        return 0 if self.tok_table is None else int(self.tok_table.shape[1])

    @property
    def source_rank(self) -> int:
        """r_s of the source basis; 0 when the maps read a mix of source layers."""
        return 0 if self.src_basis is None else int(self.src_basis.shape[1])

    def extra_flops_per_token(self) -> int:
        """FLOPs per target token beyond the per-layer maps: the token features' K and V maps of every layer, the
        source basis (once per token, shared by every layer) and the context branch."""
        flops = 0 if self.src_basis is None else 2 * self.src_basis.numel()
        if self.tok_table is None:
            return flops + self._context_flops()
        lt, r, d_t = self.wk_tok.shape
        return flops + 2 * 2 * lt * r * d_t + self._context_flops()

    def _context_flops(self) -> int:
        """The context branch per token: its filter, then its two GEMMs."""
        if self.ctx_lags is None:
            return 0
        if not self.context_norm:  # format 5: a GEMM per lag over the inputs (adapter.linear_context_maps), then B
            return 2 * (self.ctx_g.shape[1] * self.ctx_a.numel() + self.ctx_b.numel())
        return 2 * (self.ctx_g.numel() + self.ctx_a.numel() + self.ctx_b.numel())

    def token_features(self, target_ids: torch.Tensor) -> torch.Tensor | None:
        """[T] target ids -> [T, r] float32 token features, or None without token features."""
        if self.tok_table is None:
            return None
        ids = torch.as_tensor(target_ids, dtype=torch.int64)
        vocab = self.tok_table.shape[0]
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"target token id outside the adapter's vocabulary of {self.tok_table.shape[0]}")
        return self.tok_table[ids.to(self.tok_table.device)].float()  # ids on a device: checked by the kernel

    MAPS = ("mix_k", "mix_v", "wk", "bk", "wv", "bv", "wk_tok", "wv_tok", "src_basis", "ctx_mu", "ctx_g", "ctx_a",
            "ctx_b")

    def maps_in(self, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
        """The maps (mixes, weights, biases, token maps, source basis) in `dtype`: as they are when already in it,
        else converted once and kept until one of them is replaced or changed in place (a bf16 adapter computing in
        float32 on a CPU without native bf16 GEMM would otherwise convert ~8 M weights on every projection)."""
        tensors = {n: getattr(self, n) for n in self.MAPS}
        if all(t is None or t.dtype == dtype for t in tensors.values()):
            return tensors
        key = (dtype, tuple((id(t), t._version) if t is not None else None for t in tensors.values()))
        if key not in self._converted:
            self._converted.clear()
            self._converted[key] = {n: None if t is None else t.to(dtype) for n, t in tensors.items()}
        return self._converted[key]

    def cached(self, key, compute):
        """compute(), kept under key until one of the adapter's tensors is replaced or changed in place (what a
        projection derives from the weights on every call otherwise, e.g. format 5's per-lag maps)."""
        versions = self._versions()
        if self._derived.get("versions") != versions:
            self._derived.clear()
            self._derived["versions"] = versions
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def with_maps_dtype(self, dtype: torch.dtype) -> "Adapter":
        """The same adapter with its maps (mixes, weights, biases, token table and maps, source basis, context
        branch) in `dtype`; the layer map, the context's lags and the exact start KV are kept as they are."""
        names = ("tok_table", *self.MAPS)
        return dataclasses.replace(self, **{n: getattr(self, n).to(dtype) for n in names
                                            if getattr(self, n) is not None})

    TENSORS = ("layer_map", "mix_k", "mix_v", "wk", "bk", "wv", "bv", "start_kv", "tok_table", "wk_tok", "wv_tok",
               "src_basis", *CONTEXT)

    def _versions(self) -> tuple:
        return tuple((id(t), t._version) if t is not None else None for t in (getattr(self, n) for n in self.TENSORS))

    @property
    def digest(self) -> str:
        """sha256 of the adapter's content: its metadata (JSON, keys sorted) and every tensor's name, dtype, shape
        and bytes. Two adapters with one name and version but other weights differ here, so caches keyed by it never
        serve one's KV for the other. Computed once (a few hundred ms for a 7B pair's maps), again only when a
        tensor is replaced or changed in place."""
        versions = self._versions()
        if self._digest and self._digest[0] == versions:
            return self._digest[1]
        h = hashlib.sha256(json.dumps(dataclasses.asdict(self.meta), sort_keys=True, default=str).encode())
        for name in self.TENSORS:
            t = getattr(self, name)
            if t is None:
                continue
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"|{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
            h.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
        self._digest = (versions, h.hexdigest())
        return self._digest[1]

    def to(self, device: torch.device | str) -> "Adapter":
        move = {n: getattr(self, n).to(device) if getattr(self, n) is not None and n != "ctx_lags" else
                getattr(self, n) for n in self.TENSORS}  # the context's lags stay host integers: read, never computed
        moved = Adapter(meta=self.meta, **move)
        if self._digest and self._digest[0] == self._versions():  # the same content on another device
            moved._digest = (moved._versions(), self._digest[1])
        return moved

    def check_models(self, source: ModelSpec, target: ModelSpec) -> None:
        """Raise ValueError unless these are the models (config and RoPE) the adapter was fitted for."""
        check_fitted_for(f"adapter {self.name!r}", self.meta, source, target)


def check_fitted_for(what: str, meta: AdapterMeta, source: ModelSpec, target: ModelSpec) -> None:
    """Raise ValueError unless `source` and `target` are the models (config hash, sizes and RoPE) that `meta` (checked
    by check_meta) records; `what` names the fitted thing in the message ("adapter 'a->b'", "fuser FILE")."""
    for role, spec, rec in (("source", source, meta.source), ("target", target, meta.target)):
        if spec.identity.config_hash != rec["config_hash"]:
            raise ValueError(f"{what} was fitted for {role} {rec['name']!r} (config {rec['config_hash'][:16]}), not "
                             f"{spec.name!r} (config {spec.identity.config_hash[:16]})")
        got = model_record(spec)
        for key in ("num_layers", "num_kv_heads", "head_dim", "rope"):
            if got[key] != rec[key]:
                raise ValueError(f"{what}: {role} {key} differs from the model's ({spec.name!r})")
