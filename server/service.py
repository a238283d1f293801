"""KVBridgeService: what the gRPC server does, as a library (no gRPC here; the servicer only converts messages).

It holds the served models (one source, one or more targets; a model may be both), the paged store, and the
adapter registry. Model forwards are serialised per model (a lock each); projection is pure tensor work on the
adapter's device. Every method takes the caller's tenant, and every store call is made in that tenant's
namespace. Errors: ValueError (bad input, the sentence names the field), NotFound, CapacityError,
FailedPrecondition; a failed call leaves the store as it was.

The projected fetch's side (projection, reuse, served corrections, placement) is `server/projecting.py`, a part of
this class kept in a file of its own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.chunks import CHUNK_FRAMING, MIN_CHUNK_BYTES, MessageLimit, MessageTooLarge
from kvbridge.server.corrections import Corrections
from kvbridge.server.errors import FailedPrecondition
from kvbridge.server.projecting import CacheResult, KVOut, Projecting, ServedModel
from kvbridge.server.prompt_place import KeptIds, Placing
from kvbridge.server.request_limits import quote
from kvbridge.server.undo import created, undoable
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import tokenize
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import EntryInfo, LookupResult, PagedStore
from kvbridge.transfer.store.config import MAX_TTL_S
from kvbridge.transfer.suffix.detector import SuffixDetector

log = logging.getLogger(__name__)

# CacheResult and KVOut are re-exported from server/projecting.py
__all__ = ["KVBridgeService", "ServiceLimits", "CacheResult", "KVOut", "IngestResult", "SourceUpload"]



@dataclass(frozen=True)
class ServiceLimits:
    max_text_chars: int = 1_000_000  # longer texts are refused before tokenizing
    max_upload_bytes: int = 1 << 30  # largest source KV one PutSourceKV may describe
    chunk_bytes: int = 1 << 20  # default streamed chunk size
    max_chunk_bytes: int = 3 << 20  # a client may ask for bigger chunks up to this (gRPC's default limit is 4 MiB)
    max_message_bytes: int = 4 << 20  # the largest message the server sends (its gRPC limit, --max-message-mb)
    text_memo_chars: int = 16_000_000  # longest text kept with its entry (aligned again when fetched by key)
    max_projections: int = 2  # projections running at once; more wait their turn

    def __post_init__(self):
        for name in ("max_text_chars", "max_upload_bytes", "chunk_bytes", "max_chunk_bytes", "max_message_bytes",
                     "text_memo_chars", "max_projections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServiceLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.chunk_bytes > self.max_chunk_bytes:
            raise ValueError(f"ServiceLimits.chunk_bytes {self.chunk_bytes} exceeds max_chunk_bytes "
                             f"{self.max_chunk_bytes}")


@dataclass(frozen=True)
class IngestResult:
    entries: list[tuple[EntryInfo, int]]  # (entry, start position)
    source_ids: torch.Tensor  # [T] int64
    model: str


@dataclass(frozen=True)
class SourceUpload:
    """A PutSourceKV header, as library types (the KV itself arrives in chunks)."""

    model: str
    config_hash: str  # "" accepts the served model of that name
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor | None  # [T] int64; None: 0..T-1
    rotated: bool
    kind: str  # "prefix" or "segment"
    ttl_s: float | None = None
    pin: bool = False


def extend_prefix(lm: LoadedModel, prefix: KVSegment, ids: torch.Tensor) -> KVSegment:
    """Source KV of ids ([T]) computed over the cached KV of its first P tokens (prefix: [L, 2, H, P, D] at 0..P-1):
    the model runs on ids[P:] only, writing after the prefix in place (kvcache.extract's `prefix=`)."""
    return kvcache.extract(lm.model, lm.spec, ids, prefix=prefix)


def _max_positions(lm: LoadedModel) -> int:
    config = lm.model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 0) or 1 << 31)


class KVBridgeService(Placing, Projecting):
    def __init__(self, source: LoadedModel, targets: list[LoadedModel], store: PagedStore,
                 adapters: AdapterRegistry, limits: ServiceLimits = ServiceLimits(),
                 detector: SuffixDetector | None = None, corrections: Corrections | None = None):
        self.store = store
        self.corrections = corrections or Corrections()  # GetProjectedCache's modes (server/corrections.py)
        self.detector = detector or SuffixDetector()  # Ingest's DETECT_SEGMENTS option
        self.limits = limits
        self.models: dict[str, ServedModel] = {}
        for lm, role in [(source, "source")] + [(t, "target") for t in targets]:
            served = self.models.get(lm.name)
            if served is None:
                self.models[lm.name] = ServedModel(lm=lm, roles={role}, max_positions=_max_positions(lm))
            elif served.lm is not lm and served.lm.spec.identity != lm.spec.identity:
                raise ValueError(f"two different models are both named {lm.name!r}")
            elif served.lm.has_weights != lm.has_weights:
                raise ValueError(f"{lm.name!r} is both the source (loaded {'with' if source.has_weights else 'without'}"
                                 f" its weights) and a target ({'with' if lm.has_weights else 'without'} them): a "
                                 "model that is both is served with its weights")
            else:
                served.roles.add(role)
        self.source_name = source.name
        self.target_names = [t.name for t in targets]
        if not targets:
            raise ValueError("the service needs at least one target model")
        self.adapters = adapters
        self.document_ids = KeptIds()  # target ids of documents that prompt-carrying fetches asked about
        self._projecting = threading.BoundedSemaphore(limits.max_projections)
        self._flights: dict[str, tuple[threading.Lock, int]] = {}  # Projecting._single_flight: name -> (lock, users)
        self._flights_lock = threading.Lock()
        # (stage, how) -> tokens: stage "ingest" (source tokens) or "projection" (target tokens); how "reused"
        # (read from the store) or "computed" (by the source model, or by the adapter)
        self.token_counts: Counter = Counter()
        self._counts_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ models

    def model(self, name: str, role: str) -> ServedModel:
        name = name or (self.source_name if role == "source" else self.target_names[0])
        served = self.models.get(name)
        if served is None or role not in served.roles:
            have = sorted(n for n, m in self.models.items() if role in m.roles)
            raise ValueError(f"unknown {role} model {quote(name)}; this server serves {have}")
        return served

    def _source_ids(self, served: ServedModel, text: str | None, token_ids, special: bool = True,
                    field: str = "token_ids") -> torch.Tensor:
        """The source's token ids of a text (with the tokenizer's special tokens, as a prefix entry holds them;
        special=False: without, as a segment entry holds them) or the ids given, checked; errors name `field`
        (the request's field of the ids: a PutSourceKV's are header.token_ids)."""
        lm = served.lm
        if text is not None:
            self._check_text(text)
            if lm.tokenizer is None:
                raise ValueError(f"model {lm.name!r} has no tokenizer: send token_ids")
            ids = torch.as_tensor(lm.tokenizer(text, add_special_tokens=special)["input_ids"], dtype=torch.int64)
            if ids.numel() == 0:
                raise ValueError("text has no tokens: there is nothing to cache")
        elif token_ids is not None:
            ids = torch.as_tensor(list(token_ids), dtype=torch.int64).reshape(-1)
            if ids.numel() == 0:
                raise ValueError(f"{field} is empty: there is nothing to cache")
            bad = (ids < 0) | (ids >= lm.spec.vocab_size)
            if bool(bad.any()):
                raise ValueError(f"{field}[{int(bad.nonzero()[0, 0])}] = {int(ids[bad][0])} is outside the "
                                 f"vocabulary of {lm.name!r} (0..{lm.spec.vocab_size - 1})")
        else:
            raise ValueError("give either text or token_ids")
        if ids.numel() > served.max_positions:
            what = "the text is" if text is not None else f"{field} holds"
            raise ValueError(f"{what} {ids.numel()} tokens, more than {lm.name!r} takes ({served.max_positions})")
        return ids

    def _check_text(self, text: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if len(text) > self.limits.max_text_chars:
            raise ValueError(f"text is {len(text)} characters long, more than this server takes "
                             f"({self.limits.max_text_chars})")
        if not text.strip():
            raise ValueError("text is empty: there is nothing to cache")

    def _put(self, segment: KVSegment, tenant: str, **options) -> EntryInfo:
        """store.put, the entry noted as this call's when the put created it (undone if the call fails: server/undo)."""
        return created(self.store.put(segment, tenant, **options), tenant)

    def _kept(self, text: str | None) -> str | None:
        """The text to keep with an entry (for aligning it again when it is fetched by key): None when too long."""
        return text if text is not None and len(text) <= self.limits.text_memo_chars else None

    # ------------------------------------------------------------------------------------------ RPCs

    @undoable
    def ingest(self, tenant: str, text: str | None = None, token_ids=None, model: str = "", session_id: str = "",
               detect_segments: bool = False, ttl_s: float | None = None, pin: bool = False) -> IngestResult:
        """Run the source model on the text (or ids) and store its KV as one prefix entry; with detect_segments
        (text only) also store each segment the detector finds as its own content-keyed "segment" entry, so
        targets can fetch a segment by its text."""
        if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"options.ttl_s must be > 0 and at most {MAX_TTL_S:.0f} s (ten years), or 0 for the "
                             f"server default, got {ttl_s}")
        served = self.model(model, "source")
        if not served.lm.has_weights:
            raise FailedPrecondition(
                f"this server holds the source model {served.lm.name!r} without its weights (source_weights = "
                "false): it stores the source KV others compute and computes none. Upload it (PutSourceKV), or let "
                "the vLLM engine serving the source save it (kv_role kv_producer, kv_transfer_params "
                "{\"kvbridge\": {\"save\": ...}}); a fetch by text finds what was stored")
        if detect_segments and text is None:
            raise ValueError("DETECT_SEGMENTS needs text (segments are fetched by their text)")
        lm = served.lm
        ids = self._source_ids(served, text, token_ids)
        found = self.store.lookup(ids, tenant, lm.spec.identity, lm.spec.dtype)
        segment = None
        if found.key is not None and not detect_segments:
            try:
                info = self.store.refresh(found.key, tenant, ttl_s=ttl_s, pin=pin, text=self._kept(text))
                self._count("ingest", reused=ids.numel())
                return IngestResult(entries=[(info, 0)], source_ids=ids, model=lm.name)
            except NotFound:
                pass  # expired or evicted in between: compute it again
        # a cached prefix (whole blocks) is read, not computed: the model runs on the new tokens only, over its KV
        # (the segment detector needs the whole forward: no reuse with it)
        prefix = self._cached_prefix(tenant, lm, ids, found.num_tokens) if not detect_segments else None
        with served.lock:
            if prefix is None:
                segment = kvcache.extract(lm.model, lm.spec, ids)
            else:
                segment = extend_prefix(lm, prefix, ids)
            spans = self.detector.segments(lm.model, lm.spec, ids) if detect_segments else []
        reused = prefix.num_tokens if prefix is not None else 0
        self._count("ingest", reused=reused, computed=ids.numel() - reused)
        info = self._put(segment, tenant, kind="prefix", ttl_s=ttl_s, pin=pin, text=self._kept(text))
        entries = [(info, 0)]
        if len(spans) > 1:
            entries += self._store_segments(tenant, lm, text, ids, segment, spans, ttl_s)
        log.info("ingest tenant=%s session=%s model=%s tokens=%d (reused %d) key=%s new_blocks=%d segments=%d", tenant,
                 session_id or "-", lm.name, ids.numel(), reused, info.key[:16], info.new_blocks, len(entries) - 1)
        return IngestResult(entries=entries, source_ids=ids, model=lm.name)

    def _cached_prefix(self, tenant: str, lm: LoadedModel, ids: torch.Tensor, cached: int) -> KVSegment | None:
        """The KV of the longest cached whole-block prefix of ids that leaves at least one token to compute; None
        when there is none (or its blocks left the store since the lookup)."""
        bs = self.store.config.block_size
        p = min(cached, (ids.numel() - 1) // bs * bs)
        if p <= 0:
            return None
        try:
            return self.store.get_prefix(ids, tenant, lm.spec.identity, lm.spec.dtype, p)
        except NotFound:
            return None

    def _count(self, stage: str, reused: int = 0, computed: int = 0) -> None:
        with self._counts_lock:
            self.token_counts[(stage, "reused")] += reused
            self.token_counts[(stage, "computed")] += computed

    def _store_segments(self, tenant: str, lm: LoadedModel, text: str, ids: torch.Tensor, segment: KVSegment,
                        spans: list[tuple[int, int]], ttl_s: float | None) -> list[tuple[EntryInfo, int]]:
        """Each detected span whose text tokenizes back to its own tokens, as a "segment" entry (KV at its
        positions in the text). A failure removes them and the prefix entry (`ingest` is undoable: server/undo)."""
        tokenized = tokenize(lm.tokenizer, text, add_special_tokens=True)
        stored: list[tuple[EntryInfo, int]] = []
        for start, end in spans:
            text_tokens = (~tokenized.special[start:end]).nonzero()[:, 0] + start
            if text_tokens.numel() == 0:
                continue
            a, b = int(text_tokens[0]), int(text_tokens[-1]) + 1  # structural specials stay out
            piece = text[int(tokenized.offsets[a, 0]):int(tokenized.offsets[b - 1, 1])]
            alone = tokenize(lm.tokenizer, piece, add_special_tokens=False).ids
            if not piece.strip() or not torch.equal(alone, ids[a:b]):
                log.info("segment [%d, %d) does not tokenize back to itself alone: not stored", a, b)
                continue
            info = self._put(segment.slice(a, b), tenant, kind="segment", ttl_s=ttl_s, text=self._kept(piece))
            stored.append((info, a))
        return stored

    def check_upload(self, upload: SourceUpload) -> tuple[ServedModel, torch.Tensor, torch.Tensor]:
        """Validate a PutSourceKV header before any KV arrives: (served model, token ids, positions)."""
        served = self.models.get(upload.model)
        if served is None:
            raise ValueError(f"header.model.name: unknown model {quote(upload.model)}; this server serves "
                             f"{sorted(self.models)}")
        spec = served.lm.spec
        if upload.config_hash and upload.config_hash != spec.identity.config_hash:
            raise ValueError(f"header.model.config_hash {upload.config_hash[:16]}... is not the served "
                             f"{spec.name!r} ({spec.identity.config_hash[:16]}...): KV of another configuration")
        expect = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        got = (upload.num_layers, upload.num_kv_heads, upload.head_dim)
        if got != expect:
            raise ValueError(f"header (num_layers, num_kv_heads, head_dim) = {got} does not match {spec.name!r}: "
                             f"expected {expect}")
        if not upload.rotated:
            raise ValueError("header.rotated must be true: upload keys as the model caches them (after RoPE)")
        if upload.kind not in ("prefix", "segment"):
            raise ValueError(f"header.kind must be 'prefix' or 'segment', got {upload.kind!r}")
        if upload.ttl_s is not None and not 0 < upload.ttl_s <= MAX_TTL_S:
            raise ValueError(f"header.options.ttl_s must be > 0 and at most {MAX_TTL_S:.0f} s (ten years), got "
                             f"{upload.ttl_s}")
        ids = self._source_ids(served, None, upload.token_ids.tolist(), field="header.token_ids")
        t = ids.numel()
        positions = upload.positions if upload.positions is not None else torch.arange(t)
        if positions.shape != (t,):
            raise ValueError(f"header.positions has {positions.numel()} entries for {t} token_ids")
        if int(positions.min()) < 0 or int(positions.max()) >= served.max_positions:
            raise ValueError(f"header.positions must lie in [0, {served.max_positions}) for {spec.name!r}")
        if upload.kind == "prefix" and not torch.equal(positions, torch.arange(t)):
            raise ValueError("header.positions of a prefix entry must be 0..T-1 (send kind 'segment' otherwise)")
        return served, ids, positions

    @undoable
    def put_source(self, tenant: str, upload: SourceUpload, kv: torch.Tensor) -> tuple[EntryInfo, int]:
        """Store uploaded source KV ([L, 2, H, T, D]); converted to the served model's dtype."""
        served, ids, positions = self.check_upload(upload)
        spec = served.lm.spec
        t = ids.numel()
        if tuple(kv.shape) != (spec.num_layers, 2, spec.num_kv_heads, t, spec.head_dim):
            raise ValueError(f"received KV of shape {tuple(kv.shape)}, expected "
                             f"{(spec.num_layers, 2, spec.num_kv_heads, t, spec.head_dim)}")
        converted = kv.to(getattr(torch, spec.dtype))
        if kv.dtype != converted.dtype and not bool(torch.isfinite(converted).all()):  # (the chunks were checked)
            raise ValueError(f"the uploaded KV ({str(kv.dtype).removeprefix('torch.')}, header.dtype) holds values "
                             f"past the range of {spec.dtype}, the dtype {spec.name!r} is served and stored in")
        segment = KVSegment(kv=converted, token_ids=ids, positions=positions.clone(), model=spec.identity,
                            rotated=True)
        info = self._put(segment, tenant, kind=upload.kind, ttl_s=upload.ttl_s, pin=upload.pin)
        log.info("put_source tenant=%s model=%s tokens=%d key=%s", tenant, spec.name, t, info.key[:16])
        return info, int(positions[0])

    def lookup(self, tenant: str, text: str | None = None, token_ids=None, model: str = "",
               kind: str = "prefix") -> tuple[LookupResult, int]:
        """(result, query token count)."""
        if kind not in ("prefix", "segment"):
            raise ValueError(f"kind must be 'prefix' or 'segment', got {kind!r}")
        served = self.model(model, "source")
        # a segment entry holds its piece's tokens without the tokenizer's special tokens (a start token, say)
        ids = self._source_ids(served, text, token_ids, special=kind == "prefix")
        return self.store.lookup(ids, tenant, served.lm.spec.identity, served.lm.spec.dtype, kind=kind), ids.numel()

    def _source_entry(self, tenant: str, key: str | None, text: str | None, require_cached: bool
                      ) -> tuple[str, KVSegment, str | None, EntryInfo | None, EntryInfo]:
        """(key, segment, text, created, info) of a source entry named by key, or found (or ingested) by text; created
        is the entry's info when this call stored it (so a failure later may undo exactly that); info, read before
        its KV: what derives from this KV is stored with `source_serial=info.serial`, so that the entry deleted and
        stored again meanwhile (other KV under the same key) never gets it."""
        if key:
            info = self.store.info(key, tenant)
            return key, self.store.get(key, tenant), info.text, None, info
        if text is None:
            raise ValueError("give either key or text")
        found = self._cached_source_key(tenant, text)
        if found is not None:
            try:
                info = self.store.info(found, tenant)
                return found, self.store.get(found, tenant), text, None, info
            except NotFound:
                pass
        if require_cached:
            raise NotFound("no cached source entry for this text (require_cached is set)")
        info = self.ingest(tenant, text=text).entries[0][0]
        created = info if info.generation == 0 else None  # else another request stored it meanwhile
        return info.key, self.store.get(info.key, tenant), text, created, info

    @undoable
    def source_cache(self, tenant: str, key: str | None = None, text: str | None = None,
                     require_cached: bool = False) -> CacheResult:
        key, segment, known, _, info = self._source_entry(tenant, key, text, require_cached)
        return CacheResult(segment=segment, entry_key=key, source_key=key, adapter="", text=known,
                           exact_coverage=1.0, entry_kind=info.kind)

    def delete(self, tenant: str, key: str) -> int:
        """Delete an entry and the projected entries derived from it; NotFound when there is none."""
        if not key:
            raise ValueError("key is empty")
        removed = self.store.delete(key, tenant)  # the store deletes what derives from it too
        if not removed:
            raise NotFound(f"no entry {quote(key)}")
        return removed

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(entries, tokens) this tenant holds."""
        usage = self.store.tenant_usage(tenant)
        return usage.entries, usage.tokens

    def describe_models(self) -> list[dict]:
        out = []
        for name, served in self.models.items():
            spec = served.lm.spec
            out.append({"name": name, "config_hash": spec.identity.config_hash,
                        "role": ",".join(r for r in ("source", "target") if r in served.roles),
                        "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                        "dtype": spec.dtype, "max_positions": served.max_positions,
                        "device": str(served.lm.device)})
        return out

    def message_limit(self, declared: int | None) -> MessageLimit:
        """The largest message of a fetch whose client declared it receives `declared` bytes (None: nothing)."""
        return MessageLimit(server=self.limits.max_message_bytes, client=declared)

    def chunk_bytes(self, requested: int, limit: MessageLimit | None = None) -> int:
        """The KV bytes of a fetch's chunks: the request's (0: the server's default; capped by max_chunk_bytes), no
        more than a message of `limit` holds; MessageTooLarge naming both limits when it holds no chunk at all."""
        if requested < 0:
            raise ValueError(f"chunk_bytes must be >= 0, got {requested}")
        size = self.limits.chunk_bytes if requested == 0 else min(max(requested, MIN_CHUNK_BYTES),
                                                                   self.limits.max_chunk_bytes)
        if limit is None:
            return size
        room = limit.bytes - CHUNK_FRAMING
        if room < MIN_CHUNK_BYTES:
            raise MessageTooLarge(f"no chunk fits in the message limit of {limit}: the smallest chunk is "
                                  f"{MIN_CHUNK_BYTES} bytes of KV and up to {CHUNK_FRAMING} of framing; raise the "
                                  "client's max_message_mb")
        return min(size, room)


