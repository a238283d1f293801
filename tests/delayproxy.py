"""A TCP proxy on a loopback port that forwards to a real server and delays everything the server sends by
`delay_s` (each chunk leaves `delay_s` after it arrived, so the delay does not add up over a stream): a slow network
or a slow server, for the real client and server on either side (no mock of either)."""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    def __init__(self, target: str, delay_s: float):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="delayproxy-accept").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.delay_s), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        """Copy source -> sink; with a delay, a second thread sends each chunk `delay_s` after it arrived."""
        chunks: queue.Queue = queue.Queue()
        if delay_s:
            threading.Thread(target=self._send_later, args=(chunks, sink, delay_s), daemon=True).start()
        try:
            while chunk := source.recv(1 << 16):
                if delay_s:
                    chunks.put((time.monotonic() + delay_s, chunk))
                else:
                    sink.sendall(chunk)
        except OSError:
            pass
        chunks.put(None)
        if not delay_s:
            _shut(sink)

    @staticmethod
    def _send_later(chunks: queue.Queue, sink: socket.socket, delay_s: float) -> None:
        try:
            while (item := chunks.get()) is not None:
                due, chunk = item
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(chunk)
        except OSError:
            pass
        _shut(sink)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            s.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
