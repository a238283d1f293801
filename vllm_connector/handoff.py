"""Fetched KV handed from the connector's scheduler side to its workers on the same host: a safetensors file in
shared memory (/dev/shm), mode 0600, an unguessable name, removed by the worker once read. The scheduler's message
to the workers then carries only a path and block ids, never the KV itself.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def stage(kv: torch.Tensor, folder: str | Path) -> Path:
    """Write kv [L, 2, H_kv, T, D] to a fresh 0600 file in `folder`; its path."""
    # kv: [L, 2, H_kv, T, D]
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"staged KV must be [L, 2, H_kv, T, D], got {tuple(kv.shape)}")
    path = Path(folder) / f"kvbridge-{secrets.token_hex(16)}.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # exists before any byte is written, as 0600
    os.close(fd)
    try:
        save_file({"kv": kv.detach().cpu().contiguous()}, str(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def take(path: str | Path) -> torch.Tensor:
    """Read a staged file and remove it: kv [L, 2, H_kv, T, D]."""
    try:
        return load_file(str(path))["kv"]
    finally:
        Path(path).unlink(missing_ok=True)


def discard(path: str | Path) -> None:
    Path(path).unlink(missing_ok=True)
