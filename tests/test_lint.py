"""The house lint (pyproject's [tool.ruff]; experiments/ruff.toml for the experiments' scripts) holds on every package,
the tests, the benchmarks and the experiments: CI runs the pinned ruff of the `test` extra."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["adapters", "bench", "cli", "eval", "proto", "server", "tests", "transfer", "vllm_connector"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_passes_the_house_lint():
    done = _ruff(*PACKAGES)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_experiments_pass_their_lint():
    done = _ruff("--config", "experiments/ruff.toml", "experiments")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lint_finds_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    done = _ruff("--config", str(ROOT / "pyproject.toml"), str(bad))
    assert done.returncode == 1 and "F401" in done.stdout
