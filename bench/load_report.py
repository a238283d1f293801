"""What a load run (bench/load_test.py) measured: the server's metrics, latency percentiles, the calls' errors by
kind, and the report it prints."""

from __future__ import annotations

import math
import urllib.request
from collections import Counter, defaultdict

from load_client import INF, OPS, RESTART_CODES


def metrics(port: int) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def classify(clients: list[dict], down_at: float, up_at: float) -> tuple[dict, Counter, Counter, Counter, list]:
    """Latencies of answered calls by op; intended, restart and unexpected errors by (op, code)."""
    latency: dict[str, list[float]] = defaultdict(list)
    intended, restart, unexpected = Counter(), Counter(), Counter()
    samples = []
    for c in clients:
        rows = c["rows"]
        # a client is back once it has an answered call that started after the server came back
        back = min((t0 for op, t0, dt, code, _, _ in rows if code == "OK" and t0 > up_at), default=INF)
        for op, t0, dt, code, why, detail in rows:
            if code == "OK":
                latency[op].append(dt)
            elif code == "NOT_FOUND" and why:
                intended[(op, code, why)] += 1
            elif code in RESTART_CODES and t0 + dt >= down_at and t0 <= back:
                restart[(op, code)] += 1
            else:
                unexpected[(op, code)] += 1
                if len(samples) < 8:
                    samples.append(f"client {c['cid']}: {op} {code} at {t0 - down_at:+.2f} s from the restart: "
                                   f"{detail}")
    return latency, intended, restart, unexpected, samples


def print_report(r: dict) -> None:
    print(f"\nload: {r['clients']} client processes, {r['tenants']} tenants, preset {r['preset']}, Redis tier "
          f"{'on' if r['redis'] else 'off'}: {r['calls']} calls in {r['load_s']:.1f} s, the server down "
          f"{r['down_s']:.1f} s of it; {r['answered']} answered = {r['throughput']:.1f} answered calls/s while it was "
          "up", flush=True)
    print("| operation | answered | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|")
    for op in OPS:
        v = r["latency"].get(op)
        if v:
            print(f"| {op} | {v['n']} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {v['max_ms']:.1f} |")
    print(f"errors: {r['intended']} intended {r['intended_by'] or ''}; {r['restart_errors']} at the restart "
          f"{r['restart_by'] or ''}; {r['unexpected']} unexpected {r['unexpected_by'] or ''}; {r['wrong']} wrong "
          "answers")
    print(f"after: store {r['store']}; tokens {r['tokens']}; shared memory {r['shm_after_run']} while serving, "
          f"{len(r['shm_after_stop'])} folders after stop; Redis entry keys {r.get('redis_keys_after_run', '-')}, "
          f"blocks (TTL) {r.get('redis_blocks_after_run', '-')}; "
          f"witness {r['witness']}; {r['clients_resumed']} clients resumed after the restart; server exit "
          f"{r['server_exit']}", flush=True)
