"""The projection adapter: per target layer j, a convex mix of source layers S(j), then linear K and V maps
d_s -> d_t with bias. Keys are mapped un-rotated: un-rotate with the source RoPE at the source positions, map,
rotate with the target RoPE of layer j at the target positions.

Shapes (L = layers, H = KV heads, D = head_dim, d = H * D, T = tokens, k = source layers per target layer):
  layer_map [L_t, k] int64;  mix_k, mix_v [L_t, k] float32 (convex weights: rows sum to 1)
  wk, wv [L_t, d_s, d_t];    bk, bv [L_t, d_t]
  start_kv [L_t, 2, H_t, D_t] or None: the target's own KV of its start token at position 0 (exact)

Optional token features (format 2): the target's own token identity as a second input of every map. A target token
often shares its source token with its neighbours (one Gemma token covers several SmolLM2 tokens), so the source
features alone cannot tell them apart; the target's embedding of the token can. tok_table [V_t, r] holds the
target's RMS-normalised input embeddings projected on their first r principal directions (fixed when the adapter is
fitted), and wk_tok, wv_tok [L_t, r, d_t] add tok_table[id] @ w_tok to the maps:

  y = mix(x) @ W + tok_table[id] @ W_tok + b

Optional source basis (format 3): a per-layer mix of a few source layers of one kind (K for the K map, V for the V
map) reads little of what the source knows. With src_basis [2 · L_s · d_s, r], every map reads instead the same r
features of all source layers' keys and values, z = [xk of every layer, xv of every layer] @ src_basis, fitted by
reduced-rank regression (`fit.source_basis`); layer_map is then [L_t, 1] of zeros and wk, wv [L_t, r, d_t]: the
rest of the adapter (mix, token features, bias, start KV) works on z as on one source layer of width r.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.align import AlignKind, Alignment
from kvbridge.transfer.devices import compute_dtype
from kvbridge.transfer.rope import ModelRope
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelSpec

FORMAT_VERSION = 1  # an adapter of the source maps only; version 2 adds token features (TOKENS_FORMAT_VERSION)
TOKENS_FORMAT_VERSION = 2
BASIS_FORMAT_VERSION = 3  # a source basis over all source layers (src_basis)
READ_VERSIONS = (1, 2, 3)


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
    tok_table: torch.Tensor | None = None  # [V_t, r] the target's token features (see the module docstring)
    wk_tok: torch.Tensor | None = None  # [L_t, r, d_t]
    wv_tok: torch.Tensor | None = None  # [L_t, r, d_t]
    src_basis: torch.Tensor | None = None  # [2 · L_s · d_s, r_s]: the maps read r_s features of every source layer
    # the maps converted to a compute dtype by `maps_in`, kept while the tensors are the same objects, unchanged
    _converted: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (the tensors' identities and versions, `digest`) of the last digest computed, carried over by `to`
    _digest: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
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
        if self.start_kv is not None and tuple(self.start_kv.shape) != (lt, 2, t["num_kv_heads"], t["head_dim"]):
            raise ValueError(f"adapter start_kv has shape {tuple(self.start_kv.shape)}, expected "
                             f"{(lt, 2, t['num_kv_heads'], t['head_dim'])}")

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
        """FLOPs per target token beyond the per-layer maps: the token features' K and V maps of every layer, and
        the source basis (once per token, shared by every layer)."""
        flops = 0 if self.src_basis is None else 2 * self.src_basis.numel()
        if self.tok_table is None:
            return flops
        lt, r, d_t = self.wk_tok.shape
        return flops + 2 * 2 * lt * r * d_t

    def token_features(self, target_ids: torch.Tensor) -> torch.Tensor | None:
        """[T] target ids -> [T, r] float32 token features, or None without token features."""
        if self.tok_table is None:
            return None
        ids = torch.as_tensor(target_ids, dtype=torch.int64)
        vocab = self.tok_table.shape[0]
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"target token id outside the adapter's vocabulary of {self.tok_table.shape[0]}")
        return self.tok_table[ids.to(self.tok_table.device)].float()  # ids on a device: checked by the kernel

    MAPS = ("mix_k", "mix_v", "wk", "bk", "wv", "bv", "wk_tok", "wv_tok", "src_basis")

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

    def with_maps_dtype(self, dtype: torch.dtype) -> "Adapter":
        """The same adapter with its maps (mixes, weights, biases, token table and maps, source basis) in `dtype`;
        the layer map and the exact start KV are kept as they are."""
        names = ("mix_k", "mix_v", "wk", "bk", "wv", "bv", "tok_table", "wk_tok", "wv_tok", "src_basis")
        return dataclasses.replace(self, **{n: getattr(self, n).to(dtype) for n in names
                                            if getattr(self, n) is not None})

    TENSORS = ("layer_map", "mix_k", "mix_v", "wk", "bk", "wv", "bv", "start_kv", "tok_table", "wk_tok", "wv_tok",
               "src_basis")

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
        move = {n: getattr(self, n).to(device) if getattr(self, n) is not None else None for n in self.TENSORS}
        moved = Adapter(meta=self.meta, **move)
        if self._digest and self._digest[0] == self._versions():  # the same content on another device
            moved._digest = (moved._versions(), self._digest[1])
        return moved

    def check_models(self, source: ModelSpec, target: ModelSpec) -> None:
        """Raise ValueError unless these are the models (config and RoPE) the adapter was fitted for."""
        for role, spec, rec in (("source", source, self.meta.source), ("target", target, self.meta.target)):
            if spec.identity.config_hash != rec["config_hash"]:
                raise ValueError(f"adapter {self.name!r} was fitted for {role} {rec['name']!r} (config "
                                 f"{rec['config_hash'][:16]}), not {spec.name!r} "
                                 f"(config {spec.identity.config_hash[:16]})")
            got = model_record(spec)
            for key in ("num_layers", "num_kv_heads", "head_dim", "rope"):
                if got[key] != rec[key]:
                    raise ValueError(f"adapter {self.name!r}: {role} {key} differs from the model's ({spec.name!r})")


def has_text_source(kind: torch.Tensor) -> torch.Tensor:
    """kind: Alignment.kind [T_t] -> [T_t] bool, True where a source text token covers the target token."""
    return (kind == AlignKind.EXACT) | (kind == AlignKind.FALLBACK)


def mix_layers(x: torch.Tensor, layer_map: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The convex mix of source layers per target layer: x [L_s, T, d] (layer_map [L_t, k], mix [L_t, k]) ->
    [L_t, T, d], as one dense [L_t, L_s] matmul (gathering [L_t, k, T, d] copied k times the input and cost most of
    a projection's time)."""
    ls, t, d = x.shape
    dense = torch.zeros(layer_map.shape[0], ls, dtype=x.dtype, device=x.device)
    dense.scatter_add_(1, layer_map.to(x.device), mix.to(device=x.device, dtype=x.dtype))
    return (dense @ x.reshape(ls, t * d)).reshape(-1, t, d)


def source_inputs(src_basis: torch.Tensor | None, xk: torch.Tensor, xv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the maps read: xk, xv [L_s, T, d_s] as they are, or with a source basis [2 · L_s · d_s, r] the one
    "layer" z = [xk of every layer, xv of every layer] @ src_basis, [1, T, r], for both maps. Computed in the
    basis's dtype (float32 accumulation inside the GEMM for bf16)."""
    if src_basis is None:
        return xk, xv
    ls, t, d = xk.shape
    flat = torch.cat((xk.transpose(0, 1).reshape(t, ls * d), xv.transpose(0, 1).reshape(t, ls * d)), dim=1)
    if flat.shape[1] != src_basis.shape[0]:
        raise ValueError(f"the source basis reads {src_basis.shape[0]} features, the source KV has {flat.shape[1]}")
    z = (flat.to(src_basis.dtype) @ src_basis)[None]
    return z, z


def map_tokens(adapter: Adapter, xk: torch.Tensor, xv: torch.Tensor, accumulate_fp32: bool = True,
               target_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear part, batched over target layers.

    xk, xv: [L_s, T, d_s] un-rotated source keys / values (already gathered to target tokens)
    target_ids: [T], needed when the adapter has token features
    returns yk, yv: [L_t, T, d_t] un-rotated target keys / values, in float32 (accumulate_fp32) or xk's dtype

    An adapter stored in bfloat16 or float16 (the shipped ones) runs its matmuls in that dtype where the device
    does that GEMM natively (CUDA; CPUs with AMX or AVX512-BF16, where they take a fifth of the float32 time): the
    products accumulate in float32 inside the GEMM, inputs and outputs are rounded to 8 (11) mantissa bits — an
    error of the order of the weights' own rounding. On other CPUs (AVX2 only: half GEMM ~20× slower than float32)
    it computes in float32 from its weights converted once (`Adapter.maps_in`; `devices.compute_dtype` decides,
    `devices.half_gemm` forces either path). A float32 adapter (a fitted one, the identity) runs in float32.
    """
    work = torch.float32 if accumulate_fp32 else xk.dtype
    half = adapter.wk.dtype in (torch.bfloat16, torch.float16)
    gemm = compute_dtype(adapter.wk.dtype, adapter.wk.device) if half else work
    maps = adapter.maps_in(gemm)
    if adapter.src_basis is not None:
        xk, xv = source_inputs(maps["src_basis"], xk.to(gemm), xv.to(gemm))
    tok = None
    if adapter.tok_table is not None:
        if target_ids is None:
            raise ValueError(f"adapter {adapter.name!r} reads the target's token ids: pass target_ids")
        tok = adapter.token_features(target_ids).to(device=xk.device, dtype=gemm)  # [T, r]
    out = []
    for x, kind in ((xk, "k"), (xv, "v")):
        mixed = mix_layers(x.to(gemm), adapter.layer_map, maps[f"mix_{kind}"])  # [L_t, T, d_s]
        bias = maps[f"b{kind}"][:, None, :]  # [L_t, 1, d_t]
        if tok is None:
            y = torch.baddbmm(bias, mixed, maps[f"w{kind}"])  # [L_t, T, d_t]
        else:  # every layer's token map (tok broadcast over layers: no copy), the bias and the map, in place
            y = torch.matmul(tok, maps[f"w{kind}_tok"]).add_(bias).baddbmm_(mixed, maps[f"w{kind}"])
        out.append(y.to(work))
    return out[0], out[1]


TILE_BYTES = 32 << 20  # a CPU tile's working set: inside a last-level cache, so its steps never wait on DRAM


def cpu_tile_tokens(adapter: Adapter, segment: KVSegment) -> int:
    """Target tokens per tile on the CPU: every step of a projection is per token, and walking a long context in
    tiles whose float32 intermediates (gathered source KV, mixed inputs, mapped outputs) fit in TILE_BYTES keeps them in
    cache (a 2-core AVX2 VM moves ~4 GB/s to and from DRAM: one untiled pass over 2,048 tokens' mapped keys costs
    as much as their GEMM)."""
    d_s = segment.num_kv_heads * segment.head_dim
    lt, d_in, d_t = adapter.wk.shape
    per_token = 4 * (2 * segment.num_layers * d_s + 2 * lt * (d_in + 2 * d_t))
    return max(32, TILE_BYTES // per_token // 16 * 16)


def _project_tile(adapter: Adapter, segment: KVSegment, alignment: Alignment, target_ids: torch.Tensor,
                  source_rope: ModelRope, target_rope: ModelRope, positions: torch.Tensor, t0: int, t1: int,
                  out: torch.Tensor | None, accumulate_fp32: bool) -> torch.Tensor:
    """Target tokens t0 .. t1 - 1 of `project`, written into out[:, :, :, t0:t1] ([L_t, 2, H_t, T_t, D_t]) and
    out returned; with out None (autograd), returned as a new [L_t, 2, H_t, t1 - t0, D_t] tensor.

    The source tokens they read are gathered first (keys and values at once), un-rotated at their own positions,
    mapped, and the keys rotated straight into `out`: every step is per token."""
    device = adapter.wk.device
    ls, hs, ds_ = segment.num_layers, segment.num_kv_heads, segment.head_dim
    n = t1 - t0
    idx = alignment.source_index[t0:t1].cpu()  # [n] (the alignment lives on the CPU: no read back from the device)
    mapped = idx >= 0
    gather = idx.clamp(min=0)
    src = segment.kv.to(device).index_select(3, gather.to(device))  # [L_s, 2, H_s, n, D_s]
    keys = source_rope.unrotate_all(src[:, 0].float(), segment.positions.cpu()[gather])  # [L_s, H_s, n, D_s]
    xk = keys.permute(0, 2, 1, 3).reshape(ls, n, hs * ds_)  # a view when H_s == 1
    xv = src[:, 1].float().permute(0, 2, 1, 3).reshape(ls, n, hs * ds_)
    if not bool(mapped.all()):  # unmapped tokens get zero input
        on = mapped.to(device)[None, :, None]
        xk, xv = xk * on, xv * on
    ids = target_ids[t0:t1]
    yk, yv = map_tokens(adapter, xk, xv, accumulate_fp32, ids)  # [L_t, n, d_t]
    tgt = target_rope.spec
    lt, ht, dt = tgt.num_layers, tgt.num_kv_heads, tgt.head_dim
    yk = yk.view(lt, n, ht, dt).permute(0, 2, 1, 3)  # [L_t, H_t, n, D_t]
    yv = yv.view(lt, n, ht, dt).permute(0, 2, 1, 3)
    start = adapter.meta.start_token
    if adapter.start_kv is not None and start is not None:
        use_start = (~has_text_source(alignment.kind[t0:t1])) & (ids == start)
        if bool(use_start.any()):
            where = use_start.nonzero()[:, 0].to(device)
            yk[:, :, where] = adapter.start_kv[:, 0, :, None, :].to(yk.dtype)
            yv[:, :, where] = adapter.start_kv[:, 1, :, None, :].to(yv.dtype)
    if out is None:  # autograd (adapter refinement): no writes into a result
        return torch.stack((target_rope.rotate_all(yk, positions[t0:t1]), yv), dim=1)
    keys_out = out[:, 0, :, t0:t1]
    if keys_out.dtype == (torch.float64 if yk.dtype == torch.float64 else torch.float32):  # rotate's work dtype
        target_rope.rotate_all(yk, positions[t0:t1], out=keys_out)  # no copy of the rotated keys
    else:
        keys_out.copy_(target_rope.rotate_all(yk, positions[t0:t1]))
    out[:, 1, :, t0:t1] = yv
    return out


def project(adapter: Adapter, segment: KVSegment, alignment: Alignment, target_ids: torch.Tensor,
            source_rope: ModelRope, target_rope: ModelRope, offset: int = 0, dtype: torch.dtype | None = None,
            accumulate_fp32: bool = True, tile: int | None = None) -> KVSegment:
    """Project a source segment into the target's KV space: one position per target token.

    segment: source KV, rotated, [L_s, 2, H_s, T_s, D_s]; alignment: target -> source token indices ([T_t]);
    target_ids: [T_t]. The result sits at target positions offset .. offset + T_t - 1, rotated, in `dtype`
    (default: the segment's). The target's start token (when not covered by source text) takes its exact stored
    KV; other target tokens without a source token take the map's bias (zero source input; token features, when the
    adapter has them, still apply). `tile`: target tokens per step (default: all on a GPU, `cpu_tile_tokens` on a
    CPU).
    """
    adapter.check_models(source_rope.spec, target_rope.spec)
    if segment.model != source_rope.spec.identity:
        raise ValueError(f"the segment holds KV of {segment.model.key}, the adapter maps from "
                         f"{source_rope.spec.identity.key}")
    if not segment.rotated:
        raise ValueError("project expects rotated source keys (as the source model caches them)")
    target_ids = torch.as_tensor(target_ids, dtype=torch.int64).cpu()
    t_t = target_ids.numel()
    if alignment.source_index.shape != (t_t,):
        raise ValueError(f"alignment covers {alignment.source_index.numel()} target tokens, target_ids has {t_t}")
    if t_t and int(alignment.source_index.max()) >= segment.num_tokens:
        raise ValueError(f"alignment refers to source token {int(alignment.source_index.max())}, the segment has "
                         f"{segment.num_tokens}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    device = adapter.wk.device
    tgt = target_rope.spec
    lt, ht, dt = tgt.num_layers, tgt.num_kv_heads, tgt.head_dim
    positions = torch.arange(offset, offset + t_t, dtype=torch.int64)
    out_dtype = dtype or segment.dtype
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    differentiable = segment.kv.requires_grad or any(
        t is not None and t.requires_grad for t in (getattr(adapter, n) for n in (*adapter.MAPS, "start_kv")))
    if torch.is_grad_enabled() and differentiable:  # one piece, built without in-place writes
        out = _project_tile(adapter, segment, alignment, target_ids, source_rope, target_rope, positions, 0, t_t,
                            None, accumulate_fp32).to(out_dtype)
        return KVSegment(kv=out, token_ids=target_ids, positions=positions, model=tgt.identity, rotated=True)
    out = torch.empty(lt, 2, ht, t_t, dt, dtype=work if out_dtype == work else out_dtype, device=device)
    if tile is None:
        tile = t_t if device.type != "cpu" else cpu_tile_tokens(adapter, segment)
    for t0 in range(0, t_t, max(tile, 1)):
        _project_tile(adapter, segment, alignment, target_ids, source_rope, target_rope, positions, t0,
                      min(t0 + tile, t_t), out, accumulate_fp32)
    out = out.to(out_dtype)
    return KVSegment(kv=out, token_ids=target_ids, positions=positions, model=tgt.identity, rotated=True)
