"""The KV a trainable map gives start + context of a window, differentiable: projected from the source alone
(`residual.ResidualMaps`, as `adapter.project` builds it: un-rotated maps, the start token's exact KV, the target's
RoPE at 0..T-1) or the target's own KV plus a residual from the source (`fuser.FuserMaps`)."""

from __future__ import annotations

import torch
from kvbridge.adapters.fuser import FuserMaps
from kvbridge.adapters.residual import ResidualMaps
from kvbridge.transfer.models import LoadedModel


def project_window(maps: ResidualMaps, start_kv: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                   start_mask: torch.Tensor, target: LoadedModel, ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `adapter.project` computes, differentiable. xk, xv: [L_s, T, d_s]; start_mask, ids: [T] (target ids:
    the token features); start_kv: [L_t, 2, H_t, D_t] (keys un-rotated) -> keys (rotated at 0..T-1), values:
    [L_t, H_t, T, D_t]."""
    spec = target.spec
    yk, yv = maps(xk, xv, ids)  # [L_t, T, d_t]
    lt, t, _ = yk.shape
    k = yk.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = yv.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    m = start_mask.to(k.device)[None, None, :, None]
    k = torch.where(m, start_kv[:, 0, :, None, :], k)
    v = torch.where(m, start_kv[:, 1, :, None, :], v)
    return target.rope.rotate_all(k, torch.arange(t)), v


def context_kv(maps, start_kv: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, start_mask: torch.Tensor,
               target: LoadedModel, ids: torch.Tensor, own_k: torch.Tensor | None = None,
               own_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache a map gives for start + context: projected (ResidualMaps) or fused with the target's own K/V
    (FuserMaps; own_k, own_v needed) -> keys (rotated), values [L_t, H_t, T, D_t]."""
    if isinstance(maps, FuserMaps):
        if own_k is None or own_v is None:
            raise ValueError("a fuser needs the target's own K/V of the context")
        return maps.fuse(xk, xv, own_k, own_v, target, keep=start_mask)
    return project_window(maps, start_kv, xk, xv, start_mask, target, ids)
