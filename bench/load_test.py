"""A load test from outside (issue 16, part 7): N clients, each its own OS process with its own channel and bearer
token, against `kvbridge serve` in its own process, with one server restart in the middle. Each client mixes
Ingest, prefix-extending Ingest, Lookup, GetProjectedCache through shared memory and through the stream,
GetProjectedCache by text, GetSourceCache and Delete of its own entries, and checks every answer against what it
knows. Afterwards every client deletes what it made and the runner checks the server from outside: each tenant's
Stats empty, /metrics (store entries and bytes 0, store.check() clean, no evictions), no segment left in the
server's shared-memory folder, no traceback in its log, no entry record left in Redis (full blocks stay there until
their TTL: a Delete cannot see which entries elsewhere share them), and no segment folder after it stops.

    .venv/bin/python bench/load_test.py [--preset tiny|small] [--clients 64] [--seconds 60] [--tenants 8]
                                        [--redis | --no-redis] [--restart term|kill|none] [--adapter FILE]
                                        [--json FILE] [--keep]

What survives the restart: with the Redis tier on (`--redis`, the default when redis-server is on PATH) every
entry written before it (records and blocks are written through), so keys made before it are still found, fetched
with the same KV, and deleted; without it nothing, so those keys answer NOT_FOUND and Lookup misses. The runner
asserts which one holds with a witness tenant's entries, and the clients with theirs. After a crash (`--restart
kill`) an entry answered just before it may be missing even with Redis: a call's write-through can still be queued
when it answers (another thread is sending), and the crash loses it; the clients accept either for the entries made
before a crash (the witness's, made long before, must be there).

Errors are sorted into: intended (NOT_FOUND of a key this client deleted or the restart dropped), restart
(UNAVAILABLE or CANCELLED of a call that overlapped the server's down window, or came before that client's first
answered call after it: the channel reconnects with backoff) and unexpected (everything else; the run fails).
Latencies are reported, never asserted. Exit status 0 only when every check held.

One client process, its calls and its checks: load_client.py. This file: the runner, and the checks after the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for folder in (BENCH_DIR, ROOT / "tests"):  # load_client.py, machine.py; serveproc.py and redisproc.py (tests')
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from load_client import (  # noqa: E402
    OPS,
    PRESETS,
    TIMEOUT_S,
    Shared,
    client_main,
    kv_digest,
    sample_words,
    token_of,
)
from load_report import classify, metrics, percentile, print_report  # noqa: E402

WITNESSES = 3  # the witness tenant's entries, made before the restart and checked after it
START_TIMEOUT_S = 600.0  # bound on the server starting, and on the client processes getting ready
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # each unwinds run(): its finally stops what it started


# ------------------------------------------------------------------------------------------------ the runner


def run(args) -> dict:
    from kvbridge.server.client import KVBridgeClient, KVBridgeError
    from machine import machine_line
    from redisproc import RedisProcess, redis_available
    from serveproc import ServeProcess

    t_begin = time.monotonic()
    redis_on = args.redis if args.redis is not None else redis_available()
    print(machine_line("full" if args.clients >= 64 and args.seconds >= 60 else "short",
                       f"preset {args.preset}", f"{args.clients} client processes", f"{args.tenants} tenants",
                       f"Redis tier {'on' if redis_on else 'off'}", f"restart by {args.restart}"), flush=True)
    work = shm_root = None
    try:  # a stop signal while the run is set up removes what was made so far (the clean-up below is not armed)
        work = Path(tempfile.mkdtemp(prefix="kvbridge-load-"))
        shm_root = Path(tempfile.mkdtemp(prefix="kvload-", dir="/dev/shm"))  # the server's segment folders go here
        tenants = [f"load{t}" for t in range(args.tenants)]
        (work / "tokens").write_text("".join(f"{t} {token_of(t)}\n" for t in [*tenants, "witness"]))
        (work / "tokens").chmod(0o600)  # the server refuses a token file other users can read
        (work / "adapters").mkdir()
        redis = RedisProcess(work / "redis") if redis_on else None
        sizes = PRESETS[args.preset]
        serve_args = ["--preset", args.preset, "--device", "cpu", "--store-device", "cpu",
                      "--store-capacity-mb", str(args.capacity_mb or sizes["capacity_mb"]),
                      "--adapters", str(work / "adapters"),
                      "--no-selfcheck", "--token-file", str(work / "tokens"), "--metrics-listen", "127.0.0.1:0",
                      "--correction", "replace",  # the witness counts a source and its projection per Delete
                      "--shm-dir", str(shm_root), "--grace-s", "5"]
        if args.adapter:
            shutil.copy(args.adapter, work / "adapters" / Path(args.adapter).name)
        elif args.preset == "tiny":
            serve_args.append("--fit-adapter")  # no adapter ships for the random pair: a ridge fit at the first start
    except BaseException:
        for folder in (shm_root, None if args.keep else work):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        raise
    server = None
    procs: list = []  # the client processes, once started (stopped in the finally below, whatever happened)
    report: dict = {"preset": args.preset, "clients": args.clients, "tenants": args.tenants, "redis": redis_on,
                    "restart": args.restart, "failures": []}
    failures = report["failures"]

    def fail(what: str) -> None:
        failures.append(what)
        print(f"FAIL {what}", flush=True)

    try:
        if redis is not None:
            redis.start()
            secret = work / "redis-secret"  # the replicas' shared secret tagging what they write to Redis
            secret.write_text(secrets.token_hex(32) + "\n")
            secret.chmod(0o600)
            serve_args += ["--redis-url", redis.url, "--redis-secret-file", str(secret)]
        server = ServeProcess(work / "server", serve_args, start_timeout_s=START_TIMEOUT_S)
        t0 = time.monotonic()
        server.start()
        report["server_start_s"] = time.monotonic() - t0

        def metrics_port() -> int:
            return json.loads((server.workdir / f"ready-{server.starts}.json").read_text())["metrics_port"]

        def check_metrics(when: str) -> dict[str, float]:
            """The running server's metrics, its store checked; its evictions too (each server process counts its own:
            those of the one before a restart are checked before it)."""
            m = metrics(metrics_port())
            if m.get("kvbridge_store_check_problems") != 0:
                fail(f"{when}: store.check() found {m.get('kvbridge_store_check_problems')} problems "
                     "(the server log has them)")
            if m.get('kvbridge_store_evictions_total{tier="device"}'):
                fail(f"{when}: the device pool evicted blocks: the run was sized so that it never does")
            return m

        print(f"server: {server.address}, started in {report['server_start_s']:.1f} s (pid {server.pid})",
              flush=True)

        # the witness: entries made before the restart, checked after it
        witness = KVBridgeClient(server.address, token=token_of("witness"), timeout_s=TIMEOUT_S, retries=0)
        words = sample_words()
        texts = [" ".join(words[900 + 30 * i:930 + 30 * i]) for i in range(WITNESSES)]
        made = []
        for text in texts:
            key = witness.ingest(text).entries[0].key
            made.append((key, kv_digest(witness.fetch_projected(key=key).segment), kv_digest(witness.fetch_source(
                key=key).segment)))

        # the clients: processes forked from a server process that imported torch and the client once (each
        # process pays only for what it writes); no gRPC channel exists in it before the fork
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "kvbridge.server.client", "kvbridge.transfer.selfcheck"])
        shared = Shared(ctx, args.clients)
        preambles = [" ".join(words[500 + 20 * t:520 + 20 * t]) for t in range(args.tenants)]
        outs = [work / f"client-{i}.json" for i in range(args.clients)]
        procs = [ctx.Process(target=client_main, name=f"load-client-{i}",
                             args=(i, server.address, tenants[i % args.tenants], preambles[i % args.tenants],
                                   args.preset, redis_on, args.restart == "kill", args.seed * 1000 + i, shared,
                                   str(outs[i])))
                 for i in range(args.clients)]
        t0 = time.monotonic()
        for p in procs:
            with stop_signals_held():  # an exception in start() loses the child's pid: that client is never killed
                p.start()
        while sum(shared.ready) < args.clients:
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead or time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"client processes not ready after {time.monotonic() - t0:.0f} s "
                                   f"(exited: {dead})")
            time.sleep(0.05)
        report["clients_ready_s"] = time.monotonic() - t0
        half = args.seconds / 2
        start = time.monotonic() + 0.5
        shared.start_at.value = start
        print(f"{args.clients} client processes ready in {report['clients_ready_s']:.1f} s; load for "
              f"{half:.0f} s, restart, {half:.0f} s", flush=True)

        time.sleep(max(0.0, start + half - time.monotonic()))
        before = check_metrics("before the restart")
        if args.restart == "none":  # (to tell what the restart causes from what the load does)
            up = time.monotonic()
        else:
            shared.down_at.value = time.monotonic()
            if args.restart == "kill":
                server.kill()
            else:
                server.stop(timeout_s=60)
            server.start()
            shared.up_at.value = up = time.monotonic()
        shared.deadline.value = up + half
        report["down_s"] = up - min(up, shared.down_at.value)
        print(f"restarted ({args.restart}): down {report['down_s']:.1f} s; {before['kvbridge_store_entries']:.0f} "
              f"entries before", flush=True)

        # the witness after the restart: kept with the Redis tier, gone without
        witness.close()
        witness = KVBridgeClient(server.address, token=token_of("witness"), timeout_s=TIMEOUT_S, retries=8,
                                 backoff_s=0.25)
        for text, (key, projected, source) in zip(texts, made):
            found = witness.lookup(text)
            if redis_on or args.restart == "none":
                if found.key != key:
                    fail(f"witness: Lookup after the restart answered {found.key}, expected {key} (Redis tier on)")
                if kv_digest(witness.fetch_source(key=key).segment) != source:
                    fail("witness: the source KV after the restart differs from before")
                if kv_digest(witness.fetch_projected(key=key).segment) != projected:
                    fail("witness: the projected KV after the restart differs from before")
            else:
                if found.key is not None:
                    fail(f"witness: Lookup after the restart found {found.key} without a Redis tier")
                for name, fn in (("GetSourceCache", witness.fetch_source), ("GetProjectedCache",
                                                                             witness.fetch_projected)):
                    try:
                        fn(key=key)
                        fail(f"witness: {name} after the restart answered without a Redis tier")
                    except KVBridgeError as exc:
                        if exc.code.name != "NOT_FOUND":
                            fail(f"witness: {name} after the restart: {exc.code.name}, expected NOT_FOUND")
        report["witness"] = "kept" if redis_on or args.restart == "none" else "gone"

        while time.monotonic() < up + half:
            check_metrics("during the load")
            time.sleep(min(5.0, max(0.0, up + half - time.monotonic())))
        for p in procs:
            p.join(timeout=max(1.0, up + half + TIMEOUT_S - time.monotonic()))
        alive = [p.name for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if alive:
            fail(f"{len(alive)} client processes still running {TIMEOUT_S:.0f} s after the deadline")
        report["load_s"] = time.monotonic() - start
        clients = [json.loads(o.read_text()) for o in outs if o.exists()]
        if len(clients) != args.clients:
            fail(f"{args.clients - len(clients)} clients wrote no results (exit codes "
                 f"{sorted(Counter(p.exitcode for p in procs).items(), key=str)})")

        # the witness's entries go too (kept only with Redis)
        for key, _, _ in made:
            try:
                deleted = witness.delete(key)
            except KVBridgeError as exc:
                deleted = exc.code.name
            want = 2 if redis_on or args.restart == "none" else "NOT_FOUND"
            if deleted != want:
                fail(f"witness: Delete answered {deleted}, expected {want}")
        witness.close()

        # after: nothing left, from outside
        latency, intended, restart, unexpected, samples = classify(clients, shared.down_at.value, up)
        wrong = [w for c in clients for w in c["wrong"]]
        for tenant in [*tenants, "witness"]:
            with KVBridgeClient(server.address, token=token_of(tenant), retries=4) as c:
                s = c.stats()
            used = {t.tier: t.bytes_used for t in s.tiers if t.bytes_used}
            if s.tenant_entries or s.tenant_tokens or used:
                fail(f"tenant {tenant} holds {s.tenant_entries} entries, {s.tenant_tokens} tokens, {used} after "
                     "every client deleted what it made")
        m = check_metrics("after the run")
        report["store"] = {k: m.get(k) for k in ("kvbridge_store_entries", 'kvbridge_store_bytes{tier="device"}',
                                                  'kvbridge_store_bytes{tier="cpu"}', "kvbridge_store_check_problems",
                                                  'kvbridge_store_evictions_total{tier="device"}')}
        report["tokens"] = {k.split("{", 1)[1].rstrip("}"): v for k, v in m.items()
                            if k.startswith("kvbridge_tokens_total")}
        if m.get("kvbridge_store_entries") or m.get('kvbridge_store_bytes{tier="device"}') or \
                m.get('kvbridge_store_bytes{tier="cpu"}'):
            fail(f"the store holds {report['store']} after every entry was deleted: leaked entries or blocks")
        server_errors = {k: v for k, v in m.items() if k.startswith("kvbridge_requests_total")
                         and re.search(r'code="(INTERNAL|UNKNOWN|DATA_LOSS)"', k)}
        if server_errors:
            fail(f"the restarted server answered {server_errors}")
        folders = [f for f in shm_root.iterdir()]
        files = [p.name for f in folders for p in f.iterdir() if p.name != ".lock"]
        segments = [name for name in files if name.endswith(".safetensors")]  # named to a client, not released
        report["shm_after_run"] = {"folders": len(folders), "segments": len(segments),
                                   "other files (spares)": len(files) - len(segments)}
        if segments:
            fail(f"{len(segments)} shared-memory segments left in {folders}")
        if redis is not None:
            import redis as redis_py
            from kvbridge.transfer.store.redis_commands import BLOCK_PREFIX, ENTRY_PREFIX

            # no entry record or derived set may be left; blocks (full and partial tails) stay until their TTL (a
            # Delete cannot see which entries elsewhere share them)
            r = redis_py.Redis.from_url(redis.url)
            kinds = Counter(k.rsplit(b":", 1)[0].decode() for k in r.scan_iter(count=1000))
            report["redis_blocks_after_run"] = kinds.pop(BLOCK_PREFIX.decode().rstrip(":"), 0)
            keys = sum(kinds.values())
            report["redis_keys_after_run"] = keys
            if keys:
                records = [json.loads((r.get(k) or b"- {}").split(b" ", 1)[-1])  # "<tag> <json>"
                           for k in r.scan_iter(match=ENTRY_PREFIX + b"*", count=1000)]
                report["redis_records_after_run"] = [
                    {"key": e.get("key"), "tenant": e.get("tenant"), "model": e.get("model_name"),
                     "source_key": e.get("source_key"), "tokens": len(e.get("token_ids") or ()),
                     "text": (e.get("text") or "")[-80:]} for e in records]
                fail(f"Redis holds {keys} entry keys after every entry was deleted: {dict(kinds)}")
        rc = server.stop(timeout_s=60)
        log = server.logfile.read_text(errors="replace")
        tracebacks = log.count("Traceback")
        report["server_exit"], report["server_tracebacks"] = rc, tracebacks
        if rc != 0:
            fail(f"the server exited {rc} on SIGTERM")
        if tracebacks or "ERROR" in log:
            fail(f"the server log has {tracebacks} tracebacks / ERROR lines: {server.logfile}")
        left = [str(p) for p in shm_root.iterdir()]
        report["shm_after_stop"] = left
        if left:
            fail(f"shared-memory folders left after the server stopped: {left}")

        answered = sum(len(v) for v in latency.values())
        total = answered + sum(intended.values()) + sum(restart.values()) + sum(unexpected.values())
        # throughput: answered calls per second the server was up (the clients' retries while it was down would
        # count as calls otherwise)
        report.update(calls=total, answered=answered, throughput=answered / (report["load_s"] - report["down_s"]),
                      intended=sum(intended.values()), restart_errors=sum(restart.values()),
                      unexpected=sum(unexpected.values()), wrong=len(wrong),
                      latency={op: {"n": len(v), "p50_ms": 1e3 * percentile(v, 0.5),
                                    "p99_ms": 1e3 * percentile(v, 0.99), "max_ms": 1e3 * max(v)}
                               for op, v in latency.items()},
                      intended_by={f"{op} {code} ({note})": n for (op, code, note), n in sorted(intended.items())},
                      restart_by={f"{op} {code}": n for (op, code), n in sorted(restart.items())},
                      unexpected_by={f"{op} {code}": n for (op, code), n in sorted(unexpected.items())},
                      samples=samples + wrong[:8])
        resumed = sum(1 for c in clients if any(code == "OK" and t0 > up for _, t0, _, code, _, _ in c["rows"]))
        if args.restart == "none":
            resumed = len(clients)
        report["clients_resumed"] = resumed
        if unexpected:
            fail(f"{sum(unexpected.values())} unexpected errors: {report['unexpected_by']}; {samples}")
        if wrong:
            fail(f"{len(wrong)} wrong answers: {wrong[:5]}")
        if resumed != len(clients):
            fail(f"{len(clients) - resumed} clients had no answered call after the restart")
        missing = [op for op in OPS if not latency.get(op)]
        if missing:
            fail(f"no answered {missing}")
        print_report(report)
    finally:
        # clients still running (an error or Ctrl-C before their deadline) would keep this process from exiting,
        # which joins them; a first stop signal now (a run that ended by itself) waits for the clean-up's end
        with stop_signals_held():
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                if p.pid is not None:  # started
                    p.join(timeout=10)
            if server is not None:
                server.kill()
            if redis is not None:
                redis.stop()
            shutil.rmtree(shm_root, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.monotonic() - t_begin
    print(f"{'PASS' if not failures else 'FAIL'}: {len(failures)} failed checks; done in {report['wall_s']:.0f} s",
          flush=True)
    return report


def _stop(signum: int, frame) -> None:
    """SIGINT (Ctrl-C) and SIGTERM (kill, timeout(1), a cancelled CI job) unwind the run, whose finally stops the
    clients, the server and removes its shared-memory folder (SIGTERM's default action would end this process at once
    and leave them): KeyboardInterrupt, or SystemExit(143). The first one only: both are ignored from then on, as a
    second (Ctrl-C twice, timeout's or a canceller's TERM again) would interrupt that clean-up and leave them too; the
    process exits with the first one's status (SIG_IGN, not a handler that returns: the interpreter puts SIG_DFL back
    for Python handlers as it finalizes, and a TERM then would end it with -15)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stop_signals_held():
    """SIGINT and SIGTERM held for the block: the first is recorded, then handed to the handler it found once the block
    is done (_stop raises then); a second is dropped (_stop would ignore it). Not by pthread_sigmask: that holds them in
    the calling thread only (the kernel hands them to another, a gRPC channel's, whose C handler has the main thread run
    the Python one at once), and the forkserver and clients the block starts inherit it (both blocked for good)."""
    came: list = []  # (signum, frame) of the first
    def record(signum: int, frame) -> None:
        if not came:
            came.append((signum, frame))
    previous = {s: signal.signal(s, record) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if came:
            signum, frame = came[0]
            if callable(previous[signum]):
                previous[signum](signum, frame)
            else:
                signal.raise_signal(signum)  # SIG_DFL's action (SIG_IGN: nothing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0, help="load time, half before the restart")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--redis", dest="redis", action="store_true", default=None)
    parser.add_argument("--no-redis", dest="redis", action="store_false")
    parser.add_argument("--restart", choices=["term", "kill", "none"], default="term",
                        help="stop the server by SIGTERM (drain) or SIGKILL (crash) in the middle; none: no restart")
    parser.add_argument("--adapter", help="an adapter file for the server's folder (default: the shipped one for "
                        "small; tiny: fitted at the first start)")
    parser.add_argument("--capacity-mb", type=float, help="the server's device pool (default: room for every "
                        "client's entries, so nothing is evicted; less: evictions, and the check that there were none "
                        "fails)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (server log, client results)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.tenants < 1 or args.seconds <= 0:
        parser.error("--clients, --tenants and --seconds must be positive")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        # written after the run: refused now rather than lost then
        parser.error(f"--json {args.json}: not a file in an existing folder")
    if args.adapter and not Path(args.adapter).is_file():
        parser.error(f"--adapter {args.adapter}: no such file")
    # Ctrl-C stops the run (the finally in run() stops what it started) even where this process was started with
    # SIGINT ignored (from a non-interactive shell's `&`, which Python keeps): it would never exit on SIGINT then;
    # SIGTERM stops it the same way; a second of either is ignored (_stop)
    for s in STOP_SIGNALS:
        signal.signal(s, _stop)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
