"""The client's channels to kvbridge: the target it dials — one server, or replicas behind one name that gRPC balances
itself — with its options and service config, and the calls made on each channel.

Addresses a client takes (`parse_target`):
- "host:port" or "unix:PATH": one server; a plain channel (gRPC's pick_first), retried by the client alone.
- several replicas by IP address: "ip:port,ip:port,..." or a list of them ("localhost" is 127.0.0.1); dialled as the
  target "ipv4:ip:port,ip:port" (or "ipv6:[ip]:port,...": one address family per list).
- replicas behind a DNS name: "dns:///name:port" (every A/AAAA record is a replica; gRPC resolves it again when a
  connection drops, so replicas may come and go).

Replicas get `service_config`: round_robin over the replicas that gRPC's client-side health check (a grpc.health.v1
Watch of "kvbridge.v1.KVBridge", which `kvbridge serve` reports SERVING until it drains) finds serving, and a retry
policy: a call that fails UNAVAILABLE before its replica answered (the replica died under it) is sent again, by the
channel, to the next replica. Balancing is only meaningful when the replicas share a tier (the same Redis, or the
cluster tier): an entry ingested through one replica is found by the others there; without one, a call the balancer
sends to another replica answers NOT_FOUND.

Sticky: a same-host fetch hands the client a shared-memory segment in its replica's folder, and the release must go
back to that replica. With replicas listed by address the client pins such fetches itself: each replica has a plain
channel (`Channels.pinned`), the fetch and its release go through the same one. A DNS name gives no addresses to pin
to, so its fetches stream (transport "auto"; "shared_memory" is refused by name).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.config import is_loopback, split_address

SERVICE = pb2.DESCRIPTOR.services_by_name["KVBridge"].full_name  # "kvbridge.v1.KVBridge": health-checked, retried
DOWNLOADS = (("GetProjectedCache", pb2.GetProjectedCacheRequest), ("GetSourceCache", pb2.GetSourceCacheRequest))
MAX_ATTEMPTS = 5  # gRPC's own ceiling on a retry policy's maxAttempts (it lowers larger values to 5)
MAX_BACKOFF_S = 2.0  # the channel's retries (and the client's) wait at most this long between attempts
RECONNECT_BACKOFF_S = 1.0  # a channel whose server went away tries to reconnect at least this often
NOT_RETRIED = ("Delete",)  # a lost answer may hide its effect: tried again, it would say NOT_FOUND, or delete anew
TRANSPORTS = ("stream", "shared_memory", "auto")


@dataclass(frozen=True)
class Target:
    uri: str  # what the channel dials: "host:port", "unix:PATH", "ipv4:ip:port,ip:port", "dns:///name:port"
    replicas: tuple[str, ...]  # the addresses listed, each a target of its own ("ip:port"); () for a DNS name
    balanced: bool  # replicas: round_robin over the healthy ones, the channel's retry policy, pinned same-host fetches
    same_host: bool  # every replica listed is on this host (loopback, a unix socket): "auto" means shared memory

    @property
    def pinnable(self) -> bool:
        """Whether a same-host fetch and its release can be sent to one replica (one server, or replicas listed)."""
        return not self.balanced or bool(self.replicas)


def parse_target(address: str | Sequence[str]) -> Target:
    """The Target of one address, several (a list, or a comma-separated string), or "dns:///name:port"; ValueError
    naming the address that is wrong."""
    if isinstance(address, str):
        given = address.strip()
        if given.startswith("dns:"):
            split_address(given.rsplit("/", 1)[-1], "a DNS target (dns:///name:port)")
            return Target(uri=given, replicas=(), balanced=True, same_host=False)
        if given.startswith("unix:"):
            return Target(uri=given, replicas=(given,), balanced=False, same_host=True)
        for scheme in ("ipv4:", "ipv6:"):  # gRPC's own form of a list: read as the list it is
            given = given.removeprefix(scheme)
        parts = given.split(",")
    else:
        parts = list(address)
    if not parts or parts == [""]:
        raise ValueError("no kvbridge address given: host:port, several (ip:port,ip:port or a list), or "
                         "dns:///name:port")
    if any(not isinstance(p, str) or not p.strip() for p in parts):
        raise ValueError(f"an empty or non-text kvbridge address in {address!r}")
    parts = [p.strip() for p in parts]
    if len(parts) == 1:
        host, _ = split_address(parts[0], "a kvbridge address")
        return Target(uri=parts[0], replicas=(parts[0],), balanced=False, same_host=is_loopback(host))
    replicas, versions, hosts = [], set(), []
    for part in parts:
        host, port = split_address(part, "a replica's address")
        try:
            ip = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
        except ValueError:
            raise ValueError(f"replica address {part!r} is not an IP address: a list of replicas takes IP addresses "
                             f"(gRPC's ipv4:/ipv6: targets); replicas behind a DNS name are dns:///NAME:PORT") from None
        versions.add(ip.version)
        hosts.append(ip)
        replicas.append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if len(versions) > 1:
        raise ValueError(f"the replica addresses {parts} mix IPv4 and IPv6: gRPC dials one family per list")
    twice = sorted({r for r in replicas if replicas.count(r) > 1})
    if twice:
        raise ValueError(f"replica address {twice[0]} is listed twice in {address!r}")
    scheme = "ipv4" if versions == {4} else "ipv6"
    return Target(uri=f"{scheme}:{','.join(replicas)}", replicas=tuple(replicas), balanced=True,
                  same_host=all(ip.is_loopback for ip in hosts))


def resolve_transport(name: str, target: Target) -> str:
    """"stream" or "shared_memory" for a transport name on this target ("auto": shared memory when every replica is
    on this host and a fetch can be pinned to one); ValueError for a name that is none, or shared memory that a DNS
    target cannot do."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "auto":
        return "shared_memory" if target.same_host and target.pinnable else "stream"
    if name == "shared_memory" and not target.pinnable:
        raise ValueError(f"transport 'shared_memory' needs the replicas' addresses (a segment's release goes back to "
                         f"the replica that made it), and {target.uri!r} names none: list them (ip:port,ip:port) or "
                         f"use transport 'stream'")
    return name


def service_config(retries: int, backoff_s: float) -> str:
    """The service config of a channel to replicas: round_robin over the replicas whose health check says SERVING;
    UNAVAILABLE retried `retries` times (at most MAX_ATTEMPTS - 1; none when 0) from backoff_s, doubling."""
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE}}
    if retries > 0:
        first = max(backoff_s, 0.001)
        config["methodConfig"] = [{"name": [{"service": SERVICE}], "retryPolicy": {
            "maxAttempts": min(retries + 1, MAX_ATTEMPTS), "initialBackoff": f"{first:.3f}s",
            "maxBackoff": f"{max(first, MAX_BACKOFF_S):.3f}s", "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"]}},
            {"name": [{"service": SERVICE, "method": m} for m in NOT_RETRIED]}]  # no retry policy: sent once
    return json.dumps(config)


class Endpoint:
    """One channel and the kvbridge calls on it: the generated stub, and the fetches whose messages come as bytes
    (read by chunk_wire: the KV data is not copied again)."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.stub = pb2_grpc.KVBridgeStub(channel)
        self.downloads = {name: channel.unary_stream(f"/{SERVICE}/{name}", request_serializer=request.SerializeToString)
                          for name, request in DOWNLOADS}


class Channels:
    """The client's channels: `main` dials the target (one server, or the replicas balanced by gRPC); for replicas
    listed by address, `pinned()` hands out one plain channel per replica, in turn, for the calls that must meet the
    same replica (a same-host fetch and its segment's release)."""

    def __init__(self, target: Target, options: list[tuple], credentials: grpc.ChannelCredentials | None,
                 retries: int, backoff_s: float):
        self.target = target
        self._options = options
        self._credentials = credentials
        extra = [("grpc.service_config", service_config(retries, backoff_s)),
                 ("grpc.service_config_disable_resolution", 1)] if target.balanced else []  # ours, not DNS TXT's
        self.main = Endpoint(self._open(target.uri, options + extra))
        self._pinned: dict[str, Endpoint] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def _open(self, uri: str, options: list[tuple]) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(uri, self._credentials, options=options)
        return grpc.insecure_channel(uri, options=options)

    def pinned(self) -> list[Endpoint]:
        """Every replica's own channel, beginning with the next in turn (a call tries them in this order until one
        answers); [main] for one server."""
        if not self.target.balanced:
            return [self.main]
        assert self.target.replicas, "a DNS target has no replicas to pin to (resolve_transport refuses it)"
        n = len(self.target.replicas)
        start = next(self._turn) % n
        with self._lock:
            for address in self.target.replicas:
                if address not in self._pinned:
                    self._pinned[address] = Endpoint(self._open(address, self._options))
            return [self._pinned[self.target.replicas[(start + i) % n]] for i in range(n)]

    def close(self) -> None:
        with self._lock:
            pinned = list(self._pinned.values())
        for endpoint in [self.main, *pinned]:
            endpoint.channel.close()
