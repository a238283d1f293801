"""The server's plumbing, end to end (a real gRPC server on a loopback port, the tiny pair): health and reflection
without a token, /metrics, the client's retries and deadlines, draining streams at shutdown, TLS. The servers are
the session fixtures of tests/conftest.py, or started here; the transfers: tests/test_server.py.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
import served
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient
from served import ALICE, TEXT

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------------ plumbing


def test_health_and_reflection_answer(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:  # no token: probes and tools stay open
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvbridge.v1.KVBridge"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvbridge.v1.KVBridge")]
        listed, files = list(reflect.ServerReflectionInfo(iter(requests), timeout=10))
        services = {s.name for s in listed.list_services_response.service}
        assert {"kvbridge.v1.KVBridge", "grpc.health.v1.Health"} <= services
        from google.protobuf import descriptor_pb2

        proto = descriptor_pb2.FileDescriptorProto.FromString(files.file_descriptor_response.file_descriptor_proto[0])
        assert proto.name == "kvbridge/v1/kvbridge.proto" and proto.package == "kvbridge.v1"


def test_idle_reflection_streams_do_not_stop_health_watches_or_refusals(server):
    """Reflection needs no token, and a stream holds its thread while the client keeps it open: six idle ones (more
    than the threads it has, and than the server's default pool) leave health Watch (what a balanced client checks a
    replica by) and the refusal of a call without a token answering (reflection itself waits for its threads)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    done, channels, calls = threading.Event(), [], []

    def idle():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        done.wait(60)  # then nothing until the test ends

    try:
        for _ in range(6):  # each on a channel of its own
            channels.append(grpc.insecure_channel(server.address))
            calls.append(reflection_pb2_grpc.ServerReflectionStub(channels[-1]).ServerReflectionInfo(idle(),
                                                                                                      timeout=60))
        # every stream is in the server: the reflection threads are held, the other streams wait for one (which of
        # the six got a thread is the server's choice: no stream's answer is waited for, a queued one never comes)
        pool = server.pools["reflection"]
        end = time.monotonic() + 30
        while not (len(pool._threads) == pool._max_workers and pool._work_queue.qsize() == 6 - pool._max_workers):
            assert time.monotonic() < end, (f"the six streams never all reached the server: {len(pool._threads)} "
                                            f"reflection threads, {pool._work_queue.qsize()} streams queued")
            time.sleep(0.01)
        with grpc.insecure_channel(server.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            with pytest.raises(grpc.RpcError) as refused:
                pb2_grpc.KVBridgeStub(channel).Stats(pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        done.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def test_the_servers_tests_start_keep_their_shared_memory_in_the_sessions_own_folder(server, session_shm_dir):
    """Not in /dev/shm itself, where a server a test kills would leave its folder behind for good."""
    if session_shm_dir is None:
        pytest.skip("no /dev/shm on this machine")
    assert server.segments is not None and server.segments.folder.parent == session_shm_dir


def test_metrics_endpoint_counts_requests_bytes_and_store(server, alice):
    alice.ingest(TEXT)  # its own Ingest, so the test does not lean on an earlier one
    alice.fetch_projected(text=TEXT)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvbridge_requests_total{code="OK",method="GetProjectedCache"}' in body
    assert 'kvbridge_request_seconds_bucket{le="0.001",method="Ingest"}' in body
    assert 'kvbridge_streamed_bytes_total{direction="out",method="GetProjectedCache"}' in body
    assert 'kvbridge_store_bytes{tier="device"}' in body and "kvbridge_store_hits_total" in body
    assert "\nkvbridge_store_check_problems 0.0\n" in body  # store.check() on every scrape: consistent


def test_calls_refused_before_the_servicer_are_counted_too(server):
    """kvbridge_requests_total counts RPCs by method and status: also the ones refused before the servicer runs, a
    missing token (the interceptor) and a string over its limit (the message check); they were never counted."""
    def counts() -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in body.splitlines()
                if line.startswith("kvbridge_requests_total{")}

    before = counts()
    auth = (("authorization", f"Bearer {ALICE}"),)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb2_grpc.KVBridgeStub(channel)
        for call, code in ((lambda: stub.Stats(pb2.StatsRequest(), timeout=10), "UNAUTHENTICATED"),
                           (lambda: stub.Lookup(pb2.LookupRequest(text="x", model="m" * 300), timeout=10,
                                                metadata=auth), "INVALID_ARGUMENT")):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code().name == code
    after = counts()
    for name, code in (("Stats", "UNAUTHENTICATED"), ("Lookup", "INVALID_ARGUMENT")):
        key = f'kvbridge_requests_total{{code="{code}",method="{name}"}}'
        assert after.get(key, 0) - before.get(key, 0) == 1, key


def test_client_retries_unavailable_with_backoff_then_reports_it(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound here, never listened on, for the whole test
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        client = KVBridgeClient(f"127.0.0.1:{port}", retries=3, backoff_s=0.001, timeout_s=5)
        waits = []
        monkeypatch.setattr(client, "_sleep", lambda attempt: waits.append(attempt))
        for call in (client.stats, lambda: client.fetch_source(text=TEXT)):
            waits.clear()
            code, _ = served.code(call)
            assert code == grpc.StatusCode.UNAVAILABLE and waits == [0, 1, 2]
        client.close()


def test_every_call_has_a_deadline(server):
    with KVBridgeClient(server.address, token=ALICE, timeout_s=1e-4, retries=0) as client:
        code, _ = served.code(lambda: client.fetch_projected(text=served.text(8)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_shutdown_drains_streams_in_flight(tiny_source, tiny_target, adapters_dir):
    from kvbridge.server.chunks import ChunkAssembler, wire_dtype

    running = served.start(tiny_source, [tiny_target], adapters_dir, chunk_kb=4)
    channel = grpc.insecure_channel(running.address)
    stream = pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
        pb2.GetProjectedCacheRequest(text=TEXT), metadata=(("authorization", f"Bearer {ALICE}"),), timeout=30)
    first = next(stream)
    h = first.header
    assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim, wire_dtype(h.dtype))
    stopper = threading.Thread(target=running.stop, args=(20,))
    stopper.start()
    for message in [first, *stream]:
        c = message.chunk
        assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
    assert assembler.complete and h.num_chunks > 3
    stopper.join(30)
    channel.close()
    with KVBridgeClient(running.address, token=ALICE, retries=0, timeout_s=5) as client:
        code, _ = served.code(client.stats)
        assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_a_self_signed_pair(tmp_path, tiny_source, tiny_target, adapters_dir):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    running = served.start(tiny_source, [tiny_target], adapters_dir, tls_cert=str(cert), tls_key=str(key))
    try:
        with KVBridgeClient(f"localhost:{running.port}", token=ALICE, tls_root_cert=cert) as client:
            fetched = client.fetch_projected(text=TEXT)
            assert fetched.segment.num_tokens > 0
        with KVBridgeClient(f"localhost:{running.port}", token=ALICE, retries=0, timeout_s=5) as plain:
            code, _ = served.code(plain.stats)
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(1)
