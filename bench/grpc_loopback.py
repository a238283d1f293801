"""The two ends bench_grpc.py times over loopback: the server in its own process, and the raw-TCP baseline.

`ServerProcess`: `kvbridge serve` as a deployment runs it. The baseline moves the same chunks with nothing around
them: its sender, a thread of this process (`RawServer`) or a process of its own (`RawSenderProcess`), and
`RawClient`, which reads them into one fresh buffer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LENGTH = struct.Struct("!Q")  # the raw baseline's per-chunk length prefix
READY_TIMEOUT_S = 600.0  # the server process's start: model load (and, on a fresh machine, the models' conversion)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(could not read {path}: {exc})"


def child_env(threads: int) -> dict[str, str]:
    """This process's environment with torch's intra-op thread count (OpenMP/MKL read these at start)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# ---------------------------------------------------------------------------------------------------- server process


class ServerProcess:
    """`kvbridge serve` as a deployment runs it: its own process, found through its ready file, stopped by SIGTERM.
    Its output goes to files in `folder` (a pipe nobody reads would stall its logging)."""

    def __init__(self, args: list[str], folder: Path, threads: int):
        self.ready = folder / "ready.json"
        self.stdout, self.stderr = folder / "server.out", folder / "server.err"
        cmd = [sys.executable, "-m", "kvbridge.cli", "serve", "--listen", "127.0.0.1:0", "--ready-file",
               str(self.ready), *args]
        t0 = time.perf_counter()
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=child_env(threads))
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not self.ready.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server process exited with {self.proc.returncode} before it was "
                                       f"ready; its stderr:\n{tail(self.stderr)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server process was not ready after {READY_TIMEOUT_S:.0f} s; its "
                                       f"stderr:\n{tail(self.stderr)}")
                time.sleep(0.05)
            # the server writes the file in one call; a reader may still catch it empty for an instant
            for _ in range(100):
                text = self.ready.read_text()
                if text:
                    break
                time.sleep(0.05)
            self.address = json.loads(text)["address"]
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def stop(self) -> int:
        """SIGTERM (the server drains and exits), then SIGKILL if it has not exited within a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ---------------------------------------------------------------------------------------------------- raw baseline


class RawServer:
    """A plain TCP server thread on loopback (the --in-process layout): for every request byte it sends the
    payloads, each after an 8-byte length. No encoding, no checks: what moving these bytes through the kernel costs
    from Python."""

    def __init__(self, payloads: list[bytes]):
        self.payloads = payloads
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="raw-tcp-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                for p in self.payloads:
                    conn.sendall(LENGTH.pack(len(p)))
                    conn.sendall(p)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


# The raw sender's process: the same loop as RawServer._serve. It reads the length-prefixed payloads from the file
# named by argv[1] before it listens, prints its port, and exits when the client closes the connection.
RAW_SENDER = r"""
import socket, struct, sys
LENGTH = struct.Struct("!Q")
data = memoryview(open(sys.argv[1], "rb").read())
payloads, pos = [], 0
while pos < len(data):
    (size,) = LENGTH.unpack_from(data, pos)
    payloads.append(bytes(data[pos + LENGTH.size:pos + LENGTH.size + size]))
    pos += LENGTH.size + size
del data
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
listener.close()
with conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(1):
        for p in payloads:
            conn.sendall(LENGTH.pack(len(p)))
            conn.sendall(p)
"""


class RawSenderProcess:
    """The raw baseline's sender in its own process (the default layout, like the server process): a short Python
    script, no torch, that sends the payloads it read from a temporary file before the timed part."""

    def __init__(self, payloads: list[bytes]):
        self.folder = tempfile.TemporaryDirectory(prefix="kvbridge-bench-raw-")
        blobs = Path(self.folder.name) / "payloads.bin"
        with open(blobs, "wb") as f:
            for p in payloads:
                f.write(LENGTH.pack(len(p)))
                f.write(p)
        self.stderr = Path(self.folder.name) / "sender.err"
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(blobs)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err)
        line = self.proc.stdout.readline()  # "" when the process died first
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the raw sender process did not start (exit {self.proc.returncode}); its "
                               f"stderr:\n{tail(self.stderr)}")
        self.port = int(line)

    def close(self) -> None:
        try:
            self.proc.wait(timeout=10)  # it exits once the client has closed the connection
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.folder.cleanup()


class RawClient:
    def __init__(self, port: int, num_chunks: int, total_bytes: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.num_chunks = num_chunks
        self.total_bytes = total_bytes

    def _read_into(self, view: memoryview) -> None:
        while view:
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionError("the raw server closed the connection mid-chunk")
            view = view[n:]

    def fetch(self) -> bytearray:
        """All chunks, back to back in one fresh buffer (as the client's assembler fills one fresh tensor)."""
        self.sock.sendall(b"g")
        out = bytearray(self.total_bytes)
        view, head, pos = memoryview(out), bytearray(LENGTH.size), 0
        for _ in range(self.num_chunks):
            self._read_into(memoryview(head))
            (size,) = LENGTH.unpack(head)
            self._read_into(view[pos:pos + size])
            pos += size
        if pos != self.total_bytes:
            raise AssertionError(f"raw fetch moved {pos} bytes, expected {self.total_bytes}")
        return out

    def close(self) -> None:
        self.sock.close()
