"""Reliability of the service against faults of the server and its clients (issue 8): `kvbridge serve` killed
during a streamed fetch and started again on its port; clients that vanish in the middle of an upload (the call
cancelled, the channel closed, the client process killed). Real servers on loopback, the tiny pair, every wait
bounded. Load: tests/test_reliability.py; Redis and capacity faults: tests/test_reliability_store.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest
import served
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient
from kvbridge.transfer import kvcache
from served import ALICE

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------------ faults: server


CRASH_TOKEN = "crash-token-0123456789abcdef"


def test_server_killed_mid_stream_then_back_on_its_port(tmp_path, tiny_source, tiny_target):
    """SIGKILL of `kvbridge serve` during a streamed fetch: the client's next reads end in UNAVAILABLE, not a
    truncated success. A client with retries started while the server is down succeeds once it is back on the
    same port, with the whole cache."""
    from kvbridge.adapters.io import load_adapter
    from kvbridge.adapters.pairs import pair_text
    from serveproc import ServeProcess

    (tmp_path / "tokens").write_text(f"crash {CRASH_TOKEN}\n")
    (tmp_path / "tokens").chmod(0o600)  # a token file others can read is refused
    adapters = tmp_path / "adapters"
    serve = ServeProcess(tmp_path / "serve", [
        "--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
        "--correction", "replace", "--adapters", str(adapters), "--fit-adapter", "--no-selfcheck", "--token-file",
        str(tmp_path / "tokens")],
        env={"KVBRIDGE_HOME": str(tmp_path)}, start_timeout_s=240)
    metadata = (("authorization", f"Bearer {CRASH_TOKEN}"),)
    text = " ".join(served.words()[:500])  # ~1300 source tokens, ~2000 target tokens: 9 MB of projected KV
    try:
        serve.start()
        address = serve.address
        with KVBridgeClient(address, token=CRASH_TOKEN, retries=0, timeout_s=120) as client:
            key = client.ingest(text).entries[0].key

        channel = grpc.insecure_channel(address)
        try:
            stream = pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
                pb2.GetProjectedCacheRequest(key=key, chunk_bytes=4096), metadata=metadata, timeout=120)
            first = next(stream)
            num_chunks = first.header.num_chunks
            assert num_chunks > 1000 and first.header.total_bytes > 8 << 20
            serve.kill()
            received = 1
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    received += 1
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert received < num_chunks  # what was in flight may arrive; never the whole stream
        finally:
            channel.close()

        with KVBridgeClient(address, token=CRASH_TOKEN, retries=0, timeout_s=10) as client:
            code, _ = served.code(lambda: client.fetch_projected(key=key))
            assert code == grpc.StatusCode.UNAVAILABLE  # no retries: the client reports the server gone

        # A client with retries starts its call while the server is down; the server comes back on its port.
        retrying = KVBridgeClient(address, token=CRASH_TOKEN, retries=11, backoff_s=0.05, timeout_s=120)
        failed_attempts = []
        first_failure = threading.Event()
        real_sleep = retrying._sleep

        def sleep(attempt: int) -> None:  # observe each UNAVAILABLE retry, then back off as the client does
            failed_attempts.append(attempt)
            first_failure.set()
            real_sleep(attempt)

        retrying._sleep = sleep
        result = {}

        def fetch() -> None:
            try:
                result["fetched"] = retrying.fetch_projected(text=text)  # a fresh process: by text, not by key
            except Exception as exc:
                result["error"] = exc

        caller = threading.Thread(target=fetch, name="retrying-client")
        caller.start()
        try:
            assert first_failure.wait(30), "the retrying client's first attempt did not fail while the server is down"
            assert (adapters / "tiny-qwen2--tiny-phi3--proportional.safetensors").exists()  # fitted at first start
            serve.restart()  # same port; the adapter is in the folder now
            assert serve.address == address
            caller.join(timeout=150)
            assert not caller.is_alive(), "the retrying client did not finish within 150 s of the restart"
        finally:
            retrying.close()
        assert "error" not in result, result.get("error")
        assert failed_attempts and failed_attempts == list(range(len(failed_attempts)))
        fetched = result["fetched"]

        paired = pair_text(text, tiny_source.tokenizer, tiny_target.tokenizer)
        fitted = load_adapter(adapters / "tiny-qwen2--tiny-phi3--proportional.safetensors")
        _, expected = served.expected_projection(text, tiny_source, tiny_target, fitted)
        assert torch.equal(fetched.segment.token_ids, paired.target_ids)
        assert torch.equal(fetched.segment.positions, torch.arange(paired.target_ids.numel()))
        torch.testing.assert_close(fetched.segment.kv, expected.kv, atol=1e-5, rtol=1e-5)  # another process
        assert fetched.source_key == key  # same tokens, same tenant: the same content key as before the crash

        with KVBridgeClient(address, token=CRASH_TOKEN, retries=0) as client:
            assert client.stats().tenant_entries == 2  # the re-ingested source and its projection: nothing else
        assert serve.stop() == 0, serve.log_tail()
    finally:
        serve.kill()


# ------------------------------------------------------------------------------------------------ faults: uploads


_UPLOAD_CHILD = r"""
import sys, threading
import grpc
from kvbridge.proto import pb2, pb2_grpc

address, token, path, keep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = open(path, "rb").read()
messages, i = [], 0
while i < len(data):
    n = int.from_bytes(data[i:i + 4], "little")
    messages.append(pb2.PutSourceKVRequest.FromString(data[i + 4:i + 4 + n]))
    i += 4 + n

def requests():
    yield from messages[:keep]
    print("sent", flush=True)
    threading.Event().wait()  # never sends the rest: the test kills this process

channel = grpc.insecure_channel(address)
pb2_grpc.KVBridgeStub(channel).PutSourceKV(requests(), metadata=(("authorization", "Bearer " + token),), timeout=300)
"""


def _upload_messages(segment) -> list[pb2.PutSourceKVRequest]:
    from kvbridge.server.chunks import dtype_name, iter_chunks

    kv = segment.kv.detach().cpu()
    header = pb2.KVHeader(model=pb2.ModelRef(name=segment.model.name, config_hash=segment.model.config_hash),
                          dtype=dtype_name(kv.dtype), num_layers=segment.num_layers,
                          num_kv_heads=segment.num_kv_heads, head_dim=segment.head_dim,
                          token_ids=segment.token_ids.tolist(), positions=segment.positions.tolist(), rotated=True,
                          kind="prefix")
    out = [pb2.PutSourceKVRequest(header=header)]
    for r, blob in iter_chunks(kv, 4096):
        out.append(pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                            token_start=r.token_start, token_end=r.token_end,
                                                            data=blob)))
    return out


@pytest.mark.parametrize("how", ["cancel", "close-channel", "kill-client-process"])
def test_a_client_gone_mid_put_source_kv_stores_nothing(how, tmp_path, tiny_source, tiny_target, adapters_dir):
    """PutSourceKV cut off after a few chunks (the call cancelled or the channel closed from another thread, or
    the client process killed): the server ends the call without storing anything, the store is as before and
    consistent; a whole upload of the same KV then succeeds."""
    running = served.start_on_cpu(tiny_source, [tiny_target], adapters_dir)
    store = running.service.store
    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            alice.ingest(served.text(1))  # something already stored, which must stay as it is
            segment = kvcache.extract(tiny_source.model, tiny_source.spec,
                                      tiny_source.tokenizer(served.text(2))["input_ids"])
            messages = _upload_messages(segment)
            keep = 4  # header + 3 chunks
            assert len(messages) > 3 * keep
            sent_bytes = sum(len(m.chunk.data) for m in messages[:keep])
            before = served.snapshot(store, "alice")
            received = running.metrics.bytes_streamed.labels("PutSourceKV", "in")
            received_before = received._value.get()

            def server_has_the_chunks() -> bool:
                return received._value.get() - received_before >= sent_bytes

            if how == "kill-client-process":
                blob = b"".join(len(m.SerializeToString()).to_bytes(4, "little") + m.SerializeToString()
                                for m in messages)
                (tmp_path / "upload.bin").write_bytes(blob)
                child = subprocess.Popen([sys.executable, "-c", _UPLOAD_CHILD, running.address, ALICE,
                                          str(tmp_path / "upload.bin"), str(keep)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
                try:
                    served.wait_for(server_has_the_chunks, "the server to receive the first chunks")
                    child.send_signal(signal.SIGKILL)
                finally:
                    child.kill()
                    child.communicate(timeout=30)
            else:
                release = threading.Event()

                def requests():
                    yield from messages[:keep]
                    release.wait(served.WAIT_S)  # the rest never comes: the test cuts the call off meanwhile

                channel = grpc.insecure_channel(running.address)
                future = pb2_grpc.KVBridgeStub(channel).PutSourceKV.future(
                    requests(), metadata=(("authorization", f"Bearer {ALICE}"),), timeout=served.WAIT_S)
                try:
                    served.wait_for(server_has_the_chunks, "the server to receive the first chunks")
                    cutter = threading.Thread(target=future.cancel if how == "cancel" else channel.close)
                    cutter.start()
                    cutter.join(timeout=30)
                    assert not cutter.is_alive()
                    with pytest.raises((grpc.RpcError, grpc.FutureCancelledError)):
                        future.result(timeout=30)
                    assert future.cancelled() or future.code() == grpc.StatusCode.CANCELLED
                finally:
                    release.set()
                    channel.close()

            # The server ends the call as CANCELLED, or (a race inside grpcio: the vanished peer's stream can end
            # like a normal half-close before the cancellation is seen) as INVALID_ARGUMENT, "the stream ended
            # before all KV arrived". Never OK, and nothing stored either way.
            served.wait_for(lambda: sum(served.server_codes(running, "PutSourceKV").values()) == 1,
                            "the server to end the broken upload", timeout_s=30,
                            state=lambda: f"PutSourceKV calls by code: {served.server_codes(running, 'PutSourceKV')}")
            codes = {c: n for c, n in served.server_codes(running, "PutSourceKV").items() if n}
            assert codes in ({"CANCELLED": 1}, {"INVALID_ARGUMENT": 1}), codes
            assert served.snapshot(store, "alice") == before
            assert store.check() == []
            entry = alice.put_source_kv(segment, chunk_bytes=4096)  # the same KV, whole: stored
            assert entry.num_tokens == segment.num_tokens and entry.new_blocks > 0
            assert torch.equal(alice.fetch_source(key=entry.key).segment.kv, segment.kv)
        assert served.internal_errors(running) == {}
    finally:
        running.stop(1)
