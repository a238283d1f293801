"""A fetch's reply as the client reads it (GetProjectedCache, GetSourceCache): one header, then the KV in chunks — or
no chunk and a same-host shared-memory segment named in the header, opened here — made into a FetchedCache.

No retries, no channels, no release of a segment: the client (server/client.py) does those around these.
"""

from __future__ import annotations

import logging
import os

import grpc
import torch
from kvbridge.proto import pb2
from kvbridge.server import shm_layout
from kvbridge.server.chunk_wire import ChunkView, WireError, read_chunk_message
from kvbridge.server.chunks import ChunkAssembler, ChunkError, int64_tensor, wire_dtype
from kvbridge.server.replies import FetchedCache, KVBridgeError, SharedSegment
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity

log = logging.getLogger(__name__)
HEADROOM_TOKENS = 64  # slots a streamed fetch leaves after each row of its KV, for the cache's next tokens
# bytes one fetch may make the client allocate unless told otherwise: a 70B-class model's bf16 KV of 32k tokens
# (80 layers x 8 KV heads x 128) is 10 GiB; a header claiming more is refused before anything is allocated
DEFAULT_MAX_BYTES = 16 << 30


class FetchReply:
    """One try's messages, read as they come: `received` counts them (a try cut after its first message is retried
    differently from one cut before).

    The header is checked before anything is allocated: a dtype and dimensions the client reads, one position per
    token id, its total_bytes its shape's, the model `model` names (a ListModels entry) when given, and at most
    `max_bytes` to allocate. Every chunk must land inside the header's [L, 2, H, T, D] and all of them fill it once,
    in the header's num_chunks messages. An error raised while the stream runs cancels the call first."""

    def __init__(self, method: str, max_bytes: int = DEFAULT_MAX_BYTES, model: pb2.ModelInfo | None = None):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.method = method
        self.max_bytes = max_bytes
        self.model = model  # the model the KV must be of; None: any
        self.header = None  # pb2.CacheHeader, once it came
        self.assembler: ChunkAssembler | None = None  # None with a shared segment: no chunk follows the header
        self.received = 0  # messages
        self.wire = 0  # KV bytes in chunks

    @property
    def shared(self) -> bool:
        return self.header is not None and self.header.HasField("shared")

    def read(self, stream) -> None:
        """Every message of the stream; KVBridgeError (DATA_LOSS, INTERNAL, RESOURCE_EXHAUSTED) for a reply that is
        not well formed or too large, grpc.RpcError as the call fails. Whatever is raised while messages still come
        cancels the call (`stream.cancel()`, where the stream has one): the server stops sending."""
        try:
            for raw in stream:
                self.received += 1
                self._take(raw)
        except BaseException:
            cancel = getattr(stream, "cancel", None)
            if cancel is not None:
                cancel()
            raise
        if self.shared:
            return
        if self.header is None or not self.assembler.complete:
            raise self._error(grpc.StatusCode.DATA_LOSS, "the stream ended early: "
                              + (self.assembler.missing() if self.assembler else "no header"))
        if self.header.num_chunks and self.received != self.header.num_chunks:
            raise self._error(grpc.StatusCode.DATA_LOSS, f"the KV came whole in {self.received} messages, the header "
                              f"announced {self.header.num_chunks}")

    def _take(self, raw: bytes) -> None:
        """One message: the header (checked, then the KV's buffer allocated), a chunk, or both."""
        try:
            first, c = read_chunk_message(raw)
        except WireError as exc:
            raise self._error(grpc.StatusCode.DATA_LOSS, f"a bad message from the server: {exc}") from None
        if first is not None:
            if self.header is not None:
                raise self._error(grpc.StatusCode.INTERNAL, "the server sent a second header")
            self._check_header(first)
            self.header = h = first
            if self.shared:  # the KV is in shared memory: no chunk follows
                if c is not None:
                    raise self._error(grpc.StatusCode.INTERNAL, "a chunk came with a shared-memory segment's header")
                return
            self.assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim,
                                            wire_dtype(h.dtype), check_finite=False, headroom=HEADROOM_TOKENS)
        elif self.header is None:
            raise self._error(grpc.StatusCode.INTERNAL, "a chunk arrived before the header")
        elif self.shared:
            raise self._error(grpc.StatusCode.INTERNAL,
                              "a message came after the header naming a shared-memory segment")
        c = c or ChunkView()
        try:
            self.assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
        except ChunkError as exc:
            raise self._error(grpc.StatusCode.DATA_LOSS, f"a bad chunk from the server: {exc}") from None
        self.wire += len(c.data)

    def _check_header(self, h: pb2.CacheHeader) -> None:
        """KVBridgeError naming the field unless the header describes KV this reader can take: DATA_LOSS for one
        that contradicts itself or the expected model, RESOURCE_EXHAUSTED for one over max_bytes."""
        def bad(details: str) -> KVBridgeError:
            return self._error(grpc.StatusCode.DATA_LOSS, f"the server's header: {details}")

        try:
            element = wire_dtype(h.dtype).itemsize
        except ValueError as exc:
            raise bad(str(exc)) from None
        dims = {"num_layers": h.num_layers, "num_kv_heads": h.num_kv_heads, "head_dim": h.head_dim}
        for name, value in dims.items():
            if value <= 0:
                raise bad(f"{name} must be > 0, got {value}")
        t = len(h.token_ids)
        if t == 0:
            raise bad("no token ids")
        if len(h.positions) != t:
            raise bad(f"{len(h.positions)} positions for {t} token ids")
        if len(h.recomputed_positions) > t:
            raise bad(f"{len(h.recomputed_positions)} recomputed positions for {t} tokens")
        if (m := self.model) is not None:
            if h.model.name != m.name:
                raise bad(f"KV of model {h.model.name!r}, expected {m.name!r}")
            if h.model.config_hash and m.config_hash and h.model.config_hash != m.config_hash:
                raise bad(f"config_hash {h.model.config_hash!r}, {m.name!r} has {m.config_hash!r}")
            for name, value in dims.items():
                if getattr(m, name) and value != getattr(m, name):
                    raise bad(f"{name} {value}, {m.name!r} has {getattr(m, name)}")
            if m.max_positions and t > m.max_positions:
                raise bad(f"{t} tokens, more than {m.name!r}'s {m.max_positions} positions")
        headroom = max(h.shared.headroom_tokens, 0) if h.HasField("shared") else HEADROOM_TOKENS
        row = 2 * h.num_kv_heads * h.head_dim * element  # bytes of one layer's token
        allocated = h.num_layers * (t + headroom) * row + h.num_layers * t  # the buffer, and which cells came
        if allocated > self.max_bytes:
            raise self._error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server's header describes {allocated} bytes "
                              f"to allocate (num_layers {h.num_layers} x num_kv_heads {h.num_kv_heads} x head_dim "
                              f"{h.head_dim} x 2 x {element}-byte {h.dtype}, {t} tokens + {headroom} headroom), "
                              f"more than the {self.max_bytes} bytes this client takes in one fetch")
        if h.total_bytes and h.total_bytes != h.num_layers * t * row:
            raise bad(f"total_bytes {h.total_bytes}, its shape makes {h.num_layers * t * row}")

    def open_shared(self, keep: bool) -> torch.Tensor | SharedSegment:
        """The header's segment, tensor [L, 2, H, T + headroom, D] mapped with the KV in the first T slots of each
        row; keep: only checked that it opens here, left to another reader (a SharedSegment). OSError when it cannot
        be opened or checked here (another host, another OS user)."""
        h, s = self.header, self.header.shared
        shape = (h.num_layers, 2, h.num_kv_heads, len(h.token_ids) + s.headroom_tokens, h.head_dim)
        if s.layout != shm_layout.LAYOUT:
            raise shm_layout.SegmentError(f"layout {s.layout!r} is not {shm_layout.LAYOUT!r}")
        if s.headroom_tokens < 0:
            raise shm_layout.SegmentError(f"headroom_tokens {s.headroom_tokens} < 0")
        shm_layout.check_path(s.path, s.name)
        if keep:  # readable here: its reader maps it and checks the rest (layout, checksum)
            os.close(shm_layout.open_segment(s.path, s.size))
            return SharedSegment(path=s.path, name=s.name, size=s.size, checksum=s.checksum, shape=shape,
                                 dtype=h.dtype, ttl_s=s.ttl_s)
        return shm_layout.map_kv(s.path, s.size, s.checksum, shape, wire_dtype(h.dtype))

    def cache(self, opened: torch.Tensor | SharedSegment | None = None) -> FetchedCache:
        """The FetchedCache of a reply read whole; `opened`: what open_shared gave for a shared segment."""
        h = self.header
        shared = opened if isinstance(opened, SharedSegment) else None
        if shared is not None:  # not read here: a meta tensor of the KV's shape
            kv, room = torch.empty((*shared.shape[:3], len(h.token_ids), shared.shape[4]), dtype=wire_dtype(h.dtype),
                                   device="meta"), None
        elif opened is not None:
            kv, room = opened[:, :, :, :len(h.token_ids)], opened
        else:
            kv, room = self.assembler.kv, self.assembler.room
        segment = KVSegment(kv=kv, token_ids=int64_tensor(h.token_ids), positions=int64_tensor(h.positions),
                            model=ModelIdentity(h.model.name, h.model.config_hash), rotated=h.rotated)
        log.info("%s: %d tokens of %s KV in %s, %d bytes in %d messages", self.method, segment.num_tokens,
                 h.model.name, h.dtype, self.wire, self.received)
        return FetchedCache(segment=segment, entry_key=h.entry_key, source_key=h.source_key, adapter=h.adapter,
                            text=h.text, exact_coverage=h.exact_coverage, wire_bytes=self.wire,
                            num_chunks=self.received, transport="shared_memory" if self.shared else "stream",
                            room=[room] if room is not None else [], mode=h.mode, shared=shared,
                            recomputed=self._recomputed(segment.positions), adapter_digest=h.adapter_digest,
                            document_position=self._document_position(segment.positions),
                            document_cut=max(0, int(h.document_cut)), entry_kind=h.entry_kind)

    def _recomputed(self, positions: torch.Tensor) -> torch.Tensor:
        """The header's recomputed positions, checked against the segment's: [R] int64."""
        got = int64_tensor(self.header.recomputed_positions)
        if got.numel() and not bool(torch.isin(got, positions).all()):
            raise self._error(grpc.StatusCode.DATA_LOSS, "the header's recomputed positions are not the segment's")
        return got

    def _document_position(self, positions: torch.Tensor) -> int | None:
        """The header's document position (None when it sends none), checked to be one of the segment's."""
        if not self.header.HasField("document_position"):
            return None
        got = self.header.document_position
        if not bool((positions == got).any()):
            raise self._error(grpc.StatusCode.DATA_LOSS, f"the header's document position {got} is not one of the "
                              "segment's")
        return got

    def _error(self, code: grpc.StatusCode, details: str) -> KVBridgeError:
        return KVBridgeError(code, details, self.method)
