"""bench/gpu_check.py's own pieces, on the CPU: its first line names what the figures were measured on (that its
serve check leaves no folder behind is checked by tests/test_gpu_check.py's dry run, in its TMPDIR)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def test_the_header_names_the_cpu_capability_beside_the_device():
    import gpu_check

    line = gpu_check.header("cpu", "float32")
    assert line.startswith("gpu_check: ") and "device cpu" in line and "dtype float32" in line, line
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in line, line
