"""A cheaper context branch (issue 38): the library's branch (kvbridge.adapters.context) filters 2 d_in = 640 input
features over its lags before its first GEMM, elementwise work that made the projection 10.1x the target's prefill
instead of the shipped adapter's 19.5x. This one applies the first GEMM to each token once and filters its r outputs:

  p_t = ((x_t - mu) / std) @ A                  A: [2 d_in, r], per token (the cost of the library's first GEMM)
  c_t = sum_i g_i * p_{t - lag_i}               g: [w, r]: r values a lag instead of 2 d_in
  [dK_t, dV_t] = silu(rmsnorm(c_t) * n) @ B     the norm over r values; B starts at zero

(per token and layer: 2 d_in r + w r + r 2 d_t multiply-adds, the filter 192 instead of 5,120 at w 8, r 24). Trained
by train.py --factored, scored by eval.py (which reads train.py's args.json; the projection's map patched, one tile).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kvbridge.adapters.adapter import RMS_EPS
from kvbridge.adapters.context import ContextConfig, ContextMaps
from torch import nn


class FactoredContextMaps(ContextMaps):
    def __init__(self, ridge, stats, config: ContextConfig):
        super().__init__(ridge, stats, config)
        lt = self.wk.shape[0]
        g = torch.zeros(lt, config.window, config.rank)
        g[:, 0] = 1.0
        self.ctx_g = nn.Parameter(g)  # [L_t, w, r]
        self.ctx_norm = nn.Parameter(torch.ones(lt, config.rank))

    def forward(self, xk, xv, ids=None):
        inputs = self.inputs(xk, xv, ids)
        yk, yv = self.maps(inputs)  # the per-token maps (ResidualMaps)
        x = torch.cat((inputs["k"], inputs["v"]), dim=-1)  # [L_t, T, 2 d_in]
        mu = torch.cat((self.mu_k, self.mu_v), dim=-1)[:, None]
        std = torch.cat((self.std_k, self.std_v), dim=-1)[:, None]
        p = torch.bmm((x - mu) / std, self.ctx_a)  # [L_t, T, r]
        lt, t, _ = p.shape
        c = torch.zeros_like(p)
        for i, lag in enumerate(self.context_config.lags.tolist()):
            if lag == 0:
                c = c + p * self.ctx_g[:, i, None]
            elif lag < t:
                c = c + F.pad(p[:, :t - lag], (0, 0, lag, 0)) * self.ctx_g[:, i, None]
        h = F.silu(F.rms_norm(c, (c.shape[-1],), eps=RMS_EPS) * self.ctx_norm[:, None])
        cfg = self.context_config
        r = torch.bmm(h, self.ctx_b) * (cfg.scale / math.sqrt(cfg.rank))
        r = r.view(lt, t, 2, self.num_heads, -1) * self.ctx_gate[:, None, :, :, None]
        ck, cv = r[:, :, 0].reshape(lt, t, -1), r[:, :, 1].reshape(lt, t, -1)
        return yk + self.sigma_k[:, None, None] * ck, yv + self.sigma_v[:, None, None] * cv

    def to_adapter(self, ridge):
        raise ValueError("a factored context branch has no adapter format yet (eval.py --factored patches the map)")
