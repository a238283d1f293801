"""RoPE on cached keys: rotate, unrotate and shift, with cos/sin from the model's own rotary module.

Convention: transformers' `rotate_half` (the first and second halves of the rotated dims form the pairs).
With partial rotary (`partial_rotary_factor` < 1) only the first R = cos.shape[-1] dims rotate; the rest pass.

Scaled variants (yarn, longrope) multiply cos and sin by an attention scale s, so their "rotation" is s·R(θ).
`unrotate` divides by cos² + sin² = s², which makes unrotate∘rotate the identity for every scaling type.
"""

from __future__ import annotations

import copy
import inspect
import sys

import torch
from kvbridge.transfer.spec import ModelSpec, RopeSpec, find_rotary_module
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' convention, for reference and tests. x: [..., R] -> [..., R]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply RoPE. x: [..., T, D]; cos, sin: [T, R] with R <= D, R even. Returns [..., T, D] in x's dtype, or
    written into `out` (x's shape, float32 or float64 as the work dtype; not with autograd) and returned."""
    return _apply(x, cos, sin, inverse=False, out=out)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert `rotate`. x: [..., T, D]; cos, sin: [T, R]. Returns [..., T, D] in x's dtype."""
    return _apply(x, cos, sin, inverse=True)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
           out: torch.Tensor | None = None) -> torch.Tensor:
    # With pairs (x1, x2) = (x[:h], x[h:]) and rotate_half(x) = (-x2, x1):
    #   rotate:   (x1·c1 − x2·s1,  x2·c2 + x1·s2)
    #   unrotate: (x1·c1 + x2·s1,  x2·c2 − x1·s2) / (c² + s²)      (c² + s² = attention scale², usually 1)
    r = cos.shape[-1]
    h = r // 2
    work = _compute_dtype(x)
    cos, sin = cos.to(device=x.device, dtype=work), sin.to(device=x.device, dtype=work)
    x1, x2 = x[..., :h].to(work), x[..., h:r].to(work)
    sign = 1.0 if inverse else -1.0
    if torch.is_grad_enabled() and x.requires_grad:  # autograd path (adapter refinement): no out= writes
        o1 = torch.addcmul(x1 * cos[:, :h], x2, sin[:, :h], value=sign)
        o2 = torch.addcmul(x2 * cos[:, h:], x1, sin[:, h:], value=-sign)
        out = torch.cat((o1, o2), dim=-1)
        if inverse:
            out = out / (cos * cos + sin * sin)
        if r < x.shape[-1]:
            out = torch.cat((out, x[..., r:].to(work)), dim=-1)
        return out.to(x.dtype)
    if out is not None and (out.shape != x.shape or out.dtype != work):
        raise ValueError(f"rotate out= must be {work} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    given = out is not None  # (out must not overlap x: o1 is written before o2 reads x1)
    out = out if given else torch.empty(x.shape, dtype=work, device=x.device)
    if inverse:  # the division by c² + s² on the [T, R] tables, not on every key
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, sin / norm
    o1, o2 = out[..., :h], out[..., h:r]
    torch.mul(x1, cos[:, :h], out=o1).addcmul_(x2, sin[:, :h], value=sign)
    torch.mul(x2, cos[:, h:], out=o2).addcmul_(x1, sin[:, h:], value=-sign)
    if r < x.shape[-1]:
        out[..., r:] = x[..., r:]
    return out if given or work == x.dtype else out.to(x.dtype)


def consecutive_runs(layers: list[int]) -> list[slice]:
    """Sorted layer indices -> the slices of their runs of consecutive indices ([0, 1, 2, 5, 6] -> 0:3, 5:7)."""
    runs: list[slice] = []
    for layer in layers:
        if runs and runs[-1].stop == layer:
            runs[-1] = slice(runs[-1].start, layer + 1)
        else:
            runs.append(slice(layer, layer + 1))
    return runs


class ModelRope:
    """Per-layer RoPE of one model: cos/sin tables, rotate/unrotate/shift of cached keys.

    Holds a private copy of the model's rotary module, so asking for tables never changes the live model's state
    (dynamic and longrope modules keep state between calls). Tables are always computed in float32.
    """

    def __init__(self, spec: ModelSpec, rotary_module: nn.Module):
        self.spec = spec
        self._module = copy.deepcopy(rotary_module).float()
        self._takes_layer_type = "layer_type" in inspect.signature(self._module.forward).parameters
        self._device = next(iter(self._module.buffers()), torch.empty(0)).device
        by_rope: dict[RopeSpec, list[int]] = {}
        for layer in spec.layers:
            if layer.rope is not None:
                by_rope.setdefault(layer.rope, []).append(layer.index)
        # (rope, layers, the runs of consecutive layers as slices)
        self._groups = [(rope, layers, consecutive_runs(layers)) for rope, layers in by_rope.items()]

    @property
    def device(self) -> torch.device:
        """Where the tables are computed (the model's rotary module's device)."""
        return self._device

    @property
    def families(self) -> list[tuple[RopeSpec, list[int]]]:
        """Each distinct RoPE of the model with the layers that use it (layers without RoPE are in none)."""
        return [(rope, layers) for rope, layers, _ in self._groups]

    @classmethod
    def from_model(cls, model: nn.Module, spec: ModelSpec) -> "ModelRope":
        """Build from a loaded model and check that its attention rotates keys the way `rotate` does."""
        rope = cls(spec, find_rotary_module(model, spec.name))
        rope.check_convention(model)
        return rope

    def check_convention(self, model: nn.Module, atol: float = 1e-5) -> float:
        """Compare `rotate` with the model's own `apply_rotary_pos_emb` on random keys, for each RoPE family.

        Returns the largest absolute difference seen. Raises ValueError (naming model, layer and reason) when the
        modeling code has no such function or rotates differently (e.g. interleaved pairs).
        """
        worst = 0.0
        for _, layers in self.families:  # the first layer of each RoPE family
            layer = layers[0]
            ours, theirs = self.convention_probe(model, layer)
            err = float((ours - theirs).abs().max())
            if err > atol:
                raise ValueError(
                    f"model {self.spec.name!r} layer {layer}: its RoPE does not follow the rotate_half convention "
                    f"kvbridge implements (max difference {err:.3g} on random keys); re-rotating its keys would be "
                    "wrong"
                )
            worst = max(worst, err)
        return worst

    def convention_probe(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random keys rotated by `rotate` and by the model's own `apply_rotary_pos_emb` at a few positions of
        `layer`: (ours, theirs), each [1, H, T, D] on the device of the model's rotary module, where every tensor made
        here lives (a model on CUDA gets no CPU tensor). No value is read back, so the probe runs on fake tensors."""
        rope = self.layer_rope(layer)
        if rope is None:
            raise ValueError(f"layer {layer} of {self.spec.name!r} applies no RoPE: there is no convention to check")
        modeling = sys.modules.get(type(model).__module__)
        apply = getattr(modeling, "apply_rotary_pos_emb", None)
        if apply is None:
            raise ValueError(
                f"model {self.spec.name!r} layer {layer}: {type(model).__module__} defines no "
                "apply_rotary_pos_emb, so kvbridge cannot verify how it rotates keys"
            )
        valid = [p for p in (0, 1, 7, 100, 1000, 4095) if p < max(rope.original_max_positions, 2)]
        positions = torch.tensor(valid, dtype=torch.long, device=self._device)  # [T], all valid: no check needed
        cos, sin = self._compute_tables(rope, positions)
        gen = torch.Generator().manual_seed(0)  # keys drawn on the CPU (the same in every process), then moved
        k = torch.randn(1, self.spec.num_kv_heads, len(valid), self.spec.head_dim, generator=gen).to(self._device)
        try:
            _, theirs = apply(k.clone(), k.clone(), cos[None], sin[None])  # keys: [1, H, T, D] as attention sees
        except Exception as exc:  # a signature we do not know how to call
            raise ValueError(
                f"model {self.spec.name!r} layer {layer}: could not call {type(model).__module__}."
                f"apply_rotary_pos_emb(q, k, cos, sin) to verify the RoPE convention: {exc}"
            ) from exc
        return rotate(k, cos, sin), theirs

    def layer_rope(self, layer: int) -> RopeSpec | None:
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range: {self.spec.name!r} has {self.spec.num_layers} layers")
        return self.spec.layers[layer].rope

    def cos_sin(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one layer. positions: [T] int64 -> cos, sin: [T, R] float32 on the rope's device."""
        rope = self.layer_rope(layer)
        if rope is None:
            raise ValueError(f"layer {layer} of {self.spec.name!r} applies no RoPE; it has no cos/sin tables")
        return self._tables(rope, layer, positions)

    def _tables(self, rope: RopeSpec, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D [T], got shape {tuple(positions.shape)}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
        if rope.position_dependent and positions.numel() and int(positions.max()) >= rope.original_max_positions:
            how = {"dynamic": "dynamic-NTK RoPE rescales its frequencies with the longest sequence seen",
                   "longrope": "longrope switches every position's factors to its long ones once a call reaches past "
                               "original_max_position_embeddings (Phi-3-128k)"}[rope.rope_type]
            raise ValueError(
                f"{self.spec.name!r} layer {layer}: {how}, so keys at positions >= {rope.original_max_positions} "
                f"cannot be re-rotated exactly (got position {int(positions.max())}); keep documents and their "
                f"placement below {rope.original_max_positions} tokens"
            )
        return self._compute_tables(rope, positions)

    def _compute_tables(self, rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (checked) -> cos, sin [T, R] float32 on the rotary module's device; reads no value back."""
        dummy = torch.empty(0, dtype=torch.float32, device=self._device)
        pos = positions.to(device=self._device, dtype=torch.long)[None]
        with torch.no_grad():
            if self._takes_layer_type:
                cos, sin = self._module(dummy, pos, rope.module_key)
            else:
                cos, sin = self._module(dummy, pos)
        return cos[0].float(), sin[0].float()

    def rotate(self, x: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        # x: [..., T, D]; positions: [T]
        if self.layer_rope(layer) is None:
            return x
        cos, sin = self.cos_sin(layer, positions)
        return rotate(x, cos, sin)

    def unrotate(self, x: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        # x: [..., T, D]; positions: [T]
        if self.layer_rope(layer) is None:
            return x
        cos, sin = self.cos_sin(layer, positions)
        return unrotate(x, cos, sin)

    def shift(self, x: torch.Tensor, layer: int, positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """Move keys rotated at `positions` to `new_positions`. x: [..., T, D]; positions, new_positions: [T].

        Unrotate then rotate, which is exact for every scaling type (for plain RoPE it equals one rotation by Δ).
        """
        if positions.shape != new_positions.shape:
            raise ValueError(f"positions {tuple(positions.shape)} and new_positions "
                             f"{tuple(new_positions.shape)} differ")
        if self.layer_rope(layer) is None:
            return x
        return self.rotate(self.unrotate(x, layer, positions), layer, new_positions)

    def _per_group(self, keys: torch.Tensor, fn, out: torch.Tensor | None, *position_sets: torch.Tensor
                   ) -> torch.Tensor:
        """keys: [L, H, T, D] -> [L, H, T, D], written into `out` when given (float32, or float64 for float64
        keys). fn(k, tables, o) transforms a run of consecutive layers k that share one RopeSpec into o, tables:
        one (cos, sin) per position set, computed once per RopeSpec. Layers without RoPE are copied as they are;
        runs are slices, so nothing is gathered or scattered."""
        if keys.shape[0] != self.spec.num_layers:
            raise ValueError(f"keys have {keys.shape[0]} layers, {self.spec.name!r} has {self.spec.num_layers}")
        if torch.is_grad_enabled() and keys.requires_grad:  # autograd (adapter training): no writes into a result
            if out is not None:
                raise ValueError("out= is not differentiable: call without it when keys require grad")
            layers_out = list(keys.unbind(0))  # each run transformed, layers without RoPE as they are
            for rope, layers, runs in self._groups:
                tables = [self._tables(rope, layers[0], p) for p in position_sets]
                for run in runs:
                    layers_out[run] = fn(keys[run], tables, None).unbind(0)
            return torch.stack(layers_out)
        work = _compute_dtype(keys)
        result = out if out is not None else torch.empty(keys.shape, dtype=work, device=keys.device)
        if sum(len(g[1]) for g in self._groups) < self.spec.num_layers:
            result.copy_(keys)
        for rope, layers, runs in self._groups:
            tables = [self._tables(rope, layers[0], p) for p in position_sets]
            for run in runs:
                fn(keys[run], tables, result[run])
        return result if out is not None or work == keys.dtype else result.to(keys.dtype)

    def rotate_all(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """keys: [L, H, T, D] un-rotated; positions: [T] -> [L, H, T, D] rotated (written into `out`, float32 of
        keys' shape, when given: one copy less for a caller that assembles a larger tensor)."""
        return self._per_group(keys, lambda k, tables, o: rotate(k, *tables[0], out=o), out, positions)

    def unrotate_all(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """keys: [L, H, T, D] rotated at positions [T] -> [L, H, T, D] un-rotated."""
        return self._per_group(keys, lambda k, tables, o: _apply(k, *tables[0], inverse=True, out=o), None,
                               positions)

    def shift_all(self, keys: torch.Tensor, positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """keys: [L, H, T, D] rotated at positions [T] -> rotated at new_positions [T]."""
        if positions.shape != new_positions.shape:
            raise ValueError(f"positions {tuple(positions.shape)} and new_positions "
                             f"{tuple(new_positions.shape)} differ")

        def move(k: torch.Tensor, tables, o: torch.Tensor) -> torch.Tensor:
            return rotate(unrotate(k, *tables[0]), *tables[1], out=o)

        return self._per_group(keys, move, None, positions, new_positions)
