"""bench/gpu_check.py's own pieces, on the CPU: its first line names what the figures were measured on, and the
serve check leaves no folder behind (the fitted adapter it hands the server is tens of MB here, more on a GPU)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def test_the_header_names_the_cpu_capability_beside_the_device():
    import gpu_check

    line = gpu_check.header("cpu", "float32")
    assert line.startswith("gpu_check: ") and "device cpu" in line and "dtype float32" in line, line
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in line, line


@pytest.mark.integration
def test_the_serve_check_removes_its_folder(tmp_path, monkeypatch):
    import gpu_check
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.presets import load_pair
    from kvbridge.transfer.tiny_pair import tiny_corpus_text

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the check's folder
    source, target = load_pair("production-shaped", device="cpu", dtype="float32")
    adapter, _ = train_adapter(source, target, [data_path("tiny_corpus.txt")],
                               TrainConfig(max_tokens=768, window_tokens=256), progress=False)  # as --quick
    text = "\n\n".join(tiny_corpus_text().split("\n\n")[:2])
    gpu_check.check_serve(argparse.Namespace(device="cpu", dtype="float32"), text, target, adapter)
    assert gpu_check.results[-1] == "PASS", gpu_check.results
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("kvbridge-gpu-check-")]
    assert not left, f"the serve check left {left} in {tmp_path}"
