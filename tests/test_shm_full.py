"""Shared memory a server cannot have, or must give back.

A same-host segment on a full file system: tmpfs lets a file grow past its free space, and a write to a page it
cannot give kills the writer with SIGBUS. The server must answer such a fetch by the stream and stay up. Each case
runs in a process of its own inside a private mount namespace (`unshare -rm`) with a tmpfs of a few KiB mounted
over a folder; skipped where unprivileged namespaces or tmpfs mounts are not allowed.

A server that cannot start (its port in use, its TLS key missing) leaves no segment folder behind."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # processes in a tmpfs of their own, servers

SMALL_KB = 16


def _in_small_tmpfs(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    folder = tmp_path / "small"
    folder.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={SMALL_KB}k tmpfs {folder}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stderr.strip()}")
    (tmp_path / "case.py").write_text(textwrap.dedent(script))
    command = (f"mount -t tmpfs -o size={SMALL_KB}k tmpfs {folder} && "
               f"exec {sys.executable} {tmp_path / 'case.py'} {folder} {' '.join(args)}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=300)


def test_a_segment_larger_than_the_free_shared_memory_is_refused_not_a_sigbus(tmp_path):
    done = _in_small_tmpfs(tmp_path, """
        import os, sys, torch
        from kvbridge.server import shm_layout
        try:
            shm_layout.write(os.path.join(sys.argv[1], "segment"), torch.ones(2, 2, 4, 256, 64))  # 1 MiB
        except OSError as exc:
            print("refused", exc.errno, exc)
        print("left", sorted(os.listdir(sys.argv[1])))
    """)
    assert done.returncode == 0, f"exit {done.returncode} (-7 or 135: SIGBUS)\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "refused 28 [Errno 28] no room for" in done.stdout and "left []" in done.stdout, done.stdout


def test_a_server_whose_shared_memory_is_full_streams_the_fetch_and_stays_up(tmp_path, tiny_adapter_file):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    shutil.copy(tiny_adapter_file, adapters / "tiny-pair.safetensors")
    done = _in_small_tmpfs(tmp_path, """
        import sys, torch
        from kvbridge.server.app import build_service, start_server
        from kvbridge.server.client import KVBridgeClient
        from kvbridge.server.config import ServeConfig
        from kvbridge.transfer.tiny_pair import tiny_source, tiny_target

        target = tiny_target(device="cpu")
        config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=sys.argv[2], store_capacity_mb=16,
                             store_device="cpu", selfcheck=False, shm_dir=sys.argv[1])
        running = start_server(build_service(config, source=tiny_source(device="cpu"), targets=[target]), config)
        text = " ".join(f"Record {i} keeps its name, its value and the order of its fields." for i in range(40))
        with KVBridgeClient(running.address) as client:
            key = client.ingest(text).entries[0].key
            shared = client.fetch_projected(key=key, target_model=target.name, transport="shared_memory")
            stream = client.fetch_projected(key=key, target_model=target.name, transport="stream")
            print("kv bytes", shared.segment.kv.numel() * shared.segment.kv.element_size())
            print("came", shared.transport, "identical", torch.equal(shared.segment.kv, stream.segment.kv))
            print("up", client.ingest("One more record, asked for after the refusal.").entries[0].key != "")
        running.stop(1)
    """, str(adapters))
    assert done.returncode == 0, f"exit {done.returncode} (-7 or 135: SIGBUS)\n{done.stdout}\n{done.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert int(lines["kv"].split()[-1]) > SMALL_KB * 1024, done.stdout  # more than the tmpfs could hold
    assert lines["came"] == "stream identical True", done.stdout
    assert lines["up"] == "True", done.stdout


@pytest.mark.parametrize("why", ["port in use", "no TLS key"])
def test_a_server_that_cannot_start_leaves_no_segment_folder(tmp_path, tiny_source, tiny_target, tiny_adapter_file,
                                                              why):
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    adapters = tmp_path / "adapters"
    adapters.mkdir()
    shutil.copy(tiny_adapter_file, adapters / "tiny-pair.safetensors")
    root = tmp_path / "shm"
    root.mkdir()
    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(adapters), store_capacity_mb=16,
                         store_device="cpu", selfcheck=False, shm_dir=str(root))
    first = start_server(build_service(config, source=tiny_source, targets=[tiny_target]), config)
    try:
        held = set(root.iterdir())
        assert len(held) == 1  # the running server's folder
        if why == "port in use":
            other = dataclasses.replace(config, listen=first.address)
        else:
            other = dataclasses.replace(config, tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))
        with pytest.raises((RuntimeError, OSError)):
            start_server(build_service(other, source=tiny_source, targets=[tiny_target]), other)
        assert set(root.iterdir()) == held
    finally:
        first.stop(1)
    assert list(root.iterdir()) == []
