"""Hostile input from outside (issue 16, part 6), through raw grpcio stubs (not kvbridge's own client) against
`kvbridge serve` in its own process: megabyte strings in every kind of field, unknown enum values, control
characters, nine stalled uploads from one tenant while another calls health and Stats, cancelled uploads. Each is
answered with a short message on a channel that still works afterwards, and the server log stays quiet."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.request_limits import MAX_DETAILS_BYTES

pytestmark = pytest.mark.integration

MALLORY = "mallory-token-0123456789abcdef"
ALICE = "alice-token-0123456789abcdef0"
MIB = "k" * (1 << 20)
TEXT = "Each record holds a name and a value; readers skip the fields they do not know and keep the rest."


@pytest.fixture(scope="module")
def serve(tmp_path_factory, session_shm_dir):
    from serveproc import ServeProcess

    home = tmp_path_factory.mktemp("hostile")
    (home / "tokens").write_text(f"mallory {MALLORY}\nalice {ALICE}\n")
    (home / "tokens").chmod(0o600)  # a token file others can read is refused
    proc = ServeProcess(home / "serve", [
        "--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
        "--adapters", str(home / "adapters"), "--no-selfcheck", "--token-file", str(home / "tokens"),
        "--workers", "4", "--stream-workers", "4", "--uploads-per-tenant", "2",
        *(["--shm-dir", str(session_shm_dir)] if session_shm_dir else [])],  # killed below: its folder goes too
        env={"KVBRIDGE_HOME": str(home)}, start_timeout_s=240)
    proc.start()
    yield proc
    proc.kill()


def _md(token: str):
    return (("authorization", f"Bearer {token}"),)


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, (err.code(), err.details()[:200])
    assert len(err.details().encode()) <= MAX_DETAILS_BYTES, len(err.details())
    return err.details()


def _still_works(channel, token: str = ALICE) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    pb2_grpc.KVBridgeStub(channel).Stats(pb2.StatsRequest(), metadata=_md(token), timeout=10)


def test_megabyte_strings_in_every_field_are_refused_short_and_the_channel_lives(serve):
    inv = grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(serve.address) as channel:
        stub = pb2_grpc.KVBridgeStub(channel)
        md = _md(MALLORY)
        cases = [
            ("key", lambda: stub.Delete(pb2.DeleteRequest(key=MIB), metadata=md, timeout=30)),
            ("key", lambda: next(stub.GetProjectedCache(pb2.GetProjectedCacheRequest(key=MIB), metadata=md,
                                                        timeout=30))),
            ("key", lambda: next(stub.GetSourceCache(pb2.GetSourceCacheRequest(key="k" * 64_000), metadata=md,
                                                     timeout=30))),
            ("model", lambda: stub.Ingest(pb2.IngestRequest(text=TEXT, model=MIB), metadata=md, timeout=30)),
            ("session_id", lambda: stub.Ingest(pb2.IngestRequest(text=TEXT, session_id=MIB), metadata=md,
                                               timeout=30)),
            ("adapter", lambda: next(stub.GetProjectedCache(pb2.GetProjectedCacheRequest(text=TEXT, adapter=MIB),
                                                            metadata=md, timeout=30))),
            ("target_model", lambda: next(stub.GetProjectedCache(
                pb2.GetProjectedCacheRequest(text=TEXT, target_model=MIB), metadata=md, timeout=30))),
            ("dtype", lambda: next(stub.GetProjectedCache(pb2.GetProjectedCacheRequest(text=TEXT, dtype=MIB),
                                                          metadata=md, timeout=30))),
            ("kind", lambda: stub.Lookup(pb2.LookupRequest(text=TEXT, kind=MIB), metadata=md, timeout=30)),
            ("name", lambda: stub.LoadAdapter(pb2.LoadAdapterRequest(name=MIB), metadata=md, timeout=30)),
            ("text", lambda: stub.Ingest(pb2.IngestRequest(text=MIB), metadata=md, timeout=30)),
            ("header.model.name", lambda: stub.PutSourceKV(iter([pb2.PutSourceKVRequest(
                header=pb2.KVHeader(model=pb2.ModelRef(name=MIB)))]), metadata=md, timeout=30)),
            ("header.dtype", lambda: stub.PutSourceKV(iter([pb2.PutSourceKVRequest(
                header=pb2.KVHeader(model=pb2.ModelRef(name="tiny-qwen2"), dtype=MIB))]), metadata=md, timeout=30)),
        ]
        for field, call in cases:
            details = _refused(call, inv)
            assert field in details and "k" * 100 not in details, (field, details[:300])
            _still_works(channel, MALLORY)

        # unknown enum values: refused, not read as the default
        details = _refused(lambda: stub.Ingest(pb2.IngestRequest(text=TEXT, mode=99), metadata=md, timeout=30), inv)
        assert "mode = 99" in details and "STORE_WHOLE=0" in details
        # a short unknown key with control and non-ASCII characters: quoted escaped, NOT_FOUND as for any miss
        details = _refused(lambda: stub.Delete(pb2.DeleteRequest(key="\x1b[2J\u202e\x00abc" + "z" * 200),
                                               metadata=md, timeout=30), grpc.StatusCode.NOT_FOUND)
        assert details.isascii() and "\x1b" not in details and "\x00" not in details and "z" * 100 not in details
        # ... and the same channel still does real work
        reply = stub.Ingest(pb2.IngestRequest(text=TEXT), metadata=md, timeout=60)
        assert reply.entries[0].num_tokens == len(reply.source_token_ids) > 0
    log = serve.logfile.read_text(errors="replace")
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]


def _stalled_upload_requests(header: pb2.KVHeader, release: threading.Event):
    yield pb2.PutSourceKVRequest(header=header)
    release.wait(120)  # the header, then nothing: the test cancels the call or lets it end


def _cut_uploads(log: str) -> int:
    """Log lines of uploads the client cut off: CANCELLED, or (a race inside grpcio: a cancelled stream can end
    like a normal half-close first) the stream ended before all KV arrived."""
    return log.count("stream broken by the client") + log.count("the stream ended before all KV arrived")


def test_nine_stalled_uploads_neither_starve_health_nor_another_tenant(serve):
    with grpc.insecure_channel(serve.address) as channel:
        stub = pb2_grpc.KVBridgeStub(channel)
        source = next(m for m in stub.ListModels(pb2.ListModelsRequest(), metadata=_md(MALLORY), timeout=10).models
                      if "source" in m.role)
        header = pb2.KVHeader(model=pb2.ModelRef(name=source.name), dtype=source.dtype,
                              num_layers=source.num_layers, num_kv_heads=source.num_kv_heads,
                              head_dim=source.head_dim, token_ids=list(range(5, 45)), rotated=True, kind="prefix")
        before = serve.logfile.read_text(errors="replace")
        release = threading.Event()
        uploads = [stub.PutSourceKV.future(_stalled_upload_requests(header, release), metadata=_md(MALLORY),
                                           timeout=120) for _ in range(9)]
        try:
            refused = []
            deadline = time.monotonic() + 60
            while len(refused) < 7 and time.monotonic() < deadline:  # the server answers them as they come
                refused = [u for u in uploads if u.done()]
                time.sleep(0.05)
            assert len(refused) == 7, f"{len(refused)} of 9 uploads answered; expected 7 refused, 2 held"
            for u in refused:
                assert u.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (u.code(), u.details())
                assert "uploads open" in u.details() and len(u.details()) < 200

            # another tenant, and the health check, while mallory holds the two it may
            with grpc.insecure_channel(serve.address) as other:
                alice = pb2_grpc.KVBridgeStub(other)
                for _ in range(3):  # each call within its 10 s deadline
                    _still_works(other, ALICE)
                baseline = alice.Stats(pb2.StatsRequest(), metadata=_md(ALICE), timeout=10)
                alice.Ingest(pb2.IngestRequest(text=TEXT), metadata=_md(ALICE), timeout=60)
                # mallory's activity is invisible in alice's Stats (and the other way round)
                mallory_before = stub.Stats(pb2.StatsRequest(), metadata=_md(MALLORY), timeout=10)
                stub.Ingest(pb2.IngestRequest(text=TEXT + " More."), metadata=_md(MALLORY), timeout=60)
                stub.Ingest(pb2.IngestRequest(token_ids=pb2.TokenIds(ids=list(range(3, 300)))),
                            metadata=_md(MALLORY), timeout=60)
                after = alice.Stats(pb2.StatsRequest(), metadata=_md(ALICE), timeout=10)
                own = alice.Stats(pb2.StatsRequest(), metadata=_md(ALICE), timeout=10)
                assert after == own and after.tenant_entries == baseline.tenant_entries + 1
                mallory_after = stub.Stats(pb2.StatsRequest(), metadata=_md(MALLORY), timeout=10)
                assert mallory_after.tenant_entries == mallory_before.tenant_entries + 2
                assert [t.bytes_used for t in mallory_after.tiers] != [t.bytes_used for t in mallory_before.tiers]
                alice.Ingest(pb2.IngestRequest(text=TEXT + " Alice's own."), metadata=_md(ALICE), timeout=60)
                assert stub.Stats(pb2.StatsRequest(), metadata=_md(MALLORY), timeout=10) == mallory_after

            held = [u for u in uploads if not u.done()]
            assert len(held) == 2
            for u in held:
                u.cancel()
            # the server logs one line per cancelled upload, and nothing else about them
            deadline = time.monotonic() + 30
            while _cut_uploads(serve.logfile.read_text(errors="replace")[len(before):]) < 2:
                assert time.monotonic() < deadline, serve.log_tail()
                time.sleep(0.05)
        finally:
            release.set()
            for u in uploads:
                u.cancel()
        _still_works(channel, MALLORY)  # the channel that did all this still works
        reply = stub.Ingest(pb2.IngestRequest(text=TEXT + " Again."), metadata=_md(MALLORY), timeout=60)
        assert reply.entries
    log = serve.logfile.read_text(errors="replace")[len(before):]
    assert _cut_uploads(log) == 2, log[-3000:]
    assert "Traceback" not in log and "Exception serializing" not in log and "Exception" not in log, log[-3000:]


def test_an_idle_upload_is_cancelled_by_the_watchdog(tmp_path, tiny_source, tiny_target, caplog):
    """A stalled upload (header, then nothing) in an in-process server: the watchdog's sweep, run on a clock past
    the idle limit, cancels it; the client sees CANCELLED, the server logs one line, the upload slot is free."""
    import logging

    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(tmp_path), store_capacity_mb=16,
                         store_device="cpu", selfcheck=False, stream_idle_s=60, uploads_per_tenant=1)
    running = start_server(build_service(config, source=tiny_source, targets=[tiny_target]), config,
                           tokens={ALICE: "alice"})
    release = threading.Event()
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = pb2_grpc.KVBridgeStub(channel)
            spec = tiny_source.spec
            header = pb2.KVHeader(model=pb2.ModelRef(name=tiny_source.name), dtype="float32",
                                  num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                  token_ids=list(range(5, 45)), rotated=True)
            with caplog.at_level(logging.INFO, logger="kvbridge.server"):
                upload = stub.PutSourceKV.future(_stalled_upload_requests(header, release), metadata=_md(ALICE),
                                                 timeout=60)
                deadline = time.monotonic() + 30
                while running.watchdog.watching < 1:  # the server holds the stalled call
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert running.watchdog.sweep(time.monotonic() + 30) == 0  # not idle long enough yet
                assert running.watchdog.sweep(time.monotonic() + 61) == 1
                with pytest.raises(grpc.RpcError) as info:
                    upload.result(timeout=30)
                assert info.value.code() == grpc.StatusCode.CANCELLED
                def lines():
                    return [r.getMessage() for r in caplog.records if "PutSourceKV" in r.getMessage()]

                # the servicer logs once it has left the watch (and freed the slot): wait for both
                while running.watchdog.watching or not lines():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            assert lines() == ["PutSourceKV: no message for 60 s, cancelled; nothing stored"], lines()
            # the slot is free again: the next upload (a real one) is taken
            upload = stub.PutSourceKV.future(iter([pb2.PutSourceKVRequest(header=header)]), metadata=_md(ALICE),
                                             timeout=30)
            details = _refused(lambda: upload.result(timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
            assert "the stream ended before all KV arrived" in details
    finally:
        release.set()
        running.stop(1)


def test_a_download_nobody_reads_is_cancelled_by_the_watchdog(tmp_path, tiny_source, tiny_target, caplog):
    """GetSourceCache of many small chunks, the client reading only the first: the stream blocks on flow control;
    the watchdog's sweep past the idle limit cancels it and frees its stream thread."""
    import logging

    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(tmp_path), store_capacity_mb=32,
                         store_device="cpu", selfcheck=False, stream_idle_s=60)
    running = start_server(build_service(config, source=tiny_source, targets=[tiny_target]), config,
                           tokens={ALICE: "alice"})
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = pb2_grpc.KVBridgeStub(channel)
            ids = [5 + i % 500 for i in range(1200)]  # the tiny vocabulary has 512 ids
            key = stub.Ingest(pb2.IngestRequest(token_ids=pb2.TokenIds(ids=ids)), metadata=_md(ALICE),
                              timeout=120).entries[0].key
            with caplog.at_level(logging.INFO, logger="kvbridge.server"):
                stream = stub.GetSourceCache(pb2.GetSourceCacheRequest(key=key, chunk_bytes=4096),
                                             metadata=_md(ALICE), timeout=60)
                first = next(stream)
                assert first.header.num_chunks > 100
                deadline = time.monotonic() + 30
                while running.watchdog.watching < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert running.watchdog.sweep(time.monotonic() + 61) == 1
                with pytest.raises(grpc.RpcError) as info:
                    for _ in stream:
                        pass
                assert info.value.code() == grpc.StatusCode.CANCELLED
                while running.watchdog.watching:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)

                def logged() -> list[str]:  # the stream's thread logs after it stops being watched
                    return [r.getMessage() for r in caplog.records if "GetSourceCache" in r.getMessage()]

                while not logged() and time.monotonic() < deadline:
                    time.sleep(0.01)
            lines = logged()
            assert len(lines) == 1 and "no chunk taken for 60 s, cancelled" in lines[0], lines
            _still_works(channel, ALICE)
    finally:
        running.stop(1)


def test_an_upload_being_stored_is_not_cancelled_as_idle(tmp_path, tiny_source, tiny_target, monkeypatch):
    """The watchdog watches an upload's messages, not the store's work after the last one: an upload whose storing
    takes past the idle limit (a slow Redis tier) is answered with its entry, never CANCELLED "nothing stored"
    while it was in fact stored."""
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(tmp_path), store_capacity_mb=16,
                         store_device="cpu", selfcheck=False, stream_idle_s=60)
    running = start_server(build_service(config, source=tiny_source, targets=[tiny_target]), config,
                           tokens={ALICE: "alice"})
    storing, stored = threading.Event(), threading.Event()
    real = running.service.put_source

    def slow_put_source(*args, **kwargs):
        storing.set()
        stored.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(running.service, "put_source", slow_put_source)
    try:
        spec = tiny_source.spec
        kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, 40, spec.head_dim)
        with KVBridgeClient(running.address, token=ALICE, retries=0) as client:
            def upload():
                done.entry = client.put_kv(kv, list(range(5, 45)))  # model "": the server's source model

            done = threading.Thread(target=upload)
            done.start()
            assert storing.wait(30)
            running.watchdog.sweep(time.monotonic() + 61)  # past the idle limit while it stores
            stored.set()
            done.join(30)
            assert getattr(done, "entry", None) is not None and done.entry.num_tokens == 40
    finally:
        stored.set()
        running.stop(1)
