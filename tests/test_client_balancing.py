"""Replicas behind one name (issue 37, part 2): one KVBridgeClient given three `kvbridge serve` processes that share a
redis-server spreads its calls over them (gRPC's round_robin, read from each replica's /metrics), keeps answering
every call when one replica is SIGKILLed under load (the channel's retry policy and the client's restart of a cut
fetch), and sends a same-host segment's release back to the replica that made it. The address forms and their errors
are checked without servers."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch
from kvbridge.server.channel import parse_target, resolve_transport
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.vllm.params import ConnectorConfig
from prometheus_client.parser import text_string_to_metric_families
from redisproc import RedisProcess, redis_available
from served import TEXT, wait_for
from serveproc import tiny_replica_args

TOKEN = "balanced-token-0123456789abcdef"
REPLICAS = 3
WAIT_S = 30.0  # bound on each poll below (the whole module runs in about 30 s on a 2-core VM)


class Replica:
    """A `kvbridge serve` child process and its /metrics endpoint (its port from the ready file)."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str]):
        from serveproc import ServeProcess

        self.proc = ServeProcess(workdir, args, env=env, start_timeout_s=WAIT_S * 4)
        self.metrics_port: int | None = None

    def start(self) -> None:
        self.proc.start()
        ready = json.loads((self.proc.workdir / f"ready-{self.proc.starts}.json").read_text())
        self.metrics_port = ready["metrics_port"]

    @property
    def address(self) -> str:
        return self.proc.address

    def answered(self) -> Counter:
        """The calls this replica answered OK, by method (its kvbridge_requests counter)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        out = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvbridge_requests_total" and sample.labels.get("code") == "OK":
                    out[sample.labels["method"]] += int(sample.value)
        return out


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_adapter_file):
    """Three `kvbridge serve --preset tiny` processes on one redis-server (values signed with one secret), one token
    file, /metrics each; stopped (or found killed) at the end."""
    if not redis_available():
        pytest.fail("no redis-server (or valkey-server) on PATH: these tests need a real Redis")
    root = tmp_path_factory.mktemp("balanced")
    redis = RedisProcess(root / "redis")
    redis.start()
    args = tiny_replica_args(root, tiny_adapter_file, redis.url, f"acme {TOKEN}\n") + [
        "--metrics-listen", "127.0.0.1:0", "--shm-ttl-s", "300", "--shm-keep-s", "0"]
    started = []
    try:  # one after another, from this thread: a server started by a thread that ends gets SIGKILL (pdeathsig)
        for i in range(REPLICAS):
            started.append(Replica(root / f"replica-{i}", args, {"KVBRIDGE_HOME": str(root)}))
            started[-1].start()
        yield started
    finally:
        for replica in started:
            replica.proc.stop(timeout_s=10)
        redis.stop()


def live(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.proc.running]


@pytest.mark.integration
def test_calls_spread_over_the_replicas_and_survive_one_killed_under_load(replicas):
    addresses = ",".join(r.address for r in replicas)
    with KVBridgeClient(addresses, token=TOKEN, timeout_s=WAIT_S, retries=4, transport="stream") as client:
        assert client.target.balanced and client.target.uri.startswith("ipv4:127.0.0.1:")
        entry = client.ingest(TEXT).entries[0]  # on one replica; the others find it in Redis
        expected = client.fetch_source(key=entry.key).segment.kv
        before = [r.answered() for r in replicas]

        def served_since(replica: Replica, then: Counter) -> int:
            now = replica.answered()
            return sum(now[m] - then[m] for m in ("Lookup", "GetSourceCache"))

        def call_once() -> None:
            assert client.lookup(TEXT).key == entry.key
            assert torch.equal(client.fetch_source(key=entry.key).segment.kv, expected)

        def spread() -> bool:
            call_once()
            return all(served_since(r, b) > 0 for r, b in zip(replicas, before))

        wait_for(spread, "every replica to answer some of one client's calls",
                 timeout_s=WAIT_S, state=lambda: [served_since(r, b) for r, b in zip(replicas, before)])

        # three threads keep calling while one replica is killed: no call may fail
        stop, calls, errors = threading.Event(), Counter(), []

        def caller(n: int) -> None:
            while not stop.is_set():
                try:
                    call_once()
                    calls[n] += 1
                except (KVBridgeError, AssertionError) as exc:
                    errors.append(repr(exc))

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: min(calls[n] for n in range(3)) >= 2, "the callers to be under way", timeout_s=WAIT_S)
            victim, survivors = replicas[1], [replicas[0], replicas[2]]
            victim.proc.kill()  # SIGKILL: no drain, its connections just drop
            at_kill = [r.answered() for r in survivors]
            calls_at_kill = sum(calls.values())
            wait_for(lambda: all(served_since(r, b) >= 5 for r, b in zip(survivors, at_kill)),
                     "both live replicas to keep answering after the kill", timeout_s=WAIT_S,
                     state=lambda: f"errors {errors[:3]}")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=WAIT_S)
        assert not errors, f"{len(errors)} calls failed while a replica died, first: {errors[:3]}"
        assert sum(calls.values()) > calls_at_kill
        assert not victim.proc.running and len(live(replicas)) == REPLICAS - 1


@pytest.mark.integration
def test_a_same_host_fetch_is_released_on_the_replica_that_made_its_segment(replicas):
    up = live(replicas)
    with KVBridgeClient([r.address for r in up], token=TOKEN, timeout_s=WAIT_S, transport="auto") as client:
        assert client.transport == "shared_memory"  # every replica is on loopback
        entry = client.ingest(TEXT).entries[0]
        folders = set()
        for _ in range(2 * len(up)):
            fetched = client.fetch_projected(key=entry.key, mode="replace", keep_shared=True)
            path = Path(fetched.shared.path)
            assert fetched.transport == "shared_memory" and path.exists()
            folders.add(path.parent)
            client.release_segment(fetched.shared)  # a release sent elsewhere would leave it for the TTL (300 s)
            wait_for(lambda p=path: not p.exists(), f"the replica that made {path.name} to remove it on release",
                     timeout_s=WAIT_S)
            assert client.lookup(TEXT).key == entry.key  # the balanced channel's turn moves on apart from the pins'
        assert len(folders) == len(up)  # the pinned fetches took the replicas in turn
        mapped = client.fetch_projected(key=entry.key, mode="replace")  # mapped here, released without waiting
        assert mapped.transport == "shared_memory" and mapped.segment.num_tokens > 0


@pytest.mark.integration
def test_a_dns_name_reaches_a_replica_and_streams(replicas):
    one = live(replicas)[0]
    with KVBridgeClient(f"dns:///localhost:{one.proc.port}", token=TOKEN, timeout_s=WAIT_S,
                        transport="auto") as client:
        assert client.target.balanced and client.transport == "stream"  # no addresses to pin a segment to
        assert client.lookup(TEXT).key is not None
        with pytest.raises(ValueError, match="needs the replicas' addresses"):
            client.fetch_source(text=TEXT, transport="shared_memory")


# ------------------------------------------------------------------------------------------------ no servers


def test_address_forms_and_what_is_wrong_with_a_bad_one():
    assert parse_target("127.0.0.1:5").uri == "127.0.0.1:5" and not parse_target("127.0.0.1:5").balanced
    listed = parse_target(["127.0.0.1:5", "localhost:6"])
    assert listed.uri == "ipv4:127.0.0.1:5,127.0.0.1:6" and listed.replicas == ("127.0.0.1:5", "127.0.0.1:6")
    assert parse_target(" 127.0.0.1:5, 127.0.0.1:6 ") == listed and parse_target(listed.uri) == listed
    assert parse_target("[::1]:5,[::1]:6").uri == "ipv6:[::1]:5,[::1]:6"
    assert resolve_transport("auto", listed) == "shared_memory"
    assert resolve_transport("auto", parse_target("10.0.0.1:5,10.0.0.2:5")) == "stream"
    for bad, message in [("", "no kvbridge address"), ([], "no kvbridge address"),
                         ("127.0.0.1:5,,127.0.0.1:6", "an empty or non-text"),
                         ("kv-a:5,kv-b:5", "'kv-a:5' is not an IP address.*dns:///"),
                         ("127.0.0.1:5,127.0.0.1:5", "127.0.0.1:5 is listed twice"),
                         ("127.0.0.1:5,[::1]:6", "mix IPv4 and IPv6"),
                         ("127.0.0.1:5,127.0.0.1", "must be host:port, got '127.0.0.1'"),
                         ("dns:///kv.svc", "must be host:port")]:
        with pytest.raises(ValueError, match=message):
            parse_target(bad)
    with pytest.raises(ValueError, match="transport 'shared_memory' needs the replicas' addresses"):
        KVBridgeClient("dns:///kv.svc:50051", transport="shared_memory")


def test_the_connector_takes_the_same_forms():
    config = ConnectorConfig.from_extra({"kvbridge_address": ["127.0.0.1:5", "127.0.0.1:6"], "kvbridge_servers": {
        "dns": {"address": "dns:///kv.svc:50051"}, "listed": {"address": "127.0.0.1:7,127.0.0.1:8"}}})
    assert config.servers["default"].address == ("127.0.0.1:5", "127.0.0.1:6")  # a list, kept frozen
    client = config.open_client("default")
    try:
        assert client.target.uri == "ipv4:127.0.0.1:5,127.0.0.1:6" and client.transport == "shared_memory"
    finally:
        client.close()
    dns = config.open_client("dns")
    try:
        assert dns.target.balanced and dns.transport == "stream"
    finally:
        dns.close()
    with pytest.raises(ValueError, match="kvbridge server address .*kv-a:1.* is not an IP address"):
        ConnectorConfig.from_extra({"kvbridge_address": "kv-a:1,kv-b:1"})
    with pytest.raises(ValueError, match="needs the replicas' addresses"):
        ConnectorConfig.from_extra({"kvbridge_address": "dns:///kv.svc:1", "kvbridge_transport": "shared_memory"})

