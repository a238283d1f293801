"""`kvbridge serve` as a child process for tests: found through its ready file, killed or stopped, started again on
the same port. Its output goes to a log file (a pipe nobody reads would fill and block the server).

No pytest in here; tests wrap it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

_POLL_S = 0.1
# where tiny_replica_args puts a replica's shared-memory segment folders when the test names none: a folder of the
# test session's own in /dev/shm (conftest's `session_shm_dir` sets it, then removes it with what a killed server left)
SHM_DIR: str | None = None


def tiny_replica_args(folder: Path, tiny_adapter_file: Path, redis_url: str, tokens: str,
                      shm_dir: str | None = None) -> list[str]:
    """`kvbridge serve` arguments of a tiny-pair replica on a shared Redis tier (values signed with the tests'
    secret): folder gets the adapters, the token file (`tokens`: its lines) and the secret file; its shared-memory
    folders go in shm_dir, else SHM_DIR, else the server's default (/dev/shm)."""
    from redisproc import write_secret_file

    adapters = folder / "adapters"
    adapters.mkdir(exist_ok=True)
    shutil.copy(tiny_adapter_file, adapters / "tiny-pair.safetensors")
    (folder / "tokens").write_text(tokens)
    (folder / "tokens").chmod(0o600)  # a token file others can read is refused
    return ["--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
            "--adapters", str(adapters), "--no-selfcheck", "--token-file", str(folder / "tokens"),
            "--redis-url", redis_url, "--redis-secret-file", str(write_secret_file(folder)),
            *(["--shm-dir", shm_dir or SHM_DIR] if shm_dir or SHM_DIR else [])]


def _die_with_parent() -> list[str]:
    """A command prefix that makes the server get SIGKILL when the test process dies (no orphan servers):
    util-linux `setpriv --pdeathsig KILL` where present. Not a preexec_fn: that makes subprocess fork() instead
    of vfork(), and a fork() while this process has gRPC streams open corrupts them (with grpcio's default fork
    support, streams received duplicated messages and malformed HTTP/2 frames in this test suite)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


class ServeProcess:
    """`python -m kvbridge.cli serve ARGS --listen 127.0.0.1:PORT --ready-file F`; port 0 on the first start,
    the port it bound on every later one."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None,
                 start_timeout_s: float = 300.0):
        self.workdir = Path(workdir)
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        self.address: str | None = None
        self.starts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def logfile(self) -> Path:
        return self.workdir / "serve.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start and wait for the ready file (RuntimeError with the log tail if the server exits or takes longer
        than start_timeout_s)."""
        if self.running:
            raise RuntimeError(f"kvbridge serve already running on port {self.port}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        ready = self.workdir / f"ready-{self.starts}.json"
        listen = f"127.0.0.1:{self.port or 0}"
        cmd = [*_die_with_parent(), sys.executable, "-m", "kvbridge.cli", "serve", *self.args,
               "--listen", listen, "--ready-file", str(ready)]
        with open(self.logfile, "ab") as log:
            log.write(f"\n--- start {self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                rc = self._proc.returncode
                self.kill()
                raise RuntimeError(f"kvbridge serve did not start on {listen} (rc {rc}):\n{self.log_tail()}")
            time.sleep(_POLL_S)
        info = json.loads(ready.read_text())
        self.port, self.address = info["port"], info["address"]

    def kill(self) -> None:
        """SIGKILL now (a crash): no drain, no goodbye to the clients. The process is forgotten only once reaped (an
        interrupt in the wait leaves it to the next kill or stop, not to its pdeathsig)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        self._proc = None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (drain and exit), SIGKILL after timeout_s or when the wait is interrupted (KeyboardInterrupt,
        SystemExit: raised on once it is reaped); the exit code, None if it was not running."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()  # reaped already: only forgets it
        return proc.returncode

    def restart(self) -> None:
        """Start again on the port of the first start (after kill or stop)."""
        if self.port is None:
            raise RuntimeError("restart before the first start")
        self.stop()
        self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(timeout_s=10)
