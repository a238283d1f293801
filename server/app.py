"""Putting a server together: models, store, adapters and service from a ServeConfig; the gRPC server with auth,
health, reflection and metrics; graceful shutdown. `kvbridge serve` calls `serve`; tests call `start_server`
with port 0 and talk to it over loopback."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.shipped import find_shipped
from kvbridge.proto import pb2
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.admission import IdleWatchdog, StreamSlots
from kvbridge.server.auth import Authenticator, AuthInterceptor, read_token_file
from kvbridge.server.config import ServeConfig, is_loopback, split_address
from kvbridge.server.corrections import CorrectionLimits, Corrections
from kvbridge.server.fair_pool import FairPool, FairStreams
from kvbridge.server.gather_buffers import GatherBuffers
from kvbridge.server.metrics import Metrics
from kvbridge.server.request_limits import check_message, clip_details
from kvbridge.server.service import KVBridgeService, ServiceLimits
from kvbridge.server.servicer import KVBridgeServicer
from kvbridge.server.shm_segments import SegmentRegistry
from kvbridge.server.wire_cache import WireCache
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.models import LoadedModel, kvbridge_home
from kvbridge.transfer.store import PagedStore, StoreConfig, read_secret_file
from kvbridge.transfer.store.config import default_capacity
from kvbridge.transfer.tensor_files import write_text

log = logging.getLogger(__name__)

SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["KVBridge"].full_name  # "kvbridge.v1.KVBridge"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(verbose: bool, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("kvbridge.server").setLevel(logging.INFO)


def selfcheck_models(models: list[LoadedModel]) -> None:
    """The foundation's self-checks on each distinct model; RuntimeError (refuse to serve) if any fails."""
    from kvbridge.transfer.selfcheck import run_selfcheck

    seen = set()
    for lm in models:
        if lm.name in seen:
            continue
        seen.add(lm.name)
        t0 = time.perf_counter()
        results = run_selfcheck(lm)
        failed = [r for r in results if not r.passed]
        for r in results:
            log.info("selfcheck %s", r.line())
        if failed:
            raise RuntimeError(f"self-checks failed on {lm.name!r}, refusing to serve: "
                               + "; ".join(r.line() for r in failed))
        log.info("selfcheck %s: %d passed in %.1f s", lm.name, len(results), time.perf_counter() - t0)


def store_config(config: ServeConfig) -> StoreConfig:
    mb = 1 << 20
    capacity = int(config.store_capacity_mb * mb) if config.store_capacity_mb else None
    if capacity is None:  # sized here as the store would size itself (half the free memory): its quarter is the quota
        capacity = default_capacity(resolve_device(config.store_device), StoreConfig.capacity_fraction)
    pinned = config.tenant_max_pinned_mb
    if pinned is None:
        pinned = capacity / 4 / mb  # one tenant pins at most a quarter of the pool
    secret = None
    if config.redis_url and config.redis_secret_file:
        secret = read_secret_file(config.redis_secret_file)
        log.info("redis tier %s: values signed and checked with the secret in %s", config.redis_url,
                 config.redis_secret_file)
    return StoreConfig(capacity_bytes=capacity, block_size=config.block_size,
                       cpu_capacity_bytes=int(config.cpu_tier_mb * mb), redis_url=config.redis_url,
                       redis_secret=secret, redis_insecure=config.redis_insecure,
                       default_ttl_s=config.default_ttl_s, device=config.store_device,
                       share_entries=config.share_entries, tenant_max_entries=config.tenant_max_entries,
                       tenant_max_pinned_bytes=int(pinned * mb) if pinned is not None else None)


def adapter_folder(config: ServeConfig) -> Path:
    return Path(config.adapters).expanduser() if config.adapters else kvbridge_home() / "adapters"


def fit_default_adapter(source: LoadedModel, target: LoadedModel, folder: Path) -> Path:
    """A ridge adapter with train-adapter's defaults, written to the folder (about a minute on the small pair)."""
    from kvbridge.adapters.io import save_adapter
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.transfer.data import data_path

    t0 = time.perf_counter()
    adapter, _ = train_adapter(source, target, [str(data_path("pydoc_corpus_sample.txt"))], TrainConfig(),
                               progress=True)
    path = save_adapter(adapter, folder / f"{source.name}--{target.name}--proportional.safetensors")
    log.info("fitted adapter %s in %.1f s", path.name, time.perf_counter() - t0)
    return path


def build_service(config: ServeConfig, source: LoadedModel | None = None,
                  targets: list[LoadedModel] | None = None, store: PagedStore | None = None) -> KVBridgeService:
    """Load the preset's models (unless given), self-check them, and wire store, adapters and service."""
    if source is None or targets is None:
        from kvbridge.transfer.presets import load_pair

        t0 = time.perf_counter()
        src, tgt = load_pair(config.preset, config.source, config.target, dtype=config.dtype, device=config.device,
                             source_weights=config.source_weights)
        source, targets = source or src, targets or [tgt]
        log.info("loaded %s -> %s in %.1f s", source.name, targets[0].name, time.perf_counter() - t0)
    for lm in (source, *targets):
        log.info("model %s: %s on %s, attention %s (projected KV and the wire use the target's dtype)", lm.name,
                 lm.spec.dtype, lm.device, lm.model.config._attn_implementation)
    if config.selfcheck:  # a source without weights has no forward to check: what it receives is checked instead
        selfcheck_models([lm for lm in (source, *targets) if lm.has_weights])
    store = store or PagedStore(store_config(config))
    folder = adapter_folder(config)
    registry = AdapterRegistry(folder, source.spec, [t.spec for t in targets], device=targets[0].device)
    loaded = registry.autoload(config.default_adapter)
    if config.fit_adapter:
        for target in targets:
            if registry.default_for(target.spec) is None:
                if not source.has_weights:
                    raise ValueError(f"fit_adapter needs the source model's weights to read a corpus, and "
                                     f"{source.name} is loaded without them (source_weights = false)")
                fit_default_adapter(source, target, folder)
        loaded = registry.autoload(config.default_adapter)
    for target in targets:  # a pair with no adapter in the folder takes the one shipped with kvbridge, if any
        shipped = find_shipped(source.spec, target.spec) if registry.default_for(target.spec) is None else None
        if shipped is not None:
            loaded.append(registry.add(shipped.stem, load_adapter(shipped), make_default=True).name)
            log.info("adapter for %s -> %s: the shipped %s", source.name, target.name, shipped.name)
    if not loaded:
        log.warning("no adapter for %s -> %s in %s: projected fetches fail until one is loaded "
                    "(train-adapter, then LoadAdapter; or start with --fit-adapter)", source.name,
                    [t.name for t in targets], folder)
    for lm in (source, *targets):  # a chunk holds at least one token of one layer (K and V): else every fetch fails
        row = 2 * lm.spec.num_kv_heads * lm.spec.head_dim * torch.finfo(getattr(torch, lm.spec.dtype)).bits // 8
        if config.chunk_kb * 1024 < row:
            raise ValueError(f"chunk_kb {config.chunk_kb}: one token of one layer of {lm.name!r} takes {row} bytes")
    limits = ServiceLimits(chunk_bytes=config.chunk_kb * 1024,
                           max_chunk_bytes=max(config.chunk_kb * 1024, config.max_message_bytes - 65536),
                           max_message_bytes=config.max_message_bytes,
                           max_projections=config.max_projections)
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    layers = tuple(config.detector_layers) if config.detector_layers is not None else None
    if layers is not None and max(layers, default=0) >= source.spec.num_layers:  # else every detecting Ingest fails
        raise ValueError(f"detector_layers {list(layers)}: the source {source.name!r} has layers "
                         f"0..{source.spec.num_layers - 1}")
    detector = SuffixDetector(DetectorConfig.strict(layers=layers) if config.detector_strict
                              else DetectorConfig(layers=layers))
    corrections = Corrections(CorrectionLimits(default=config.correction, max_running=config.max_corrections,
                                               prior=config.correction_prior,
                                               prior_file=config.correction_prior_file or ""))
    corrections.check_prior_file(list(targets))
    if config.selfcheck:  # with the start-up checks: no user's first corrected fetch pays for first runs
        for target in targets:
            log.info("corrections warmed on %s in %.1f s (prior: %s)", target.name, corrections.warm(target),
                     getattr(corrections.prior(target), "origin", None))
    return KVBridgeService(source, targets, store, registry, limits, detector=detector, corrections=corrections)


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    address: str  # host:port the clients use
    service: KVBridgeService
    metrics: Metrics
    metrics_port: int | None
    health: health.HealthServicer
    pools: dict[str, futures.ThreadPoolExecutor | FairPool]  # the thread budgets: health, unary, stream, other
    watchdog: IdleWatchdog
    segments: SegmentRegistry | None  # same-host fetches' shared-memory files; None: off
    wire: WireCache | None = None  # recent streamed fetches' messages, for the next fetch of the same KV

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking calls; in-flight calls and streams get grace_s to finish; shared-memory segments go."""
        self.health.enter_graceful_shutdown()
        _shut(self.server, grace_s, self.watchdog, self.segments, self.pools, self.metrics)


def _shut(server: grpc.Server, grace_s: float, watchdog: IdleWatchdog, segments: SegmentRegistry | None,
          pools: dict[str, futures.ThreadPoolExecutor | FairPool], metrics: Metrics) -> None:
    """Stop the server (in-flight calls get grace_s) and everything it started: nothing of it is left behind."""
    server.stop(grace_s).wait()
    watchdog.stop()
    if segments is not None:
        segments.close()
    for pool in pools.values():
        pool.shutdown(wait=False)
    metrics.close()


class _Undecodable:
    """What a request that is no valid protobuf message deserializes to (grpc would answer INTERNAL)."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize):
    def run(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError, invalid UTF-8 in a string field, ...
            return _Undecodable(exc)
    return run


def _refusing(behavior, request_streaming: bool, max_text_chars: int, counted=None):
    """The servicer method, refusing undecodable requests, strings over their length limit and unknown enum values
    with INVALID_ARGUMENT before the servicer sees them (`counted()`: the refusal counted in the metrics; a stream's
    refusal raises inside the servicer, which counts it)."""
    message = "the request is not a valid kvbridge.v1 message ({})"

    if request_streaming:
        def run(request_iterator, context):
            def checked():
                for request in request_iterator:
                    if isinstance(request, _Undecodable):
                        raise ValueError(message.format(request.error))
                    check_message(request, max_text_chars)
                    yield request
            return behavior(checked(), context)
        return run

    def run(request, context):
        if isinstance(request, _Undecodable):
            refused = clip_details(message.format(request.error))
        else:
            try:
                check_message(request, max_text_chars)
                refused = None
            except ValueError as exc:
                refused = clip_details(str(exc))
        if refused is not None:
            if counted is not None:
                counted()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        return behavior(request, context)
    return run


def _on(pool: futures.ThreadPoolExecutor | FairPool, behavior):
    """The behavior, run on this pool instead of the server's default one (grpc's per-method thread pool); on a
    FairPool, its lane of no tenant until FairStreams points the call at its caller's."""
    def run(*args):
        return behavior(*args)
    run.experimental_thread_pool = pool.lane("") if isinstance(pool, FairPool) else pool
    return run


def kvbridge_handler(servicer: KVBridgeServicer, max_text_chars: int,
                     pools: dict[str, futures.ThreadPoolExecutor | FairPool] | None = None,
                     metrics: Metrics | None = None) -> grpc.GenericRpcHandler:
    """The generated stubs' method handlers, with deserializers that let the servicer refuse bad bytes; unary
    methods on pools["unary"], streamed ones on pools["stream"] (when given); refusals before the servicer counted
    in `metrics` as the servicer counts its own."""
    handlers = {}
    for method in pb2.DESCRIPTOR.services_by_name["KVBridge"].methods:
        request_type = getattr(pb2, method.input_type.name)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming,
                                                                       method.server_streaming)]
        counted = None if metrics is None else metrics.requests.labels(method.name, "INVALID_ARGUMENT").inc
        behavior = _refusing(getattr(servicer, method.name), method.client_streaming, max_text_chars, counted)
        if pools is not None:
            streamed = method.client_streaming or method.server_streaming
            behavior = _on(pools["stream" if streamed else "unary"], behavior)
        handlers[method.name] = kind(behavior, request_deserializer=_tolerant(request_type.FromString),
                                     response_serializer=_serialized)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _serialized(message) -> bytes:
    """A response's wire bytes: a message serialised, or bytes a servicer serialised itself (the KV chunks, whose
    data is joined in once: chunk_wire.chunk_message)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def health_handler(servicer: health.HealthServicer, pool: futures.ThreadPoolExecutor) -> grpc.GenericRpcHandler:
    """grpc.health.v1 with Check on its own threads (never queued behind kvbridge calls); Watch, a stream that lasts
    as long as the client wants, stays on the server's default pool."""
    request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(_on(pool, servicer.Check), request_deserializer=request.FromString,
                                                     response_serializer=response.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(servicer.Watch, request_deserializer=request.FromString,
                                                      response_serializer=response.SerializeToString)}
    return grpc.method_handlers_generic_handler(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, handlers)


def reflection_handler(names, pool: futures.ThreadPoolExecutor) -> grpc.GenericRpcHandler:
    """Server reflection (grpc.reflection.v1alpha) on threads of its own: a reflection stream holds its thread as
    long as the client keeps it open, and on the server's default pool a few idle ones (no token needed) would stop
    health Watch calls from starting (a balanced client then never sees the replica SERVING) and refusals."""
    info = reflection.ReflectionServicer(names).ServerReflectionInfo
    handler = grpc.stream_stream_rpc_method_handler(
        _on(pool, info), request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": handler})


def start_server(service: KVBridgeService, config: ServeConfig, tokens: dict[str, str] | None = None
                 ) -> RunningServer:
    """Bind and start (non-blocking). Tokens: given, or read from config.token_file, else an open server."""
    if tokens is None and config.token_file:
        tokens = read_token_file(config.token_file)
    host, port = split_address(config.listen, "listen")
    if tokens is None:
        if not is_loopback(host) and not config.allow_remote_without_tokens:
            raise ValueError(f"refusing to listen on {config.listen} without a token file")
        log.warning("no token file: the server is open (every caller is tenant 'default') on %s", config.listen)
    auth = Authenticator(tokens)
    metrics = Metrics(service.store, service)
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]
    # Thread budgets: streams (whose length a client can stretch) never hold a thread that unary calls or health
    # checks need; "stream" shares its threads fairly between tenants (server/fair_pool.py). "reflection": its
    # streams, which anyone may open and hold (health and reflection need no token).
    # "other": the start of a health Watch (it holds no thread after) and refusals of calls without a valid token.
    pools = {"health": futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-health"),
             "unary": futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="kvbridge-unary"),
             "stream": FairPool(config.stream_workers, config.stream_threads_for(len(set(tokens.values()))
                                                                                 if tokens else 1)),
             "reflection": futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-reflection"),
             "other": futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvbridge-rpc")}
    metrics.watch_streams(pools["stream"])
    server = grpc.server(pools["other"], options=options,
                         interceptors=[AuthInterceptor(auth, metrics), FairStreams(pools["stream"], auth.tenant)])
    watchdog = IdleWatchdog(config.stream_idle_s)
    segments = None
    if config.shm_dir:
        try:
            segments = SegmentRegistry(config.shm_dir, ttl_s=config.shm_ttl_s,
                                       max_bytes=int(config.shm_max_mb * (1 << 20)), keep_s=config.shm_keep_s,
                                       headroom=config.shm_headroom_tokens)
        except OSError as exc:
            log.warning("no same-host data plane (fetches stream): cannot make a folder in %s (%s)",
                        config.shm_dir, exc)
    try:
        bound, metrics_port, servicer, health_servicer = _bind_and_start(
            config, service, auth, metrics, server, pools, watchdog, segments)
    except BaseException:  # a port in use, a missing TLS key, ...: nothing of this server is left behind
        _shut(server, 0, watchdog, segments, pools, metrics)
        raise
    address = f"{host if ':' not in host else f'[{host}]'}:{bound}"
    log.info("serving kvbridge.v1 on %s (%s, %s)%s", address, "TLS" if config.tls_cert else "plaintext",
             "tokens" if tokens else "open", f"; metrics on :{metrics_port}/metrics" if metrics_port else "")
    return RunningServer(server=server, port=bound, address=address, service=service, metrics=metrics,
                         metrics_port=metrics_port, health=health_servicer, pools=pools, watchdog=watchdog,
                         segments=segments, wire=servicer.wire)


def serve(config: ServeConfig, ready_file: str | None = None) -> int:
    """Build, start, and block until SIGINT/SIGTERM; then drain and stop."""
    service = build_service(config)
    running = start_server(service, config)
    print(f"kvbridge serving on {running.address}" +
          (f", metrics on port {running.metrics_port}" if running.metrics_port else ""), flush=True)
    if ready_file:
        # written beside it, then renamed (tensor_files.write_text): a watcher that sees the file sees all of it
        write_text(ready_file, json.dumps({"address": running.address, "port": running.port,
                                           "metrics_port": running.metrics_port}))
    done = threading.Event()

    def on_signal(signum, frame):
        log.warning("signal %d: draining (up to %.0f s)", signum, config.grace_s)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Python runs a handler in the main thread, but the kernel may deliver the signal to any thread (grpc's, torch's):
    # then nothing wakes a plain done.wait(). Waking every half second lets the main thread run the handler.
    while not done.wait(0.5):
        pass
    running.stop(config.grace_s)
    print("kvbridge server stopped", flush=True)
    return 0


def _bind_and_start(config: ServeConfig, service, auth, metrics, server, pools, watchdog, segments):
    """Register the services on `server`, bind it, start it and its helpers: (port, metrics port, servicer, health
    servicer). Raises where the port cannot be bound (grpcio raises; 0 from an older one is raised here)."""
    servicer = KVBridgeServicer(service, auth, metrics,
                                uploads=StreamSlots(per_tenant=config.uploads_per_tenant, total=config.max_uploads),
                                watchdog=watchdog, segments=segments, buffers=GatherBuffers(),
                                wire=WireCache(int(config.stream_keep_mb * (1 << 20)), config.stream_keep_s)
                                if config.stream_keep_mb else None)
    server.add_generic_rpc_handlers((kvbridge_handler(servicer, service.limits.max_text_chars, pools, metrics),))
    health_servicer = health.HealthServicer()
    server.add_generic_rpc_handlers((health_handler(health_servicer, pools["health"]),))
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    server.add_generic_rpc_handlers((reflection_handler(names, pools["reflection"]),))
    if config.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
        bound = server.add_secure_port(config.listen, creds)
    else:
        bound = server.add_insecure_port(config.listen)
    if bound == 0:
        raise OSError(f"could not bind {config.listen}")
    server.start()
    watchdog.start()
    if segments is not None:
        segments.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_port = None
    if config.metrics_listen:
        m_host, m_port = split_address(config.metrics_listen, "metrics_listen")
        metrics_port = metrics.serve_http(m_host, m_port)
    return bound, metrics_port, servicer, health_servicer
