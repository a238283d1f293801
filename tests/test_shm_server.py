"""The same-host data plane (issue 16, part 3) through a server: a real `kvbridge serve` process (the tiny pair,
its segment folders in a /dev/shm folder of this module's own) against the project's client and raw grpcio stubs:
bit-identical KV to the stream, the file's mode, its removal once read and after its TTL (the process's real clock;
the same TTL on a clock the test moves in an in-process server), the fallback to the stream, another tenant, another
OS user, kept files linked for the next fetch, and no segment left after the server stops. The file and the
registry alone: tests/test_shm.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
import served
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server import shm_layout
from kvbridge.server.client import KVBridgeClient
from test_shm import FakeClock, file_mode

pytestmark = pytest.mark.integration  # `kvbridge serve` in a process of its own, and servers in this one

ALICE = "alice-token-0123456789abcdef0"
BOB = "bob-token-0123456789abcdef012"
TEXT = ("Each record holds a name and a value; readers skip the fields they do not know and keep the rest. "
        "Writers keep the order of the fields they were given, and a reader may stop at any field.")
TTL_S = 3.0


def _shm_entries(serve) -> set[str]:
    """What the server has in its segment root: its own folder while it runs, nothing once it has stopped."""
    return {p.name for p in serve.shm_root.iterdir()}


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_adapter_file):
    from serveproc import ServeProcess

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    home = tmp_path_factory.mktemp("shm")
    (home / "tokens").write_text(f"alice {ALICE}\nbob {BOB}\n")
    (home / "tokens").chmod(0o600)  # a token file others can read is refused
    (home / "adapters").mkdir()
    shutil.copy(tiny_adapter_file, home / "adapters" / "tiny-pair.safetensors")
    root = Path(tempfile.mkdtemp(prefix="kvb-test-", dir="/dev/shm"))
    proc = ServeProcess(home / "serve", [
        "--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
        "--adapters", str(home / "adapters"), "--no-selfcheck", "--token-file", str(home / "tokens"),
        "--shm-ttl-s", str(TTL_S), "--shm-dir", str(root)], env={"KVBRIDGE_HOME": str(home)}, start_timeout_s=240)
    proc.shm_root = root
    proc.start()
    yield proc
    proc.kill()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def entry_key(serve):
    with KVBridgeClient(serve.address, token=ALICE) as client:
        return client.ingest(TEXT).entries[0].key


def _raw_fetch(serve, token: str, key: str, dtype: str = "") -> pb2.CacheHeader:
    """A projected fetch through shared memory by raw grpcio stubs, never released: the header."""
    with grpc.insecure_channel(serve.address) as channel:
        stub = pb2_grpc.KVBridgeStub(channel)
        request = pb2.GetProjectedCacheRequest(key=key, transport=pb2.SHARED_MEMORY, dtype=dtype)
        messages = list(stub.GetProjectedCache(request,
                                               metadata=(("authorization", f"Bearer {token}"),), timeout=60))
    assert len(messages) == 1 and not messages[0].HasField("chunk")
    header = messages[0].header
    assert header.HasField("shared") and header.num_chunks == 0
    return header


def _release(serve, token: str, name: str, read: bool = True) -> bool:
    with grpc.insecure_channel(serve.address) as channel:
        return pb2_grpc.KVBridgeStub(channel).ReleaseSegment(
            pb2.ReleaseSegmentRequest(name=name, read=read), metadata=(("authorization", f"Bearer {token}"),),
            timeout=30).removed


def test_same_host_fetches_are_bit_identical_to_the_stream_and_leave_no_file(serve, entry_key):
    with KVBridgeClient(serve.address, token=ALICE, transport="auto") as client:  # 127.0.0.1: shared memory
        for fetch in (client.fetch_projected, client.fetch_source):
            for dtype in ("", "bfloat16"):
                streamed = fetch(key=entry_key, dtype=dtype, transport="stream")
                shared = fetch(key=entry_key, dtype=dtype)
                assert (streamed.transport, shared.transport) == ("stream", "shared_memory")
                assert shared.wire_bytes == 0 and shared.num_chunks == 1 and streamed.wire_bytes > 0
                assert shared.segment.kv.dtype == streamed.segment.kv.dtype
                assert torch.equal(shared.segment.kv, streamed.segment.kv)
                assert torch.equal(shared.segment.token_ids, streamed.segment.token_ids)
                assert torch.equal(shared.segment.positions, streamed.segment.positions)
                assert (shared.entry_key, shared.source_key, shared.adapter, shared.text) == (
                    streamed.entry_key, streamed.source_key, streamed.adapter, streamed.text)
    header = _raw_fetch(serve, ALICE, entry_key)
    folder = Path(header.shared.path).parent
    assert folder.parent == serve.shm_root and _shm_entries(serve) == {folder.name}
    assert file_mode(header.shared.path) == 0o600 and file_mode(folder) == 0o700
    assert os.stat(header.shared.path).st_uid == os.geteuid()
    assert [p.name for p in folder.glob("*.safetensors")] == [Path(header.shared.path).name]  # the client's went
    assert _release(serve, ALICE, header.shared.name) is True
    assert not Path(header.shared.path).exists() and not any(folder.glob("*.safetensors"))


def _mapped_kv(header, dtype: torch.dtype) -> torch.Tensor:
    """The KV [L, 2, H, T, D] of a fetch's shared segment, read as a client does; its headroom slots are zeros."""
    t, room = len(header.token_ids), header.shared.headroom_tokens
    shape = (header.num_layers, 2, header.num_kv_heads, t + room, header.head_dim)
    mapped = shm_layout.map_kv(header.shared.path, header.shared.size, header.shared.checksum, shape, dtype)
    assert not mapped[:, :, :, t:].any()
    return mapped[:, :, :, :t]


@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_the_next_fetch_of_the_same_projection_links_the_kept_file_until_the_entry_is_made_again(serve, dtype):
    """A warm same-host fetch of a projection fetched before gets the first fetch's file under a new name (the same
    inode, nothing written), in the store's dtype or converted to another (bf16: converted once, at the first fetch);
    once the source entry is deleted and ingested again (a new projected entry, same key), the fetch gets a new
    file."""
    text = f"{TEXT} Kept in {dtype or 'the store dtype'}."
    with KVBridgeClient(serve.address, token=ALICE) as client:
        key = client.ingest(text).entries[0].key
        expected = client.fetch_projected(key=key, transport="stream", dtype=dtype).segment.kv
    first = _raw_fetch(serve, ALICE, key, dtype)
    inode = os.stat(first.shared.path).st_ino
    assert _release(serve, ALICE, first.shared.name) is True
    second = _raw_fetch(serve, ALICE, key, dtype)
    assert second.shared.name != first.shared.name and os.stat(second.shared.path).st_ino == inode
    assert second.shared.checksum == first.shared.checksum
    assert torch.equal(_mapped_kv(second, expected.dtype), expected)
    assert _release(serve, ALICE, second.shared.name) is True
    assert not Path(first.shared.path).exists() and not Path(second.shared.path).exists()
    with KVBridgeClient(serve.address, token=ALICE) as client:
        assert client.delete(key) >= 2  # the source entry and its projection
        assert client.ingest(text).entries[0].key == key
        client.fetch_projected(key=key, transport="stream")  # projected again: a new entry, same key
    third = _raw_fetch(serve, ALICE, key, dtype)
    assert os.stat(third.shared.path).st_ino != inode
    assert torch.equal(_mapped_kv(third, expected.dtype), expected)
    assert _release(serve, ALICE, third.shared.name) is True


def test_a_client_that_cannot_open_the_segment_streams_and_the_server_drops_it(serve, entry_key, monkeypatch):
    tried = []

    def cannot_open(path, *args):
        tried.append(path)
        raise PermissionError(13, "Permission denied", path)  # as for a client under another OS user

    with KVBridgeClient(serve.address, token=ALICE, transport="shared_memory") as client:
        expected = client.fetch_projected(key=entry_key, transport="stream")
        monkeypatch.setattr(shm_layout, "map_kv", cannot_open)
        fetched = client.fetch_projected(key=entry_key)
    assert len(tried) == 1 and fetched.transport == "stream" and fetched.wire_bytes > 0
    assert torch.equal(fetched.segment.kv, expected.segment.kv)
    assert not Path(tried[0]).exists()  # released (read=False) before the stream


def test_another_tenant_can_neither_release_nor_fetch_the_segment(serve, entry_key):
    header = _raw_fetch(serve, ALICE, entry_key)
    path = Path(header.shared.path)
    assert _release(serve, BOB, header.shared.name) is False and path.exists()
    assert _release(serve, BOB, path.name) is False and _release(serve, BOB, str(path)) is False  # never a path
    with grpc.insecure_channel(serve.address) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
            pb2.GetProjectedCacheRequest(key=entry_key, transport=pb2.SHARED_MEMORY),
            metadata=(("authorization", f"Bearer {BOB}"),), timeout=60))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _release(serve, ALICE, header.shared.name) is True and not path.exists()


def test_another_os_user_can_neither_list_nor_open_a_segment(serve, entry_key):
    """The folder (0700) and the file (0600) belong to the server's user: `nobody` gets EACCES on both. Needs root
    to switch users (util-linux setpriv), as the test machines run."""
    import subprocess

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("switching to another OS user needs root and setpriv")
    header = _raw_fetch(serve, ALICE, entry_key)
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    for cmd in (["cat", header.shared.path], ["ls", str(Path(header.shared.path).parent)]):
        done = subprocess.run([*as_nobody, *cmd], capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode != 0 and "Permission denied" in done.stderr, (cmd, done.stderr)
    assert _release(serve, ALICE, header.shared.name) is True


def test_a_segment_never_released_is_removed_after_its_ttl(serve, entry_key):
    header = _raw_fetch(serve, ALICE, entry_key)
    assert header.shared.ttl_s == TTL_S
    path = Path(header.shared.path)
    # the server's own sweeper, in a real process: its clock is real time (the in-process test below moves it)
    served.wait_for(lambda: not path.exists(), f"the server to remove a segment after its {TTL_S:g} s TTL",
                    timeout_s=TTL_S + 30)
    assert _release(serve, ALICE, header.shared.name) is False


def test_a_segment_never_released_is_removed_once_its_ttl_has_passed_on_the_registry_clock(
        tiny_source, tiny_target, adapters_dir, shm_root):
    """The TTL above on a clock the test moves (an in-process server's registry): the file is there just before
    ttl_s, gone at ttl_s, and its name releases nothing afterwards."""
    running = served.start(tiny_source, [tiny_target], adapters_dir, tokens={ALICE: "alice"}, selfcheck=False,
                           shm_dir=str(shm_root), shm_ttl_s=TTL_S)
    clock = FakeClock()
    running.segments.clock = clock  # before the first fetch: every segment expires on this clock (its sweeper's too)
    try:
        with KVBridgeClient(running.address, token=ALICE) as client:
            key = client.ingest(TEXT).entries[0].key
        header = _raw_fetch(running, ALICE, key)
        path = Path(header.shared.path)
        assert header.shared.ttl_s == TTL_S and path.exists() and path.parent.parent == shm_root
        clock.now = TTL_S - 1e-3
        assert running.segments.sweep() == 0 and path.exists()
        clock.now = TTL_S
        running.segments.sweep()  # (unless the server's sweeper thread, on the same clock, was first)
        assert not path.exists() and len(running.segments) == 0
        assert _release(running, ALICE, header.shared.name) is False
    finally:
        running.stop(1)
    assert not any(shm_root.iterdir())


def test_no_segment_is_left_after_the_server_stops_or_is_killed_and_restarted(serve, entry_key):
    """Last in this file: it stops the module's server, with a segment never released; then kills it (SIGKILL leaves
    the folder) and starts it again (the new server removes the dead one's folder)."""
    header = _raw_fetch(serve, ALICE, entry_key)
    assert Path(header.shared.path).exists()
    assert serve.stop() == 0
    assert not Path(header.shared.path).parent.exists()
    assert _shm_entries(serve) == set()
    serve.start()
    with KVBridgeClient(serve.address, token=ALICE) as client:
        key = client.ingest(TEXT).entries[0].key
    killed = Path(_raw_fetch(serve, ALICE, key).shared.path)
    serve.kill()
    assert killed.exists()
    serve.start()
    assert not killed.parent.exists()
    assert serve.stop() == 0
    assert _shm_entries(serve) == set()
