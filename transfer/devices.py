"""Devices and dtypes by name: device "auto" picks CUDA when present; dtype "auto" is bfloat16 on CUDA (what the
production pair runs in, and what flash-attn needs) and float32 elsewhere (CPU bf16 matmuls are slow and
inexact). `compute_dtype` says what dtype a half-precision operand's matmuls run in: its own on CUDA and on CPUs with
native bf16/fp16 GEMM, float32 on the others."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "HALF_GEMM_ENV", "compute_dtype", "compute_path", "cpu_half_gemm_native",
           "half_gemm", "resolve_device", "resolve_dtype"]

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


# ------------------------------------------------------------------------------- the compute dtype of half tensors

HALF_GEMM_ENV = "KVBRIDGE_HALF_GEMM"  # auto (default) | native | float32: force the path, for tests and benchmarks
HALF_GEMM_CHOICES = ("auto", "native", "float32")
_HALF = (torch.bfloat16, torch.float16)
_forced: list[str] = []  # the innermost `half_gemm(...)` block's choice, above the environment


def cpu_half_gemm_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bfloat16 or float16) matrices in hardware, as PyTorch reports it: bf16
    with AMX tiles or AVX512-BF16, fp16 with AMX-FP16. Elsewhere PyTorch's half GEMM is a slow fallback (AVX2:
    2048×576 @ 576×576 on one thread, float32 22 ms, bfloat16 ~500–980 ms)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return bool(cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported())
    if dtype == torch.float16:
        return bool(cpu._is_amx_fp16_supported())
    return False


def half_gemm_choice() -> str:
    """"auto", "native" or "float32": the innermost `half_gemm` block, else $KVBRIDGE_HALF_GEMM, else auto."""
    choice = _forced[-1] if _forced else os.environ.get(HALF_GEMM_ENV, "auto") or "auto"
    if choice not in HALF_GEMM_CHOICES:
        raise ValueError(f"{HALF_GEMM_ENV} must be one of {list(HALF_GEMM_CHOICES)}, got {choice!r}")
    return choice


@contextmanager
def half_gemm(choice: str):
    """Force the half-precision GEMM path inside the block ("native": in the tensors' own dtype; "float32": upcast;
    "auto": by the CPU). Tests and benchmarks use it to run both paths on one machine."""
    if choice not in HALF_GEMM_CHOICES:
        raise ValueError(f"half_gemm choice must be one of {list(HALF_GEMM_CHOICES)}, got {choice!r}")
    _forced.append(choice)
    try:
        yield
    finally:
        _forced.pop()


def compute_dtype(dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to run matmuls of `dtype` operands in on `device`: a bfloat16/float16 operand computes in its own
    dtype on CUDA and on CPUs that do that GEMM natively, in float32 on other CPUs (the same products up to the
    half dtype's rounding of inputs and outputs, ~20× faster there); every other dtype as it is."""
    if dtype not in _HALF:
        return dtype
    choice = half_gemm_choice()
    if choice == "native" or torch.device(device).type != "cpu":
        return dtype
    if choice == "float32":
        return torch.float32
    return dtype if cpu_half_gemm_native(dtype) else torch.float32


def compute_path() -> str:
    """This process's half-precision GEMM path on the CPU, in words, for benchmark machine lines."""
    flags = [name for name, on in (("AMX", torch.cpu._is_amx_tile_supported()),
                                   ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                   ("AMX-FP16", torch.cpu._is_amx_fp16_supported())) if on]
    bf16 = "bf16" if compute_dtype(torch.bfloat16) == torch.bfloat16 else "float32"
    fp16 = "fp16" if compute_dtype(torch.float16) == torch.float16 else "float32"
    choice = half_gemm_choice()
    return (f"CPU capability {torch.backends.cpu.get_cpu_capability()} ({', '.join(flags) or 'no AMX/AVX512-BF16'})"
            f" | half GEMM on the CPU: bf16 in {bf16}, fp16 in {fp16}"
            + ("" if choice == "auto" else f" (forced: {HALF_GEMM_ENV}={choice})"))
