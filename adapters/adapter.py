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


def _mixed(adapter: Adapter, maps: dict, x: torch.Tensor, kind: str, gemm: torch.dtype) -> torch.Tensor:
    """The mix of source layers in gemm's dtype; a float32 input is mixed before it is rounded (a bf16 GEMM over the
    few source layers is slower than the float32 one and its conversion)."""
    if x.dtype == torch.float32:
        return mix_layers(x, adapter.layer_map, getattr(adapter, f"mix_{kind}").float()).to(gemm)
    return mix_layers(x.to(gemm), adapter.layer_map, maps[f"mix_{kind}"])


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
    out, inputs, lagged = [], [], None
    fused = None  # format 5 without autograd: the maps' GEMMs also give every lag's branch input (more columns)
    if adapter.ctx_lags is not None and not adapter.context_norm and not _autograd(
            xk, xv, *(t for t in maps.values() if t is not None)):
        fused = adapter.cached(("fused_context", gemm), lambda: _fused_maps(adapter, maps, gemm))
    for x, kind in ((xk, "k"), (xv, "v")):
        mixed = _mixed(adapter, maps, x, kind, gemm)  # [L_t, halo + T, d_s]
        if fused is not None:  # [L_t, halo + T, d_t + lags x r]: the map's outputs, then the branch's inputs
            w, b, w_tok = fused[kind]
            y = torch.baddbmm(b[:, None], mixed, w)
            if tok is not None:  # (tok broadcast over layers: no copy)
                y.baddbmm_(tok.expand(mixed.shape[0], -1, -1), w_tok)
            d_t = maps[f"w{kind}"].shape[-1]
            lagged = y[..., d_t:] if lagged is None else lagged.add_(y[..., d_t:])  # K's and V's shares
            out.append(y[:, halo:, :d_t])
            continue
        if adapter.ctx_lags is not None:  # the branch reads [mixed, token features] of every token
            inputs += [mixed] if tok is None else [mixed, tok[None].expand(mixed.shape[0], -1, -1)]
        mixed = mixed[:, halo:]
        t_tok = None if tok is None else tok[halo:]
        bias = maps[f"b{kind}"][:, None, :]  # [L_t, 1, d_t]
        y = torch.baddbmm(bias, mixed, maps[f"w{kind}"])  # [L_t, T, d_t]
        if t_tok is not None:  # every layer's token map (tok broadcast over layers: no copy), in place
            y = y.baddbmm_(t_tok.expand(mixed.shape[0], -1, -1), maps[f"w{kind}_tok"]) if not _autograd(
                y, t_tok, maps[f"w{kind}_tok"]) else y + torch.matmul(t_tok, maps[f"w{kind}_tok"])
        out.append(y)
    if fused is not None:
        y = _lagged_branch(lagged, fused["beta"], adapter.ctx_lags, maps["ctx_b"], halo)
        d_t = out[0].shape[-1]
        return (out[0].add_(y[..., :d_t]).to(work).contiguous(), out[1].add_(y[..., d_t:]).to(work).contiguous())
    if inputs:
        d_t = out[0].shape[-1]
        ctx = (adapter.ctx_lags, maps["ctx_mu"], maps["ctx_g"], maps["ctx_a"], maps["ctx_b"], halo)
        if _autograd(inputs[0], *ctx[1:5]):
            y = branch(torch.cat(inputs, dim=-1), *ctx, norm=adapter.context_norm)
        else:  # format 4: no copy of the inputs into one tensor
            y = _branch_inference(inputs, *ctx)
        if _autograd(out[0], out[1], y):
            out = [out[0] + y[..., :d_t].to(out[0].dtype), out[1] + y[..., d_t:].to(out[1].dtype)]
        else:
            out[0].add_(y[..., :d_t])
            out[1].add_(y[..., d_t:])
    return out[0].to(work), out[1].to(work)


RMS_EPS = torch.finfo(torch.float32).eps  # the context branch's norm epsilon, whatever dtype its GEMMs run in


def _autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def branch(x: torch.Tensor, lags: torch.Tensor, mu: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           halo: int = 0, norm: bool = True) -> torch.Tensor:
    """x: [L_t, halo + n, 2 d_in] the maps' inputs (K then V) of the halo tokens before and the n tokens wanted ->
    [L_t, n, 2 d_t] the branch's K then V outputs of the n tokens. Token halo + t reads halo + t - lag (none before
    index 0: the document's start, or a tile's first read token with halo >= max lag). The filter and the norm run in
    float32, the two GEMMs in a's dtype. norm False (format 5): the filter goes to A as it is."""
    lt, total, _ = x.shape
    n = total - halo
    if not _autograd(x, mu, g, a, b):
        if norm:
            return _branch_inference([x], lags, mu, g, a, b, halo)
        maps, beta = linear_context_maps(lags, mu, g, a, (((0, x.shape[-1]),),), a.dtype)
        return _linear_branch([x], maps, beta, lags, b, halo)
    u = x.float() - mu.float()[:, None]
    c = torch.zeros(lt, n, u.shape[-1], dtype=torch.float32, device=x.device)
    g = g.float()
    for i, lag in enumerate(lags.tolist()):  # in place: a temporary per lag costs more than the filter (CPU)
        first = halo - lag  # the read index of the first wanted token
        if first >= 0:
            c.addcmul_(u[:, first:first + n], g[:, i, None])
        elif n + first > 0:  # the first -first wanted tokens have nothing that far back
            c[:, -first:].addcmul_(u[:, :n + first], g[:, i, None])
    h = (F.rms_norm(c, (c.shape[-1],), eps=RMS_EPS) if norm else c).to(a.dtype)
    return torch.bmm(F.silu(torch.bmm(h, a)), b)


BRANCH_TILE = 448  # layers x tokens the inference filter holds at once: a piece's input and filter in a core's cache


def _branch_inference(pieces: list[torch.Tensor], lags: torch.Tensor, mu: torch.Tensor, g: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, halo: int) -> torch.Tensor:
    """`branch` without autograd, on its input's pieces (in feature order, each [L_t, halo + n, w], concatenated
    `branch`'s x; a view may broadcast a piece over layers), copied side by side a few target layers at a time (no
    copy of every layer's inputs at once) so each group's input and filter stay in cache, and the norm taken after
    the first GEMM, which it commutes with
    (rms_norm(c) @ a = (c @ a) / rms(c)): the filter is never normalised or copied, only read by the GEMM and by
    the sum of its squares. Equal to `branch` up to rounding (the GEMM's inputs are rounded before the scale)."""
    lt, total = pieces[0].shape[:2]
    n = total - halo
    width, rank = a.shape[1:]
    if sum(p.shape[-1] for p in pieces) != width:
        raise ValueError(f"the branch reads {width} features, its inputs have {sum(p.shape[-1] for p in pieces)}")
    dev, f32 = pieces[0].device, torch.float32
    z = torch.empty(lt, n, rank, dtype=f32, device=dev)  # c @ a
    sq = torch.empty(lt, n, dtype=f32, device=dev)  # |c|^2
    mu, g, a = mu.float(), g.float(), a.float()  # (a float32 GEMM costs here what a bf16 one does with its casts)
    lag_list = lags.tolist()
    k_max = max(1, min(lt, round(BRANCH_TILE / max(n, 1)))) if dev.type == "cpu" else lt  # (a GPU: all at once)
    u = torch.empty(k_max, total, width, dtype=f32, device=dev)
    c = torch.empty(k_max, n, width, dtype=f32, device=dev)
    for j0 in range(0, lt, k_max):
        k = min(k_max, lt - j0)
        uj, cj = u[:k], c[:k]
        col = 0
        for piece in pieces:  # the inputs side by side, in float32, then standardised
            uj[..., col:col + piece.shape[-1]] = piece[j0:j0 + k]
            col += piece.shape[-1]
        uj.sub_(mu[j0:j0 + k, None])
        started = False
        for i, lag in enumerate(lag_list):
            first = halo - lag  # the read index of the first wanted token
            if n + min(first, 0) <= 0:
                continue  # no wanted token reads that far back
            dst = cj if first >= 0 else cj[:, -first:]
            src = uj[:, max(first, 0):max(first, 0) + dst.shape[1]]
            gi = g[j0:j0 + k, i, None]
            if started:
                dst.addcmul_(src, gi)
            else:  # the first lag writes (no zeroing pass); the tokens it does not reach are zero
                torch.mul(src, gi, out=dst)
                if first < 0:
                    cj[:, :-first].zero_()
                started = True
        if not started:
            cj.zero_()
        torch.linalg.vector_norm(cj, dim=-1, out=sq[j0:j0 + k])
        torch.bmm(cj, a[j0:j0 + k], out=z[j0:j0 + k])
    z.mul_(torch.rsqrt(sq.square_().div_(width).add_(RMS_EPS))[..., None])
    return torch.bmm(F.silu(z).to(b.dtype), b)


def linear_context_maps(lags: torch.Tensor, mu: torch.Tensor, g: torch.Tensor, a: torch.Tensor,
                        layout: tuple[tuple[tuple[int, int], ...], ...], dtype: torch.dtype
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A format-5 branch (no norm) as GEMMs: its filter then A is, for lag i, the map A_i = diag(g_i) A applied to
    the token lag_i back. layout: for each input piece, the feature ranges of the branch's input it stands for (a
    piece of token features stands for K's and V's). Returns each piece's [L_t, w_piece, lags x r] maps (in dtype)
    and the standardisation's share [L_t, lags, r] (float32), subtracted for each lag a token reaches."""
    g, a = g.float(), a.float()
    lt, w, width = g.shape
    per_lag = (g[..., None] * a[:, None]).permute(0, 2, 1, 3).reshape(lt, width, w * a.shape[-1])  # [L_t, W, w r]
    beta = torch.einsum("lf,lwf,lfr->lwr", mu.float(), g, a)
    maps = [sum(per_lag[:, s:e] for s, e in ranges).to(dtype) for ranges in layout]
    return maps, beta


def _fused_maps(adapter: Adapter, maps: dict, dtype: torch.dtype) -> dict:
    """Format 5's maps for `map_tokens`: each kind's map, bias and token map with every lag's branch map as more
    columns (the branch's input is [K map's input, V map's input], each with its token features), and beta."""
    d_in, r_tok = maps["wk"].shape[1], adapter.token_rank
    kinds = [(0, d_in), (d_in, d_in + r_tok), (d_in + r_tok, 2 * d_in + r_tok), (2 * d_in + r_tok, 2 * (d_in + r_tok))]
    lin, beta = linear_context_maps(adapter.ctx_lags, maps["ctx_mu"], maps["ctx_g"], maps["ctx_a"],
                                    tuple((k,) for k in kinds), dtype)
    extra = lin[0].shape[-1]
    out = {"beta": beta}
    for i, kind in enumerate("kv"):
        w = torch.cat((maps[f"w{kind}"], lin[2 * i]), dim=-1)
        b = torch.cat((maps[f"b{kind}"], maps[f"b{kind}"].new_zeros(maps[f"b{kind}"].shape[0], extra)), dim=-1)
        w_tok = None if adapter.tok_table is None else torch.cat((maps[f"w{kind}_tok"], lin[2 * i + 1]), dim=-1)
        out[kind] = (w, b, w_tok)
    return out


def _linear_branch(pieces: list[torch.Tensor], maps: list[torch.Tensor], beta: torch.Tensor, lags: torch.Tensor,
                   b: torch.Tensor, halo: int) -> torch.Tensor:
    """A format-5 branch over its input's pieces ([L_t, halo + n, w] each, or [halo + n, w] for one every layer
    shares) with `linear_context_maps`: one GEMM per piece for all lags, then each lag's columns shifted and summed
    (r values a token and lag instead of the filter's 2 d_in), silu, B. Equal to `branch(..., norm=False)` up to
    rounding."""
    p = None  # [L_t, halo + n, lags x r] in the maps' dtype, as the per-token maps' outputs
    for piece, m in zip(pieces, maps):
        p = torch.matmul(piece.to(m.dtype), m) if p is None else p.add_(torch.matmul(piece.to(m.dtype), m))
    return _lagged_branch(p, beta, lags, b, halo)


def _lagged_branch(p: torch.Tensor, beta: torch.Tensor, lags: torch.Tensor, b: torch.Tensor, halo: int
                   ) -> torch.Tensor:
    """p: [L_t, halo + n, lags x r] every token's input through each lag's map -> [L_t, n, 2 d_t]: for each wanted
    token the columns of lag i of the token lag_i before (none before index 0), less the standardisation's share,
    summed; silu; B."""
    lt, total = p.shape[:2]
    n, r = total - halo, beta.shape[-1]
    z = torch.zeros(lt, n, r, dtype=torch.float32, device=b.device)
    for i, lag in enumerate(lags.tolist()):
        first = halo - lag  # the read index of the first wanted token
        skip = max(0, -first)  # wanted tokens with nothing that far back
        if skip >= n:
            continue
        z[:, skip:].add_(p[:, first + skip:first + n, i * r:(i + 1) * r]).sub_(beta[:, i, None])
    return torch.bmm(F.silu(z).to(b.dtype), b)


TILE_BYTES = 32 << 20  # a CPU tile's working set: inside a last-level cache, so its steps never wait on DRAM


def cpu_tile_tokens(adapter: Adapter, segment: KVSegment) -> int:
    """Target tokens per tile on the CPU: every step of a projection is per token, and walking a long context in
    tiles whose float32 intermediates (gathered source KV, mixed inputs, mapped outputs) fit in TILE_BYTES keeps them in
    cache (a 2-core AVX2 VM moves ~4 GB/s to and from DRAM: one untiled pass over 2,048 tokens' mapped keys costs
    as much as their GEMM)."""
    d_s = segment.num_kv_heads * segment.head_dim
    lt, d_in, d_t = adapter.wk.shape
    per_token = 4 * (2 * segment.num_layers * d_s + 2 * lt * (d_in + 2 * d_t))
    if adapter.ctx_lags is not None:  # the branch's hidden layer (its inputs are the maps'; its filter runs a few
        per_token += 4 * lt * (adapter.ctx_a.shape[-1] + 1)  # layers at a time, in buffers of BRANCH_TILE tokens)
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
