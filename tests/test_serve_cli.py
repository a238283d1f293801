"""`kvbridge serve` as a user runs it: a separate process, found through its ready file, stopped by SIGTERM; and the
README's client snippet against the small preset."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "ci-token-0123456789abcdef"


def _serve(tmp_path, *args, env=None):
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "kvbridge.cli", "serve", "--listen", "127.0.0.1:0", "--ready-file",
           str(ready), "--adapters", str(tmp_path / "adapters"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 900  # the small preset's first start converts nothing here but fits an adapter
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"server did not start (rc {proc.returncode}):\n{out}\n{err[-4000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def _stop(proc) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_serve_tiny_with_tokens_fits_an_adapter_serves_and_stops_cleanly(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvbridge.server.client import KVBridgeClient, KVBridgeError

    (tmp_path / "tokens").write_text(f"# tenant token\nci {TOKEN}\n")
    (tmp_path / "tokens").chmod(0o600)  # a token file others can read is refused
    proc, ready = _serve(tmp_path, "--preset", "tiny", "--fit-adapter", "--token-file", str(tmp_path / "tokens"),
                         "--log-json", "--metrics-listen", "127.0.0.1:0", env={"KVBRIDGE_HOME": str(tmp_path)})
    try:
        address = ready["address"]
        with KVBridgeClient(address, token=TOKEN) as client:
            entry = client.ingest("Each record holds a name and a value; readers skip unknown fields.").entries[0]
            fetched = client.fetch_projected(key=entry.key)
            assert fetched.segment.model.name == "tiny-phi3" and fetched.adapter.startswith("tiny-qwen2--tiny-phi3")
            assert [a.name for a in client.list_adapters()] == ["tiny-qwen2--tiny-phi3--proportional"]
        with KVBridgeClient(address, retries=0) as anonymous:
            with pytest.raises(KVBridgeError) as info:
                anonymous.stats()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        rc, out, err = _stop(proc)
    assert rc == 0, err[-4000:]
    assert "kvbridge serving on 127.0.0.1:" in out and "kvbridge server stopped" in out
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any("selfcheck tiny-phi3: 5 passed" in r["message"] for r in logs), err[-3000:]
    assert any(r["message"].startswith("fitted adapter") for r in logs)
    assert any(r["message"].startswith("signal 15: draining") for r in logs)


def _thread_taking(pid: int, signum: int) -> int:
    """A thread of process pid other than its main one that does not block signum."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        if not blocked & (1 << (signum - 1)):
            return tid
    pytest.fail(f"process {pid} has no thread but its main one that takes signal {signum}")


def test_serve_stops_when_sigterm_reaches_another_thread(tmp_path):
    """The kernel may hand a process's SIGTERM to any of its threads (grpc's, torch's); Python then runs the handler
    only when the main thread wakes. The server must still drain and exit, not wait for a SIGKILL."""
    import ctypes

    proc, ready = _serve(tmp_path, "--preset", "tiny", "--no-selfcheck", env={"KVBRIDGE_HOME": str(tmp_path)})
    try:
        tid = _thread_taking(proc.pid, signal.SIGTERM)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.tgkill(proc.pid, tid, int(signal.SIGTERM)) == 0, os.strerror(ctypes.get_errno())
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"SIGTERM to thread {tid} did not stop the server within 30 s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert "signal 15: draining" in err and "kvbridge server stopped" in out


def test_serve_refuses_an_open_server_on_a_public_address():
    proc = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--preset", "tiny", "--listen",
                           "0.0.0.0:0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a loopback address and there is no token_file" in proc.stderr


def test_serve_refuses_models_that_fail_their_self_checks(monkeypatch, tiny_source, tiny_target):
    from kvbridge.server import app
    from kvbridge.server.config import ServeConfig
    from kvbridge.transfer import selfcheck

    def failing(lm, **kwargs):
        return [selfcheck.CheckResult(lm.name, "inject", "0/16 greedy tokens equal (planted failure)", 16.0, False)]

    monkeypatch.setattr(selfcheck, "run_selfcheck", failing)
    with pytest.raises(RuntimeError, match="self-checks failed on 'tiny-qwen2', refusing to serve"):
        app.build_service(ServeConfig(preset="tiny", listen="127.0.0.1:0"), source=tiny_source,
                          targets=[tiny_target])


@pytest.mark.slow
def test_readme_client_snippet_runs_against_serve_small(tmp_path):
    from readme_blocks import python_client

    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/kvbridge serve --preset small\n" in readme
    snippet = python_client(readme)  # the README's one python block with a KVBridgeClient
    # the shipped adapter; the start-up self-checks of the small preset run in test_cli's own test
    proc, ready = _serve(tmp_path, "--preset", "small", "--device", "cpu", "--no-selfcheck")
    try:
        run = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "KVBRIDGE_ADDRESS": ready["address"]})
    finally:
        rc, out, err = _stop(proc)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert re.fullmatch(r"\d+ source tokens -> \d+ projected target tokens", lines[0]), run.stdout
    assert len(lines) >= 2 and lines[1].strip(), run.stdout  # SmolLM2 said something after the projected context
    assert rc == 0, err[-4000:]


def test_config_reads_toml_then_flags_and_names_bad_fields(tmp_path):
    from kvbridge.server.config import ServeConfig

    path = tmp_path / "serve.toml"
    path.write_text('preset = "tiny"\nlisten = "127.0.0.1:7000"\nworkers = 3\nstore_capacity_mb = 64\n')
    config = ServeConfig.load(path, workers=5, listen=None)
    assert (config.preset, config.listen, config.workers, config.store_capacity_mb) == ("tiny", "127.0.0.1:7000", 5, 64)
    path.write_text('preset = "tiny"\nchunk_kb = 1024.0\n')
    with pytest.raises(ValueError, match="chunk_kb must be int"):
        ServeConfig.load(path)
    path.write_text('preset = "tiny"\nlisen = "x"\n')
    with pytest.raises(ValueError, match=r"unknown keys \['lisen'\]"):
        ServeConfig.load(path)
    for fields, message in [({"listen": "nowhere"}, "listen must be host:port"),
                            ({"tls_cert": "c.pem"}, "tls_cert and tls_key go together"),
                            ({"chunk_kb": 8192, "max_message_mb": 4}, "does not fit in max_message_mb"),
                            ({"listen": "10.0.0.5:50051"}, "not a loopback address"),
                            ({"preset": "huge"}, "preset must be one of"),
                            ({"correction_prior_file": "p.safetensors", "correction_prior": False},
                             "correction_prior is off"),
                            # a value of another kind (any TOML value reaches here): a float count failed every fetch
                            ({"chunk_kb": 1024.0}, r"chunk_kb must be int, got 1024.0 \(float\)"),
                            ({"workers": True}, "workers must be int"), ({"block_size": 16.5}, "block_size must be"),
                            ({"listen": 50051}, "listen must be str"), ({"selfcheck": "no"}, "selfcheck must be bool"),
                            ({"detector_layers": [0, "1"]}, "detector_layers must be")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**fields)
    assert ServeConfig(listen="10.0.0.5:50051", token_file="tokens").listen == "10.0.0.5:50051"
    assert ServeConfig(listen="[::1]:0").listen == "[::1]:0"


def test_values_that_fail_later_are_refused_at_start_by_name(tmp_path, monkeypatch):
    """Values the store, gRPC or the detector would refuse only after the models load (or, for the detector, at every
    Ingest that detects segments, as the client's fault) are refused by the field's name; the secret file's
    variable no longer contradicts an explicit redis_insecure."""
    from kvbridge.server.app import build_service
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.server.config import SECRET_FILE_ENV, ServeConfig
    from kvbridge.transfer.tiny_pair import tiny_source, tiny_target

    for fields, message in [({"store_capacity_mb": -1}, "store_capacity_mb must be > 0"),
                            ({"cpu_tier_mb": -1}, "cpu_tier_mb must be >= 0"),
                            ({"default_ttl_s": 0}, "default_ttl_s must be > 0"),
                            ({"tenant_max_entries": -1}, "tenant_max_entries must be >= 0"),
                            ({"tenant_max_pinned_mb": -1}, "tenant_max_pinned_mb must be >= 0"),
                            ({"max_message_mb": 2048}, "max_message_mb must be under 2048"),
                            ({"chunk_kb": 2}, "chunk_kb must be >= 4"),  # every default fetch failed, as INVALID_ARG
                            ({"detector_layers": [-1]}, "detector_layers must be layer indices")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**fields)
    with pytest.raises(ValueError, match="max_message_mb must be > 0 and under 2048"):
        KVBridgeClient("127.0.0.1:1", max_message_mb=2048)
    config = ServeConfig(preset="tiny", adapters=str(tmp_path), store_capacity_mb=64, store_device="cpu",
                         selfcheck=False, detector_layers=[99], shm_dir=None)
    with pytest.raises(ValueError, match=r"detector_layers \[99\]: the source 'tiny-qwen2' has layers 0\.\.3"):
        build_service(config, source=tiny_source(device="cpu"), targets=[tiny_target(device="cpu")])
    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))
    url = "redis://127.0.0.1:6379/0"
    assert ServeConfig.load(None, redis_url=url, redis_insecure=True).redis_secret_file is None
    assert ServeConfig.load(None, redis_url=url).redis_secret_file == str(secret)


def test_the_default_store_gives_each_tenant_a_quarter_of_the_pool_to_pin(monkeypatch):
    """Without --store-capacity-mb the store sizes itself (half the free memory); the pinned quota, a quarter of the
    pool by the docs, was then none: one tenant could pin the whole pool and every other tenant's put failed."""
    from kvbridge.server.app import store_config
    from kvbridge.server.config import ServeConfig

    monkeypatch.setattr("kvbridge.server.app.default_capacity", lambda device, fraction: 64 << 20)
    config = store_config(ServeConfig(preset="tiny", store_device="cpu"))
    assert (config.capacity_bytes, config.tenant_max_pinned_bytes) == (64 << 20, 16 << 20)
    assert store_config(ServeConfig(preset="tiny", store_device="cpu", tenant_max_pinned_mb=0)
                        ).tenant_max_pinned_bytes == 0


def test_no_shm_turns_the_shared_memory_plane_off(tmp_path, monkeypatch):
    """--no-shm set shm_dir to None among the overrides, which load reads as "not given": the default folder (or the
    TOML's) stayed, and same-host fetches still went through /dev/shm."""
    import kvbridge.server.app as app
    from kvbridge.cli import main

    seen = []
    monkeypatch.setattr(app, "serve", lambda config, ready_file=None: seen.append(config.shm_dir) or 0)
    monkeypatch.setattr(app, "setup_logging", lambda verbose, as_json: None)
    toml = tmp_path / "serve.toml"
    toml.write_text(f'preset = "tiny"\nshm_dir = "{tmp_path}"\n')
    for argv in (["--preset", "tiny", "--no-shm"], ["--config", str(toml), "--no-shm"], ["--config", str(toml)],
                 ["--preset", "tiny"]):
        assert main(["serve", *argv]) == 0
    assert seen == [None, None, str(tmp_path), "/dev/shm"]


def test_log_json_in_the_toml_file_formats_the_log(tmp_path, monkeypatch):
    """README: every flag but --ready-file and --no-shm has a TOML form; log_json from the file was read after the
    log was set up, and so ignored."""
    import logging

    import kvbridge.server.app as app
    from kvbridge.cli import main

    toml = tmp_path / "serve.toml"
    toml.write_text('preset = "tiny"\nlog_json = true\n')
    seen = {}

    def serve(config, ready_file=None):
        seen["formatter"] = type(logging.getLogger().handlers[0].formatter).__name__
        return 0

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(app, "serve", serve)
    try:
        assert main(["serve", "--config", str(toml)]) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert seen["formatter"] == "JsonFormatter"
