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

Optional context branch (format 4; `branch` here, trained by context.py): a small MLP over the maps' inputs of the
few target tokens before each token, added to its K and V; a CPU tile then reads those tokens before it too (`halo`).

This module projects with an adapter (`project`, tiled on the CPU; `map_tokens`, the linear part). The adapter itself
(its tensors, metadata and saved-format versions) is defined in `weights`; `Adapter`, `AdapterMeta` and
`model_record` are imported from here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvbridge.adapters.weights import Adapter, AdapterMeta, model_record
from kvbridge.transfer.align import AlignKind, Alignment
from kvbridge.transfer.devices import compute_dtype
from kvbridge.transfer.rope import ModelRope
from kvbridge.transfer.segment import KVSegment

__all__ = ["project", "map_tokens", "mix_layers", "source_inputs", "has_text_source", "cpu_tile_tokens", "TILE_BYTES",
           "branch", "RMS_EPS",
           "Adapter", "AdapterMeta", "model_record"]  # these three: weights', imported from here too


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
               target_ids: torch.Tensor | None = None, halo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps, batched over target layers.

    xk, xv: [L_s, halo + T, d_s] un-rotated source keys / values (already gathered to target tokens)
    target_ids: [halo + T], needed when the adapter has token features
    halo: leading tokens that only the context branch reads (the tokens before a tile); no output for them
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
    if halo and adapter.ctx_lags is None:
        raise ValueError(f"adapter {adapter.name!r} has no context branch to read {halo} tokens before")
    out, inputs = [], []
    for x, kind in ((xk, "k"), (xv, "v")):
        mixed = mix_layers(x.to(gemm), adapter.layer_map, maps[f"mix_{kind}"])  # [L_t, halo + T, d_s]
        if adapter.ctx_lags is not None:  # the branch reads [mixed, token features] of every token
            inputs.append(mixed if tok is None else torch.cat((mixed, tok[None].expand(mixed.shape[0], -1, -1)), -1))
        mixed = mixed[:, halo:]
        t_tok = None if tok is None else tok[halo:]
        bias = maps[f"b{kind}"][:, None, :]  # [L_t, 1, d_t]
        if t_tok is None:
            y = torch.baddbmm(bias, mixed, maps[f"w{kind}"])  # [L_t, T, d_t]
        else:  # every layer's token map (tok broadcast over layers: no copy), the bias and the map, in place
            y = torch.matmul(t_tok, maps[f"w{kind}_tok"]).add_(bias).baddbmm_(mixed, maps[f"w{kind}"])
        out.append(y)
    if inputs:
        d_t = out[0].shape[-1]
        y = branch(torch.cat(inputs, dim=-1), adapter.ctx_lags, maps["ctx_mu"], maps["ctx_g"], maps["ctx_a"],
                   maps["ctx_b"], halo)
        out = [out[0] + y[..., :d_t].to(out[0].dtype), out[1] + y[..., d_t:].to(out[1].dtype)]
    return out[0].to(work), out[1].to(work)


RMS_EPS = torch.finfo(torch.float32).eps  # the context branch's norm epsilon, whatever dtype its GEMMs run in


def branch(x: torch.Tensor, lags: torch.Tensor, mu: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           halo: int = 0) -> torch.Tensor:
    """x: [L_t, halo + n, 2 d_in] the maps' inputs (K then V) of the halo tokens before and the n tokens wanted ->
    [L_t, n, 2 d_t] the branch's K then V outputs of the n tokens. Token halo + t reads halo + t - lag (none before
    index 0: the document's start, or a tile's first read token with halo >= max lag). The filter and the norm run in
    float32, the two GEMMs in a's dtype."""
    lt, total, _ = x.shape
    n = total - halo
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, mu, g, a, b))):
        return _branch_inference(x, lags, mu, g, a, b, halo)
    u = x.float() - mu.float()[:, None]
    c = torch.zeros(lt, n, u.shape[-1], dtype=torch.float32, device=x.device)
    g = g.float()
    for i, lag in enumerate(lags.tolist()):  # in place: a temporary per lag costs more than the filter (CPU)
        first = halo - lag  # the read index of the first wanted token
        if first >= 0:
            c.addcmul_(u[:, first:first + n], g[:, i, None])
        elif n + first > 0:  # the first -first wanted tokens have nothing that far back
            c[:, -first:].addcmul_(u[:, :n + first], g[:, i, None])
    h = F.rms_norm(c, (c.shape[-1],), eps=RMS_EPS).to(a.dtype)
    return torch.bmm(F.silu(torch.bmm(h, a)), b)


def _branch_inference(x, lags, mu, g, a, b, halo, layers: int = 3):
    """`branch` without autograd, a few target layers at a time: their inputs and filter output (float32) stay in
    the cores' caches, where the whole tile's passed through memory once per lag (about 3x faster on the 2-core VM;
    one layer at a time pays more per-operation overhead than it saves)."""
    lt, total, width = x.shape
    n = total - halo
    h = torch.empty(lt, n, width, dtype=a.dtype, device=x.device)
    c = torch.empty(layers, n, width, dtype=torch.float32, device=x.device)
    u = torch.empty(layers, total, width, dtype=torch.float32, device=x.device)
    mu, g = mu.float(), g.float()
    lag_list = lags.tolist()
    for j0 in range(0, lt, layers):
        k = min(layers, lt - j0)
        uj, cj = u[:k], c[:k]
        torch.sub(x[j0:j0 + k], mu[j0:j0 + k, None], out=uj)  # (never in place: x may be the caller's float32)
        cj.zero_()
        for i, lag in enumerate(lag_list):
            first = halo - lag
            gi = g[j0:j0 + k, i, None]
            if first >= 0:
                cj.addcmul_(uj[:, first:first + n], gi)
            elif n + first > 0:
                cj[:, -first:].addcmul_(uj[:, :n + first], gi)
        h[j0:j0 + k] = F.rms_norm(cj, (width,), eps=RMS_EPS)
    return torch.bmm(F.silu(torch.bmm(h, a)), b)


TILE_BYTES = 32 << 20  # a CPU tile's working set: inside a last-level cache, so its steps never wait on DRAM


def cpu_tile_tokens(adapter: Adapter, segment: KVSegment) -> int:
    """Target tokens per tile on the CPU: every step of a projection is per token, and walking a long context in
    tiles whose float32 intermediates (gathered source KV, mixed inputs, mapped outputs) fit in TILE_BYTES keeps them in
    cache (a 2-core AVX2 VM moves ~4 GB/s to and from DRAM: one untiled pass over 2,048 tokens' mapped keys costs
    as much as their GEMM)."""
    d_s = segment.num_kv_heads * segment.head_dim
    lt, d_in, d_t = adapter.wk.shape
    per_token = 4 * (2 * segment.num_layers * d_s + 2 * lt * (d_in + 2 * d_t))
    if adapter.ctx_lags is not None:  # the branch's inputs (its filter runs a layer at a time, in cache)
        per_token += 2 * lt * 2 * (d_in + adapter.token_rank)
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
    halo = min(t0, adapter.context_halo)  # the tokens before the tile that its context branch reads
    n, m = t1 - t0, t1 - t0 + halo
    idx = alignment.source_index[t0 - halo:t1].cpu()  # [m] (the alignment lives on the CPU: no read back)
    mapped = idx >= 0
    gather = idx.clamp(min=0)
    src = segment.kv.to(device).index_select(3, gather.to(device))  # [L_s, 2, H_s, m, D_s]
    keys = source_rope.unrotate_all(src[:, 0].float(), segment.positions.cpu()[gather])  # [L_s, H_s, m, D_s]
    xk = keys.permute(0, 2, 1, 3).reshape(ls, m, hs * ds_)  # a view when H_s == 1
    xv = src[:, 1].float().permute(0, 2, 1, 3).reshape(ls, m, hs * ds_)
    if not bool(mapped.all()):  # unmapped tokens get zero input
        on = mapped.to(device)[None, :, None]
        xk, xv = xk * on, xv * on
    yk, yv = map_tokens(adapter, xk, xv, accumulate_fp32, target_ids[t0 - halo:t1], halo)  # [L_t, n, d_t]
    ids = target_ids[t0:t1]
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
