"""The Redis tier's URL: one server in redis-py's forms (redis://, rediss://, unix://) or a Redis Cluster,

    redis+cluster://[[user]:password@]host:port[,host:port...][?wait_replicas=1&wait_timeout_ms=250]

(`rediss+cluster://` for TLS). The nodes listed are where the client starts: one reachable node is enough, it learns
the others, and every change of primary, from the cluster. `wait_replicas` is how many replicas must confirm a write
before the tier acknowledges it (redis_cluster: WAIT; default 1); 0 acknowledges what a primary answered, which a
failover may lose. `wait_timeout_ms` is how long a write waits for them (default 250). A cluster has one database:
no /N. Checked here, with a form of any URL fit for logs (`shown_url`: no password).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

NODE_SCHEMES = ("redis", "rediss", "unix")  # redis-py's own: one server
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
DEFAULT_WAIT_REPLICAS = 1  # a write is acknowledged once one replica holds it: a failover then keeps it
DEFAULT_WAIT_TIMEOUT_MS = 250  # replicas of a 64-block batch (~19 MB) confirm in a few ms on a LAN
_SECRET = re.compile(r"(://[^:/@?#]*:)[^@/?#]+@|((?:^|[?&])password=)[^&#]*")


@dataclass(frozen=True, slots=True)
class ClusterUrl:
    """What a redis+cluster:// URL says (parse_cluster_url)."""

    nodes: tuple[tuple[str, int], ...]  # (host, port) of the nodes the client starts from
    username: str | None  # Redis ACL user; None: the default user
    password: str | None = field(default=None, repr=False)  # never in a log line
    tls: bool = False  # rediss+cluster://
    wait_replicas: int = DEFAULT_WAIT_REPLICAS  # replicas that must confirm a write; 0: the primary's answer is enough
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS  # how long a write waits for them


def scheme_of(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def is_cluster_url(url: str) -> bool:
    return scheme_of(url) in CLUSTER_SCHEMES


def shown_url(url: str) -> str:
    """The URL with any password replaced by ***, for logs and error messages."""
    return _SECRET.sub(lambda m: (m.group(1) or m.group(2)) + ("***@" if m.group(1) else "***"), url)


def check_redis_url(url: str) -> None:
    """ValueError, naming the URL (without its password), unless it is one of the forms in the module docstring."""
    scheme = scheme_of(url)
    if scheme in CLUSTER_SCHEMES:
        parse_cluster_url(url)
    elif scheme not in NODE_SCHEMES:
        raise ValueError(f"redis url {shown_url(url)!r} has scheme {scheme or 'none'!r}: use redis://, rediss:// or "
                         "unix:// for one server, redis+cluster://host:port[,host:port...] (rediss+cluster:// for "
                         "TLS) for a Redis Cluster")


def parse_cluster_url(url: str) -> ClusterUrl:
    """The cluster a redis+cluster:// URL names; ValueError, with what to write instead, for anything else."""
    shown = shown_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"redis url {shown!r} is not a cluster URL (redis+cluster:// or rediss+cluster://)")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")  # as redis-py reads one server's: user[:password]
        username, password = unquote(user) or None, (unquote(secret) or None if colon else None)
    nodes = tuple(_node(node.strip(), shown) for node in hosts.split(",") if node.strip())
    if not nodes:
        raise ValueError(f"redis url {shown!r} names no node: give at least one, e.g. "
                         "redis+cluster://10.0.0.1:6379,10.0.0.2:6379")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"redis url {shown!r}: a Redis Cluster has one database (0); drop {parts.path!r}")
    options = {"wait_replicas": DEFAULT_WAIT_REPLICAS, "wait_timeout_ms": DEFAULT_WAIT_TIMEOUT_MS}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in options:
            raise ValueError(f"redis url {shown!r}: unknown option {name!r}; a cluster URL takes "
                             f"{' and '.join(options)}")
        least = 0 if name == "wait_replicas" else 1  # WAIT with a timeout of 0 would wait for ever
        if not value.isdigit() or int(value) < least:
            raise ValueError(f"redis url {shown!r}: {name} must be an integer >= {least}, got {value!r}")
        options[name] = int(value)
    return ClusterUrl(nodes, username, password, parts.scheme.lower() == "rediss+cluster", **options)


def _node(node: str, shown: str) -> tuple[str, int]:
    if node.startswith("["):  # [IPv6]:port
        host, _, rest = node[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (rest or None)
    else:
        host, colon, port = node.rpartition(":")
        if not colon:
            host, port = node, None
    if port is None:
        return host, DEFAULT_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis url {shown!r}: node {node!r} is not host:port with a port in 1..65535")
    return host, int(port)
