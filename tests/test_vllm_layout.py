"""vLLM's CPU KV layouts as kvbridge.vllm.layouts writes them out (vec, vec16, and amx where the CPU has AMX tiles),
compared with vLLM's own cache writer in the vLLM venv. Skipped when that venv is missing."""

from __future__ import annotations

import os
import subprocess

import pytest
from kvbridge.vllm.engine import CPU_ENV, vllm_available, vllm_python

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(vllm_available()), reason=vllm_available() or "vLLM venv present")]


def test_the_documented_cpu_layouts_are_vllms():
    env = {**os.environ, **CPU_ENV}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([str(vllm_python()), "-m", "kvbridge.vllm.layouts"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip() == "all layouts as documented"
    checked = next(line for line in run.stderr.splitlines() if line.startswith("checked:")).split()[1:]
    assert "vec/bfloat16/D64/bs128" in checked and "vec/float32/D64/bs32" in checked
