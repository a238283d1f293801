"""The gRPC servicer: converts kvbridge.v1 messages to library calls on KVBridgeService and back, maps errors to
status codes, streams KV in bounded chunks, and counts requests, latencies and bytes."""

from __future__ import annotations

import json
import logging
import urllib.parse

import grpc
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.admission import IdleWatchdog, StreamSlots, TooManyStreams
from kvbridge.server.auth import Authenticator
from kvbridge.server.chunk_wire import chunk_message, first_messages, fit_header
from kvbridge.server.chunks import (
    CHUNK_FRAMING,
    ChunkAssembler,
    ChunkError,
    MessageTooLarge,
    declared_limit,
    dtype_name,
    encode_parts,
    int64_tensor,
    plan_chunks,
    wire_dtype,
)
from kvbridge.server.config import is_loopback
from kvbridge.server.errors import FailedPrecondition
from kvbridge.server.gather_buffers import GatherBuffers
from kvbridge.server.metrics import Metrics
from kvbridge.server.request_limits import clip_details
from kvbridge.server.service import CacheResult, KVBridgeService, SourceUpload
from kvbridge.server.shm_layout import LAYOUT
from kvbridge.server.shm_segments import SegmentRegistry, SegmentsFull
from kvbridge.server.undo import undone_on_failure
from kvbridge.server.wire_cache import StreamOut, WireCache
from kvbridge.transfer import timeline
from kvbridge.transfer.errors import CapacityError, NotFound
from kvbridge.transfer.store import QuotaExceeded

log = logging.getLogger(__name__)

MAX_HEADER_TEXT_CHARS = 200_000  # the text rides in the first message only when it is this short


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and sentence a library exception becomes on the wire."""
    if isinstance(exc, (NotFound, FileNotFoundError)):
        return grpc.StatusCode.NOT_FOUND, str(exc) or "not found"
    if isinstance(exc, QuotaExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"over quota: {exc}"
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"the store is full: {exc}"
    if isinstance(exc, (TooManyStreams, MessageTooLarge)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, (ValueError, ChunkError, OverflowError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"


def _entry(info, start: int, model: str) -> pb2.Entry:
    return pb2.Entry(key=info.key, kind=info.kind, num_tokens=info.num_tokens, start=start,
                     new_blocks=info.new_blocks, tier=info.tier, model=model)


class KVBridgeServicer(pb2_grpc.KVBridgeServicer):
    def __init__(self, service: KVBridgeService, auth: Authenticator, metrics: Metrics,
                 uploads: StreamSlots | None = None, watchdog: IdleWatchdog | None = None,
                 segments: SegmentRegistry | None = None, buffers: GatherBuffers | None = None,
                 wire: WireCache | None = None):
        self.service = service
        self.auth = auth
        self.metrics = metrics
        self.uploads = uploads or StreamSlots(per_tenant=4, total=4)  # open PutSourceKV calls
        self.watchdog = watchdog or IdleWatchdog(idle_s=60.0)  # streams that move nothing are cancelled
        self.segments = segments  # same-host fetches' shared-memory files; None: every fetch streams
        self.buffers = buffers  # reused buffers streamed fetches gather into; None: a new tensor each
        self.wire = wire  # recent streamed fetches' messages, sent again to the next fetch of the same KV; None: off

    # ------------------------------------------------------------------------------------------ plumbing

    def _tenant(self, context) -> str:
        tenant = self.auth.tenant(context.invocation_metadata())
        if tenant is None:  # the interceptor refuses these first; kept so no path runs without a tenant
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        return tenant

    def _failure(self, outcome: dict, method: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        code, message = status_of(exc)
        message = clip_details(message)
        outcome["code"] = code.name
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        else:
            log.info("%s -> %s: %s", method, code.name, message)
        return code, message

    def _unary(self, method: str, context, body):
        """Run body(tenant); library errors become a status (context.abort is called outside the try: it raises)."""
        with self.metrics.observe(method) as outcome:
            tenant = self._tenant(context)
            try:
                return body(tenant)
            except Exception as exc:
                code, message = self._failure(outcome, method, exc)
            context.abort(code, message)

    # ------------------------------------------------------------------------------------------ unary RPCs

    def Ingest(self, request, context):
        def body(tenant):
            which = request.WhichOneof("input")
            if which is None:
                raise ValueError("give text or token_ids")
            opts = request.options
            result = self.service.ingest(
                tenant, text=request.text if which == "text" else None,
                token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
                model=request.model, session_id=request.session_id,
                detect_segments=request.mode == pb2.IngestRequest.DETECT_SEGMENTS,
                ttl_s=opts.ttl_s if opts.ttl_s else None, pin=opts.pin)
            return pb2.IngestResponse(entries=[_entry(info, start, result.model) for info, start in result.entries],
                                      source_token_ids=result.source_ids.tolist(), model=result.model)
        return self._unary("Ingest", context, body)

    def Lookup(self, request, context):
        def body(tenant):
            which = request.WhichOneof("input")
            if which is None:
                raise ValueError("give text or token_ids")
            found, n = self.service.lookup(tenant, text=request.text if which == "text" else None,
                                           token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
                                           model=request.model, kind=request.kind or "prefix")
            return pb2.LookupResponse(key=found.key or "", num_tokens=found.num_tokens, query_tokens=n,
                                      tier=found.tier or "")
        return self._unary("Lookup", context, body)

    def ListModels(self, request, context):
        return self._unary("ListModels", context, lambda tenant: pb2.ListModelsResponse(
            models=[pb2.ModelInfo(**m) for m in self.service.describe_models()]))

    def ListAdapters(self, request, context):
        return self._unary("ListAdapters", context, lambda tenant: pb2.ListAdaptersResponse(
            adapters=[_adapter_info(a) for a in self.service.adapters.available(tenant)]))

    def LoadAdapter(self, request, context):
        return self._unary("LoadAdapter", context, lambda tenant: _adapter_info(
            self.service.adapters.load(request.name, make_default=request.make_default, tenant=tenant)))

    def Delete(self, request, context):
        return self._unary("Delete", context,
                           lambda tenant: pb2.DeleteResponse(deleted=self.service.delete(tenant, request.key)))

    def ReleaseSegment(self, request, context):
        return self._unary("ReleaseSegment", context, lambda tenant: pb2.ReleaseSegmentResponse(
            removed=self.segments is not None and self.segments.release(tenant, request.name)))

    def Stats(self, request, context):
        def body(tenant):
            # Only what this tenant holds, and the store's fixed capacity: store-wide use, hit and eviction counts
            # move with other tenants' activity (operators read those on /metrics).
            usage = self.service.store.tenant_usage(tenant)
            capacity = self.service.store.capacity()
            tiers = [pb2.TierStats(tier=t, bytes_used=usage.bytes_used.get(t, 0), bytes_capacity=capacity.get(t, 0),
                                   up=True) for t in ("device", "cpu")]
            redis_up = self.service.store.redis_up()
            if redis_up is not None:
                tiers.append(pb2.TierStats(tier="redis", bytes_used=usage.bytes_used.get("redis", 0), up=redis_up))
            return pb2.StatsResponse(tenant_entries=usage.entries, tenant_tokens=usage.tokens, tiers=tiers,
                                     device=str(self.service.store.device))
        return self._unary("Stats", context, body)

    # ------------------------------------------------------------------------------------------ upload

    def PutSourceKV(self, request_iterator, context):
        method = "PutSourceKV"
        with self.metrics.observe(method) as outcome:
            tenant = self._tenant(context)
            watched = None
            try:
                with self.uploads.hold(tenant):
                    with self.watchdog.watch(context.cancel) as watched:  # the stream's messages, not the store's work
                        upload, kv = self._receive(method, request_iterator, watched)
                    if not context.is_active():  # cancelled, or past its deadline, after its last chunk: grpc ends
                        raise ConnectionAbortedError("the client left")  # the iterator as if it half-closed
                    info, start = self.service.put_source(tenant, upload, kv)
                return pb2.PutSourceKVResponse(entry=_entry(info, start, upload.model))
            except Exception as exc:
                if isinstance(exc, grpc.RpcError) or not context.is_active() or (watched and watched.expired):
                    # the client went away mid-upload (grpc may end its iterator like a normal half-close), or the
                    # watchdog ended an idle one (its iterator too may end before the context reads as inactive):
                    # one line, and an abort (a returned None would be serialised)
                    outcome["code"] = "CANCELLED"
                    why = (f"no message for {self.watchdog.idle_s:g} s, cancelled" if watched and watched.expired
                           else "stream broken by the client")
                    log.info("%s: %s; nothing stored", method, why)
                    failure = grpc.StatusCode.CANCELLED, f"upload {why}; nothing stored"
                else:
                    failure = self._failure(outcome, method, exc)
            context.abort(*failure)

    def _receive(self, method: str, request_iterator, watched) -> tuple[SourceUpload, torch.Tensor]:
        """Header, then chunks into one preallocated tensor; complete or ValueError."""
        upload, assembler = None, None
        for message in request_iterator:
            watched.touch()
            part = message.WhichOneof("part")
            if part == "header":
                if upload is not None:
                    raise ValueError("header: sent twice (exactly one header, first)")
                upload = _upload_of(message.header)
                self.service.check_upload(upload)  # refuse a bad header before any KV arrives
                assembler = ChunkAssembler(upload.num_layers, upload.num_kv_heads, upload.token_ids.numel(),
                                           upload.head_dim, upload.dtype,
                                           max_bytes=self.service.limits.max_upload_bytes)
            elif part == "chunk":
                if assembler is None:
                    raise ValueError("chunk: received before the header (send the header first)")
                c = message.chunk
                assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
                self.metrics.bytes_streamed.labels(method, "in").inc(len(c.data))
            else:
                raise ValueError("a PutSourceKV message must hold a header or a chunk")
        if upload is None:
            raise ValueError("header: the stream ended without a header")
        if not assembler.complete:
            raise ValueError(f"the stream ended before all KV arrived: {assembler.missing()}")
        return upload, assembler.kv

    # ------------------------------------------------------------------------------------------ downloads

    def GetProjectedCache(self, request, context):
        def fetch(tenant, out) -> CacheResult:
            which = request.WhichOneof("input")
            if which is None:
                raise ValueError("give key or text")
            key, text = (request.key if which == "key" else None), (request.text if which == "text" else None)
            if request.HasField("prompt"):
                if request.offset:
                    raise ValueError("give offset or prompt, not both (a prompt places the document itself)")
                return self.service.prompt_cache(
                    tenant, list(request.prompt.ids), key=key, text=text, target_model=request.target_model,
                    adapter=request.adapter, require_cached=request.require_cached, out=out, mode=request.mode)
            return self.service.projected_cache(
                tenant, key=key, text=text, target_model=request.target_model, adapter=request.adapter,
                offset=request.offset, require_cached=request.require_cached, out=out, mode=request.mode)
        yield from self._stream("GetProjectedCache", context, fetch, request.dtype, request.chunk_bytes,
                                request.transport)

    def GetSourceCache(self, request, context):
        def fetch(tenant, out) -> CacheResult:
            which = request.WhichOneof("input")
            if which is None:
                raise ValueError("give key or text")
            return self.service.source_cache(tenant, key=request.key if which == "key" else None,
                                             text=request.text if which == "text" else None,
                                             require_cached=request.require_cached)
        yield from self._stream("GetSourceCache", context, fetch, request.dtype, request.chunk_bytes,
                                request.transport)

    def _stream(self, method: str, context, fetch, dtype: str, chunk_bytes: int, transport: int):
        with self.metrics.observe(method) as outcome:
            tenant = self._tenant(context)
            pending = lent = None  # a same-host segment, or a lent buffer, the fetch may gather its KV into
            resent = False  # the messages of an earlier fetch of this KV go out again
            try:
                out_dtype = wire_dtype(dtype, "dtype") if dtype else None
                limit = self.service.message_limit(declared_limit(context.invocation_metadata()))
                size = self.service.chunk_bytes(chunk_bytes, limit)  # chunks the client receives
                if transport == pb2.SHARED_MEMORY and self.segments is not None and is_local_peer(context.peer()):
                    pending = self.segments.reserve(tenant, out_dtype)
                else:  # streamed: gathered into a reused buffer (lent until the last chunk), or sent as before
                    pending = lent = StreamOut(self.wire, self.buffers.lend(out_dtype) if self.buffers else None,
                                               tenant, out_dtype, size)
                timeline.event("server_begin")
                # what the fetch stored is removed again when its reply is refused here (server/undo)
                with undone_on_failure(self.service.store):
                    result = fetch(tenant, pending)
                    seg = result.segment
                    # sent before: seg.kv is a meta tensor (a reuse whose entry went before its touch projected again:
                    # real KV, whatever messages the reuse found are not this fetch's)
                    resent = lent is not None and lent.messages is not None and seg.kv.is_meta
                    if resent:
                        kv = seg.kv
                    else:
                        kv = seg.kv.to(device="cpu", dtype=out_dtype or seg.dtype)  # [L, 2, H, T, D]
                    n_layers, _, h, t, d = kv.shape
                    per_token = 2 * h * d * kv.element_size()  # one token of one layer
                    if per_token + CHUNK_FRAMING > limit.bytes:
                        raise MessageTooLarge(f"one token of one layer of this KV is {per_token} bytes: no chunk of it "
                                              f"fits in the message limit of {limit}")
                    ranges = plan_chunks(n_layers, t, per_token, size)
                    header = pb2.CacheHeader(
                        model=pb2.ModelRef(name=seg.model.name, config_hash=seg.model.config_hash),
                        dtype=dtype_name(kv.dtype), num_layers=n_layers, num_kv_heads=h, head_dim=d,
                        token_ids=seg.token_ids.tolist(), positions=seg.positions.tolist(), rotated=seg.rotated,
                        entry_key=result.entry_key, source_key=result.source_key, adapter=result.adapter,
                        num_chunks=len(ranges), total_bytes=kv.numel() * kv.element_size(),
                        text=result.text if result.text and len(result.text) <= MAX_HEADER_TEXT_CHARS else "",
                        exact_coverage=result.exact_coverage, mode=result.mode,
                        recomputed_positions=[int(seg.positions[0]) + p for p in result.recomputed],
                        adapter_digest=result.adapter_digest,
                        document_cut=result.document_cut, entry_kind=result.entry_kind,
                        document_position=None if result.document_index is None
                        else int(seg.positions[0]) + result.document_index)
                    fit_header(header, limit, per_token)  # a first message holds it (without the text if need be)
                failure = None
            except Exception as exc:
                failure = self._failure(outcome, method, exc)
                if pending is not None:
                    pending.discard()
            if failure is not None:
                context.abort(*failure)
            if pending is not None and lent is None:
                if not context.is_active():  # the client left while the server fetched: no segment for nobody
                    pending.discard()
                    outcome["code"] = "CANCELLED"
                    return
                shared = self._publish(method, pending, kv)
                if shared is not None:  # one message, no KV in it: the client reads the file and releases it
                    header.shared.CopyFrom(shared)
                    header.num_chunks = 0
                    timeline.event("server_end")
                    self.metrics.bytes_streamed.labels(method, "shm").inc(shared.size)
                    outcome["code"] = "CANCELLED"  # until the header is out: a client that leaves closes this
                    try:
                        yield pb2.CacheChunk(header=header)
                    except GeneratorExit:  # nobody will read or release the segment: removed now, not at its TTL
                        self.segments.release(tenant, shared.name)
                        raise
                    outcome["code"] = "OK"
                    return
            outcome["code"] = "CANCELLED"  # until the last chunk is out: a client that leaves closes this generator
            sent = 0
            before = lent.messages if resent else None  # the messages of an earlier fetch of this KV
            if before is not None and len(before) != len(ranges):
                raise AssertionError(f"{len(before)} kept messages for {len(ranges)} chunks")
            messages = []  # this fetch's chunks as planned (kept for the next fetch of this KV), without the header
            with self.watchdog.watch(context.cancel) as watched:  # a client that stops reading is cut off
                try:
                    for i, r in enumerate(ranges):
                        if not context.is_active():
                            break
                        if before is not None:
                            message = before[i]
                        else:
                            head, data = encode_parts(kv, r)
                            message = chunk_message(r, head, data)
                            messages.append(message)
                        # the first chunk rides with the header: cut when both exceed the limit (num_chunks says so)
                        for part in first_messages(header, message, r, per_token, limit) if i == 0 else (message,):
                            self.metrics.bytes_streamed.labels(method, "out").inc(len(part))
                            yield part
                            sent += 1
                            watched.touch()
                except GeneratorExit:  # grpc closes the generator of a call that ended (cancelled, client gone)
                    pass
                finally:
                    if lent is not None:
                        lent.discard()
            if sent == header.num_chunks:
                outcome["code"] = "OK"
                if lent is not None:
                    lent.keep(messages)
            else:
                log.info("%s: %s after %d of %d chunks", method, f"no chunk taken for {self.watchdog.idle_s:g} s, "
                         "cancelled" if watched.expired else "client left", sent, header.num_chunks)


    def _publish(self, method: str, pending, kv: torch.Tensor) -> pb2.SharedSegment | None:
        """kv [L, 2, H, T, D] in the fetch's shared-memory segment (already there when the store gathered into it);
        None (the fetch streams) when the segments are full or the file cannot be written."""
        try:
            segment = pending.publish(kv)
        except (SegmentsFull, OSError) as exc:
            log.info("%s: streaming instead of shared memory: %s", method, exc)
            return None
        return pb2.SharedSegment(name=segment.name, path=str(segment.path), size=segment.size,
                                 checksum=segment.checksum, layout=LAYOUT, ttl_s=self.segments.ttl_s,
                                 headroom_tokens=self.segments.headroom)


def is_local_peer(peer: str) -> bool:
    """Whether a call comes from this host (grpc's peer string: a loopback address or a unix socket): only such a
    client can open a shared-memory segment, so no other is given one (a remote one could only fill /dev/shm)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")  # grpc writes ipv6:%5B::1%5D:PORT
    if kind == "unix":
        return True
    host = rest.rpartition(":")[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    host = host.split("%")[0].lower().removeprefix("::ffff:")  # no zone; an IPv4-mapped address as IPv4
    return is_loopback(host) if host else False


def _upload_of(h: pb2.KVHeader) -> SourceUpload:
    if not h.HasField("model") or not h.model.name:
        raise ValueError("header.model.name is empty")
    return SourceUpload(model=h.model.name, config_hash=h.model.config_hash,
                        dtype=wire_dtype(h.dtype, "header.dtype"), num_layers=h.num_layers,
                        num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
                        token_ids=int64_tensor(h.token_ids),
                        positions=int64_tensor(h.positions) if len(h.positions) else None,
                        rotated=h.rotated, kind=h.kind or "prefix",
                        ttl_s=h.options.ttl_s if h.options.ttl_s else None, pin=h.options.pin)


def _adapter_info(a) -> pb2.AdapterInfo:
    return pb2.AdapterInfo(name=a.name, source_model=a.source_model, target_model=a.target_model, version=a.version,
                           layer_map=a.layer_map, loaded=a.loaded, is_default=a.is_default,
                           metrics_json=json.dumps(a.metrics, default=float, sort_keys=True))
