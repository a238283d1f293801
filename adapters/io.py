"""Adapter files: one safetensors file, tensors plus the JSON metadata in its header. Never pickle."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from kvbridge.adapters.weights import (
    BASIS_FORMAT_VERSION,
    CONTEXT,
    CONTEXT_FORMAT_VERSION,
    FORMAT_VERSION,
    LINEAR_CONTEXT_FORMAT_VERSION,
    META_FIELDS,
    READ_VERSIONS,
    TOKENS_FORMAT_VERSION,
    Adapter,
    AdapterMeta,
)
from kvbridge.transfer.tensor_files import save_tensors
from safetensors import safe_open

TENSORS = ("layer_map", "mix_k", "mix_v", "wk", "bk", "wv", "bv")
OPTIONAL = ("start_kv", "tok_table", "wk_tok", "wv_tok", "src_basis", *CONTEXT)


def save_adapter(adapter: Adapter, path: str | Path) -> Path:
    """Write atomically (temp file, then rename)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"adapter files end in .safetensors, got {path.name!r}")
    tensors = {name: getattr(adapter, name).detach().cpu().contiguous() for name in TENSORS + OPTIONAL
               if getattr(adapter, name) is not None}
    record = dataclasses.asdict(adapter.meta)
    # the lowest version that has everything in the file, so older kvbridge releases keep reading what they can
    record["format_version"] = ((CONTEXT_FORMAT_VERSION if adapter.context_norm else LINEAR_CONTEXT_FORMAT_VERSION)
                                if adapter.ctx_lags is not None else
                                BASIS_FORMAT_VERSION if adapter.src_basis is not None else
                                TOKENS_FORMAT_VERSION if adapter.tok_table is not None else FORMAT_VERSION)
    meta = {"kvbridge_adapter": json.dumps(record, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, tensors, metadata=meta)
    return path


def read_adapter_meta(path: str | Path) -> dict | None:
    """The JSON metadata of an adapter file, read from its header only; None when it is not a kvbridge adapter."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
        return json.loads(header["kvbridge_adapter"]) if "kvbridge_adapter" in header else None
    except Exception:  # not a safetensors file, or bad JSON: not an adapter
        return None


def load_adapter(path: str | Path, device: torch.device | str = "cpu") -> Adapter:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no adapter file {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for bad files
        raise ValueError(f"{path} is not a safetensors file: {exc}") from exc
    if "kvbridge_adapter" not in header:
        raise ValueError(f"{path} is a safetensors file but not a kvbridge adapter (no kvbridge_adapter metadata)")
    try:
        data = json.loads(header["kvbridge_adapter"])
    except ValueError as exc:
        raise ValueError(f"{path}: its kvbridge_adapter metadata is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: its kvbridge_adapter metadata is not a JSON object")
    if data.get("format_version") not in READ_VERSIONS or data.get("kind", "projection") != "projection":
        raise ValueError(f"{path}: adapter format version {data.get('format_version')} kind {data.get('kind')!r}, "
                         f"this kvbridge reads projection adapters of versions {READ_VERSIONS}")
    absent = [name for name in META_FIELDS if name not in data]
    if absent:
        raise ValueError(f"{path}: adapter metadata field {absent[0]!r} missing (an adapter records {META_FIELDS})")
    fields = {f.name for f in dataclasses.fields(AdapterMeta)}
    meta = AdapterMeta(**{k: v for k, v in data.items() if k in fields})
    missing = [n for n in TENSORS if n not in tensors]
    if missing:
        raise ValueError(f"{path}: adapter tensors missing: {missing}")
    # the format says how its tensors are read (a context branch with its norm or without, 4 or 5): tensors of a
    # later format than the metadata names are refused, not read as some format the file does not claim
    version = data["format_version"]
    for names, needs in ((CONTEXT, CONTEXT_FORMAT_VERSION), (("src_basis",), BASIS_FORMAT_VERSION),
                         (("tok_table", "wk_tok", "wv_tok"), TOKENS_FORMAT_VERSION)):
        held = [n for n in names if n in tensors]
        if held and version < needs:
            raise ValueError(f"{path}: adapter format version {version} holds no {held[0]}; its tensors {held} are "
                             f"those of format {needs} and later")
    try:
        adapter = Adapter(meta=meta, **{n: tensors[n] for n in TENSORS}, **{n: tensors.get(n) for n in OPTIONAL})
    except ValueError as exc:  # a shape, dtype or metadata field that is not an adapter's: named with the file
        raise ValueError(f"{path}: {exc}") from None
    return adapter.to(device)
