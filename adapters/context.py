"""The context branch (adapter format 4): every other part of a map reads one target token's source features; the
branch reads those of the few target tokens before it. A Gemma token often covers several SmolLM2 tokens, which then
get the same source KV; which of them a token is, and what came just before, the per-token map cannot see.

For target layer j (x_t = [mixed K input, mixed V input] of target token t, each with its token features: what the
linear maps read, width 2 · d_in):

  c_t = sum_i g_i * (x_{t - lag_i} - mu)        per-feature causal filter over the lags (nothing before the first)
  h_t = silu(rmsnorm(c_t) @ A)                  A: [2 d_in, r]
  [dK_t, dV_t] = h_t @ B                        B: [r, 2 d_t], added to the linear maps' un-rotated K and V

In an adapter file (`Adapter.ctx_*`, folded: the standardisation in g, the norm's weight in A, the output scale,
per-head gates and the target's K/V scale in B): ctx_lags [w] int64, ctx_mu [L_t, 2 d_in], ctx_g [L_t, w, 2 d_in],
ctx_a [L_t, 2 d_in, r], ctx_b [L_t, r, 2 d_t]. `adapter.branch` computes it for both (the trained `ContextMaps` and
`adapter.map_tokens`), so what was trained is what projects. A CPU tile of a projection reads the `halo` tokens
before it (adapter.py), so a tiled projection equals an untiled one.

Without the norm (`ContextConfig(norm=False)`, `train-adapter --context-no-norm`, adapter format 5: the same tensors)
h_t = silu(c_t @ A) is linear up to silu, so the projection runs it as one GEMM per lag (A_i = diag(g_i) A, as more
columns of the per-token maps' GEMMs) and sums each lag's r columns of the token that far back, not as elementwise
passes over 2 · d_in features (adapter.py: `linear_context_maps`, `_fused_maps`); the small pair's shipped adapter.

`ContextMaps` is the trainable form: residual.ResidualMaps (the ridge map and its linear residual) plus the branch,
whose B starts at zero (step 0 is the per-token map); trained by `train-adapter --trainer chain --context-window W`
(docs/adapters.md: the 8 tokens before each token, not the token itself, raised held-out recovery by +0.020 at the
same data and steps).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from kvbridge.adapters.adapter import branch
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from torch import nn


@dataclass(frozen=True)
class ContextConfig:
    window: int = 8  # tokens the branch reads
    rank: int = 32  # width of its hidden layer per target layer
    first_lag: int = 1  # 1: the `window` tokens before (not the token itself); 0: the token and window - 1 before
    scale: float = 0.1  # the branch's output scale at training (its Adam steps a tenth of the linear residual's)
    norm: bool = True  # False: no rmsnorm before A (format 5: the projection runs the filter as GEMMs, adapter.py)

    def __post_init__(self):
        if self.window < 1 or self.rank < 1:
            raise ValueError(f"the context window and rank must be >= 1, got {self.window}, {self.rank}")
        if self.first_lag not in (0, 1):
            raise ValueError(f"first_lag must be 0 or 1, got {self.first_lag}")

    @property
    def lags(self) -> torch.Tensor:
        return torch.arange(self.first_lag, self.first_lag + self.window, dtype=torch.int64)

    @classmethod
    def of(cls, adapter) -> "ContextConfig":
        """The branch a trained adapter holds (formats 4 and 5): its window, first lag, rank and norm."""
        lags = adapter.ctx_lags.tolist()
        if lags != list(range(lags[0], lags[0] + len(lags))):
            raise ValueError(f"the adapter's context lags {lags} are not consecutive: no ContextConfig trains them")
        return cls(window=len(lags), rank=adapter.ctx_a.shape[-1], first_lag=lags[0], norm=adapter.context_norm)


class ContextMaps(ResidualMaps):
    """ResidualMaps plus the context branch (module docstring); `to_adapter` folds both into a format-4 adapter."""

    def __init__(self, ridge, stats, config: ContextConfig = ContextConfig()):
        super().__init__(ridge, stats, CapacityConfig())
        self.context_config = config
        lt = self.wk.shape[0]
        for m in "kv":  # the inputs' standard deviations, the diagonal of cov + eps = white^-2 (eigh: an LU-based
            w, q = torch.linalg.eigh(getattr(self, f"white_{m}").double())  # inverse failed in MKL on this VM)
            var = (q * q * w.clamp(min=1e-12).pow(-2)[:, None, :]).sum(-1)
            self.register_buffer(f"std_{m}", var.sqrt().float())  # [L_t, d_in]
        d_in = 2 * self.d_s
        # the inputs' mean the filter subtracts: the statistics' own, or the one of the adapter `unfold` starts from
        self.register_buffer("ctx_mu", torch.cat((self.mu_k, self.mu_v), dim=-1), persistent=False)
        g = torch.zeros(lt, config.window, d_in)
        g[:, 0] = 1.0
        self.ctx_g = nn.Parameter(g)
        self.ctx_norm = nn.Parameter(torch.ones(lt, d_in))
        self.ctx_a = nn.Parameter(torch.randn(lt, d_in, config.rank) / math.sqrt(d_in))
        self.ctx_b = nn.Parameter(torch.zeros(lt, config.rank, 2 * self.d_t))
        self.ctx_gate = nn.Parameter(torch.ones(lt, 2, self.num_heads))

    def folded(self) -> dict[str, torch.Tensor]:
        """The branch as an adapter holds it (differentiable: training runs through these)."""
        cfg, lt = self.context_config, self.wk.shape[0]
        std = torch.cat((self.std_k, self.std_v), dim=-1)  # [L_t, 2 d_in]
        gate = self.ctx_gate[:, :, :, None].expand(lt, 2, self.num_heads, self.d_t // self.num_heads)
        out_scale = gate.reshape(lt, 1, 2 * self.d_t) * self._out_scale()
        return {"ctx_lags": cfg.lags, "ctx_mu": self.ctx_mu,
                "ctx_g": self.ctx_g / std[:, None], "ctx_a": self.ctx_a * self.ctx_norm[:, :, None],
                "ctx_b": self.ctx_b * (cfg.scale / math.sqrt(cfg.rank)) * out_scale}

    def _out_scale(self) -> torch.Tensor:
        """[L_t, 1, 2 d_t]: the target's K and V scale per output feature (what `folded` multiplies B by at gate 1)."""
        lt = self.wk.shape[0]
        sigma = torch.stack((self.sigma_k, self.sigma_v), dim=1)[:, :, None]  # [L_t, 2, 1]
        return sigma.expand(lt, 2, self.d_t).reshape(lt, 1, 2 * self.d_t)

    @torch.no_grad()
    def unfold(self, adapter) -> None:
        """Start the branch as the trained `adapter` holds it folded (`train-adapter --init` of a format-4/5
        adapter): `folded()` then gives back its tensors (up to rounding), whatever statistics these maps whiten
        with; the norm's weight and the gates start at 1 (folded into A and B)."""
        cfg = self.context_config
        if ContextConfig.of(adapter) != dataclasses.replace(cfg, scale=ContextConfig.scale):
            raise ValueError(f"the adapter's context branch is {ContextConfig.of(adapter)}, these maps' {cfg}")
        std = torch.cat((self.std_k, self.std_v), dim=-1)
        self.ctx_mu.copy_(adapter.ctx_mu.float())
        self.ctx_g.copy_(adapter.ctx_g.float() * std[:, None])
        self.ctx_norm.fill_(1.0)
        self.ctx_a.copy_(adapter.ctx_a.float())
        self.ctx_gate.fill_(1.0)
        self.ctx_b.copy_(adapter.ctx_b.float() / (self._out_scale() * (cfg.scale / math.sqrt(cfg.rank))))

    def forward(self, xk, xv, ids=None):
        inputs = self.inputs(xk, xv, ids)  # read once, by the linear maps and the branch
        yk, yv = self.maps(inputs)
        x = torch.cat((inputs["k"], inputs["v"]), dim=-1)
        f = self.folded()
        y = branch(x, f["ctx_lags"], f["ctx_mu"], f["ctx_g"], f["ctx_a"], f["ctx_b"], norm=self.context_config.norm)
        return yk + y[..., :self.d_t], yv + y[..., self.d_t:]

    def to_adapter(self, ridge):
        from kvbridge.adapters.weights import CONTEXT_FORMAT_VERSION, LINEAR_CONTEXT_FORMAT_VERSION

        linear = super().to_adapter(ridge)
        with torch.no_grad():
            tensors = {k: v.detach().cpu().clone() for k, v in self.folded().items()}
        meta = dataclasses.replace(linear.meta, format_version=CONTEXT_FORMAT_VERSION if self.context_config.norm
                                   else LINEAR_CONTEXT_FORMAT_VERSION)
        return dataclasses.replace(linear, meta=meta, **tensors)

    def adapter_bytes(self) -> int:
        return super().adapter_bytes() + sum(v.numel() * 4 for k, v in self.folded().items() if k != "ctx_lags")
