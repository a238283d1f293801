"""Stream threads shared between tenants (server/fair_pool.py): the pool's order and limits on plain callables, then
a served one where a tenant's unread fetches used to hold every stream thread until the idle watchdog."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import served
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.config import ServeConfig
from kvbridge.server.fair_pool import FairPool, default_per_tenant
from prometheus_client import generate_latest


def _blocker(started: list, name: str, release: threading.Event):
    def run():
        started.append(name)
        assert release.wait(served.WAIT_S)
        return name
    return run


def _until(condition, what):
    served.wait_for(condition, what)


def test_a_tenant_holds_at_most_its_share_and_its_other_calls_wait_without_refusal():
    pool = FairPool(threads=4, per_tenant=3)
    started, release = [], threading.Event()
    try:
        bobs = [pool.submit("bob", _blocker(started, f"bob{i}", release)) for i in range(6)]
        _until(lambda: pool.running() == {"bob": 3}, "bob's first three running")
        assert pool.waiting() == {"bob": 3}
        time.sleep(0.05)
        assert len(started) == 3  # the fourth thread is not bob's to take
        assert pool.submit("alice", lambda: "alice").result(served.WAIT_S) == "alice"
    finally:
        release.set()
    assert [f.result(served.WAIT_S) for f in bobs] == [f"bob{i}" for i in range(6)]
    assert started == [f"bob{i}" for i in range(6)]  # in the order they came
    _until(lambda: not pool.running() and not pool.waiting(), "the pool idle")
    pool.shutdown()


def test_a_free_thread_takes_the_call_of_the_tenant_running_fewest_before_earlier_calls():
    pool = FairPool(threads=3, per_tenant=3)
    started, hold, release = [], threading.Event(), threading.Event()
    try:
        pool.submit("bob", _blocker(started, "bob0", release))
        pool.submit("bob", _blocker(started, "bob1", release))
        gate = pool.submit("carol", _blocker(started, "carol0", hold))  # the third thread, until `hold`
        _until(lambda: len(started) == 3, "three calls running")
        later = [pool.submit("bob", _blocker(started, "bob2", release)),
                 pool.submit("alice", _blocker(started, "alice0", release)),
                 pool.submit("bob", _blocker(started, "bob3", release))]
        hold.set()
        assert gate.result(served.WAIT_S) == "carol0"
        _until(lambda: len(started) == 4, "the freed thread taken")
        assert started[3] == "alice0"  # bob runs two, alice none: hers goes first though it came after bob2
    finally:
        hold.set()
        release.set()
    assert [f.result(served.WAIT_S) for f in later] == ["bob2", "alice0", "bob3"]
    assert started[4:] == ["bob2", "bob3"]
    pool.shutdown()


def test_one_tenant_alone_gets_every_thread_and_errors_reach_the_future():
    assert (default_per_tenant(8, 1), default_per_tenant(8, 2), default_per_tenant(2, 2), default_per_tenant(3, 5),
            default_per_tenant(16, 3)) == (8, 6, 1, 2, 12)
    # one more than the uploads a tenant may hold open: its own uploads never leave its fetches waiting
    assert (default_per_tenant(8, 2, 2), default_per_tenant(2, 2, 1), default_per_tenant(3, 2, 1),
            default_per_tenant(4, 3, 3)) == (6, 2, 2, 4)
    pool = FairPool(threads=3, per_tenant=default_per_tenant(3, 1))
    started, release = [], threading.Event()
    try:
        calls = [pool.submit("default", _blocker(started, str(i), release)) for i in range(3)]
        _until(lambda: pool.running() == {"default": 3}, "all three threads running one tenant's calls")
    finally:
        release.set()
    assert [c.result(served.WAIT_S) for c in calls] == ["0", "1", "2"]

    def fails():
        raise KeyError("the call's own error")
    with pytest.raises(KeyError, match="the call's own error"):
        pool.submit("default", fails).result(served.WAIT_S)
    assert pool.submit("default", lambda: 7).result(served.WAIT_S) == 7  # the thread survived it
    pool.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_new_calls():
    pool = FairPool(threads=1, per_tenant=1)
    started, release = [], threading.Event()
    first = pool.submit("a", _blocker(started, "first", release))
    _until(lambda: started == ["first"], "the first call running")
    queued = pool.submit("b", lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit("a", lambda: None)
    release.set()
    assert first.result(served.WAIT_S) == "first"  # what ran, runs to its end
    pool.shutdown(wait=True)
    with pytest.raises(ValueError, match="per_tenant <= threads"):
        FairPool(threads=2, per_tenant=3)


def test_the_per_tenant_share_is_configured_and_checked():
    assert ServeConfig(preset="tiny").stream_threads_for(2) == 6
    assert ServeConfig(preset="tiny", stream_workers=4, stream_threads_per_tenant=4).stream_threads_for(3) == 4
    with pytest.raises(ValueError, match=r"stream_threads_per_tenant must be 0 \(automatic\) or 1 to stream_workers"):
        ServeConfig(preset="tiny", stream_workers=4, stream_threads_per_tenant=5)
    with pytest.raises(ValueError, match="leaves a tenant's fetches no thread while it holds its 2 uploads open"):
        ServeConfig(preset="tiny", stream_workers=4, stream_threads_per_tenant=2)
    assert ServeConfig(preset="tiny", stream_workers=2).stream_threads_for(2) == 2  # one upload (half of 2) + 1


def test_a_tenants_unread_fetches_leave_a_stream_thread_for_another_tenant(tiny_source, tiny_target, tmp_path):
    """Bob opens four fetches of a long entry and reads none: each holds its thread (grpc's flow control stops the
    writes) until the idle watchdog, 60 s here. On a server of three stream threads, alice's fetch got no thread until
    then; now bob runs two at a time and alice's is served at once."""
    running = served.start_on_cpu(tiny_source, [tiny_target], tmp_path, stream_workers=3, stream_idle_s=60)
    channels = []
    try:
        def stub(token):
            channel = grpc.insecure_channel(running.address, options=[("grpc.http2.bdp_probe", 0)])
            channels.append(channel)
            return pb2_grpc.KVBridgeStub(channel), [("authorization", f"Bearer {token}")]
        bob, bob_md = stub(served.BOB)
        alice, alice_md = stub(served.ALICE)
        ids = pb2.TokenIds(ids=[i % 500 for i in range(4000)])
        key = bob.Ingest(pb2.IngestRequest(token_ids=ids), metadata=bob_md).entries[0].key
        alice_key = alice.Ingest(pb2.IngestRequest(text=served.TEXT), metadata=alice_md).entries[0].key
        unread = [bob.GetSourceCache(pb2.GetSourceCacheRequest(key=key, chunk_bytes=4096), metadata=bob_md)
                  for _ in range(4)]
        _until(lambda: running.watchdog.watching >= 2, "bob's first fetches running")
        time.sleep(0.5)  # bob's other fetches reach the server
        chunks = list(alice.GetSourceCache(pb2.GetSourceCacheRequest(key=alice_key), metadata=alice_md, timeout=20))
        assert chunks and len(chunks[0].header.token_ids) > 0
        pool = running.pools["stream"]
        _until(lambda: pool.running() == {"bob": 2}, "alice's fetch ended on the server")  # bob runs two at a time
        assert pool.waiting() == {"bob": 2}
        scraped = generate_latest(running.metrics.registry).decode()
        assert 'kvbridge_stream_calls{state="running"} 2.0' in scraped
        assert 'kvbridge_stream_calls{state="waiting"} 2.0' in scraped
        for call in unread:
            call.cancel()
    finally:
        for channel in channels:
            channel.close()
        running.stop(1)


def test_a_call_done_leaves_no_reference_to_its_arguments_behind():
    """A worker that kept its last call's arguments while it waited kept grpc's call objects until the process
    exited, freed after grpc's core had shut down: `kvbridge serve` then aborted on SIGTERM (exit -6), one stop in
    two after a fetch (tests/test_shm_server.py's stop saw it)."""
    import gc
    import weakref

    class Call:
        pass

    pool = FairPool(threads=2, per_tenant=2)
    call = Call()
    gone = weakref.ref(call)
    assert pool.submit("t", lambda c: type(c).__name__, call).result(served.WAIT_S) == "Call"
    del call
    _until(lambda: not pool.running(), "the worker idle again")
    gc.collect()
    assert gone() is None
    pool.shutdown()


def test_a_tenants_open_upload_leaves_its_own_fetch_a_thread(tiny_source, tiny_target, tmp_path):
    """On two stream threads a tenant's share was one: its upload (paced by its client: here a header, then the KV
    still being made) left its own fetch waiting until the upload ended or the idle watchdog cancelled it."""
    running = served.start_on_cpu(tiny_source, [tiny_target], tmp_path, stream_workers=2, stream_idle_s=60)
    channel = grpc.insecure_channel(running.address)
    release = threading.Event()
    try:
        stub = pb2_grpc.KVBridgeStub(channel)
        metadata = [("authorization", f"Bearer {served.BOB}")]
        key = stub.Ingest(pb2.IngestRequest(text=served.TEXT), metadata=metadata).entries[0].key
        spec = tiny_source.spec
        header = pb2.KVHeader(model=pb2.ModelRef(name=tiny_source.name), dtype="float32",
                              num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                              token_ids=[1, 2, 3], positions=[0, 1, 2], rotated=True, kind="prefix")

        def messages():
            yield pb2.PutSourceKVRequest(header=header)
            release.wait(served.WAIT_S)

        upload = stub.PutSourceKV.future(messages(), metadata=metadata, timeout=served.WAIT_S)
        _until(lambda: running.pools["stream"].running() == {"bob": 1}, "the upload running")
        chunks = list(stub.GetSourceCache(pb2.GetSourceCacheRequest(key=key), metadata=metadata, timeout=10))
        assert chunks and len(chunks[0].header.token_ids) > 0  # DEADLINE_EXCEEDED before
    finally:
        release.set()
        channel.close()
        running.stop(1)
    assert upload.done()
