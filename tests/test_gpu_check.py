"""bench/gpu_check.sh's dry run on the CPU: the device check runs only when a GPU is lent (rarely), so its code is
kept working here, every check run on the CPU (flash-attn and vLLM SKIP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("attention", "serve", "prior", "store", "projection", "corrections", "premise", "vllm")


@pytest.mark.integration
def test_the_device_checks_dry_run_passes_on_the_cpu(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PY": sys.executable, "TMPDIR": str(tmp_path)})
    lines = {line.split()[1]: line.split()[0] for line in run.stdout.splitlines()
             if line[:4] in ("PASS", "FAIL", "SKIP")}
    errors = (tmp_path / "gpu_check.stderr.log").read_text()[-3000:] if (tmp_path / "gpu_check.stderr.log").exists() \
        else ""
    assert run.returncode == 0, run.stdout + errors
    assert set(lines) == set(CHECKS), run.stdout
    assert lines["attention"] == lines["vllm"] == "SKIP"  # no flash-attn, no CUDA vLLM on a CPU
    assert all(lines[name] == "PASS" for name in CHECKS if name not in ("attention", "vllm")), run.stdout
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("kvbridge-gpu-check-")]
    assert not left, f"the checks left {left} in TMPDIR"  # the serve check's fitted adapter and log
