"""safetensors files read back with errors that name the file, and files written atomically.

safetensors raises its own error type (not a ValueError) for a file cut short, a foreign header or bytes that are not
safetensors at all, and names no path; every kvbridge file of tensors the user can be told to remove (a prior, a
fuser, a trainer checkpoint, a teacher or prior-fit window) is read through here, so the error says which file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_tensors(path: str | Path, names=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the file's tensors, or only `names`; its metadata). FileNotFoundError when there is no file, ValueError naming
    it when it is not a readable safetensors file or lacks one of `names`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            held = set(f.keys())
            missing = sorted(set(names) - held) if names is not None else []
            tensors = {} if missing else {n: f.get_tensor(n) for n in (held if names is None else names)}
    except Exception as exc:  # safetensors' own error types
        raise ValueError(f"{path} is not a readable safetensors file ({exc}): remove it or make it again") from exc
    if missing:
        raise ValueError(f"{path} lacks tensors {missing}: remove it or make it again")
    return tensors, meta


def read_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's metadata, read from its header alone; errors as read_tensors."""
    return read_tensors(path, names=())[1]


def json_field(path: str | Path, meta: dict[str, str], field: str) -> dict:
    """The JSON object a file's metadata holds under `field`: ValueError naming the file when it is absent, not JSON or
    not an object."""
    try:
        value = json.loads(meta[field])
    except KeyError:
        raise ValueError(f"{path} holds no {field} metadata: not a file kvbridge made for this") from None
    except ValueError as exc:
        raise ValueError(f"{path}: its {field} metadata is not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: its {field} metadata is not a JSON object")
    return value


def readable(path: str | Path) -> bool:
    """Whether `path` is a safetensors file whose header opens and covers the file (a copy cut short does not)."""
    try:
        read_metadata(path)
    except (OSError, ValueError):
        return False
    return True


@contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """A temporary name beside `path` to write to; renamed onto path when the block ends, removed if it raises. The
    name is this writer's own (process id and a random part): two runs writing the same file never write or rename
    each other's (a fixed `.NAME.tmp` was renamed away by the other run, whose own rename then failed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, atomically (`replaced`): no reader, nor a run killed meanwhile, sees half a file."""
    with replaced(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def write_text(path: str | Path, text: str) -> None:
    """Path.write_text, atomically (`replaced`)."""
    with replaced(path) as tmp:
        tmp.write_text(text)
