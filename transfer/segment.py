"""KVSegment: the one canonical in-memory form of a run of cached tokens of one model.

Layout: `kv[l, 0]` are layer l's keys and `kv[l, 1]` its values, each `[H_kv, T, D]` — the same per-token layout
as a block of the paged store (`[L, 2, H_kv, block, D]`), so storing and gathering are single copies.
Metadata (ids, positions, identity, rotation state) sits apart from the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from kvbridge.transfer.spec import ModelIdentity


@dataclass(frozen=True, slots=True)
class KVSegment:
    kv: torch.Tensor  # [L, 2, H_kv, T, D]: keys at [:, 0], values at [:, 1]
    token_ids: torch.Tensor  # [T] int64 on the CPU: the tokens whose KV this is
    positions: torch.Tensor  # [T] int64 on the CPU: the RoPE position each key was (or will be) rotated at
    model: ModelIdentity  # whose KV space this is
    rotated: bool  # True: keys carry RoPE at `positions`, as the model caches them; False: un-rotated

    def __post_init__(self):
        if not isinstance(self.kv, torch.Tensor) or self.kv.ndim != 5 or self.kv.shape[1] != 2:
            shape = tuple(self.kv.shape) if isinstance(self.kv, torch.Tensor) else type(self.kv).__name__
            raise ValueError(f"KVSegment.kv must be [L, 2, H_kv, T, D], got {shape}")
        if not self.kv.is_floating_point():
            raise ValueError(f"KVSegment.kv must be a floating-point tensor, got {self.kv.dtype}")
        t = self.kv.shape[3]
        for field in ("token_ids", "positions"):
            value = getattr(self, field)
            if not isinstance(value, torch.Tensor) or value.shape != (t,) or value.dtype != torch.int64:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"KVSegment.{field} must be an int64 tensor of shape [{t}], got {got}")
            if value.device.type != "cpu":
                raise ValueError(f"KVSegment.{field} must live on the CPU, got {value.device}")
        if t and int(self.positions.min()) < 0:
            raise ValueError(f"KVSegment.positions must be >= 0, got min {int(self.positions.min())}")

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def keys(self) -> torch.Tensor:
        # [L, H_kv, T, D]
        return self.kv[:, 0]

    @property
    def values(self) -> torch.Tensor:
        # [L, H_kv, T, D]
        return self.kv[:, 1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def is_contiguous_from(self, start: int = 0) -> bool:
        """True when positions are start, start+1, ..., start+T-1."""
        expected = torch.arange(start, start + self.num_tokens, dtype=torch.int64)
        return bool(torch.equal(self.positions, expected))

    def slice(self, start: int, end: int) -> "KVSegment":
        """Tokens [start, end) as a view of this segment's storage."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"slice [{start}, {end}) out of range for a segment of {self.num_tokens} tokens")
        return replace(self, kv=self.kv[:, :, :, start:end], token_ids=self.token_ids[start:end],
                       positions=self.positions[start:end])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSegment":
        """The same segment on another device and/or in another floating dtype (metadata stays on the CPU)."""
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"a KV segment's dtype must be floating point, got {dtype}")
        return replace(self, kv=self.kv.to(device=device, dtype=dtype))

    def with_keys(self, keys: torch.Tensor, positions: torch.Tensor, rotated: bool) -> "KVSegment":
        """A copy with new keys ([L, H_kv, T, D]) at new positions ([T]); values are shared."""
        if keys.shape != self.keys.shape:
            raise ValueError(f"keys must have shape {tuple(self.keys.shape)}, got {tuple(keys.shape)}")
        kv = torch.stack((keys.to(self.kv.dtype), self.values), dim=1)
        return replace(self, kv=kv, positions=positions.to(torch.int64).cpu(), rotated=rotated)

    @staticmethod
    def concat(segments: list["KVSegment"]) -> "KVSegment":
        """Join segments of one model along the token axis, in order."""
        if not segments:
            raise ValueError("concat needs at least one segment")
        first = segments[0]
        for i, seg in enumerate(segments[1:], start=1):
            if seg.model != first.model:
                raise ValueError(f"segment {i} belongs to {seg.model.key}, segment 0 to {first.model.key}")
            if seg.rotated != first.rotated:
                raise ValueError(f"segment {i} has rotated={seg.rotated}, segment 0 rotated={first.rotated}")
            if seg.kv.shape[:3] != first.kv.shape[:3] or seg.head_dim != first.head_dim:
                raise ValueError(f"segment {i} has layout {tuple(seg.kv.shape)}, segment 0 {tuple(first.kv.shape)}")
        return KVSegment(
            kv=torch.cat([s.kv.to(first.device, first.dtype) for s in segments], dim=3),
            token_ids=torch.cat([s.token_ids for s in segments]),
            positions=torch.cat([s.positions for s in segments]),
            model=first.model,
            rotated=first.rotated,
        )
