"""What the client hands back: its error, the replies of Ingest and Lookup, and fetched caches (streamed, mapped
from a same-host segment, or that segment left for another process to read). `kvbridge.server.client` re-exports
them; this module imports no transport."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import torch
from kvbridge.proto import pb2
from kvbridge.server.chunks import dtype_name
from kvbridge.transfer.segment import KVSegment

__all__ = ["Entry", "FetchedCache", "IngestReply", "KVBridgeError", "LookupReply", "SharedSegment", "entry_of"]


class KVBridgeError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, method: str = ""):
        super().__init__(f"{method}: {code.name}: {details}" if method else f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.method = method

    def __reduce__(self):  # pickled (a process pool's worker raised it) and copied with its own arguments
        return type(self), (self.code, self.details, self.method)


@dataclass(frozen=True)
class Entry:
    key: str
    kind: str
    num_tokens: int
    start: int
    new_blocks: int
    tier: str
    model: str


@dataclass(frozen=True)
class IngestReply:
    entries: list[Entry]
    source_token_ids: torch.Tensor  # [T] int64
    model: str


@dataclass(frozen=True)
class LookupReply:
    key: str | None
    num_tokens: int
    query_tokens: int
    tier: str | None


@dataclass(frozen=True)
class SharedSegment:
    """A server's shared-memory segment left for another process of this host to read (a fetch with
    keep_shared=True): map it with `shm_layout.map_kv(path, size, checksum, shape, dtype)`, which checks it, then
    `KVBridgeClient.release_segment(this)`; the server removes it after ttl_s otherwise."""

    path: str
    name: str
    size: int
    checksum: str
    shape: tuple[int, ...]  # the file's tensor [L, 2, H, T + headroom, D]; the KV is the first T slots of each row
    dtype: str
    ttl_s: float


@dataclass(frozen=True)
class FetchedCache:
    segment: KVSegment  # rotated KV at `segment.positions`
    entry_key: str
    source_key: str
    adapter: str  # "name@version" of a server-side projection; "" for source KV
    text: str  # the text the entry was made from ("" when the server did not send it)
    exact_coverage: float
    wire_bytes: int  # bytes of chunk data received (0 through shared memory)
    num_chunks: int
    transport: str = "stream"  # how the KV came: "stream" or "shared_memory" (then segment.kv maps the file)
    mode: str = ""  # the correction the server served ("replace", "blend:0.1", ...); "" for source KV
    recomputed: torch.Tensor | None = None  # [R] int64: positions whose KV a correction recomputed with the target
    # [L, 2, H, T + headroom, D] whose first T slots of each row are segment.kv, until a cache takes it
    room: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)
    # keep_shared=True: the server's segment, not read here (segment.kv is then a meta tensor of the KV's shape)
    shared: SharedSegment | None = None
    adapter_digest: str = ""  # Adapter.digest of a server-side projection's adapter ("" where the server sent none)
    # the position of a projection's first document token: the tokens before it (the start token, a prompt's head)
    # are not the document's (None: source KV, or a server older than the field)
    document_position: int | None = None
    # a prompt's placement: the document's last tokens not served, the prompt not holding them (0: the whole document)
    document_cut: int = 0
    # a source fetch: the entry's kind, "prefix" or "segment" ("": a server older than the field)
    entry_kind: str = ""

    @property
    def dtype(self) -> str:
        """The dtype the KV came in over the wire (the server's: the target's dtype, bf16 for the production pair on
        CUDA, unless the request asked for another)."""
        return dtype_name(self.segment.dtype)

    def still_projected(self) -> torch.Tensor:
        """[T] bool: the positions whose KV is the projection's, what an induction prior reads as projected
        (`prior.reading(lm, token_ids, still)`): the document's, from `document_position` on (a server without the
        field: after the start token), less those the correction recomputed. ValueError for source KV."""
        if not self.adapter:
            raise ValueError("source KV: none of it is projected")
        positions = self.segment.positions
        first = self.document_position if self.document_position is not None else int(positions[0]) + 1
        still = positions >= first
        if self.recomputed is not None and self.recomputed.numel():
            still &= ~torch.isin(positions, self.recomputed)
        return still

    def to_cache(self, lm):
        """A DynamicCache of this KV for `lm` (it must be that model's KV at positions 0..T-1). The first cache made
        of a fetch writes the next tokens into the slots the fetch left after each row (no copy of the cache at the
        first forward; the segment's own slots are never written); later ones copy at their first forward."""
        from kvbridge.transfer import kvcache

        room = self.room.pop() if self.room else None
        return kvcache.to_cache(self.segment, lm.model, lm.spec, room=room)


def entry_of(e: pb2.Entry) -> Entry:
    return Entry(key=e.key, kind=e.kind, num_tokens=e.num_tokens, start=e.start, new_blocks=e.new_blocks,
                 tier=e.tier, model=e.model)
