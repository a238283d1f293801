"""The learned fuser (C2C's setting): the target still prefills the context itself, and the source's KV, mapped
through the adapter's layer mix, adds a learned residual to the target's own K/V — what the larger source read
that the target did not.

For target layer j and KV head h (x: the source features mixed as the ridge adapter mixes them; z: x whitened by the
ridge statistics, as in residual.py):

  K_fused = K_own + rotate_pos( sigma_kj * gate_kjh * ((z_k @ A_kj) @ B_kj / sqrt(r) + c_kj) )
  V_fused = V_own +             sigma_vj * gate_vjh * ((z_v @ A_vj) @ B_vj / sqrt(r) + c_vj)

A low-rank residual (rank r) with B and c starting at zero, so an untrained fuser returns exactly the target's own
cache; sigma_j is the target's own K (V) standard deviation in layer j, so Adam's step is in units of the cache's
own scale. The key residual lives in un-rotated space and is rotated at the token's position, as projected keys are.
Positions without a source token (the start token, unmapped tokens: their x is zero) keep their own K/V exactly.

Trained on the next-token cross-entropy of the true continuation (`TrainerConfig(objective="ce")`): the KL to the
target's own prefill would have the target itself as its optimum. Saved as an adapter file of format 2 with
"kind": "fuser" (whitening folded into A, so the file holds mixes, A, B, c and gates only).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from kvbridge.adapters.adapter import Adapter, AdapterMeta, has_text_source, mix_layers
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.pairs import pair_text
from kvbridge.adapters.residual import whitening
from kvbridge.adapters.teacher import source_features
from kvbridge.adapters.weights import META_FIELDS, check_fitted_for, check_meta
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.tensor_files import json_field, read_tensors, save_tensors
from torch import nn

FUSER_FORMAT_VERSION = 2
FUSER_TENSORS = ("layer_map", "mix_k", "mix_v", "a_k", "a_v", "b_k", "b_v", "c_k", "c_v", "gate_k", "gate_v",
                 "sigma_k", "sigma_v")


@dataclass(frozen=True)
class FuserConfig:
    rank: int = 64  # width of the low-rank residual per layer and map
    eps: float = 1e-3  # whitening floor (residual.whitening)

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


class FuserMaps(nn.Module):
    """Per target layer and map (K, V): the mix of source layers (buffers, from the ridge adapter), a whitening
    (buffers; identity once folded for a saved file) and the low-rank residual with per-head gates (parameters)."""

    fuses = True  # the trainer and probes pass the target's own K/V to `window_kv`

    def __init__(self, layer_map: torch.Tensor, mix: dict[str, torch.Tensor], mu: dict[str, torch.Tensor],
                 white: dict[str, torch.Tensor] | None, sigma: dict[str, torch.Tensor], num_heads: int, d_t: int,
                 config: FuserConfig):
        super().__init__()
        self.config, self.num_heads, self.d_t = config, num_heads, d_t
        self.register_buffer("layer_map", layer_map.clone())
        lt, d_s = mu["k"].shape
        self.d_s = d_s
        self.whitened = white is not None
        for m in "kv":
            self.register_buffer(f"mix_{m}", mix[m].detach().clone().float())
            self.register_buffer(f"mu_{m}", mu[m].detach().clone().float())
            if white is not None:
                self.register_buffer(f"white_{m}", white[m].detach().clone().float())
            self.register_buffer(f"sigma_{m}", sigma[m].detach().clone().float())
            a = torch.randn(lt, d_s, config.rank) / math.sqrt(d_s)  # seeded by the caller's generator state
            setattr(self, f"a_{m}", nn.Parameter(a))
            setattr(self, f"b_{m}", nn.Parameter(torch.zeros(lt, config.rank, d_t)))
            setattr(self, f"c_{m}", nn.Parameter(torch.zeros(lt, d_t)))
            setattr(self, f"gate_{m}", nn.Parameter(torch.ones(lt, num_heads)))

    @classmethod
    def from_ridge(cls, ridge: Adapter, stats: RidgeStats, config: FuserConfig) -> "FuserMaps":
        """Mixes from a fitted ridge adapter, whitening and scales from its training statistics."""
        if ridge.token_rank or stats.d_tok:
            raise ValueError("a fuser is built from a ridge fit without token features (token_rank 0)")
        lt = ridge.wk.shape[0]
        mu, white, sigma = {}, {}, {}
        for m in "kv":
            rows = [whitening(stats, m, j, getattr(ridge, f"mix_{m}")[j], config.eps) for j in range(lt)]
            mu[m] = torch.stack([r[0] for r in rows])
            white[m] = torch.stack([r[1] for r in rows])
            sigma[m] = torch.tensor([r[2] for r in rows])
        mix = {m: getattr(ridge, f"mix_{m}") for m in "kv"}
        return cls(ridge.layer_map, mix, mu, white, sigma, ridge.meta.target["num_kv_heads"], ridge.wk.shape[2],
                   config)

    def mixed(self, x: torch.Tensor, m: str) -> torch.Tensor:
        return mix_layers(x.float(), self.layer_map, getattr(self, f"mix_{m}"))  # [L_s, T, d_s] -> [L_t, T, d_s]

    def residual(self, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xk, xv: [L_s, T, d_s] -> the residuals [L_t, T, d_t] (keys un-rotated); zero where x is zero."""
        out = []
        for m, x in (("k", xk), ("v", xv)):
            mixed = self.mixed(x, m)
            present = (mixed.abs().sum(-1, keepdim=True) > 0).float()  # [L_t, T, 1]: a source token is there
            z = mixed - getattr(self, f"mu_{m}")[:, None]
            if self.whitened:
                z = torch.bmm(z, getattr(self, f"white_{m}"))
            h = torch.bmm(torch.bmm(z, getattr(self, f"a_{m}")), getattr(self, f"b_{m}")) / math.sqrt(self.config.rank)
            r = h + getattr(self, f"c_{m}")[:, None]
            lt, t, _ = r.shape
            r = (r.view(lt, t, self.num_heads, -1) * getattr(self, f"gate_{m}")[:, None, :, None]).view(lt, t, -1)
            out.append(getattr(self, f"sigma_{m}")[:, None, None] * r * present)
        return out[0], out[1]

    def fuse(self, xk: torch.Tensor, xv: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor,
             target: LoadedModel, keep: torch.Tensor | None = None, first_position: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """own_k (rotated), own_v: [L_t, H_t, T, D_t] the target's own cache of T tokens at positions
        first_position.. ; xk, xv: [L_s, T, d_s] the source features of the same tokens; keep: [T] bool, positions
        that stay exactly the target's own (the start token) -> fused K (rotated), V."""
        if keep is not None:
            xk = xk * (~keep.to(xk.device))[None, :, None]
            xv = xv * (~keep.to(xv.device))[None, :, None]
        rk, rv = self.residual(xk, xv)
        lt, t, _ = rk.shape
        spec = target.spec
        rk = rk.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        rv = rv.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        rk = target.rope.rotate_all(rk, torch.arange(first_position, first_position + t))
        return own_k.float() + rk.to(own_k.device), own_v.float() + rv.to(own_v.device)

    def folded(self) -> dict[str, torch.Tensor]:
        """The tensors of a saved fuser: whitening folded into A (A' = P A; c' = c - mu P A B / sqrt(r))."""
        tensors = {"layer_map": self.layer_map}
        with torch.no_grad():
            for m in "kv":
                a, b = getattr(self, f"a_{m}"), getattr(self, f"b_{m}")
                mu = getattr(self, f"mu_{m}")
                a_f = torch.bmm(getattr(self, f"white_{m}"), a) if self.whitened else a.clone()
                c = getattr(self, f"c_{m}") - torch.bmm(torch.bmm(mu[:, None], a_f), b)[:, 0] / math.sqrt(
                    self.config.rank)
                tensors |= {f"mix_{m}": getattr(self, f"mix_{m}"), f"a_{m}": a_f, f"b_{m}": b.detach(),
                            f"c_{m}": c, f"gate_{m}": getattr(self, f"gate_{m}").detach(),
                            f"sigma_{m}": getattr(self, f"sigma_{m}")}
        return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def save_fuser(maps: FuserMaps, meta: AdapterMeta, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a fuser file (format 2, kind "fuser"): the folded tensors in `dtype` (the layer map stays int64)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"fuser files end in .safetensors, got {path.name!r}")
    tensors = saved_tensors(maps, dtype)
    record = dataclasses.asdict(meta) | {"format_version": FUSER_FORMAT_VERSION, "kind": "fuser",
                                         "rank": maps.config.rank}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, tensors, metadata={"kvbridge_adapter": json.dumps(record, sort_keys=True)})
    return path


def load_fuser(path: str | Path) -> tuple[FuserMaps, dict]:
    """A saved fuser (float32 in memory) and its metadata; refuses files that are not fusers."""
    path = Path(path)
    t, header = read_tensors(path)
    record = json_field(path, header, "kvbridge_adapter") if "kvbridge_adapter" in header else {}
    if record.get("kind") != "fuser" or record.get("format_version") != FUSER_FORMAT_VERSION:
        raise ValueError(f"{path.name} is not a kvbridge fuser file (format {FUSER_FORMAT_VERSION}, kind 'fuser')")
    meta = fuser_meta(record, path)
    missing = [n for n in FUSER_TENSORS if n not in t]
    if missing:
        raise ValueError(f"{path.name} lacks tensors {missing}")
    rank = record.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{path.name}: fuser metadata rank must be an int >= 1, got {rank!r}")
    _check_saved(t, meta, rank, path)
    return _from_saved(t, rank), record


def _check_saved(t: dict[str, torch.Tensor], meta: AdapterMeta, rank: int, path: Path) -> None:
    """Every tensor of a fuser file of the shape and kind its metadata says (the parameters are filled by copy_, which
    would broadcast a tensor of rank 1 over the metadata's rank 8), the layer map inside the source's layers."""
    s, tg = meta.source, meta.target
    lt, heads = tg["num_layers"], tg["num_kv_heads"]
    d_s, d_t = s["num_kv_heads"] * s["head_dim"], heads * tg["head_dim"]
    k = t["layer_map"].shape[1] if t["layer_map"].ndim == 2 else -1
    expect = {"layer_map": (lt, k)}
    for m in "kv":
        expect |= {f"mix_{m}": (lt, k), f"sigma_{m}": (lt,), f"a_{m}": (lt, d_s, rank), f"b_{m}": (lt, rank, d_t),
                   f"c_{m}": (lt, d_t), f"gate_{m}": (lt, heads)}
    for name, shape in expect.items():
        if tuple(t[name].shape) != shape:
            raise ValueError(f"{path.name}: fuser tensor {name} has shape {tuple(t[name].shape)}, expected {shape} "
                             f"for {s['name']} -> {tg['name']} at rank {rank}")
        if (t[name].dtype == torch.int64) != (name == "layer_map") or not (
                name == "layer_map" or t[name].dtype.is_floating_point):
            raise ValueError(f"{path.name}: fuser tensor {name} has dtype {t[name].dtype}")
    if t["layer_map"].numel() and not 0 <= int(t["layer_map"].min()) <= int(t["layer_map"].max()) < s["num_layers"]:
        raise ValueError(f"{path.name}: fuser layer_map refers to source layers outside [0, {s['num_layers']})")


def fuser_meta(record: dict, path: Path) -> AdapterMeta:
    """The AdapterMeta of a fuser file's record, checked as an adapter's is (io.load_adapter): ValueError naming the
    file and the field when a model's record (its config hash above all) is missing or malformed."""
    absent = [name for name in META_FIELDS if name not in record]
    if absent:
        raise ValueError(f"{path}: fuser metadata field {absent[0]!r} missing (a fuser records {META_FIELDS}: "
                         "without the models' config hashes it cannot be checked against the models it runs with)")
    fields = {f.name for f in dataclasses.fields(AdapterMeta)}
    meta = AdapterMeta(**{k: v for k, v in record.items() if k in fields})
    try:
        check_meta(meta)
    except ValueError as exc:
        raise ValueError(f"{path}: {str(exc).replace('adapter metadata', 'fuser metadata')}") from None
    return meta


def saved_tensors(maps: FuserMaps, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a fuser file holds: the folded ones in `dtype` (the layer map stays int64)."""
    return {k: (v if k == "layer_map" else v.to(dtype)) for k, v in maps.folded().items()}


def as_saved(maps: FuserMaps, dtype: torch.dtype) -> FuserMaps:
    """The fuser `save_fuser(maps, ..., dtype=dtype)` writes, as `load_fuser` reads it back (folded, rounded)."""
    return _from_saved(saved_tensors(maps, dtype), maps.config.rank)


def _from_saved(t: dict[str, torch.Tensor], rank: int) -> FuserMaps:
    f32 = {k: (v if k == "layer_map" else v.float()) for k, v in t.items()}
    mu = {m: torch.zeros(f32[f"a_{m}"].shape[:2]) for m in "kv"}  # folded into c
    maps = FuserMaps(f32["layer_map"], {m: f32[f"mix_{m}"] for m in "kv"}, mu, None,
                     {m: f32[f"sigma_{m}"] for m in "kv"}, f32["gate_k"].shape[1], f32["b_k"].shape[2],
                     FuserConfig(rank=rank))
    with torch.no_grad():
        for m in "kv":
            for n in ("a", "b", "c", "gate"):
                getattr(maps, f"{n}_{m}").copy_(f32[f"{n}_{m}"])
    return maps


class Fuser:
    """A trained fuser at use: the source reads a text, and its features fuse into the target's own cache of the
    same text (start token + the text's target tokens, as `pairs.pair_text` tokenises it)."""

    def __init__(self, maps: FuserMaps, source: LoadedModel, target: LoadedModel):
        self.maps, self.source, self.target = maps.to(target.device), source, target

    @classmethod
    def load(cls, path: str | Path, source: LoadedModel, target: LoadedModel) -> "Fuser":
        """The fuser file at `path` for these models: refused (ValueError naming the file, the models it was fitted
        for and these) unless its metadata records these models' config hashes, sizes and RoPE."""
        maps, record = load_fuser(path)
        check_fitted_for(f"fuser {path}", fuser_meta(record, Path(path)), source.spec, target.spec)
        return cls(maps, source, target)

    @torch.no_grad()
    def fuse(self, own: KVSegment, text: str) -> KVSegment:
        """own: the target's own cache of start + text (rotated, positions 0..T-1) -> the fused cache."""
        paired = pair_text(text, self.source.tokenizer, self.target.tokenizer)
        if not torch.equal(paired.target_ids, own.token_ids.cpu()):
            raise ValueError("the target's own cache does not hold start + this text's target tokens")
        xk, xv = source_features(self.source, paired.source_ids, paired.alignment.source_index)
        keep = (~has_text_source(paired.alignment.kind)) & (paired.target_ids == paired.target_ids[0])
        keep[0] = True  # the start token keeps its own KV
        k, v = self.maps.fuse(xk, xv, own.keys, own.values, self.target, keep=keep)
        kv = torch.stack((k, v), dim=1).to(own.kv.dtype)
        return KVSegment(kv=kv, token_ids=own.token_ids, positions=own.positions, model=own.model, rotated=True)
