"""bench/bench_store.py --quick and bench/bench_grpc.py --quick run to the end and print every benchmark. No timing
is asserted (STYLE 9): the numbers belong to the machine that printed them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_store.py"
BENCH_GRPC = BENCH.with_name("bench_grpc.py")
# each benchmark's lines start with its tag; among them, its ratio and its goal
BENCHMARKS = ("get", "lookup", "bytes", "redis")


@pytest.mark.integration
@pytest.mark.slow
def test_bench_store_quick_runs_and_prints_every_benchmark(tmp_path):
    from redisproc import redis_available

    if not redis_available():
        pytest.fail("no redis-server (or valkey-server) on PATH: the bench's Redis line needs a real one. "
                    "Install it with apt-get install redis-server.")
    # a few seconds of work; the bound leaves room for converting the packaged models on a fresh machine
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], cwd=BENCH.parents[1], capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("machine: "), out
    assert "quick run" in lines[0] and "device " in lines[0] and "torch " in lines[0], lines[0]
    for tag in BENCHMARKS:
        mine = [line for line in lines if line.split(" ", 1)[0] == tag]
        assert any("ratio" in line for line in mine), f"no {tag!r} ratio line in:\n{out}"
        assert any("goal" in line for line in mine), f"no {tag!r} goal in:\n{out}"
    assert "skipped" not in out, out
    assert lines[-1].startswith("done in "), out


@pytest.mark.integration
def test_bench_grpc_quick_runs_and_prints_every_benchmark():
    # tiny random models and a real `kvbridge serve` process on a loopback port 0: seconds of work
    proc = subprocess.run([sys.executable, str(BENCH_GRPC), "--quick"], cwd=BENCH_GRPC.parents[1],
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("machine: "), out
    assert "quick run" in lines[0], lines[0]
    stream = [line for line in lines if line.split(" ", 1)[0] == "stream"]
    assert any("ratio" in line and "goal" in line for line in stream), f"no stream ratio and goal in:\n{out}"
    assert any("server in its own process" in line for line in stream), f"not the deployed layout:\n{out}"
    wire = [line for line in lines if line.split(" ", 1)[0] == "wire"]
    assert any("measured" in line and "ratio" in line for line in wire), f"no measured wire ratio in:\n{out}"
    assert lines[-1].startswith("done in "), out


@pytest.mark.integration
def test_bench_suffix_quick_runs_and_prints_every_line():
    # tiny random models, a real server on a loopback port 0, 4 turns: seconds of work
    bench = BENCH.with_name("bench_suffix.py")
    proc = subprocess.run([sys.executable, str(bench), "--quick"], cwd=bench.parents[1], capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("machine:"), out
    for tag in ("prefill", "ttft"):
        mine = [line for line in lines if line.split(" ", 1)[0] == tag]
        assert mine and all("ratio" in line for line in mine), f"no {tag!r} ratio line in:\n{out}"
    for tag in ("reuse", "answers"):
        assert any(line.split(" ", 1)[0] == tag for line in lines), f"no {tag!r} line in:\n{out}"
    assert lines[-1].startswith("done in "), out
