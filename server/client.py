"""KVBridgeClient: the Python end of kvbridge.v1. Ingest text, upload source KV, look up, and fetch caches —
projected on the server, or source KV projected here with the same adapter — as KVSegments or as transformers
caches ready for the target's `generate`. (One class, one method per RPC with its retries and transport; the
channels it dials, one server or replicas behind one name, are server/channel.py's; what it hands back lives in
server/replies.py.)

Replicas: give several addresses ("ip:port,ip:port" or a list) or "dns:///name:port", and gRPC balances the calls
over the replicas that report SERVING, sending a call again to another when its replica dies under it
(server/channel.py); they must share a tier (Redis, or the cluster tier), else an entry ingested through one is
NOT_FOUND on the others. A same-host fetch and its segment's release go to one replica the client picks.

Same host: with transport="shared_memory" (or "auto" on a loopback address) a fetch asks the server to put the KV
in a shared-memory file; the client maps it (no copy), checks its size and checksum, and tells the server it is
done. When it cannot open the file (another host, another OS user) it tells the server to drop it and streams.

Every try of a call has a deadline (timeout_s); calls that fail with UNAVAILABLE are tried again, `retries` times at
most, after a backoff from backoff_s doubling up to MAX_BACKOFF_S (a stream only while none of its messages has
arrived; to replicas, the channel's retry policy retries a call and the client fetches a stream cut later again, from
another replica); Delete, whose effect a lost answer may hide, is never tried again. Errors come back as
KVBridgeError with the status code and the server's sentence.

    with KVBridgeClient("127.0.0.1:50051", token=...) as client:
        entry = client.ingest("some long document ...").entries[0]
        cache, target_ids = client.projected_cache(target, key=entry.key)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch
from kvbridge.proto import pb2
from kvbridge.server.channel import (
    MAX_BACKOFF_S,
    NOT_RETRIED,
    RECONNECT_BACKOFF_S,
    Channels,
    Endpoint,
    parse_target,
    resolve_transport,
)
from kvbridge.server.chunks import (
    CHUNK_FRAMING,
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_METADATA,
    dtype_name,
    int64_tensor,
    iter_chunks,
    plan_chunks,
)
from kvbridge.server.config import MAX_MESSAGE_BYTES
from kvbridge.server.fetch_reply import FetchReply
from kvbridge.server.replies import (
    Entry,
    FetchedCache,
    IngestReply,
    KVBridgeError,
    LookupReply,
    SharedSegment,
    entry_of,
)
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.tensor_blob import ST_DTYPES

log = logging.getLogger(__name__)

__all__ = ["KVBridgeClient", "KVBridgeError", "FetchedCache", "Entry", "IngestReply", "LookupReply", "SharedSegment"]


def _read(value: bytes | str | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class KVBridgeClient:
    def __init__(self, address: str | Sequence[str], token: str | None = None,
                 tls_root_cert: bytes | str | Path | None = None, tls: bool | None = None, timeout_s: float = 60.0,
                 retries: int = 4, backoff_s: float = 0.1, max_message_mb: float = 8,
                 tls_server_name: str | None = None, transport: str = "stream", max_fetch_gb: float = 16):
        """address: "host:port" (or "unix:PATH") of one server; replicas as "ip:port,ip:port", a list of them, or
        "dns:///name:port" (server/channel.py).
        tls_root_cert: PEM of the CA (or self-signed cert) to trust; tls=True with none uses the system roots.
        transport: how fetches ask for KV by default: "stream", "shared_memory" (same host), or "auto" (shared
        memory when every address is a loopback one).
        max_message_mb: the largest message sent or received; every call tells the server (metadata
        MAX_MESSAGE_METADATA), which cuts a fetch's KV into messages that fit it.
        max_fetch_gb: the most a fetched cache may take in this process; a reply whose header announces more is
        refused (RESOURCE_EXHAUSTED, the stream cancelled) before anything is allocated."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 0 < max_message_mb * (1 << 20) <= MAX_MESSAGE_BYTES:  # gRPC's limits are C ints
            raise ValueError(f"max_message_mb must be > 0 and under 2048, got {max_message_mb}")
        if not max_fetch_gb > 0:
            raise ValueError(f"max_fetch_gb must be > 0, got {max_fetch_gb}")
        self.max_fetch_bytes = int(max_fetch_gb * (1 << 30))
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {retries} and {backoff_s}")
        self.target = parse_target(address)
        self.transport = resolve_transport(transport, self.target)
        self.address = self.target.uri
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        limit = self._message_limit = int(max_message_mb * (1 << 20))
        # a channel whose server went away tries to reconnect after gRPC's backoff, which grows to 120 s: a server
        # back on its port would then refuse every call of this client's retries (1.5 s by default) for seconds to
        # minutes. Kept under the retries' own longest wait, a reconnect comes within them
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF_S * 1000))]
        # (not min_reconnect_backoff_ms: gRPC takes it for the least time a connection attempt is given too, 20 s by
        # default; at 100 ms a server slow to answer its first frames was never reached)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        creds = (grpc.ssl_channel_credentials(root_certificates=_read(tls_root_cert))
                 if tls or tls_root_cert is not None else None)
        self._channels = Channels(self.target, options, creds, retries, backoff_s)
        declared = ((MAX_MESSAGE_METADATA, str(limit)),)  # the server's fetches send no larger message
        self._metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + declared
        self._releases: set[grpc.Future] = set()  # ReleaseSegment calls on their way (see _release_later)
        self._kept: dict[str, tuple[Endpoint, float]] = {}  # keep_shared segment name -> (its replica, expiry)
        self._releases_lock = threading.Lock()  # guards both (fetch threads and releases run at once)

    def close(self) -> None:
        """Wait for the ReleaseSegment calls still on their way (at most timeout_s in all), then close the channel."""
        deadline = time.monotonic() + self.timeout_s
        with self._releases_lock:
            pending = list(self._releases)
        for future in pending:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass  # logged by its callback; the server's sweeper removes the file after its TTL
        self._channels.close()

    def __enter__(self) -> "KVBridgeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ plumbing

    def _sleep(self, attempt: int) -> None:
        time.sleep(min(self.backoff_s * (2 ** attempt), max(self.backoff_s, MAX_BACKOFF_S)))

    def _retried_by_channel(self, endpoint: Endpoint) -> bool:
        """Whether the channel's retry policy already retried a call that failed before its first answer (the
        replicas' balanced channel): the client then does not try it again."""
        return endpoint is self._channels.main and self.target.balanced

    def _unary(self, method: str, request, timeout_s: float | None = None, endpoint: Endpoint | None = None):
        endpoint = endpoint or self._channels.main
        call = getattr(endpoint.stub, method)
        tries = 1 if self._retried_by_channel(endpoint) or method in NOT_RETRIED else self.retries + 1
        for attempt in range(tries):
            try:
                return call(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < tries:
                    self._sleep(attempt)
                    continue
                raise KVBridgeError(exc.code(), exc.details() or "", method) from None

    def _fetch(self, method: str, request, timeout_s: float | None, transport: str | None,
               keep_shared: bool = False) -> FetchedCache:
        """The fetch by the transport asked for; through shared memory, by stream when the segment cannot be read.
        Same-host fetches are pinned: to replicas, each try goes through one replica's own channel (in turn), so
        that the segment's release reaches the replica that made it."""
        wanted = self.transport if transport is None else resolve_transport(transport, self.target)
        if wanted == "shared_memory":
            request.transport = pb2.SHARED_MEMORY
            fetched = self._fetch_once(method, request, timeout_s, self._channels.pinned(), keep_shared)
            if fetched is not None:
                return fetched
        request.transport = pb2.STREAM
        return self._fetch_once(method, request, timeout_s, [self._channels.main])

    def release_segment(self, shared: SharedSegment) -> None:
        """Tell the server a segment kept by a keep_shared fetch was read (it removes the file); not waited for."""
        with self._releases_lock:
            endpoint, _ = self._kept.pop(shared.name, (self._channels.main, 0.0))
        self._release_later(pb2.ReleaseSegmentRequest(name=shared.name, read=True), shared.ttl_s, endpoint)

    def _keep(self, name: str, endpoint: Endpoint, ttl_s: float) -> None:
        """Remember which replica holds a kept segment (for release_segment), forgetting the expired ones (their
        servers removed them)."""
        if endpoint is self._channels.main:
            return
        now = time.monotonic()
        with self._releases_lock:
            for old in [k for k, (_, expires) in self._kept.items() if expires < now]:
                del self._kept[old]
            self._kept[name] = (endpoint, now + ttl_s)

    def _opened(self, reply: FetchReply, timeout_s: float | None, endpoint: Endpoint, keep: bool = False
                ) -> torch.Tensor | SharedSegment | None:
        """The reply's shared segment opened (FetchReply.open_shared), or None when it cannot be here; the server is
        told either way (through the replica that made it), so it removes the file now. keep: a SharedSegment left
        to another reader, not released."""
        s = reply.header.shared
        try:
            opened = reply.open_shared(keep)
        except OSError as exc:
            log.info("%s: shared-memory segment not readable here (%s); fetching by stream", reply.method, exc)
            opened = None
        if isinstance(opened, SharedSegment):
            self._keep(s.name, endpoint, s.ttl_s)
        elif opened is not None:
            self._release_later(pb2.ReleaseSegmentRequest(name=s.name, read=True), s.ttl_s, endpoint)
        else:
            try:
                self._unary("ReleaseSegment", pb2.ReleaseSegmentRequest(name=s.name, read=False), timeout_s, endpoint)
            except KVBridgeError as exc:  # the server's sweeper removes it after its TTL
                log.warning("ReleaseSegment failed (%s); the server removes the segment after %g s", exc, s.ttl_s)
        return opened

    def _release_later(self, request: pb2.ReleaseSegmentRequest, ttl_s: float, endpoint: Endpoint) -> None:
        """ReleaseSegment of a segment already mapped (the map outlives the file's removal), without waiting for the
        answer: a fetch never queues behind the server's other unary calls (in the 64-client load test the same-host
        fetch's p50 was ~10x the stream's, this wait the likely cause). close() waits for the calls still on their
        way; a failed one is logged and the server's sweeper removes the file after its TTL."""
        future = endpoint.stub.ReleaseSegment.future(request, timeout=self.timeout_s, metadata=self._metadata)
        with self._releases_lock:
            self._releases.add(future)

        def done(f: grpc.Future) -> None:
            with self._releases_lock:
                self._releases.discard(f)
            if not f.cancelled() and f.exception() is not None:
                log.warning("ReleaseSegment failed (%s); the server removes the segment after %g s", f.exception(),
                            ttl_s)

        future.add_done_callback(done)

    def _fetch_once(self, method: str, request, timeout_s: float | None, endpoints: list[Endpoint],
                    keep_shared: bool = False) -> FetchedCache | None:
        """One fetch, its tries through `endpoints` in turn; None when the server named a shared segment this client
        cannot read. A replica that answers UNAVAILABLE (down) sends the try on to the next one at once: a try waits
        and counts as one of `retries` only once every replica has failed it."""
        attempt, failed = 0, 0
        for turn in itertools.count():
            endpoint = endpoints[turn % len(endpoints)]
            reply = FetchReply(method, max_bytes=self.max_fetch_bytes)
            try:
                reply.read(endpoint.downloads[method](request, timeout=timeout_s or self.timeout_s,
                                                      metadata=self._metadata))
                if not reply.shared:
                    return reply.cache()
                opened = self._opened(reply, timeout_s, endpoint, keep_shared)
                return reply.cache(opened) if opened is not None else None
            except grpc.RpcError as exc:
                # before its first message: unless the channel retried it already; after: only to replicas (the KV
                # is read-only; another replica serves it from the shared tier), the whole fetch again
                again = not self._retried_by_channel(endpoint) if reply.received == 0 else self.target.balanced
                if exc.code() == grpc.StatusCode.UNAVAILABLE and again:
                    failed += 1
                    if failed < len(endpoints):  # a replica this try has not been to yet
                        continue
                    if attempt < self.retries:
                        self._sleep(attempt)
                        attempt, failed = attempt + 1, 0
                        continue
                raise KVBridgeError(exc.code(), exc.details() or "", method) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ calls

    def ingest(self, text: str | None = None, token_ids=None, session_id: str = "", model: str = "",
               ttl_s: float | None = None, pin: bool = False, detect_segments: bool = False,
               timeout_s: float | None = None) -> IngestReply:
        request = pb2.IngestRequest(session_id=session_id, model=model,
                                    options=pb2.StoreOptions(ttl_s=ttl_s or 0, pin=pin),
                                    mode=pb2.IngestRequest.DETECT_SEGMENTS if detect_segments else
                                    pb2.IngestRequest.STORE_WHOLE)
        _set_input(request, text, token_ids)
        reply = self._unary("Ingest", request, timeout_s)
        return IngestReply(entries=[entry_of(e) for e in reply.entries],
                           source_token_ids=int64_tensor(reply.source_token_ids),
                           model=reply.model)

    def put_source_kv(self, segment: KVSegment, kind: str = "prefix", ttl_s: float | None = None, pin: bool = False,
                      session_id: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      timeout_s: float | None = None) -> Entry:
        """Upload source KV computed here; the server stores it only once every chunk has arrived."""
        return self.put_kv(segment.kv, segment.token_ids.tolist(), segment.positions.tolist(), segment.model.name,
                           segment.model.config_hash, segment.rotated, kind, ttl_s, pin, session_id, chunk_bytes,
                           timeout_s)

    def put_kv(self, kv: torch.Tensor, token_ids: list[int], positions: list[int] | None = None, model: str = "",
               config_hash: str = "", rotated: bool = True, kind: str = "prefix", ttl_s: float | None = None,
               pin: bool = False, session_id: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               timeout_s: float | None = None) -> Entry:
        """put_source_kv from parts: kv [L, 2, H, T, D] of `model` ("": the server's source model; config_hash "":
        not checked, the server checks the shapes) at positions (None: 0..T-1)."""
        kv = kv.detach().cpu()
        # what the stream's messages would refuse, refused here by name (an error raised while gRPC iterates the
        # requests comes back as UNKNOWN "Exception iterating requests!")
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [L, 2, H, T, D], got shape {tuple(kv.shape)}")
        if kv.dtype not in ST_DTYPES:
            raise ValueError(f"kv must be one of {sorted(map(dtype_name, ST_DTYPES))}, got {dtype_name(kv.dtype)}")
        if kv.shape[3] != len(token_ids):
            raise ValueError(f"kv holds {kv.shape[3]} tokens and token_ids {len(token_ids)}")
        # a chunk's message fits the largest message this client sends (max_message_mb), as a fetch's do
        chunk_bytes = min(chunk_bytes, self._message_limit - CHUNK_FRAMING)
        plan_chunks(kv.shape[0], kv.shape[3], 2 * kv.shape[2] * kv.shape[4] * kv.element_size(), chunk_bytes)
        if not model:  # the server's source model, as it names it (the upload names its model)
            sources = [m.name for m in self.list_models() if "source" in m.role.split(",")]
            if not sources:
                raise ValueError("model: the server serves no source model; name the model whose KV this is")
            model = sources[0]
        header = pb2.KVHeader(model=pb2.ModelRef(name=model, config_hash=config_hash), dtype=dtype_name(kv.dtype),
                              num_layers=kv.shape[0], num_kv_heads=kv.shape[2], head_dim=kv.shape[4],
                              token_ids=[int(t) for t in token_ids],
                              positions=list(range(len(token_ids))) if positions is None else positions,
                              rotated=rotated, kind=kind, session_id=session_id,
                              options=pb2.StoreOptions(ttl_s=ttl_s or 0, pin=pin))

        def messages():
            yield pb2.PutSourceKVRequest(header=header)
            for r, blob in iter_chunks(kv, chunk_bytes):
                yield pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                               token_start=r.token_start, token_end=r.token_end,
                                                               data=blob))

        for attempt in range(self.retries + 1):
            try:
                reply = self._channels.main.stub.PutSourceKV(messages(), timeout=timeout_s or self.timeout_s,
                                                             metadata=self._metadata)
                return entry_of(reply.entry)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < self.retries:
                    # nothing was committed: the upload starts over (to replicas too: past gRPC's retry buffer of
                    # 256 KiB the channel no longer retries it)
                    self._sleep(attempt)
                    continue
                raise KVBridgeError(exc.code(), exc.details() or "", "PutSourceKV") from None
        raise AssertionError("unreachable")

    def lookup(self, text: str | None = None, token_ids=None, model: str = "", kind: str = "prefix",
               timeout_s: float | None = None) -> LookupReply:
        request = pb2.LookupRequest(model=model, kind=kind)
        _set_input(request, text, token_ids)
        r = self._unary("Lookup", request, timeout_s)
        return LookupReply(key=r.key or None, num_tokens=r.num_tokens, query_tokens=r.query_tokens,
                           tier=r.tier or None)

    def fetch_projected(self, text: str | None = None, key: str | None = None, target_model: str = "",
                        adapter: str = "", offset: int = 0, dtype: str = "", require_cached: bool = False,
                        chunk_bytes: int = 0, timeout_s: float | None = None,
                        transport: str | None = None, mode: str = "", prompt=None,
                        keep_shared: bool = False) -> FetchedCache:
        """The server projects the source entry (by key, or by text: ingested if missing) into target_model, and
        serves it corrected as `mode` says: "replace", "recompute:R", "blend:R"; "" for the server's default.
        transport: None for the client's default, else "stream", "shared_memory" or "auto".
        prompt: the target prompt's token ids, when the document does not begin it (a chat template or an
        instruction before it): the cache then holds the target's own KV of the tokens before the document, then
        the document at its positions in the prompt (not with offset), up to where the prompt stops holding it (it
        ends, or goes on otherwise: an edited text), so every cached token is the prompt's; prefill the rest.
        keep_shared: a same-host segment is left for another process to read (`FetchedCache.shared`; the caller
        releases it with release_segment), not mapped here."""
        request = pb2.GetProjectedCacheRequest(target_model=target_model, adapter=adapter, offset=offset,
                                               dtype=dtype, require_cached=require_cached, chunk_bytes=chunk_bytes,
                                               mode=mode)
        if prompt is not None:
            request.prompt.SetInParent()  # present even when empty (the server refuses an empty prompt by name)
            request.prompt.ids.extend(int(t) for t in prompt)
        _set_key_or_text(request, key, text)
        return self._fetch("GetProjectedCache", request, timeout_s, transport, keep_shared)

    def fetch_source(self, text: str | None = None, key: str | None = None, dtype: str = "",
                     require_cached: bool = False, chunk_bytes: int = 0, timeout_s: float | None = None,
                     transport: str | None = None) -> FetchedCache:
        request = pb2.GetSourceCacheRequest(dtype=dtype, require_cached=require_cached, chunk_bytes=chunk_bytes)
        _set_key_or_text(request, key, text)
        return self._fetch("GetSourceCache", request, timeout_s, transport)

    def projected_cache(self, target, text: str | None = None, key: str | None = None, adapter: str = "",
                        **fetch_kwargs):
        """(DynamicCache for `target` (a LoadedModel), target token ids [T]) projected on the server: continue
        with `target.model.generate(input_ids=cat(target_ids, prompt), cache=cache, ...)`, where `prompt` holds at
        least one token (generate reads the cache for input_ids[:-n] only when n new tokens follow it: with none, it
        feeds the cache's last token again at a new position and answers otherwise; `kvcache.generate` refuses it)."""
        fetched = self.fetch_projected(text=text, key=key, target_model=target.name, adapter=adapter,
                                       **fetch_kwargs)
        _check_model(fetched.segment.model, target.spec.identity)
        return fetched.to_cache(target), fetched.segment.token_ids

    def fetch_projected_locally(self, source, target, adapter, text: str | None = None, key: str | None = None,
                                offset: int = 0, require_cached: bool = False,
                                timeout_s: float | None = None) -> FetchedCache:
        """Fetch the source KV (fewer bytes on the wire) and project it here with `adapter`. `source` needs the
        source model's tokenizer, spec and rope (a LoadedModel); `target` likewise for the target."""
        from kvbridge.adapters.adapter import project
        from kvbridge.adapters.pairs import pair_segment, pair_text

        fetched = self.fetch_source(text=text, key=key, require_cached=require_cached, timeout_s=timeout_s)
        _check_model(fetched.segment.model, source.spec.identity)
        known = text or fetched.text
        if not known:
            raise ValueError("the server did not send this entry's text (too long, or unknown): pass text=")
        # as the server pairs it: a segment entry (a piece of a text) without special tokens or a start token
        pairing = pair_segment if fetched.entry_kind == "segment" else pair_text
        paired = pairing(known, source.tokenizer, target.tokenizer)
        if not torch.equal(paired.source_ids, fetched.segment.token_ids):
            raise ValueError("the fetched entry's token ids are not the source tokenization of the text")
        projected = project(adapter, fetched.segment, paired.alignment, paired.target_ids, source.rope, target.rope,
                            offset=offset, dtype=getattr(torch, target.spec.dtype))
        return FetchedCache(segment=projected, entry_key="", source_key=fetched.entry_key,
                            adapter=f"{adapter.name}@{adapter.meta.version} (local)", text=known,
                            exact_coverage=paired.alignment.exact_coverage, wire_bytes=fetched.wire_bytes,
                            num_chunks=fetched.num_chunks, adapter_digest=adapter.digest)

    def list_models(self) -> list[pb2.ModelInfo]:
        return list(self._unary("ListModels", pb2.ListModelsRequest()).models)

    def list_adapters(self) -> list[pb2.AdapterInfo]:
        return list(self._unary("ListAdapters", pb2.ListAdaptersRequest()).adapters)

    def load_adapter(self, name: str, make_default: bool = False) -> pb2.AdapterInfo:
        return self._unary("LoadAdapter", pb2.LoadAdapterRequest(name=name, make_default=make_default))

    def delete(self, key: str) -> int:
        return self._unary("Delete", pb2.DeleteRequest(key=key)).deleted

    def stats(self) -> pb2.StatsResponse:
        return self._unary("Stats", pb2.StatsRequest())


def _set_input(request, text, token_ids) -> None:
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text and token_ids")
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(int(i) for i in torch.as_tensor(token_ids).reshape(-1).tolist())


def _set_key_or_text(request, key, text) -> None:
    if (key is None) == (text is None):
        raise ValueError("give exactly one of key and text")
    if key is not None:
        request.key = key
    else:
        request.text = text


def _check_model(got: ModelIdentity, expected: ModelIdentity) -> None:
    if got != expected:
        raise ValueError(f"the server sent KV of {got.key}, this model is {expected.key}")
