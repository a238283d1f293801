"""ServeConfig: everything `kvbridge serve` needs, from a TOML file and/or flags (flags win). Frozen once built.

TOML keys are the field names below, at top level, e.g.

    preset = "small"
    listen = "127.0.0.1:50051"
    adapters = "~/.cache/kvbridge/adapters"
    store_capacity_mb = 2048
    redis_url = "redis://127.0.0.1:6379/0"  # or a cluster: "redis+cluster://10.0.0.1:6379,10.0.0.2:6379"
    redis_secret_file = "/etc/kvbridge/redis-secret"
    token_file = "/etc/kvbridge/tokens"

A Redis tier needs the secret its replicas share, in a file (`redis_secret_file`, or the file named by the
KVBRIDGE_REDIS_SECRET_FILE environment variable when neither the TOML nor a flag gives one; never the secret itself on
a command line): at least 32 bytes once whitespace is trimmed, not open to other users (mode 600 or 640). Without one
the server refuses to start, unless `redis_insecure` says that whoever can write to that Redis is trusted.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvbridge.server.chunks import MIN_CHUNK_BYTES
from kvbridge.server.fair_pool import default_per_tenant
from kvbridge.transfer.devices import DTYPE_NAMES
from kvbridge.transfer.store.config import check_ttl

SECRET_FILE_ENV = "KVBRIDGE_REDIS_SECRET_FILE"  # names the secret file when the TOML and the flags do not
MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's message limits are C ints


@dataclass(frozen=True)
class ServeConfig:
    preset: str = "small"  # tiny | small | production
    source: str | None = None  # production preset: source model folder / cached repo id
    target: str | None = None  # production preset: target model folder / cached repo id
    # False: the source model is loaded without its weights (tokenizer, shapes and RoPE only): its KV comes from
    # PutSourceKV or a vLLM engine that saves it (kv_role kv_producer), and Ingest by text is refused
    source_weights: bool = True
    device: str = "auto"  # where the models run and adapters project
    dtype: str = "auto"  # bfloat16 on CUDA, float32 elsewhere
    adapters: str | None = None  # adapter folder; None: KVBRIDGE_HOME/adapters
    default_adapter: str | None = None  # adapter name to load at start; None: the newest matching file
    fit_adapter: bool = False  # fit a ridge adapter at start when the folder has none for the pair (about a minute)
    store_device: str = "auto"
    store_capacity_mb: float | None = None  # device pool; None: half the free memory
    cpu_tier_mb: float = 0  # 0: no CPU tier under the device pool
    block_size: int = 16
    redis_url: str | None = None  # one server, or redis+cluster://host:port[,host:port...] (store/redis_url.py)
    redis_secret_file: str | None = None  # the replicas' shared secret (see the module docstring); never logged
    redis_insecure: bool = False  # a Redis tier without a secret: anyone who can write to it can plant KV
    share_entries: bool = True  # with redis_url: entries (records and blocks) written through, so replicas find them
    default_ttl_s: float | None = None  # entry TTL when a request gives none
    listen: str = "127.0.0.1:50051"  # host:port; port 0 picks a free one
    allow_remote_without_tokens: bool = False  # an open (token-less) server listens on loopback only, unless set
    tls_cert: str | None = None  # PEM certificate chain; with tls_key the server speaks TLS only
    tls_key: str | None = None
    token_file: str | None = None  # `tenant token` lines; None: open server (loopback only)
    max_message_mb: float = 8  # largest gRPC message either way
    chunk_kb: int = 1024  # default KV chunk size on the wire
    workers: int = 8  # threads for unary calls (Ingest, Lookup, Stats, ...); health checks have 2 of their own
    stream_workers: int = 8  # threads for streamed calls (uploads and fetches): streams never take a unary thread
    # stream threads one tenant may hold at once, its further streamed calls waiting (0: all of them with one tenant,
    # else all but a quarter, so one tenant's unread fetches never hold every thread; server/fair_pool.py)
    stream_threads_per_tenant: int = 0
    uploads_per_tenant: int = 2  # open PutSourceKV calls a tenant may hold; more are refused (RESOURCE_EXHAUSTED)
    stream_idle_s: float = 60.0  # a stream that moves no message for this long is cancelled
    max_projections: int = 2  # projections running at once (each holds the adapter's device for its length)
    # a projected fetch that names no mode gets this correction (server/corrections.py): blend:0.1 recovers 0.90 of
    # the NLL gap on held-out pydoc pages against replace's 0.74 (docs/eval-blend), and costs one target pass over
    # 10% of the document once per entry
    correction: str = "blend:0.1"
    max_corrections: int = 1  # corrections computed at once (each runs the target over a document); more wait
    correction_prior: bool = True  # corrections recompute with the target's induction prior
    # a prior fitted for the adapter served (`kvbridge prior fit --adapter FILE`), for the target it names; None: the
    # one that ships for each target (a correction of an adapter it was not fitted for says so in the log)
    correction_prior_file: str | None = None
    tenant_max_entries: int | None = 100_000  # entries one tenant may hold; None: no quota
    tenant_max_pinned_mb: float | None = None  # pinned KV one tenant may hold; None: a quarter of the device pool
    shm_dir: str | None = "/dev/shm"  # same-host fetches' KV goes through a private folder made here; None: off
    shm_ttl_s: float = 30.0  # a shared-memory segment the client never releases is removed after this long
    shm_max_mb: float = 4096  # live segments hold at most this much; past it, fetches go by stream
    shm_keep_s: float = 30.0  # a finished segment is kept this long after its last fetch, for the next; 0: never
    shm_headroom_tokens: int = 64  # token slots after each row of a segment's KV: the client's next tokens go there
    stream_keep_mb: float = 256  # recent streamed fetches' messages kept for the next fetch of the same KV; 0: off
    stream_keep_s: float = 30.0  # ... this long after their last use
    metrics_listen: str | None = None  # host:port of the Prometheus /metrics endpoint; None: off
    detector_layers: list[int] | None = None  # layers of Ingest's segment detector; None: every layer
    detector_strict: bool = False  # 5 positions below 0.75 nats instead of 3 below 0.8
    selfcheck: bool = True  # the foundation self-checks at start (refuse to serve on failure), then warm corrections
    grace_s: float = 10.0  # shutdown: how long in-flight calls and streams may take to finish
    log_json: bool = False  # one JSON object per log line

    def __post_init__(self):
        self._check_types()
        from kvbridge.transfer.presets import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.correction_prior_file and not self.correction_prior:
            raise ValueError("correction_prior_file names a prior for corrections, and correction_prior is off: "
                             "give one or the other")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        for name in ("max_message_mb", "chunk_kb", "workers", "stream_workers", "uploads_per_tenant", "stream_idle_s",
                     "max_projections", "max_corrections", "block_size", "grace_s", "shm_ttl_s", "shm_max_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("shm_keep_s", "shm_headroom_tokens", "stream_keep_mb", "stream_keep_s", "cpu_tier_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # None: the default (sized at start, no TTL, no quota); a value the store would refuse only after the models
        # load is refused here, by its field's name
        if self.store_capacity_mb is not None and not self.store_capacity_mb > 0:
            raise ValueError(f"store_capacity_mb must be > 0, got {self.store_capacity_mb}")
        check_ttl("default_ttl_s", self.default_ttl_s)
        for name in ("tenant_max_entries", "tenant_max_pinned_mb"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_message_bytes > MAX_MESSAGE_BYTES:  # gRPC takes the limit as a C int
            raise ValueError(f"max_message_mb must be under 2048 (gRPC's limit, 2**31 - 1 bytes), got "
                             f"{self.max_message_mb}")
        if self.detector_layers is not None and any(layer < 0 for layer in self.detector_layers):
            raise ValueError(f"detector_layers must be layer indices (>= 0), got {self.detector_layers}")
        if self.stream_workers < 2:
            raise ValueError(f"stream_workers must be >= 2 (uploads may hold half of them), got {self.stream_workers}")
        if not 0 <= self.stream_threads_per_tenant <= self.stream_workers:
            raise ValueError(f"stream_threads_per_tenant must be 0 (automatic) or 1 to stream_workers "
                             f"({self.stream_workers}), got {self.stream_threads_per_tenant}")
        if 0 < self.stream_threads_per_tenant <= self.uploads_open_per_tenant:
            raise ValueError(f"stream_threads_per_tenant {self.stream_threads_per_tenant} leaves a tenant's fetches no "
                             f"thread while it holds its {self.uploads_open_per_tenant} uploads open: give more than "
                             "that, or fewer uploads_per_tenant")
        if self.chunk_kb * 1024 < MIN_CHUNK_BYTES:  # what a request may ask for; the default is one too
            raise ValueError(f"chunk_kb must be >= {MIN_CHUNK_BYTES // 1024}, got {self.chunk_kb}")
        if self.chunk_kb * 1024 + 65536 > self.max_message_mb * (1 << 20):
            raise ValueError(f"chunk_kb {self.chunk_kb} does not fit in max_message_mb {self.max_message_mb} "
                             "(leave 64 KB for the header)")
        host, _ = split_address(self.listen, "listen")
        if self.token_file is None and not is_loopback(host) and not self.allow_remote_without_tokens:
            raise ValueError(f"listen {self.listen!r} is not a loopback address and there is no token_file: an open "
                             "server would let anyone read and write caches. Give a token_file, listen on 127.0.0.1, "
                             "or set allow_remote_without_tokens")
        if self.metrics_listen is not None:
            split_address(self.metrics_listen, "metrics_listen")
        if self.redis_url is not None:
            from kvbridge.transfer.store.redis_url import check_redis_url

            check_redis_url(self.redis_url)  # a mistyped URL stops the server here, before any model loads
        self._check_redis_secret()
        from kvbridge.transfer.suffix.correction import Correction

        Correction.parse(self.correction, "correction")

    def _check_types(self) -> None:
        """Each value of the kind its field declares (a TOML file can give any): a float where a count goes (chunk_kb
        1024.0) would fail every fetch later, a bool is no number."""
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str, os.PathLike),
                 "list[int]": (list,)}
        for f in dataclasses.fields(self):
            declared = str(f.type).replace(" ", "").split("|")
            value = getattr(self, f.name)
            if value is None and "None" in declared:
                continue
            allowed = tuple(t for d in declared for t in kinds.get(d, (object,)))
            wrong = not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
            if not wrong and f.type == "list[int] | None":
                wrong = not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            if wrong:
                raise ValueError(f"{f.name} must be {' or '.join(declared)}, got {value!r} "
                                 f"({type(value).__name__})")

    def _check_redis_secret(self) -> None:
        from kvbridge.transfer.store.redis_auth import read_secret_file

        if self.redis_url is None:
            if self.redis_secret_file is not None or self.redis_insecure:
                raise ValueError("redis_secret_file and redis_insecure apply to a Redis tier, and redis_url is not set")
        elif self.redis_secret_file is not None:
            if self.redis_insecure:
                raise ValueError("redis_secret_file and redis_insecure contradict each other: give one")
            read_secret_file(self.redis_secret_file)  # a bad file stops the server here, before any model loads
        elif not self.redis_insecure:
            raise ValueError(f"redis_url is set and there is no redis_secret_file (nor {SECRET_FILE_ENV}): whoever "
                             "can write to that Redis could plant KV and entry records for any tenant. Give the file "
                             "holding the secret the replicas share (at least 32 bytes, mode 600), or set "
                             "redis_insecure to accept that")

    @property
    def max_uploads(self) -> int:
        """Open uploads over all tenants: half the stream threads, so fetches always have threads left."""
        return max(1, self.stream_workers // 2)

    def stream_threads_for(self, tenants: int) -> int:
        """Stream threads one tenant may hold on a server that `tenants` tenants can call."""
        return self.stream_threads_per_tenant or default_per_tenant(self.stream_workers, tenants,
                                                                    self.uploads_open_per_tenant)

    @property
    def uploads_open_per_tenant(self) -> int:
        """Uploads one tenant can hold open: its own limit, within the server's."""
        return min(self.uploads_per_tenant, self.max_uploads)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * (1 << 20))

    @classmethod
    def load(cls, toml_path: str | Path | None = None, **overrides) -> "ServeConfig":
        """Defaults, then the TOML file, then overrides that are not None."""
        values: dict = {}
        if toml_path is not None:
            data = tomllib.loads(Path(toml_path).read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"{toml_path}: unknown keys {unknown}; known: {sorted(known)}")
            values.update(data)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values.get("redis_url") and values.get("redis_secret_file") is None and not values.get("redis_insecure") \
                and os.environ.get(SECRET_FILE_ENV):  # the file's name when neither the TOML nor a flag gives one
            values["redis_secret_file"] = os.environ[SECRET_FILE_ENV]
        return cls(**values)


def split_address(address: str, field: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{field} must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
