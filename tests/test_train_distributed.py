"""`train-adapter --trainer chain` under torchrun on the tiny pair: two ranks give what one process gives.

One process (no torchrun) and two ranks (torchrun, gloo) train over the same windows: the teacher cache is the same
file by file, the closed-form (ridge) stage the same to float32 rounding, every SGD step's loss the same at the same
global batch of 4 windows; a rerun under two ranks resumes from the work folder's checkpoints, and an error inside
the process group ends every rank. Real subprocesses (`python -m torch.distributed.run`), OMP_NUM_THREADS=1.

Tolerances, and why (measured on the packaged corpus sample, OMP_NUM_THREADS=1):
  statistics     float64 sums that differ only in the order the windows are added: Σy² to 1e-12 relative (measured
                 1.5e-16); the Gram and cross terms are kept in the token basis, an eigendecomposition of the sums
                 that passes their rounding on amplified by its eigengaps: 1e-8 relative (measured 1.4e-14; 6e-10
                 on another corpus).
  ridge stage    |a - b| <= 1e-6 * max(1, |a|max): the float64 solve keeps that, so the float32 weights differ by a
                 unit in the last place at most (measured 0 here; 1.2e-7 on values up to 3.5 on another corpus).
  SGD losses     |a - b| <= 2e-5 * max(1, |a|) per step: a rank's share of the batch goes through the target as a
                 batch of 2 instead of 4, so float32 matmuls sum in another order (measured 6e-8 on attention
                 losses of 1.2, 3.6e-6 on KL losses of 4.0).
  dev recovery   |a - b| <= 1e-3: rank 0 scores as one process does, but the recovery is a ratio whose denominator
                 (NLL with no context minus NLL with the target's own prefill) is small for random tiny models, so
                 it magnifies the maps' float32 differences about 10³-fold (measured 8.7e-5).
  final adapter  |a - b| <= 1e-3: Adam divides each step by the gradient's running RMS, so a float32 difference in
                 a near-zero gradient coordinate can move that weight by up to ~lr = 3e-3 (measured 6e-8; 9e-5 on
                 another corpus).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvbridge.adapters.cli import main
from kvbridge.adapters.distributed import Launch
from kvbridge.adapters.io import read_adapter_meta
from kvbridge.transfer.data import data_path
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

STAGES = "attention:3,kl:3"
CORPUS = str(data_path("pydoc_corpus_sample.txt"))  # 48 documents, 3 of them held out for dev windows


def _train(work: Path, stages: str, ranks: int, *extra: str, out: str = "adapter"
           ) -> subprocess.CompletedProcess:
    """The train-adapter command, in one process (ranks 0: no torchrun) or under torchrun with `ranks`; the adapter
    is written to work/OUT.safetensors."""
    args = ["--preset", "tiny", "--trainer", "chain", "--corpus", CORPUS, "--stages", stages, "--train-windows",
            "12", "--ridge-windows", "8", "--dev-per-corpus", "4", "--token-rank", "8", "--eval-docs", "0",
            "--work", str(work), "--out", str(work / f"{out}.safetensors"), "-q", *extra]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *launcher, "-m", "kvbridge.adapters.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process over all stages; two ranks over the first stage, then resumed with both (the folder's teacher
    cache, ridge fit and first stage read back). Returns the two work folders and the resumed run's figures."""
    one, two = tmp_path_factory.mktemp("one-process"), tmp_path_factory.mktemp("two-ranks")
    _ok(_train(one, STAGES, 0))
    first = _ok(_train(two, STAGES.split(",")[0], 2, out="first"))
    before = {"index": (two / "teacher" / "index.json").read_text(),
              "mtimes": {p.name: p.stat().st_mtime_ns for p in (two / "teacher").iterdir()},
              "stage-0": (two / "stage-0-attention" / "record.json").read_text(),
              "ridge": (two / "ridge" / "ridge.safetensors").stat().st_mtime_ns}
    resumed = _ok(_train(two, STAGES, 2))
    return one, two, {"first": first, "resumed": resumed, "before": before}


def _max_diff(a: dict, b: dict) -> dict[str, tuple[float, float]]:
    """Per float tensor: (max |a - b|, max |a|)."""
    assert a.keys() == b.keys()
    return {k: (float((a[k].double() - b[k].double()).abs().max()), float(a[k].double().abs().max()))
            for k in a if a[k].is_floating_point()}


def _losses(work: Path, stage: str) -> list[float]:
    return [x for row in json.loads((work / stage / "record.json").read_text()) for x in row["step_losses"]]


def test_sharded_teacher_cache_and_ridge_stage_equal_one_process(runs):
    one, two, _ = runs
    index = json.loads((one / "teacher" / "index.json").read_text())
    assert json.loads((two / "teacher" / "index.json").read_text()) == index  # same windows, same order
    assert not list((two / "teacher").glob("index.part-*"))  # the ranks' parts were merged
    for entry in index["windows"]:
        a, b = load_file(str(one / "teacher" / entry["file"])), load_file(str(two / "teacher" / entry["file"]))
        assert all(torch.equal(a[k], b[k]) for k in a), entry["id"]
    stats = load_file(str(one / "ridge" / "stats.safetensors")), load_file(str(two / "ridge" / "stats.safetensors"))
    assert int(stats[0]["count"]) == int(stats[1]["count"]) > 0  # the token counts, summed over the ranks
    for k, (diff, scale) in _max_diff(*stats).items():  # Σy² as summed; Gram and cross terms in the token basis
        assert diff <= (1e-12 if k.startswith("yy") else 1e-8) * scale, (k, diff, scale)
    for k, (diff, scale) in _max_diff(load_file(str(one / "ridge" / "ridge.safetensors")),
                                      load_file(str(two / "ridge" / "ridge.safetensors"))).items():
        assert diff <= 1e-6 * max(1.0, scale), (k, diff, scale)
    # 16 windows (4 dev, 12 training), each rank teacher-forwarded half of them
    assert _record(two / "first.safetensors")["ranks"] == {"world_size": 2, "teacher_windows_made": [8, 8]}
    assert "ranks" not in _record(one / "adapter.safetensors")


def _record(adapter: Path) -> dict:
    """What train_chain recorded, from the adapter's metadata."""
    return read_adapter_meta(adapter)["training"]["record"]


def test_sgd_stages_follow_one_process_step_by_step(runs):
    one, two, _ = runs
    for stage, steps in (("stage-0-attention", 3), ("stage-1-kl", 3)):
        a, b = _losses(one, stage), _losses(two, stage)
        assert len(a) == len(b) == steps
        assert all(abs(x - y) <= 2e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), (stage, a, b)
        dev_a = [row["dev_recovery"] for row in json.loads((one / stage / "record.json").read_text())]
        dev_b = [row["dev_recovery"] for row in json.loads((two / stage / "record.json").read_text())]
        assert len(dev_a) == len(dev_b) and all(abs(x - y) <= 1e-3 for x, y in zip(dev_a, dev_b)), (dev_a, dev_b)
    for k, (diff, _) in _max_diff(load_file(str(one / "adapter.safetensors")),
                                  load_file(str(two / "adapter.safetensors"))).items():
        assert diff <= 1e-3, (k, diff)


def test_two_ranks_resume_from_the_work_folder(runs):
    """The rerun with one more stage found the teacher windows, the ridge fit and the first stage (every rank read
    its checkpoint: the maps are checked equal on the ranks when a stage starts), and trained only the new one."""
    _, two, seen = runs
    before = seen["before"]
    assert "stage attention: 3 steps" in seen["first"] and "2 ranks" in seen["first"]
    assert "stage attention: 3 steps" in seen["resumed"] and "stage kl: 3 steps" in seen["resumed"]
    assert _record(two / "adapter.safetensors")["ranks"]["teacher_windows_made"] == [0, 0]
    assert (two / "teacher" / "index.json").read_text() == before["index"]
    assert {p.name: p.stat().st_mtime_ns for p in (two / "teacher").iterdir()} == before["mtimes"]
    assert (two / "ridge" / "ridge.safetensors").stat().st_mtime_ns == before["ridge"]
    assert (two / "stage-0-attention" / "record.json").read_text() == before["stage-0"]


def test_an_error_inside_the_group_ends_every_rank(runs):
    """Four windows a step cannot be split over more ranks than windows; the ranks raise after the process group is
    up (teacher cache and ridge found), tear it down, and exit with the error instead of waiting on each other."""
    _, two, _ = runs
    proc = _train(two, STAGES, 2, "--batch-windows", "1")
    assert proc.returncode != 0
    assert "2 ranks share each step's 1 windows" in proc.stderr


def test_launch_is_read_from_torchruns_environment(monkeypatch, capsys):
    assert Launch.from_env({}) is None
    assert Launch.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Launch(1, 2, 1)
    with pytest.raises(ValueError, match="RANK must be in"):
        Launch.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="integer RANK and WORLD_SIZE"):
        Launch.from_env({"RANK": "0"})
    assert Launch(0, 2, 0).device("cpu") == "cpu"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--preset", "tiny", "--trainer", "ridge"]) == 2
    assert "--trainer ridge runs in one process" in capsys.readouterr().err
