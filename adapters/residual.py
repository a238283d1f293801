"""A trainable adapter map whose Adam step has a sane scale: the ridge solution, frozen, plus a learned residual.

For target layer j (x: the convex mix of its source layers, [T, d_s]; the ridge map W, b fixed):

  z      = (x - mu_j) @ P_j                                  whitened input (ZCA from the ridge statistics)
  y      = x @ W_j + b_j                                      ridge
         + sigma_j * (z @ dW_j / sqrt(d_s) + db_j)            linear residual (dW, db start at zero)
         + sigma_j * gate_j[head] * (silu(rmsnorm(z_in) @ A_j) @ B_j / sqrt(r))   optional MLP (B starts at zero)

sigma_j is the target's own K (or V) standard deviation in layer j, so an Adam step of lr moves each output by
about lr standard deviations whatever the layer's scale (a raw-weight step of 1e-3 moved outputs by ~d_s * 1e-3 *
|x| and wrecked the ridge map). With `joint`, the MLP of K and of V both read [z_k, z_v]. The linear part folds
back into a plain `Adapter` exactly (`to_adapter`); the MLP needs the adapter format 2 (not there yet).

With token features (adapter format 2), x is [mix(x_source), tok_table[id]] (d_in = d_s + r) throughout: the ridge
map, the whitening and the residual read both; `to_adapter` splits the map back into wk and wk_tok.

With a source basis (adapter format 3), the source input is the one "layer" z = [xk, xv of every source layer] @
src_basis (fixed, `fit.source_basis`), and everything above reads z as a mixed source layer of width r_s.

Shapes: L_t target layers, k source layers per target layer, d_s / d_t flattened KV widths, H_t target KV heads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvbridge.adapters.adapter import Adapter, mix_layers, source_inputs
from kvbridge.adapters.fit import (
    DEFAULT_LAMBDAS,
    JointStats,
    RidgeStats,
    mixing_matrix,
    normalised_embeddings,
    solve_layer,
    source_basis,
    token_basis,
    with_token_basis,
)
from torch import nn


@dataclass(frozen=True)
class CapacityConfig:
    linear: bool = True  # learn the whitened full-rank residual dW, db
    rank: int = 0  # hidden width of the residual MLP per layer and map; 0: no MLP
    joint: bool = False  # the MLPs read the concatenated whitened K and V inputs
    eps: float = 1e-3  # whitening floor, × the mean eigenvalue of the input covariance

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not self.linear and self.rank == 0:
            raise ValueError("nothing to train: linear=False and rank=0")
        if self.joint and self.rank == 0:
            raise ValueError("joint applies to the MLP; set rank > 0")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def whitening(stats: RidgeStats, map_name: str, layer: int, alpha: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean [d_s], ZCA whitening matrix [d_s, d_s] of the mixed input, and the target's std (a scalar) for one
    target layer, from accumulated ridge statistics."""
    g = stats.unique.index(stats.groups[layer])
    m = mixing_matrix(alpha.to(torch.float64), stats.d_s, stats.d_tok)
    gm = m.T @ stats.gram[map_name][g].cpu() @ m  # [d_in + 1, d_in + 1], the last row/column: the bias input
    n, d = stats.count, stats.d_s + stats.d_tok
    mu = gm[:d, d] / n
    cov = gm[:d, :d] / n - torch.outer(mu, mu)
    evals, q = torch.linalg.eigh(cov)
    evals = evals.clamp(min=0) + eps * float(evals.clamp(min=0).mean())
    white = q @ torch.diag(evals.rsqrt()) @ q.T
    y_sum = stats.cross[map_name][layer, -1].cpu()  # [d_t]: Σ y
    var = float(stats.yy[map_name][layer]) / n - float((y_sum / n) @ (y_sum / n))
    return mu.float(), white.float(), math.sqrt(max(var, 1e-12) / stats.d_t)


class ResidualMaps(nn.Module):
    """The K and V maps of every target layer: ridge (buffers) + residual (parameters)."""

    def __init__(self, ridge: Adapter, stats: RidgeStats, config: CapacityConfig):
        super().__init__()
        self.config = config
        self.num_heads = ridge.meta.target["num_kv_heads"]
        lt, d_src, d_t = ridge.wk.shape
        d_s = d_src + ridge.token_rank  # the width of the maps' input: mixed source features, token features
        if stats.d_tok != ridge.token_rank:
            raise ValueError(f"the ridge statistics have token features of width {stats.d_tok}, the adapter "
                             f"{ridge.token_rank}")
        self.d_src, self.d_s, self.d_t = d_src, d_s, d_t
        for name in ("layer_map", "mix_k", "mix_v", "bk", "bv"):
            self.register_buffer(name, getattr(ridge, name).detach().clone().float() if name != "layer_map"
                                 else ridge.layer_map.clone())
        for m in "kv":  # the ridge map over [mixed source, token features]
            w = getattr(ridge, f"w{m}").float()
            if ridge.token_rank:
                w = torch.cat((w, getattr(ridge, f"w{m}_tok").float()), dim=1)
            self.register_buffer(f"w{m}", w.detach().clone())
        self.register_buffer("tok_table", None if ridge.tok_table is None else ridge.tok_table.detach().float().clone())
        self.register_buffer("src_basis", None if ridge.src_basis is None else ridge.src_basis.detach().float().clone())
        for m in "kv":
            mix = getattr(ridge, f"mix_{m}")
            rows = [whitening(stats, m, j, mix[j], config.eps) for j in range(lt)]
            self.register_buffer(f"mu_{m}", torch.stack([r[0] for r in rows]))  # [L_t, d_s]
            self.register_buffer(f"white_{m}", torch.stack([r[1] for r in rows]))  # [L_t, d_s, d_s]
            self.register_buffer(f"sigma_{m}", torch.tensor([r[2] for r in rows]))  # [L_t]
            if config.linear:
                setattr(self, f"dw_{m}", nn.Parameter(torch.zeros(lt, d_s, d_t)))
                setattr(self, f"db_{m}", nn.Parameter(torch.zeros(lt, d_t)))
            if config.rank:
                d_in = 2 * d_s if config.joint else d_s
                a = torch.randn(lt, d_in, config.rank) / math.sqrt(d_in)  # seeded by the caller's generator state
                setattr(self, f"norm_{m}", nn.Parameter(torch.ones(lt, d_in)))
                setattr(self, f"a_{m}", nn.Parameter(a))
                setattr(self, f"b_{m}", nn.Parameter(torch.zeros(lt, config.rank, d_t)))
                setattr(self, f"gate_{m}", nn.Parameter(torch.ones(lt, self.num_heads)))

    def mixed(self, x: torch.Tensor, m: str, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[L_s, T, d_src] -> [L_t, T, d_s]: the mix of source layers, then the token features of ids [T]."""
        out = mix_layers(x.float(), self.layer_map, getattr(self, f"mix_{m}"))
        if self.tok_table is None:
            return out
        if ids is None:
            raise ValueError("these maps read the target's token ids: pass ids")
        tok = self.tok_table[torch.as_tensor(ids, dtype=torch.int64).to(self.tok_table.device)]  # [T, r]
        return torch.cat((out, tok[None].expand(out.shape[0], -1, -1)), dim=-1)

    def forward(self, xk: torch.Tensor, xv: torch.Tensor, ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """xk, xv: [L_s, T, d_src] (as `adapter.map_tokens` takes), ids: [T] target ids (token features) ->
        yk, yv: [L_t, T, d_t] un-rotated."""
        return self.maps(self.inputs(xk, xv, ids))

    def inputs(self, xk: torch.Tensor, xv: torch.Tensor, ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What the maps read: {"k", "v": [L_t, T, d_s]} (the mixed source features, then the token features)."""
        xk, xv = source_inputs(self.src_basis, xk.float(), xv.float())
        return {m: self.mixed(xx, m, ids) for m, xx in (("k", xk), ("v", xv))}

    def maps(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`inputs`' result -> yk, yv: [L_t, T, d_t] un-rotated."""
        cfg = self.config
        z = {m: torch.bmm(x[m] - getattr(self, f"mu_{m}")[:, None], getattr(self, f"white_{m}")) for m in "kv"}
        out = []
        for m in "kv":
            y = torch.baddbmm(getattr(self, f"b{m}")[:, None], x[m], getattr(self, f"w{m}"))  # [L_t, T, d_t]
            sigma = getattr(self, f"sigma_{m}")[:, None, None]
            if cfg.linear:
                delta = torch.bmm(z[m], getattr(self, f"dw_{m}")) / math.sqrt(self.d_s)
                y = y + sigma * (delta + getattr(self, f"db_{m}")[:, None])
            if cfg.rank:
                z_in = torch.cat((z["k"], z["v"]), dim=-1) if cfg.joint else z[m]
                h = F.rms_norm(z_in, (z_in.shape[-1],)) * getattr(self, f"norm_{m}")[:, None]
                h = F.silu(torch.bmm(h, getattr(self, f"a_{m}")))
                r = torch.bmm(h, getattr(self, f"b_{m}")) / math.sqrt(cfg.rank)  # [L_t, T, d_t]
                lt, t, _ = r.shape
                r = (r.view(lt, t, self.num_heads, -1) * getattr(self, f"gate_{m}")[:, None, :, None]).view(lt, t, -1)
                y = y + sigma * r
            out.append(y)
        return out[0], out[1]

    def to_adapter(self, ridge: Adapter) -> Adapter:
        """Fold the linear residual into a plain adapter (exact). Refuses when an MLP is part of the map."""
        if self.config.rank:
            raise ValueError("a residual MLP cannot be folded into a linear adapter (format 1); export needs "
                             "adapter format 2")
        maps = {}
        with torch.no_grad():
            for m in "kv":
                w, b = getattr(self, f"w{m}").clone(), getattr(self, f"b{m}").clone()
                if self.config.linear:
                    sigma = getattr(self, f"sigma_{m}")[:, None, None]
                    dw = torch.bmm(getattr(self, f"white_{m}"), getattr(self, f"dw_{m}")) / math.sqrt(self.d_s)
                    w = w + sigma * dw
                    mu = getattr(self, f"mu_{m}")[:, None]  # [L_t, 1, d_s]
                    b = b + sigma[:, 0] * (getattr(self, f"db_{m}") - torch.bmm(mu, dw)[:, 0])
                maps[f"w{m}"], maps[f"b{m}"] = w[:, :self.d_src].cpu(), b.cpu()
                if self.tok_table is not None:
                    maps[f"w{m}_tok"] = w[:, self.d_src:].cpu()
        meta = dataclasses.replace(ridge.meta, metrics=dict(ridge.meta.metrics))
        return dataclasses.replace(ridge, meta=meta, **maps)

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def adapter_bytes(self) -> int:
        """Bytes of the saved map in float32: the ridge tensors plus, when present, the MLP (the linear residual
        folds into the ridge weights)."""
        ridge = sum(getattr(self, n).numel() * 4 for n in ("mix_k", "mix_v", "wk", "bk", "wv", "bv"))
        for name in ("tok_table", "src_basis"):
            if getattr(self, name) is not None:
                ridge += getattr(self, name).numel() * 4
        mlp = sum(p.numel() * 4 for n, p in self.named_parameters() if n.split("_")[0] in ("norm", "a", "b", "gate")
                  and not n.startswith("db"))
        extra = 0
        if self.config.rank:  # the MLP reads whitened inputs: mu and P travel with it
            extra = sum(getattr(self, f"{n}_{m}").numel() * 4 for n in ("mu", "white", "sigma") for m in "kv")
        return ridge + mlp + extra


def accumulate(stats: RidgeStats | JointStats, cache, indices: list[int], target, tok_table: torch.Tensor | None = None,
               desc: str = "statistics", progress: bool = True, src_basis: torch.Tensor | None = None):
    """Add the cached teacher windows' aligned pairs (source features -> the target's own un-rotated K, V) to
    `stats`; tok_table [V, d_tok]: the token features of each target id (statistics with token inputs); src_basis:
    the source features are read through it (`adapter.source_inputs`). Under torchrun each rank reads its share of
    the windows into empty `stats` and the sums are all-reduced (distributed.py)."""
    from kvbridge.adapters.distributed import reduce_stats, shard, world_size
    from kvbridge.adapters.pairs import flatten_heads
    from tqdm import tqdm

    assert world_size() == 1 or stats.count == 0, "a sharded accumulate starts from empty statistics"
    cache.require_kv(indices, desc)
    for i in tqdm(shard(indices), desc=desc, disable=not progress):
        w = cache.load(i)
        use = w["has_text"].nonzero()[:, 0]
        keys = target.rope.unrotate_all(w["k"].float(), torch.arange(w["k"].shape[2]))
        xk, xv = source_inputs(src_basis, w["xk"][:, use].float(), w["xv"][:, use].float())
        stats.add(xk, xv, flatten_heads(keys)[:, use],
                  flatten_heads(w["v"].float())[:, use], None if tok_table is None else tok_table[w["ids"][use]])
    return reduce_stats(stats)


def adapter_stats(adapter: Adapter, cache, indices: list[int], target, progress: bool = True) -> RidgeStats:
    """The statistics a residual on a trained adapter whitens with (`ResidualMaps(adapter, stats, ...)`): the
    cached windows read through the adapter's own layer groups and token table."""
    groups = [tuple(int(x) for x in g) for g in adapter.layer_map.tolist()]
    stats = RidgeStats(groups, adapter.wk.shape[1], adapter.wk.shape[2], d_tok=adapter.token_rank)
    table = None if adapter.tok_table is None else adapter.tok_table.float()
    basis = None if adapter.src_basis is None else adapter.src_basis.float()
    return accumulate(stats, cache, indices, target, table, "whitening statistics", progress, basis)


def fit_ridge(cache, train_idx: list[int], heldout_idx: list[int], target, layer_map: str = "mix", k: int = 3,
              lambdas=DEFAULT_LAMBDAS, mix_step: float = 0.25, progress: bool = True, token_rank: int = 0,
              source_rank: int = 0) -> tuple[Adapter, RidgeStats]:
    """`train.train_adapter`'s closed-form fit, on cached teacher windows (no model runs again): the statistics of
    the training windows, λ and α chosen on the held-out ones. Returns the adapter and the training statistics
    (the residual's whitening comes from them). token_rank > 0: the maps also read the target's token features of
    that rank (`fit.token_basis`: the directions of the normalised embeddings the maps use most). source_rank > 0:
    the maps read a basis of that rank over all source layers' K and V (`fit.source_basis`, format 3) instead of a
    mix of `k` layers; layer_map and k are then not used."""
    from kvbridge.adapters.layer_map import build_layer_map
    from kvbridge.adapters.pairs import start_kv
    from kvbridge.adapters.weights import (
        BASIS_FORMAT_VERSION,
        FORMAT_VERSION,
        TOKENS_FORMAT_VERSION,
        AdapterMeta,
        model_record,
    )

    header = json.loads(cache.index_path.read_text())
    sspec_layers = cache.load(train_idx[0])["xk"].shape[0]
    tspec = target.spec
    first = cache.load(train_idx[0])
    d_s, d_t = first["xk"].shape[2], tspec.num_kv_heads * tspec.head_dim
    u = None
    if token_rank:
        u = normalised_embeddings(target.model.get_input_embeddings().weight.float().cpu())  # [V, d_model]
    d_u = 0 if u is None else u.shape[1]
    src = None
    if source_rank:  # all source layers' K and V -> a basis the maps read as one source layer of width source_rank
        groups, layer_map = [(0,)] * tspec.num_layers, "basis"
        joint = {name: accumulate(JointStats(sspec_layers, d_s, tspec.num_layers, d_t, d_tok=d_u), cache, idx,
                                  target, u, f"source basis statistics ({name})", progress)
                 for name, idx in (("train", train_idx), ("heldout", heldout_idx))}
        src = source_basis(joint["train"], source_rank)
        stats = {name: st.ridge_stats(src) for name, st in joint.items()}
        del joint
        d_s = source_rank
    else:
        groups = [tuple(g) for g in build_layer_map(layer_map, sspec_layers, tspec.num_layers, k)]
        stats = {name: accumulate(RidgeStats(groups, d_s, d_t, d_tok=d_u), cache, idx, target, u,
                                  f"ridge statistics ({name})", progress)
                 for name, idx in (("train", train_idx), ("heldout", heldout_idx))}
    table = None
    if token_rank:  # the full token inputs -> the rank the maps need (reduced-rank regression), then the table
        basis, mean = token_basis(stats["train"], stats["heldout"], token_rank, lambdas, mix_step)
        stats = {name: with_token_basis(st, basis, mean) for name, st in stats.items()}
        table = ((u - mean) @ basis).float()
    fits = {m: [solve_layer(stats["train"], stats["heldout"], m, j, lambdas, mix_step) for j in range(len(groups))]
            for m in "kv"}
    source_record = header.get("source_record") or {}
    f32 = dict(dtype=torch.float32)
    adapter = Adapter(
        meta=AdapterMeta(source=source_record, target=model_record(tspec), layer_map=layer_map,
                         format_version=(BASIS_FORMAT_VERSION if source_rank else
                                         TOKENS_FORMAT_VERSION if token_rank else FORMAT_VERSION),
                         start_token=header["start_token"], lambdas={m: [f.lam for f in fits[m]] for m in "kv"},
                         corpus={"teacher_cache": str(cache.root), "train_windows": len(train_idx),
                                 "heldout_windows": len(heldout_idx), "train_tokens": stats["train"].count}),
        layer_map=torch.tensor(groups, dtype=torch.int64),
        mix_k=torch.tensor([f.alpha for f in fits["k"]], **f32),
        mix_v=torch.tensor([f.alpha for f in fits["v"]], **f32),
        wk=torch.stack([f.w[:d_s] for f in fits["k"]]).to(**f32), bk=torch.stack([f.b for f in fits["k"]]).to(**f32),
        wv=torch.stack([f.w[:d_s] for f in fits["v"]]).to(**f32), bv=torch.stack([f.b for f in fits["v"]]).to(**f32),
        start_kv=start_kv(target, header["start_token"]).cpu(), tok_table=table,
        wk_tok=torch.stack([f.w[d_s:] for f in fits["k"]]).to(**f32) if token_rank else None,
        wv_tok=torch.stack([f.w[d_s:] for f in fits["v"]]).to(**f32) if token_rank else None,
        src_basis=None if src is None else src.to(**f32))
    return adapter, stats["train"]
