"""A fetch's reply as the client reads it (GetProjectedCache, GetSourceCache): one header, then the KV in chunks — or
no chunk and a same-host shared-memory segment named in the header, opened here — made into a FetchedCache.

No retries, no channels, no release of a segment: the client (server/client.py) does those around these.
"""

from __future__ import annotations

import logging
import os

import grpc
import torch
from kvbridge.server import shm_layout
from kvbridge.server.chunk_wire import ChunkView, WireError, read_chunk_message
from kvbridge.server.chunks import ChunkAssembler, ChunkError, int64_tensor, wire_dtype
from kvbridge.server.replies import FetchedCache, KVBridgeError, SharedSegment
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity

log = logging.getLogger(__name__)
HEADROOM_TOKENS = 64  # slots a streamed fetch leaves after each row of its KV, for the cache's next tokens


class FetchReply:
    """One try's messages, read as they come: `received` counts them (a try cut after its first message is retried
    differently from one cut before)."""

    def __init__(self, method: str):
        self.method = method
        self.header = None  # pb2.KVHeader, once it came
        self.assembler: ChunkAssembler | None = None  # None with a shared segment: no chunk follows the header
        self.received = 0  # messages
        self.wire = 0  # KV bytes in chunks

    @property
    def shared(self) -> bool:
        return self.header is not None and self.header.HasField("shared")

    def read(self, stream) -> None:
        """Every message of the stream; KVBridgeError (DATA_LOSS, INTERNAL) for a reply that is not well formed,
        grpc.RpcError as the call fails."""
        for raw in stream:
            self.received += 1
            try:
                first, c = read_chunk_message(raw)
            except WireError as exc:
                stream.cancel()
                raise self._error(grpc.StatusCode.DATA_LOSS, f"a bad message from the server: {exc}") from None
            if first is not None:
                if self.header is not None:
                    raise self._error(grpc.StatusCode.INTERNAL, "the server sent a second header")
                self.header = h = first
                if self.shared:  # the KV is in shared memory: no chunk follows
                    continue
                self.assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim,
                                                wire_dtype(h.dtype), check_finite=False, headroom=HEADROOM_TOKENS)
            if self.assembler is None:
                raise self._error(grpc.StatusCode.INTERNAL, "a chunk arrived before the header")
            c = c or ChunkView()
            try:
                self.assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
            except ChunkError as exc:
                stream.cancel()
                raise self._error(grpc.StatusCode.DATA_LOSS, f"a bad chunk from the server: {exc}") from None
            self.wire += len(c.data)
        if self.shared:
            if self.received != 1:
                raise self._error(grpc.StatusCode.INTERNAL, "chunks came after a shared segment")
        elif self.header is None or not self.assembler.complete:
            raise self._error(grpc.StatusCode.DATA_LOSS, "the stream ended early: "
                              + (self.assembler.missing() if self.assembler else "no header"))

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
                            recomputed=self._recomputed(segment.positions), adapter_digest=h.adapter_digest)

    def _recomputed(self, positions: torch.Tensor) -> torch.Tensor:
        """The header's recomputed positions, checked against the segment's: [R] int64."""
        got = int64_tensor(self.header.recomputed_positions)
        if got.numel() and not bool(torch.isin(got, positions).all()):
            raise self._error(grpc.StatusCode.DATA_LOSS, "the header's recomputed positions are not the segment's")
        return got

    def _error(self, code: grpc.StatusCode, details: str) -> KVBridgeError:
        return KVBridgeError(code, details, self.method)
