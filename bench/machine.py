"""The `machine:` header line every benchmark prints first: host, CPU and cores, the CPU capability PyTorch reports
and the half-precision GEMM path it makes kvbridge take, torch and its threads, what the benchmark adds (device,
library versions), python, load average at start, full or quick run."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
from kvbridge.transfer.devices import compute_path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_label(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def machine_line(mode: str, *items: str) -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    middle = "".join(f" | {item}" for item in items)
    return (f"machine: {platform.node()} | CPU {cpu_model()} x {os.cpu_count()} cores | {compute_path()} | "
            f"torch {torch.__version__} (intra-op threads: {torch.get_num_threads()}){middle} | "
            f"python {platform.python_version()} | "
            f"load average {load} at start | {mode} run")
