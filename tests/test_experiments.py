"""The experiment scripts (experiments/) stay runnable from a fresh clone, and no file of the repository points at the
machine it was written on.

- No tracked or new (not ignored) text file under the library, the tests, the docs or experiments/ names an absolute
  path under /work/ or /root/ (this file names them to look for them).
- Every script compiles and answers `--help` (a subprocess, from the repository root); the names a script imports
  from kvbridge, from transformers, or from a module beside it exist. The scripts read their arguments before they
  import torch, so `--help` takes a fraction of a second (fit_prior.py, imported by tail_prior.py, imports torch
  first: seconds).
"""

from __future__ import annotations

import ast
import importlib
import json
import py_compile
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
CHECKED = ("experiments", "docs", "transfer", "adapters", "server", "eval", "vllm_connector", "bench", "tests")
# An absolute path under /work/ or /root/: the slash not preceded by a path's character (docs/work/ and
# ../work/ are relative).
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|root)/")
MODULES = {"common.py", "factored.py"}  # imported by the scripts beside them, no command line of their own


def experiment_files(pattern: str) -> list[Path]:
    """The files of experiments/ matching pattern, without what the scripts wrote (experiments/out/)."""
    return sorted(p for p in EXPERIMENTS.rglob(pattern) if p.relative_to(EXPERIMENTS).parts[0] != "out")


PYTHON = experiment_files("*.py")
SCRIPTS = [p for p in PYTHON if p.name not in MODULES]
SHELL = experiment_files("*.sh")


def repository_files() -> list[Path]:
    """Tracked files and new files git does not ignore, under the checked folders."""
    listed = []
    for extra in ([], ["--others", "--exclude-standard"]):
        proc = subprocess.run(["git", "ls-files", "-z", *extra, "--", *CHECKED], cwd=ROOT, capture_output=True,
                              check=False)
        if proc.returncode:
            pytest.skip("not a git checkout: " + proc.stderr.decode(errors="replace")[:200])
        listed += [name for name in proc.stdout.decode().split("\0") if name]
    return sorted({ROOT / name for name in listed if (ROOT / name).is_file()})


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_experiment_scripts_exist():
    assert SCRIPTS and SHELL, "experiments/ holds the experiment scripts"
    assert not list((ROOT / "docs").rglob("*.py")) and not list((ROOT / "docs").rglob("*.sh")), \
        "experiment scripts live in experiments/, not docs/"


def test_no_machine_paths_in_text_files():
    here = Path(__file__).resolve()
    found = []
    for path in repository_files():
        if path == here:
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary (figures, weights): their metadata is the next test's
            continue
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{relative(path)}:{n}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine (use an argument, an environment variable or a path relative " \
                      "to the repository):\n" + "\n".join(found)


def test_docs_and_experiments_name_no_folder_outside_the_repository():
    """The data files are named through $KVBRIDGE_DATA (or a script's --data), not the development machine's folder
    beside the checkout."""
    found = [f"{relative(p)}:{n}" for p in repository_files() if relative(p).startswith(("docs/", "experiments/"))
             and b"\0" not in (data := p.read_bytes())
             for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1) if "../shared" in line]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def safetensors_metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)).get("__metadata__", {})


def test_no_machine_paths_in_safetensors_metadata():
    found = [f"{relative(p)}: {key}" for p in repository_files() if p.suffix == ".safetensors"
             for key, value in safetensors_metadata(p).items() if MACHINE_PATH.search(value)]
    assert not found, "absolute paths of a machine in safetensors metadata:\n" + "\n".join(found)


def test_machine_path_pattern():
    work, root = "/" + "work", "/" + "root"  # built here: no tracked file holds the paths this test rejects
    for absolute in (f'"{work}/exp13"', f"cd {work}/main", f"`{root}/x`", f"={work}/a"):
        assert MACHINE_PATH.search(absolute), absolute
    for relative_path in ("experiments/work/pages", "../work/x", "~/work/x", "$HOME/work/x", "network/root/x"):
        assert not MACHINE_PATH.search(relative_path), relative_path


@pytest.mark.parametrize("path", PYTHON, ids=relative)
def test_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "compiled.pyc"), doraise=True)


@pytest.mark.parametrize("path", SCRIPTS, ids=relative)
def test_script_help(path):
    proc = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("path", SHELL, ids=relative)
def test_shell_script_help(path):
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    proc = subprocess.run(["bash", str(path), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "--help prints what the script does"


def top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_imported_names_exist():
    """What the scripts import from the library (and from transformers, and from the modules beside them) exists:
    a rename in the library that would break a script fails here, without running it."""
    missing = []
    for path in PYTHON:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            names = [a.name for a in node.names]
            if "*" in names:
                missing.append(f"{relative(path)}: from {node.module} import * (name what it uses)")
                continue
            beside = path.parent / f"{node.module}.py"
            if beside.exists():
                missing += [f"{relative(path)}: {node.module}.{n}" for n in names
                            if n not in top_level_names(beside)]
            elif node.module.split(".")[0] in ("kvbridge", "transformers"):
                module = importlib.import_module(node.module)
                for n in names:
                    if not hasattr(module, n):
                        try:
                            importlib.import_module(f"{node.module}.{n}")
                        except ImportError:
                            missing.append(f"{relative(path)}: {node.module}.{n}")
    assert not missing, "imports the library no longer has:\n" + "\n".join(missing)
