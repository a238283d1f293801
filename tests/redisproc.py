"""A real redis-server child process for tests: loopback only, free port, no persistence, own dir; and the secret
the tests' replicas share on it (a Redis tier needs one: transfer/store/redis_auth.py).

No pytest in here; the fixtures in conftest.py wrap it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_BINARIES = ("redis-server", "valkey-server")
_START_DEADLINE_S = 10.0
_POLL_S = 0.02
_STOP_GRACE_S = 5.0
_PORT_RETRIES = 3
TEST_SECRET = b"kvbridge tests: the replicas' shared redis secret"  # >= 32 bytes, as redis_auth requires


def write_secret_file(folder: Path, secret: bytes = TEST_SECRET) -> Path:
    """A file holding the secret, mode 0600 (what `kvbridge serve --redis-secret-file` reads)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "redis-secret"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def _binary() -> str | None:
    for name in _BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _die_with_parent() -> list[str]:
    """A command prefix that makes the server get SIGKILL if the test process dies (no orphans): util-linux
    `setpriv --pdeathsig KILL` where present. Not a preexec_fn: that makes subprocess fork() instead of vfork(),
    and a fork() while this process has gRPC streams open corrupts them (duplicated messages, malformed HTTP/2
    frames were seen in the reliability tests)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def redis_available() -> bool:
    return _binary() is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping_pid(port: int, timeout: float = 0.5) -> int | None:
    """PING over raw RESP (no redis-py needed here); if it answers, return the server's process_id.

    The pid lets start() tell its own server from another one that grabbed the port meanwhile.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            buf = b""
            while b"process_id:" not in buf or not buf.split(b"process_id:", 1)[1].count(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    return None
                buf += chunk
            if not buf.startswith(b"+PONG"):
                return None
            return int(buf.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])
    except (OSError, ValueError):
        return None


class RedisProcess:
    """A redis-server child process on 127.0.0.1 at a free port, no persistence, its own temp dir."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = Path(workdir)
        self._fixed_port = port is not None
        self._port: int | None = port
        self._proc: subprocess.Popen | None = None

    # -- properties ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisProcess has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"redis-server already running on port {self._port}")
        binary = _binary()
        if binary is None:
            raise RuntimeError("no redis-server (or valkey-server) binary on PATH")
        self.workdir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port else _PORT_RETRIES
        for attempt in range(attempts):
            if not self._fixed_port:
                self._port = _free_port()
            try:
                self._launch(binary)
                return
            except _AddressInUse:
                if attempt == attempts - 1:
                    raise RuntimeError(
                        f"redis-server could not bind 127.0.0.1:{self._port} (address in use)"
                        f" after {attempts} attempt(s):\n{self._log_tail()}"
                    ) from None

    def _launch(self, binary: str) -> None:
        port = self.port
        log_offset = self.logfile.stat().st_size if self.logfile.exists() else 0
        cmd = [
            *_die_with_parent(),
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.logfile),
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_DEADLINE_S
        while True:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self._proc = None
                new_log = self._log_since(log_offset)
                if "Address already in use" in new_log:
                    raise _AddressInUse()
                raise RuntimeError(
                    f"redis-server exited with code {rc} while starting on port {port}:\n"
                    f"{self._log_tail()}"
                )
            pid = _ping_pid(port)
            if pid == self._proc.pid:
                return
            # pid None: not up yet. Another pid: someone else's server holds the port and ours is
            # about to exit with "Address already in use" (handled above on a later poll).
            if time.monotonic() > deadline:
                self._terminate()
                raise RuntimeError(
                    f"redis-server did not answer PING on port {port} within "
                    f"{_START_DEADLINE_S:.0f} s:\n{self._log_tail()}"
                )
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bound. Safe to call any number of times."""
        self._terminate()

    def kill(self) -> None:
        """SIGKILL now, to simulate a crash."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self) -> None:
        """Stop if running, then start again on the same port (clients reconnect to the same url)."""
        port = self.port
        self.stop()
        fixed = self._fixed_port
        self._fixed_port = True
        try:
            self._port = port
            self.start()
        finally:
            self._fixed_port = fixed

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        else:
            proc.wait()

    # -- logs ---------------------------------------------------------------------------------
    def _log_since(self, offset: int) -> str:
        try:
            with open(self.logfile, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return "(no redis log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty redis log)"

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # last resort: never leave a server behind
        try:
            self.kill()
        except Exception:
            pass


class _AddressInUse(Exception):
    pass
