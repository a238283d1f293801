"""The test Redis helper itself: a real redis-server, killed and restarted on the same port."""

from __future__ import annotations

import contextlib
import socket

import pytest
import redis
from redisproc import RedisProcess

pytestmark = pytest.mark.integration


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


@contextlib.contextmanager
def _held(port: int):
    """The port bound (not listened on) by this test while the block runs: a connection there is refused, and no
    other process (another test's server given the freed port) can listen there meanwhile. Binding fails while
    something still listens on it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, never past a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            pytest.fail(f"port {port} is still listened on: {exc}")
        yield


def test_set_get_kill_restart_same_port(redis_server):
    url, port = redis_server.url, redis_server.port
    assert url == f"redis://127.0.0.1:{port}/0"
    r = _client(url)
    assert r.set("k", b"v1")
    assert r.get("k") == b"v1"

    redis_server.kill()
    with _held(port), pytest.raises(redis.exceptions.ConnectionError):
        r.get("k")

    redis_server.restart()
    assert redis_server.port == port and redis_server.url == url
    assert r.get("k") is None  # no persistence: a crash loses everything
    assert r.set("k", b"v2")
    assert r.get("k") == b"v2"
    assert _client(url).get("k") == b"v2"


def test_redis_url_fixture(redis_url):
    assert _client(redis_url).ping()


def test_two_servers_get_different_ports(tmp_path):
    with RedisProcess(tmp_path / "a") as a, RedisProcess(tmp_path / "b") as b:
        assert a.port != b.port
        _client(a.url).set("who", "a")
        _client(b.url).set("who", "b")
        assert _client(a.url).get("who") == b"a"
        assert _client(b.url).get("who") == b"b"


def test_stop_is_idempotent(tmp_path):
    server = RedisProcess(tmp_path)
    server.stop()  # never started: nothing to do
    server.start()
    url = server.url
    server.stop()
    server.stop()
    server.kill()
    assert not server.running
    with _held(server.port), pytest.raises(redis.exceptions.ConnectionError):
        _client(url).ping()


def test_explicit_port_in_use_fails_with_log(redis_server, tmp_path):
    other = RedisProcess(tmp_path / "other", port=redis_server.port)
    with pytest.raises(RuntimeError, match="in use"):
        other.start()
    assert _client(redis_server.url).ping()  # the first one is untouched


def test_free_port_taken_meanwhile_retries(redis_server, tmp_path, monkeypatch):
    import redisproc

    real = redisproc._free_port
    picks = iter([redis_server.port])  # first pick: a port someone else just took
    monkeypatch.setattr(redisproc, "_free_port", lambda: next(picks, None) or real())
    with RedisProcess(tmp_path / "late") as late:
        assert late.port != redis_server.port
        assert _client(late.url).ping()
