"""A projection map of another kind for issue 38: the ridge map and its linear residual (residual.ResidualMaps, the
shipped adapter's kind) plus a *context branch* that reads a short causal window of the target's neighbouring tokens'
source features, where every other map reads one token's.

For target layer j (x_t: the mixed source K and V inputs with token features at target token t, as ResidualMaps):

  u_t   = [(x^k_t - mu^k) / std^k, (x^v_t - mu^v) / std^v]           diagonal standardisation (from the ridge stats)
  c_t   = sum_{d=0}^{w-1} g_d * u_{t-d}                              per-feature causal filter over w tokens
  h_t   = silu(rmsnorm(c_t) * n @ A)                                  A: [2 d_s, r]
  y^k_t += sigma^k * gate^k[head] * s * (h_t @ B^k) / sqrt(r)         B starts at zero: step 0 is ResidualMaps
  y^v_t += sigma^v * gate^v[head] * s * (h_t @ B^v) / sqrt(r)

(with `first_lag` 1 the lags are 1..w: the neighbours only, not the token itself) g of the first lag starts at 1 and
the others at 0; s = `scale` (0.1) keeps the branch's Adam steps a tenth of the linear
residual's (an MLP under KL needed lr <= 3e-4, docs/adapter-training). `window=1` is the same branch without context
(the control: what a per-token MLP alone gives). Per target token and layer the branch costs w·2d_s + 2d_s·r + 2r·d_t
multiply-adds (w=4, r=64, the small pair: 67 K against the ridge maps' 123 K).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from torch import nn


class ContextMaps(ResidualMaps):
    def __init__(self, ridge, stats, window: int = 4, rank: int = 64, scale: float = 0.1, first_lag: int = 0):
        super().__init__(ridge, stats, CapacityConfig())
        if window < 1 or rank < 1:
            raise ValueError(f"window and rank must be >= 1, got {window}, {rank}")
        if first_lag not in (0, 1):
            raise ValueError("first_lag must be 0 (the token and the w-1 before it) or 1 (the w before it)")
        self.window, self.rank, self.scale, self.first_lag = window, rank, scale, first_lag
        lt = self.wk.shape[0]
        for m in "kv":  # the diagonal of the input covariance from the ZCA matrix: cov + eps = white^-2
            w, q = torch.linalg.eigh(getattr(self, f"white_{m}").double())  # (LU-based inv fails in MKL here)
            var = (q * q * w.clamp(min=1e-12).pow(-2)[:, None, :]).sum(-1)  # diag(Q diag(w^-2) Q^T)
            self.register_buffer(f"std_{m}", var.sqrt().float())  # [L_t, d_s]
        d_in = 2 * self.d_s
        g = torch.zeros(lt, window, d_in)
        g[:, 0] = 1.0  # lag first_lag
        self.ctx_g = nn.Parameter(g)
        self.ctx_norm = nn.Parameter(torch.ones(lt, d_in))
        self.ctx_a = nn.Parameter(torch.randn(lt, d_in, rank) / math.sqrt(d_in))
        self.ctx_b = nn.Parameter(torch.zeros(lt, rank, 2 * self.d_t))
        self.ctx_gate = nn.Parameter(torch.ones(lt, 2, self.num_heads))

    def context(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the mixed inputs {"k", "v": [L_t, T, d_s]} -> the branch's K and V outputs [L_t, T, d_t] (before
        sigma)."""
        u = torch.cat([(x[m] - getattr(self, f"mu_{m}")[:, None]) / getattr(self, f"std_{m}")[:, None] for m in "kv"],
                      dim=-1)  # [L_t, T, 2 d_s]
        lt, t, _ = u.shape
        c = torch.zeros_like(u)
        for i in range(self.window):  # causal: token t reads t-d, d = first_lag + i (zero before the first token)
            d = self.first_lag + i
            if d == 0:
                c = c + u * self.ctx_g[:, i, None]
            elif d < t:
                c = c + F.pad(u[:, :t - d], (0, 0, d, 0)) * self.ctx_g[:, i, None]
        h = F.rms_norm(c, (c.shape[-1],)) * self.ctx_norm[:, None]
        h = F.silu(torch.bmm(h, self.ctx_a))
        r = torch.bmm(h, self.ctx_b) * (self.scale / math.sqrt(self.rank))  # [L_t, T, 2 d_t]
        r = r.view(lt, t, 2, self.num_heads, -1) * self.ctx_gate[:, None, :, :, None]
        return r[:, :, 0].reshape(lt, t, -1), r[:, :, 1].reshape(lt, t, -1)

    def forward(self, xk, xv, ids=None):
        from kvbridge.adapters.adapter import source_inputs

        yk, yv = super().forward(xk, xv, ids)
        sk, sv = source_inputs(self.src_basis, xk.float(), xv.float())
        x = {"k": self.mixed(sk, "k", ids), "v": self.mixed(sv, "v", ids)}
        ck, cv = self.context(x)
        return yk + self.sigma_k[:, None, None] * ck, yv + self.sigma_v[:, None, None] * cv

    def branch_macs_per_token(self) -> int:
        lt = self.wk.shape[0]
        d_in = 2 * self.d_s
        return lt * (self.window * d_in + d_in * self.rank + self.rank * 2 * self.d_t)
