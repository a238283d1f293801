"""Reliability of the service (issue 8): load from many concurrent clients, and faults — the server killed during
a streamed fetch and restarted on its port, clients that vanish mid-upload, Redis killed and restarted under load,
a store filled to capacity, corrupt blocks in Redis. Real servers on loopback, the tiny pair, bounded in time.

The load test runs for 8 s with 64 clients by default; for the full run (figures printed with -s):

    KVBRIDGE_LOAD_SECONDS=60 .venv/bin/python -m pytest tests/test_reliability.py -k load -s

KVBRIDGE_LOAD_CLIENTS changes the number of clients (default 64).

(One file of ~830 lines: the scenarios share their server, Redis and client fixtures and helpers.)
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict

import grpc
import pytest
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer import kvcache
from redisproc import TEST_SECRET, write_secret_file

pytestmark = pytest.mark.integration

LOAD_CLIENTS = int(os.environ.get("KVBRIDGE_LOAD_CLIENTS", "64"))
LOAD_SECONDS = float(os.environ.get("KVBRIDGE_LOAD_SECONDS", "8"))
LOAD_TENANTS = 4
LOAD_LIVE = 2  # entries a load client keeps at most (it deletes its oldest beyond that)
LOAD_WORDS = 15  # words of a load text after its tenant's shared preamble

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
KEEPER = "keeper-token-0123456789abcd"
LOAD_TOKENS = {f"load{t}-token-0123456789abcdef": f"load{t}" for t in range(LOAD_TENANTS)}
TOKENS = {ALICE: "alice", BOB: "bob", KEEPER: "keeper", **LOAD_TOKENS}

OK, NOT_FOUND, EXHAUSTED = "OK", grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
WAIT_S = 60.0  # bound on every wait for something another thread or process does


def _words() -> list[str]:
    from kvbridge.transfer.selfcheck import sample_text

    return sample_text().split()


def _text(n: int, words: int = 40) -> str:
    w = _words()
    return " ".join(w[n * words:(n + 1) * words])


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, tiny_adapter_file):
    import shutil

    folder = tmp_path_factory.mktemp("adapters")
    shutil.copy(tiny_adapter_file, folder / "tiny-pair.safetensors")
    return folder


def _start(source, targets, adapters_dir, store=None, **overrides):
    """An in-process server on a free loopback port (store: a PagedStore built by the test, else from the config)."""
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    fields = dict(preset="tiny", listen="127.0.0.1:0", adapters=str(adapters_dir), store_capacity_mb=64,
                  store_device="cpu", max_message_mb=2, chunk_kb=64, selfcheck=False,
                  correction="replace")  # the projection's path: test_corrections has the served modes
    fields.update(overrides)
    config = ServeConfig(**fields)
    service = build_service(config, source=source, targets=targets, store=store)
    return start_server(service, config, tokens=TOKENS)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVBridgeError) as info:
        call()
    return info.value.code, info.value.details


def _wait_for(condition, what: str, timeout_s: float = WAIT_S, state=None) -> None:
    """Poll a condition that another thread or process makes true (a real server or Redis: no clock to inject).
    state(): what to show when it times out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f"; {state()}" if state else ""))
        time.sleep(0.02)


def _server_count(running, method: str, code: str) -> float:
    return running.metrics.requests.labels(method, code)._value.get()


def _server_codes(running, method: str) -> dict[str, float]:
    out = {}
    for metric in running.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("method") == method:
                out[sample.labels["code"]] = sample.value
    return out


def _internal_errors(running) -> dict[str, float]:
    """INTERNAL answers by method, from the server's own request counter."""
    out = {}
    for metric in running.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("code") == "INTERNAL" and sample.value:
                out[sample.labels["method"]] = sample.value
    return out


def _snapshot(store, *tenants):
    stats = store.stats()
    return stats.entries, stats.bytes_used["device"], [sorted(store.keys(t)) for t in tenants]


def _expected_projection(text, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text

    paired = pair_text(text, tiny_source.tokenizer, tiny_target.tokenizer)
    source_kv = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    return source_kv, project(adapter, source_kv, paired.alignment, paired.target_ids, tiny_source.rope,
                              tiny_target.rope)


class ManualClock:
    """The store's clock, moved by the test (Redis retry intervals without sleeping)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ------------------------------------------------------------------------------------------------ tallies


class Tally:
    """What one client thread saw: latencies of answered calls, errors by (method, code), wrong answers."""

    def __init__(self):
        self.latency: dict[str, list[float]] = defaultdict(list)  # method -> seconds, answered calls
        self.expected: Counter = Counter()  # (method, code): errors the client asked for (its own deleted key)
        self.tolerated: Counter = Counter()  # (method, code): errors the test allows here (misses, full store)
        self.errors: Counter = Counter()  # (method, code): everything else
        self.wrong: list[str] = []  # answers that came back but were wrong; exceptions in the client thread
        self.samples: list[str] = []  # the first few unexpected error messages
        self.where = None  # () -> str: the test's phase, noted with each unexpected error

    def call(self, method: str, fn, *args, expect: grpc.StatusCode | None = None, tolerate=None, **kwargs):
        """fn(*args, **kwargs) timed and classified; its value, or None when it failed."""
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except KVBridgeError as exc:
            key = (method, exc.code.name)
            if expect is not None and exc.code == expect:
                self.expected[key] += 1
            elif tolerate is not None and tolerate(exc.code):
                self.tolerated[key] += 1
            else:
                self.errors[key] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{exc} [{self.where()}]" if self.where else str(exc))
            return None
        self.latency[method].append(time.perf_counter() - t0)
        if expect is not None:
            self.wrong.append(f"{method} answered, expected {expect.name}")
        return out

    def check(self, ok: bool, message: str) -> None:
        if not ok and len(self.wrong) < 20:
            self.wrong.append(message)

    def run(self, body, *args) -> None:
        """body(*args) in a thread; whatever it raises becomes a wrong answer (never a silent thread death)."""
        try:
            body(*args)
        except Exception:
            self.wrong.append(traceback.format_exc())

    @staticmethod
    def merged(tallies: list[Tally]) -> Tally:
        out = Tally()
        for t in tallies:
            for method, values in t.latency.items():
                out.latency[method] += values
            out.expected.update(t.expected)
            out.tolerated.update(t.tolerated)
            out.errors.update(t.errors)
            out.wrong += t.wrong
            out.samples += t.samples[:2]
        return out

    def answered(self, method: str) -> int:
        return len(self.latency.get(method, ()))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _report(title: str, tally: Tally, seconds: float) -> None:
    answered = sum(len(v) for v in tally.latency.values())
    intended, tolerated, unexpected = (sum(c.values()) for c in (tally.expected, tally.tolerated, tally.errors))
    total = answered + intended + tolerated + unexpected
    print(f"\n{title}: {total} requests in {seconds:.1f} s = {total / seconds:.1f} requests/s ({answered} answered; "
          f"errors: {intended} intended, {tolerated} tolerated, {unexpected} unexpected)", flush=True)
    for method in sorted(tally.latency):
        v = tally.latency[method]
        print(f"  {method:<24} {len(v):>6} answered  p50 {1e3 * _percentile(v, 0.5):8.1f} ms  "
              f"p99 {1e3 * _percentile(v, 0.99):8.1f} ms  max {1e3 * max(v):8.1f} ms", flush=True)
    for name, counts in (("intended errors", tally.expected), ("tolerated errors", tally.tolerated),
                         ("unexpected errors", tally.errors)):
        by_code = Counter()
        for (method, code), n in counts.items():
            by_code[f"{method} {code}"] += n
        print(f"  {name}: {dict(sorted(by_code.items())) or 'none'}", flush=True)


# ------------------------------------------------------------------------------------------------ load


def _load_client(address: str, token: str, preamble: str, cid: int, deadline: float, tally: Tally,
                 deletes: list[int]) -> None:
    """Ingest, look up, fetch projected and source KV of its own texts, delete its oldest entries (then check the
    deleted key is gone: the intended NOT_FOUND); at the deadline, delete everything it still holds."""
    words = _words()
    live: list[str] = []  # its source entries, oldest first; each has had its projection fetched

    def delete(key: str) -> None:
        deleted = tally.call("Delete", client.delete, key)
        tally.check(deleted == 2, f"client {cid}: Delete {key[:12]} removed {deleted} entries, expected 2 "
                                  "(the source entry and its projection)")

    with KVBridgeClient(address, token=token, timeout_s=120, retries=0) as client:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            start = (cid * 37 + n * LOAD_WORDS) % (len(words) - LOAD_WORDS)
            text = f"{preamble} Note {cid}.{n}: " + " ".join(words[start:start + LOAD_WORDS])
            if n % 4:  # ingest, then everything by key
                reply = tally.call("Ingest", client.ingest, text, session_id=f"c{cid}")
                if reply is None:
                    continue
                entry = reply.entries[0]
                live.append(entry.key)
                tally.check(entry.num_tokens == reply.source_token_ids.numel() and entry.kind == "prefix",
                            f"client {cid}: Ingest answered {entry}")
                found = tally.call("Lookup", client.lookup, text)
                tally.check(found is None or (found.key == entry.key and found.tier == "device"),
                            f"client {cid}: Lookup of its own text answered {found}, expected {entry.key[:12]}")
                fetched = tally.call("GetProjectedCache", client.fetch_projected, key=entry.key)
                tally.check(fetched is None or (fetched.source_key == entry.key and fetched.segment.num_tokens > 0
                                                and fetched.segment.model.name == "tiny-phi3"),
                            f"client {cid}: GetProjectedCache by key answered the wrong entry")
                if fetched is None:
                    live.pop()  # no projection to delete with it: delete it now and expect 1
                    tally.call("Delete", client.delete, entry.key)
                    continue
                if n % 4 == 1:
                    source = tally.call("GetSourceCache", client.fetch_source, key=entry.key)
                    tally.check(source is None or torch.equal(source.segment.token_ids, reply.source_token_ids),
                                f"client {cid}: GetSourceCache by key answered other tokens")
            else:  # by text: the server ingests it and projects it in one call
                fetched = tally.call("GetProjectedCache", client.fetch_projected, text=text)
                if fetched is None:
                    continue
                live.append(fetched.source_key)
                tally.check(fetched.text == text, f"client {cid}: GetProjectedCache by text answered another text")
            while len(live) > LOAD_LIVE:
                old = live.pop(0)
                delete(old)
                deletes[0] += 1
                tally.call("GetSourceCache", client.fetch_source, key=old, expect=NOT_FOUND)
        for key in live:
            delete(key)


def test_load_many_clients_leave_no_errors_and_no_blocks(tiny_source, tiny_target, adapters_dir):
    """N clients (threads, own channel and bearer token, LOAD_TENANTS tenants) mix Ingest, Lookup, GetProjectedCache,
    GetSourceCache and Delete of their own entries for D seconds: no errors but the intended ones, server and
    clients agree on the counts, and once every client has deleted what it made the store is as before."""
    n_clients, seconds = LOAD_CLIENTS, LOAD_SECONDS
    # Room for every client's live entries (at most LOAD_LIVE + 1, ~10 target blocks of 72 KB each) with no
    # eviction, so "the device bytes return to what they were" is exact.
    running = _start(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=max(256, 10 * n_clients))
    store = running.service.store
    try:
        with KVBridgeClient(running.address, token=KEEPER, retries=0) as keeper:  # another tenant's pinned entry
            kept = keeper.ingest(_text(0), pin=True).entries[0]
            kept_projection = keeper.fetch_projected(key=kept.key)
        before = store.stats().bytes_used["device"]
        assert before > 0
        methods = ("Ingest", "Lookup", "GetProjectedCache", "GetSourceCache", "Delete")
        served_before = {(m, c): _server_count(running, m, c) for m in methods for c in ("OK", "NOT_FOUND")}

        tenants = list(LOAD_TOKENS.items())
        preambles = [" ".join(_words()[500 + 20 * t:520 + 20 * t]) for t in range(LOAD_TENANTS)]
        tallies = [Tally() for _ in range(n_clients)]
        deletes = [[0] for _ in range(n_clients)]
        t0 = time.monotonic()
        deadline = t0 + seconds
        threads = [threading.Thread(target=tallies[i].run, name=f"load-{i}",
                                    args=(_load_client, running.address, tenants[i % LOAD_TENANTS][0],
                                          preambles[i % LOAD_TENANTS], i, deadline, tallies[i], deletes[i]))
                   for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, deadline + 300 - time.monotonic()))
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "load clients still running 300 s after the deadline"

        tally = Tally.merged(tallies)
        _report(f"load: {n_clients} clients, {LOAD_TENANTS} tenants, {seconds:.0f} s of load", tally, elapsed)
        stats = store.stats()
        print(f"  store: {stats.entries} entries, {stats.bytes_used['device']} device bytes (before: {before}), "
              f"hits {stats.hits}, misses {stats.misses}, evictions {stats.evictions}", flush=True)
        assert tally.wrong == [], tally.wrong[:5]
        assert not tally.errors, (dict(tally.errors), tally.samples)
        assert tally.expected == Counter({("GetSourceCache", "NOT_FOUND"): sum(d[0] for d in deletes)})
        assert all(tally.answered(m) > 0 for m in methods), {m: tally.answered(m) for m in methods}

        # the server served exactly what the clients saw answered (its stream counters settle after the last chunk)
        def server_agrees() -> bool:
            return all(_server_count(running, m, "OK") - served_before[(m, "OK")] == tally.answered(m)
                       for m in methods)
        _wait_for(server_agrees, "the server's request counters to match the clients'", timeout_s=10)
        assert (_server_count(running, "GetSourceCache", "NOT_FOUND")
                - served_before[("GetSourceCache", "NOT_FOUND")]) == sum(tally.expected.values())

        # nothing left behind: no entries of the load tenants, no blocks in use beyond the keeper's
        assert store.check() == []
        for _, tenant in tenants:
            assert store.keys(tenant) == [] and running.service.tenant_usage(tenant) == (0, 0)
        assert stats.evictions == {"device": 0, "cpu": 0} and stats.lost_entries == 0  # the sizing held
        assert store.stats().bytes_used["device"] == before
        assert sorted(store.keys("keeper")) == sorted([kept.key, kept_projection.entry_key])
        with KVBridgeClient(running.address, token=KEEPER, retries=0) as keeper:
            again = keeper.fetch_projected(key=kept.key)
        assert torch.equal(again.segment.kv, kept_projection.segment.kv)
        assert _internal_errors(running) == {}
    finally:
        running.stop(1)


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
    adapters = tmp_path / "adapters"
    serve = ServeProcess(tmp_path / "serve", [
        "--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
        "--correction", "replace", "--adapters", str(adapters), "--fit-adapter", "--no-selfcheck", "--token-file",
        str(tmp_path / "tokens")],
        env={"KVBRIDGE_HOME": str(tmp_path)}, start_timeout_s=240)
    metadata = (("authorization", f"Bearer {CRASH_TOKEN}"),)
    text = " ".join(_words()[:500])  # ~1300 source tokens, ~2000 target tokens: 9 MB of projected KV
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
            code, _ = _code(lambda: client.fetch_projected(key=key))
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
        _, expected = _expected_projection(text, tiny_source, tiny_target, fitted)
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
    running = _start(tiny_source, [tiny_target], adapters_dir)
    store = running.service.store
    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            alice.ingest(_text(1))  # something already stored, which must stay as it is
            segment = kvcache.extract(tiny_source.model, tiny_source.spec,
                                      tiny_source.tokenizer(_text(2))["input_ids"])
            messages = _upload_messages(segment)
            keep = 4  # header + 3 chunks
            assert len(messages) > 3 * keep
            sent_bytes = sum(len(m.chunk.data) for m in messages[:keep])
            before = _snapshot(store, "alice")
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
                    _wait_for(server_has_the_chunks, "the server to receive the first chunks")
                    child.send_signal(signal.SIGKILL)
                finally:
                    child.kill()
                    child.communicate(timeout=30)
            else:
                release = threading.Event()

                def requests():
                    yield from messages[:keep]
                    release.wait(WAIT_S)  # the rest never comes: the test cuts the call off meanwhile

                channel = grpc.insecure_channel(running.address)
                future = pb2_grpc.KVBridgeStub(channel).PutSourceKV.future(
                    requests(), metadata=(("authorization", f"Bearer {ALICE}"),), timeout=WAIT_S)
                try:
                    _wait_for(server_has_the_chunks, "the server to receive the first chunks")
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
            _wait_for(lambda: sum(_server_codes(running, "PutSourceKV").values()) == 1,
                      "the server to end the broken upload", timeout_s=30,
                      state=lambda: f"PutSourceKV calls by code: {_server_codes(running, 'PutSourceKV')}")
            codes = {c: n for c, n in _server_codes(running, "PutSourceKV").items() if n}
            assert codes in ({"CANCELLED": 1}, {"INVALID_ARGUMENT": 1}), codes
            assert _snapshot(store, "alice") == before
            assert store.check() == []
            entry = alice.put_source_kv(segment, chunk_bytes=4096)  # the same KV, whole: stored
            assert entry.num_tokens == segment.num_tokens and entry.new_blocks > 0
            assert torch.equal(alice.fetch_source(key=entry.key).segment.kv, segment.kv)
        assert _internal_errors(running) == {}
    finally:
        running.stop(1)


# ------------------------------------------------------------------------------------------------ faults: Redis


def _redis_client(address: str, token: str, texts: list[str], expected: dict, tally: Tally, stop: threading.Event,
                  phase: list[str], cycles: Counter) -> None:
    """Ingest, fetch by key and by text, look up, over and over on its own few texts. A miss (NOT_FOUND) is allowed
    only for fetches by key once Redis has been killed (their blocks may have been in Redis, or lost on the way
    down); anything answered must be exact."""
    def miss_after_kill(code) -> bool:
        return code == NOT_FOUND and phase[0] != "up"

    with KVBridgeClient(address, token=token, timeout_s=60, retries=0) as client:
        i = 0
        while not stop.is_set():
            text = texts[i % len(texts)]
            i += 1
            source_kv, projected = expected[text]
            reply = tally.call("Ingest", client.ingest, text)
            if reply is not None:
                key = reply.entries[0].key
                got = tally.call("GetSourceCache(key)", client.fetch_source, key=key, tolerate=miss_after_kill)
                tally.check(got is None or torch.equal(got.segment.kv, source_kv.kv),
                            f"GetSourceCache by key: wrong KV for text {i % len(texts)}")
                got = tally.call("GetProjectedCache(key)", client.fetch_projected, key=key,
                                 tolerate=miss_after_kill)
                tally.check(got is None or torch.equal(got.segment.kv, projected.kv),
                            f"GetProjectedCache by key: wrong KV for text {i % len(texts)}")
            got = tally.call("GetProjectedCache(text)", client.fetch_projected, text=text)
            tally.check(got is None or torch.equal(got.segment.kv, projected.kv),
                        f"GetProjectedCache by text: wrong KV for text {i % len(texts)}")
            tally.call("Lookup", client.lookup, text)
            cycles[phase[0]] += 1


def test_redis_killed_and_restarted_while_clients_run(tiny_source, tiny_target, adapters_dir, adapter, redis_server):
    """Clients keep going while Redis is killed (local tiers serve; the tier reports itself down; only fetches by
    key may miss) and restarted (the tier comes back after its retry interval, on the store's clock)."""
    from kvbridge.transfer.store import PagedStore, StoreConfig

    clock = ManualClock()
    retry_s = 30.0  # on the injected clock: the tier tries Redis again only when the test moves the clock
    # 4 MB: pools of 64 source blocks (16 KB) and 14 target blocks (72 KB); a 256 KB CPU tier under them: the
    # clients' projections alone need ~80 target blocks, so blocks go down to Redis and come back all the time.
    store = PagedStore(StoreConfig(capacity_bytes=4 << 20, cpu_capacity_bytes=256 << 10, redis_url=redis_server.url,
                                   redis_secret=TEST_SECRET,
                                   redis_retry_s=retry_s, device="cpu"), clock=clock)
    # No kept wire messages or same-host files: a repeated fetch would be answered from them without reading a
    # block, and this test is about blocks going down to Redis and coming back.
    running = _start(tiny_source, [tiny_target], adapters_dir, store=store, stream_keep_mb=0, shm_keep_s=0)
    n_clients, texts_each = 4, 5
    texts = [[_text(100 + c * texts_each + j, words=15) for j in range(texts_each)] for c in range(n_clients)]
    expected = {t: _expected_projection(t, tiny_source, tiny_target, adapter) for ts in texts for t in ts}
    stop, phase, cycles = threading.Event(), ["up"], Counter()
    tallies = [Tally() for _ in range(n_clients)]
    for tally in tallies:
        tally.where = lambda: f"Redis {phase[0]}"
    tokens = [ALICE, BOB]
    threads = [threading.Thread(target=tallies[c].run, name=f"redis-load-{c}",
                                args=(_redis_client, running.address, tokens[c % 2], texts[c], expected, tallies[c],
                                      stop, phase, cycles))
               for c in range(n_clients)]

    def redis_stats() -> dict:
        return store.stats().redis

    def more_cycles(n: int):
        target = sum(cycles.values()) + n
        return lambda: sum(cycles.values()) >= target

    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        _wait_for(lambda: redis_stats()["puts"] > 0 and redis_stats()["hits"] > 0,
                  "blocks to go down to Redis and come back")
        _wait_for(more_cycles(8), "more client cycles with Redis up")

        phase[0] = "down"
        redis_server.kill()
        _wait_for(lambda: not redis_stats()["available"], "the store to report the Redis tier down")
        with KVBridgeClient(running.address, token=ALICE, retries=0) as client:
            tiers = {t.tier: t.up for t in client.stats().tiers}
        assert tiers == {"device": True, "cpu": True, "redis": False}
        _wait_for(more_cycles(8), "client cycles with Redis down")

        phase[0] = "back"
        redis_server.restart()

        def tier_back() -> bool:
            if redis_stats()["available"]:
                return True
            clock.advance(retry_s)  # the retry interval passes: the next call to the tier tries Redis again
            return False

        _wait_for(tier_back, "the store to report the Redis tier up again")
        puts = redis_stats()["puts"]
        _wait_for(lambda: redis_stats()["puts"] > puts, "blocks to go down to the restarted Redis")
        _wait_for(more_cycles(8), "client cycles with Redis back")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        running.stop(1)
    assert not any(t.is_alive() for t in threads)

    tally = Tally.merged(tallies)
    _report(f"redis kill/restart: {n_clients} clients, cycles by phase {dict(cycles)}", tally, time.monotonic() - t0)
    stats = store.stats()
    print(f"  store: redis {stats.redis}, lost entries {stats.lost_entries}, evictions {stats.evictions}",
          flush=True)
    assert tally.wrong == [], tally.wrong[:5]
    assert not tally.errors, (dict(tally.errors), tally.samples)
    assert set(m for m, _ in tally.tolerated) <= {"GetSourceCache(key)", "GetProjectedCache(key)"}
    assert cycles["up"] > 0 and cycles["down"] >= 8 and cycles["back"] >= 8
    assert stats.redis["available"] and stats.redis["errors"] > 0 and stats.redis["down_since"] is None
    assert store.check() == []
    assert _internal_errors(running) == {}


def _block_keys(store, lm, tenant: str, token_ids: torch.Tensor) -> list[bytes]:
    """The Redis keys of a source prefix entry's blocks: `kvbridge:blk:<block hash hex>` (transfer/tiers.py)."""
    from kvbridge.transfer.store.kv_blocks import Namespace, chain_root, hash_chain

    ns = Namespace(tenant=tenant, model=lm.spec.identity.key, dtype=lm.spec.dtype, adapter="")
    digest = ns.digest()
    hashes = hash_chain(token_ids, store.config.block_size, chain_root(digest, "prefix"), digest)
    return [b"kvbridge:blk:" + h.hex().encode() for h in hashes]


def test_a_corrupt_block_in_redis_is_a_miss_never_bad_data(tiny_source, tiny_target, adapters_dir, adapter,
                                                           redis_server):
    """Blocks demoted to Redis, two of one entry's overwritten (garbage; one flipped bit under a valid header):
    fetching that entry by key is NOT_FOUND, the tier counts both as corrupt and deletes them; by text it is
    computed again, exactly; an intact entry read back from Redis is exact."""
    import redis

    # 4 MB, no CPU tier: a source pool of 64 blocks; evicted blocks go straight to Redis
    running = _start(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=4, cpu_tier_mb=0,
                     redis_url=redis_server.url, redis_secret_file=str(write_secret_file(redis_server.workdir)))
    store = running.service.store
    r = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            a_text, c_text = _text(30), _text(31)
            a = alice.ingest(a_text)
            c = alice.ingest(c_text)
            ka, kc = a.entries[0].key, c.entries[0].key
            for i in range(40):  # other texts until both are wholly in Redis
                if store.info(ka, "alice").tier == "redis" and store.info(kc, "alice").tier == "redis":
                    break
                alice.ingest(_text(32 + i))
            assert store.info(ka, "alice").tier == "redis" and store.info(kc, "alice").tier == "redis"

            keys = _block_keys(store, tiny_source, "alice", a.source_token_ids)
            assert len(keys) >= 3 and all(r.exists(k) for k in keys)
            r.set(keys[0], b"\x00garbage, not a safetensors blob", keepttl=True)
            flipped = bytearray(r.get(keys[-1]))
            flipped[-1] ^= 0x01  # the last byte of the tensor data: the header still parses, the CRC does not match
            r.set(keys[-1], bytes(flipped), keepttl=True)
            corrupt = store.stats().redis["corrupt"]

            a_kv, _ = _expected_projection(a_text, tiny_source, tiny_target, adapter)
            c_kv, _ = _expected_projection(c_text, tiny_source, tiny_target, adapter)
            assert torch.equal(alice.fetch_source(key=kc).segment.kv, c_kv.kv)  # intact blocks come back exact

            code, details = _code(lambda: alice.fetch_source(key=ka))
            assert code == NOT_FOUND, details
            assert store.stats().redis["corrupt"] == corrupt + 2
            assert not r.exists(keys[0]) and not r.exists(keys[-1])  # dropped from Redis
            code, _ = _code(lambda: alice.fetch_projected(key=ka))
            assert code == NOT_FOUND  # the entry is gone, not served in part
            assert alice.lookup(a_text).key is None

            again = alice.fetch_source(text=a_text)  # by text: computed again
            assert again.entry_key == ka and torch.equal(again.segment.kv, a_kv.kv)
            _, projected = _expected_projection(a_text, tiny_source, tiny_target, adapter)
            assert torch.equal(alice.fetch_projected(text=a_text).segment.kv, projected.kv)
        stats = store.stats()
        assert stats.redis["corrupt"] == corrupt + 2 and stats.redis["available"]
        assert store.check() == []
        assert _internal_errors(running) == {}
    finally:
        r.close()
        running.stop(1)


# ------------------------------------------------------------------------------------------------ faults: capacity


def test_a_full_store_evicts_by_policy_keeps_pinned_entries_and_refuses_politely(tiny_source, tiny_target,
                                                                                adapters_dir):
    """A 2 MB store (one byte budget: 128 of the tiny source's 16 KB blocks, shared with projections; no lower
    tier): distinct texts until eviction; every call is OK or RESOURCE_EXHAUSTED; the oldest unpinned entries are
    gone (NOT_FOUND), the pinned one stays exact; pinning until full ends in RESOURCE_EXHAUSTED with a sentence,
    leaving the store as it was."""
    running = _start(tiny_source, [tiny_target], adapters_dir, store_capacity_mb=2, cpu_tier_mb=0,
                     tenant_max_pinned_mb=4)  # the tenant may pin past the pool: this is about the store filling
    store = running.service.store
    codes = Counter()

    def attempt(call, *args, **kwargs):
        try:
            out = call(*args, **kwargs)
        except KVBridgeError as exc:
            codes[exc.code.name] += 1
            return None
        codes[OK] += 1
        return out

    try:
        with KVBridgeClient(running.address, token=ALICE, retries=0) as alice:
            texts = [_text(100 + i, words=15) for i in range(140)]  # ~3 blocks of 16 KB each
            pinned = alice.ingest(texts[0], pin=True)
            keys = []
            for text in texts[1:26]:  # ~3 blocks each: twice what the source pool holds
                reply = attempt(alice.ingest, text)
                if reply is not None:
                    keys.append(reply.entries[0].key)
                    attempt(alice.fetch_projected, key=reply.entries[0].key)  # evicts older projections
            stats = store.stats()
            assert set(codes) <= {OK, "RESOURCE_EXHAUSTED"} and codes[OK] > 0, codes
            assert stats.evictions["device"] > 0 and stats.lost_entries > 0
            assert len(keys) == 25 and len(set(keys) & set(store.keys("alice"))) < 15  # some source entries went
            code, _ = _code(lambda: alice.fetch_source(key=keys[0]))  # least recently used: evicted
            assert code == NOT_FOUND
            assert alice.lookup(texts[1]).key is None
            assert alice.fetch_source(key=keys[-1]).entry_key == keys[-1]  # the newest is there
            pinned_kv = kvcache.extract(tiny_source.model, tiny_source.spec, pinned.source_token_ids)
            assert torch.equal(alice.fetch_source(key=pinned.entries[0].key).segment.kv, pinned_kv.kv)

            # more blocks than the whole pool (one byte budget for every layout: ~2,500 tokens of 1 KB against 2 MB)
            code, details = _code(lambda: alice.ingest(" ".join(_words()[:800])))
            assert code == EXHAUSTED and "the store is full" in details and "in all" in details, details

            pins = [pinned.entries[0].key]
            for text in texts[26:]:  # pin until the pool is all pinned
                before = _snapshot(store, "alice")
                try:
                    pins.append(alice.ingest(text, pin=True).entries[0].key)
                except KVBridgeError as exc:
                    assert exc.code == EXHAUSTED, exc
                    assert "the store is full" in exc.details and "pinned" in exc.details, exc.details
                    assert _snapshot(store, "alice") == before  # a refused put changes nothing
                    break
            else:
                pytest.fail(f"{len(pins)} pinned entries and the store never refused one")
            assert len(pins) > 2
            for key in pins:  # every pinned entry survived everything
                assert alice.fetch_source(key=key).entry_key == key
            assert store.check() == []
            assert alice.stats().tenant_entries == len(store.keys("alice"))  # still answering

            for key in pins:  # unpinned by deletion: room again
                alice.delete(key)
            assert alice.ingest(texts[-1]).entries[0].new_blocks > 0
        assert store.check() == []
        assert _internal_errors(running) == {}
    finally:
        running.stop(1)
