"""The vLLM venv's readiness (`kvbridge.vllm.engine.vllm_available`, setup-vllm.sh's completion marker and its venv
check) and the environment of the vLLM child processes (offline, no usage statistics). No vLLM needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvbridge.vllm import engine, openai_server
from kvbridge.vllm.engine import SETUP_MARKER, EngineOptions, EngineProcess, vllm_available

REPO = Path(__file__).resolve().parents[1]


def fake_venv(root: Path, python: str = "#!/bin/sh\nexit 1\n") -> Path:
    """A venv folder whose python is a script (by default one that fails: an interrupted or broken venv)."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /nowhere\n")
    (root / "bin" / "python").write_text(python)
    (root / "bin" / "python").chmod(0o755)
    return root / "bin" / "python"


def test_a_venv_without_vllm_is_not_available(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_VLLM_PYTHON", str(fake_venv(tmp_path / "venv")))
    assert "vllm" in vllm_available() and "setup-vllm.sh" in vllm_available()


def test_the_setup_marker_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_VLLM_PYTHON", str(fake_venv(tmp_path / "venv")))
    (tmp_path / "venv" / SETUP_MARKER).write_text("installing\n")
    assert "did not finish" in vllm_available()
    (tmp_path / "venv" / SETUP_MARKER).write_text("ready\n")
    assert vllm_available() == ""


def test_a_venv_from_before_the_marker_counts_when_vllm_and_the_connector_are_found(tmp_path, monkeypatch):
    finds = ("import sys\nprint(sys.argv, file=open(sys.argv[0] + '.ran', 'w'))\n")  # a python that finds both
    python = fake_venv(tmp_path / "venv", f"#!{sys.executable}\n{finds}")
    monkeypatch.setenv("KVBRIDGE_VLLM_PYTHON", str(python))
    assert vllm_available() == ""
    assert "find_spec" in Path(str(python) + ".ran").read_text()


class Started(Exception):
    pass


@pytest.fixture
def popen_env(monkeypatch):
    """Catches the environment a child process would start with (and starts none)."""
    seen = {}

    def popen(*args, env=None, **kwargs):
        seen.update(env)
        raise Started

    monkeypatch.setattr(engine, "vllm_available", lambda: "")
    monkeypatch.setattr(openai_server, "vllm_available", lambda: "")
    monkeypatch.setattr(subprocess, "Popen", popen)
    for name in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)
    return seen


OFFLINE = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.mark.parametrize("child", ["engine", "openai"])
def test_vllm_children_run_offline_without_usage_statistics(child, popen_env, tmp_path, monkeypatch):
    def start():
        with pytest.raises(Started):
            if child == "engine":
                EngineProcess(EngineOptions(model="m"), tmp_path / "engine.log")
            else:
                openai_server.OpenAIServer("m", {}, tmp_path / "api.log")

    start()
    assert {k: popen_env[k] for k in OFFLINE} == OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's own choice stays
    start()
    assert popen_env["HF_HUB_OFFLINE"] == "0" and popen_env["DO_NOT_TRACK"] == "1"


def run_setup_vllm(venv: Path) -> subprocess.CompletedProcess:
    """setup-vllm.sh with no Python to make a venv with (PYTHON=false) and no package index: it can install
    nothing, whatever it decides."""
    return subprocess.run(["bash", str(REPO / "setup-vllm.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVBRIDGE_VLLM_VENV": str(venv), "PYTHON": "false", "PIP_NO_INDEX": "1"})


def test_setup_vllm_makes_an_unusable_venv_again(tmp_path):
    venv = tmp_path / "venv"
    fake_venv(venv)
    done = run_setup_vllm(venv)  # no Python to make it with: it says so and stops, the venv kept
    assert done.returncode != 0
    assert f"{venv} is unusable" in done.stderr and "does not run" in done.stderr
    assert "PYTHON=false is not Python 3.11 or newer" in done.stderr
    assert (venv / "bin" / "python").exists()


def test_setup_vllm_leaves_a_folder_that_is_no_venv(tmp_path):
    folder = tmp_path / "not-a-venv"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    done = run_setup_vllm(folder)
    assert done.returncode != 0 and "no pyvenv.cfg" in done.stderr
    assert (folder / "notes.txt").read_text() == "mine"
