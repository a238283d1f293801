"""A context source for the suffix-reuse generator (kvbridge.transfer.suffix.generator.SuffixReuseGenerator) over
the gRPC client: the server projects a text's source KV into the target's space at the request's position."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbridge.server.client import KVBridgeClient, _check_model
from kvbridge.transfer.align import start_token_id
from kvbridge.transfer.segment import KVSegment

__all__ = ["FetchRecord", "ProjectedContext"]


@dataclass(frozen=True)
class FetchRecord:
    """What one projected fetch moved, without its KV (a session keeps these, never the tensors)."""

    token_ids: torch.Tensor  # [T] int64: the target tokens projected, the start token first
    first_position: int  # target position of the first of them
    wire_bytes: int
    num_chunks: int


class ProjectedContext:
    """A context source for kvbridge.transfer.suffix.generator.SuffixReuseGenerator over the gRPC client: the server
    projects a text's source KV into `target`'s space at the request's position.

    The server's projection starts with the target's start token (the adapter's convention); the generator has its
    own at position 0, so the text's tokens are fetched one position earlier and the start token is dropped (a
    text the server knows only as a detected segment of a longer one projects without it: fetched at its position).
    """

    def __init__(self, client: KVBridgeClient, target, adapter: str = "", dtype: str = "", mode: str = "replace"):
        self.client = client
        self.target = target
        self.adapter = adapter
        self.dtype = dtype
        self.mode = mode  # the server's correction; "replace" by default: the generator blends its parts itself
        self.calls = 0  # fetches made
        self.wire_bytes = 0  # bytes they moved
        self.first: FetchRecord | None = None  # the first fetch and the last one (no KV kept: a session can be long)
        self.last: FetchRecord | None = None
        self.adapter_digest = ""  # of the adapter the last fetch was projected by: the generator checks its prior
        # [T] bool, of the last segment returned: the positions whose KV is the projection's (a served correction,
        # `mode`, recomputed the others with the target); the generator's prior reads these as projected
        self.still_projected: torch.Tensor | None = None

    def projected_segment(self, text: str, offset: int) -> KVSegment:
        if offset < 1:
            raise ValueError("a projected part needs the generator's start token before it (offset >= 1)")
        fetched = self._fetch(text, offset - 1)
        if fetched.document_position is not None:  # the server says where the text's tokens begin
            lead = fetched.document_position - int(fetched.segment.positions[0])
        else:  # a server before the field: by the first token
            lead = int(not fetched.segment.num_tokens
                       or int(fetched.segment.token_ids[0]) == start_token_id(self.target.tokenizer))
        if lead == 0:
            # a "segment" entry of an Ingest with DETECT_SEGMENTS (the text known only as a part of a longer one):
            # its projection holds the text's tokens alone, so it is fetched at the text's own position
            fetched = self._fetch(text, offset)
        record = FetchRecord(token_ids=fetched.segment.token_ids.clone(),
                             first_position=int(fetched.segment.positions[0]), wire_bytes=fetched.wire_bytes,
                             num_chunks=fetched.num_chunks)
        self.adapter_digest = fetched.adapter_digest
        self.still_projected = fetched.still_projected()[lead:]
        self.first = self.first or record
        self.last = record
        return fetched.segment.slice(lead, fetched.segment.num_tokens)

    def _fetch(self, text: str, offset: int):
        fetched = self.client.fetch_projected(text=text, target_model=self.target.name, adapter=self.adapter,
                                              offset=offset, dtype=self.dtype, mode=self.mode)
        _check_model(fetched.segment.model, self.target.spec.identity)
        self.calls += 1
        self.wire_bytes += fetched.wire_bytes
        return fetched
