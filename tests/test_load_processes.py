"""The load test from outside (issue 16, part 7), short enough for CI: bench/load_test.py runs 12 client processes
for 16 s against `kvbridge serve` in its own process (the tiny pair), restarted by SIGTERM in the middle; once with
the Redis tier (entries made before the restart are still there after it) and once without (they are gone: the
clients' NOT_FOUND for them is intended). The runner checks every answer and, afterwards, the server from outside
(Stats, /metrics with store.check(), its shared-memory folder, its log, Redis) and exits 0 only when all held; this
test reads its JSON report. The full run (64 processes, 60 s) and its figures: bench/serving.md.

The runner loads the server for a given time, half before the restart and half after. What this test waits for is a
condition: every operation answered and at least one call that met the restart. A run too short to see them (a
slow, busy machine) is run again twice as long, up to SECONDS[-1]; any other failure fails at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUNNER = Path(__file__).resolve().parents[1] / "bench" / "load_test.py"
CLIENTS, TENANTS = 12, 4
SECONDS = (16, 32, 64)  # load time of each try: a try too short to see every operation and the restart is repeated
OPERATIONS = {"Ingest", "Ingest(extend)", "Lookup", "GetProjectedCache(shm)", "GetProjectedCache(stream)",
              "GetProjectedCache(text)", "GetSourceCache", "Delete"}


def _run(tmp_path, seconds: float, redis: bool, adapter, env) -> tuple[subprocess.CompletedProcess, dict]:
    """bench/load_test.py for `seconds` of load; its exit and its JSON report ({} if it wrote none)."""
    report_file = tmp_path / f"report-{seconds:g}s.json"
    proc = subprocess.run([sys.executable, str(RUNNER), "--preset", "tiny", "--clients", str(CLIENTS),
                           "--seconds", str(seconds), "--tenants", str(TENANTS), "--restart", "term",
                           "--redis" if redis else "--no-redis", "--adapter", str(adapter),
                           "--json", str(report_file)],
                          cwd=RUNNER.parents[1], env=env, capture_output=True, text=True, timeout=900, check=False)
    print(proc.stdout)
    return proc, json.loads(report_file.read_text()) if report_file.exists() else {}


def _dropped(r: dict) -> int:
    """NOT_FOUND answers the clients expected because the restart dropped their entry."""
    return sum(n for k, n in r.get("intended_by", {}).items() if "(the restart dropped it)" in k)


def _too_short(r: dict, redis: bool) -> bool:
    """A run whose only shortfall is time: an operation never answered, a client with no answer after the restart
    (the runner's own failures for these), no call that met the restart, or (without Redis) no client that asked
    for an entry the restart dropped; and nothing else wrong."""
    if not r or r.get("unexpected") or r.get("wrong"):
        return False
    timing = [f for f in r["failures"] if f.startswith("no answered ") or "no answered call after the restart" in f]
    if len(timing) != len(r["failures"]):
        return False
    return bool(timing) or r.get("restart_errors") == 0 or (not redis and _dropped(r) == 0)


@pytest.mark.parametrize("redis", [True, False], ids=["redis-tier", "no-redis"])
def test_client_processes_through_a_restart_leave_no_errors_and_nothing_behind(tmp_path, tiny_adapter_file, redis):
    from redisproc import redis_available, write_secret_file

    if redis and not redis_available():
        pytest.fail("no redis-server (or valkey-server) on PATH: install it (apt-get install redis-server)")
    adapter = tmp_path / "tiny-pair.safetensors"
    shutil.copy(tiny_adapter_file, adapter)
    # the runner's servers (and the one restarted) read their Redis tier's secret from the file this names
    env = {**os.environ, "KVBRIDGE_REDIS_SECRET_FILE": str(write_secret_file(tmp_path))}
    for seconds in SECONDS:  # until a run sees every operation answered and the restart met (or the last try)
        proc, r = _run(tmp_path, seconds, redis, adapter, env)
        if not _too_short(r, redis):
            break
    assert proc.returncode == 0, f"load test exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert r["failures"] == [] and r["unexpected"] == 0 and r["wrong"] == 0, r
    assert r["clients"] == CLIENTS and r["clients_resumed"] == CLIENTS
    # every operation was answered, and the clients met the restart (UNAVAILABLE while the server was down)
    assert set(r["latency"]) == OPERATIONS
    assert r["restart_errors"] > 0 and set(r["restart_by"]) <= {f"{op} {code}" for op in r["latency"]
                                                                for code in ("UNAVAILABLE", "CANCELLED")}
    assert r["tokens"]['how="reused",stage="ingest"'] > 0  # the prefix-extending ingests reused the cached prefix
    # what survived the restart
    dropped = _dropped(r)
    if redis:
        assert r["witness"] == "kept" and dropped == 0 and r["redis_keys_after_run"] == 0
    else:
        assert r["witness"] == "gone" and dropped > 0
    # nothing left behind
    assert r["store"]["kvbridge_store_check_problems"] == 0 and r["store"]["kvbridge_store_entries"] == 0
    assert r["store"]['kvbridge_store_bytes{tier="device"}'] == 0
    assert r["shm_after_run"]["segments"] == 0 and r["shm_after_stop"] == []
    assert r["server_exit"] == 0 and r["server_tracebacks"] == 0
