"""Devices and dtypes by name: device "auto" picks CUDA when present; dtype "auto" is bfloat16 on CUDA (what the
production pair runs in, and what flash-attn needs) and float32 elsewhere (CPU bf16 matmuls are slow and inexact)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "resolve_device", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)  # what command lines and configs accept


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "auto") -> torch.dtype:
    """A torch dtype by name; "auto" depends on the device the model runs on."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}")
    return DTYPES[dtype]
