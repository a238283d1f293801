"""The projected fetch's side of KVBridgeService (`server/service.py`, whose tenant and error rules hold here): a
source entry aligned and projected into a target's KV space (reusing a stored projection's tokens where a prefix
is shared), stored under the adapter's namespace, corrected as the fetch's mode says (server/corrections.py: once,
then stored), and placed at the fetch's offset by RoPE.

`Projecting` is a part of KVBridgeService, not a class of its own: its methods use the service's store, models,
adapters and counters.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace

import torch
from kvbridge.adapters.adapter import Adapter, project
from kvbridge.adapters.pairs import PairedText, pair_segment, pair_text
from kvbridge.server.corrections import recomputed_of
from kvbridge.server.errors import FailedPrecondition
from kvbridge.server.kv_out import KVOut, OnceOut, fresh
from kvbridge.server.shm_segments import PendingSegment
from kvbridge.server.undo import undoable
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import Alignment, start_token_id, tokenize
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import EntryInfo
from kvbridge.transfer.suffix.correction import Corrected, Correction
from kvbridge.transfer.suffix.reuse import place

log = logging.getLogger("kvbridge.server.service")  # one logger for the service's lines, wherever they are written

__all__ = ["CacheResult", "KVOut", "Projecting", "ServedModel", "cache_label"]


@dataclass
class ServedModel:
    lm: LoadedModel
    roles: set[str]  # {"source"}, {"target"} or both
    max_positions: int  # the model's max_position_embeddings
    lock: threading.Lock = field(default_factory=threading.Lock)  # one forward at a time per model


@dataclass(frozen=True)
class CacheResult:
    segment: KVSegment  # what goes on the wire (rotated at its positions)
    entry_key: str  # the entry it came from (projected entry for a projected cache)
    source_key: str  # the source entry
    adapter: str  # "name@version" for projected caches, "" for source caches
    text: str | None  # the text, when the server knows it
    exact_coverage: float  # projected: fraction of target text tokens aligned exactly; 1.0 for source caches
    mode: str = ""  # projected: the correction served ("replace", "blend:0.1", ...); "" for source caches
    recomputed: tuple[int, ...] = ()  # projected: positions whose KV a correction recomputed with the target
    adapter_digest: str = ""  # projected: Adapter.digest of the adapter ("" where not known)
    # projected: the index in `segment` of the first document token (the tokens before it, the start token or a
    # prompt's head, are not the document's); None for source caches
    document_index: int | None = None
    # projected: the serial of the source entry whose KV it was made from (read before that KV); what is derived
    # from it is stored with it (store.put's source_serial), never for other KV stored under the key since
    source_serial: int | None = None
    # a prompt's placement: the document's last tokens not served (the prompt stops holding it before them)
    document_cut: int = 0
    entry_kind: str = ""  # a source fetch: the entry's kind ("prefix" or "segment")


# a stored projection's (and correction's) annotation: 1 when it begins with the target's start token (its source a
# prefix entry), 0 when with the document (a segment entry): known after the source expired (the projection outlives it)
DOCUMENT_INDEX = "document_index"


def _document_index(info: EntryInfo) -> int:
    """Where a stored projection's document begins (entries stored before the annotation: after a start token)."""
    return 0 if info.annotations.get(DOCUMENT_INDEX) == 0 else 1


def decoded_text(source: LoadedModel, ids: torch.Tensor) -> str | None:
    """The text a source entry's ids (with the tokenizer's special tokens) decode to, when they come back from it
    (an upload keeps no text); None otherwise."""
    text = source.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    return text if torch.equal(tokenize(source.tokenizer, text, add_special_tokens=True).ids, ids) else None


def cache_label(label: str, adapter: Adapter) -> str:
    """The adapter's part of a stored projection's namespace: its label ("name@version", what clients are told) and
    its content digest, so a retrained adapter saved under the same name and version never finds the old one's KV
    in the store, nor, through the entry keys they are tagged with, in the wire cache or kept shared-memory files."""
    return digest_label(label, adapter.digest)


def digest_label(label: str, digest: str) -> str:
    """`cache_label` of the adapter with this label and content digest."""
    return f"{label}~{digest[:32]}"


class Projecting:
    """KVBridgeService's projected fetches (see the module docstring)."""

    def _paired(self, source: LoadedModel, target: LoadedModel, segment: KVSegment, text: str | None) -> PairedText:
        if text is None:
            # Fetched by key and the text is not remembered: recover it from the ids, if they round-trip.
            text = decoded_text(source, segment.token_ids)
            if text is None:
                raise FailedPrecondition(
                    "this entry's source token ids do not come back from their decoded text, so its target tokens "
                    "cannot be aligned; fetch it by text instead")
        paired = pair_text(text, source.tokenizer, target.tokenizer)
        if not torch.equal(paired.source_ids, segment.token_ids):
            raise FailedPrecondition("the entry's source token ids are not the source tokenization of its text "
                                     "(uploaded with other ids?); fetch it by text, or upload the tokenizer's ids")
        return paired

    def _paired_segment(self, source: LoadedModel, target: LoadedModel, segment: KVSegment, text: str | None
                        ) -> PairedText:
        """A segment entry (a piece of a text, at its positions there) as both models cut its text: no start token,
        the target's tokens aligned to the segment's source tokens."""
        if text is None:
            raise FailedPrecondition("this segment's text is not known to the server any more: ingest the text again")
        paired = pair_segment(text, source.tokenizer, target.tokenizer)
        if not torch.equal(paired.source_ids, segment.token_ids):
            raise FailedPrecondition("the segment's tokens are not the source tokenization of its text")
        return paired

    @undoable
    def projected_cache(self, tenant: str, key: str | None = None, text: str | None = None, target_model: str = "",
                        adapter: str = "", offset: int = 0, require_cached: bool = False,
                        out: KVOut | None = None, mode: str = "") -> CacheResult:
        """The source entry projected into the target's KV space and corrected as `mode` says ('' = the server's
        default), at target positions offset.. (cached in the store at positions 0.., shifted by RoPE for other
        offsets). A warm fetch at offset 0 gathers the stored KV straight into `out`'s buffer when it offers one.
        A correction is computed from the projection once, stored linked to the source entry, and read after."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        out = OnceOut(out) if out is not None and offset == 0 else None  # offered to one store read at most
        correction = self.corrections.resolve(mode)
        target = self.model(target_model, "target")
        # resolved once: a default changed meanwhile (LoadAdapter make_default) must not make the projection the
        # correction is computed from another adapter's than the label it is stored and served under
        resolved = self.adapters.resolve(adapter, self.models[self.source_name].lm.spec, target.lm.spec, tenant)
        if correction.kind == "replace":
            return self._projection(tenant, key, text, target, resolved, offset, require_cached, out)
        label, chosen = resolved
        source_key = key or self._cached_source_key(tenant, text)
        held = self._source_info(tenant, source_key)  # read before a stored correction of it: its kind and serial
        serial = held.serial if held is not None else None
        warm = None
        # a source that expired (its correction outlives it) may have been a prefix entry or a segment entry: its
        # correction is looked for under either's namespace
        for lead in (int(held.kind == "prefix"),) if held is not None else (0, 1):
            tag = self._correction_tag(label, chosen, correction, target, lead)
            warm = self._cached_projection(tenant, source_key, tag, target, fresh(out)) if source_key else None
            if warm is not None:
                break
        if warm is None:
            if offset:  # the projection's checks of the offset first: a refused request computes and stores nothing
                self._projection(tenant, key, text, target, resolved, offset, require_cached, None)
            base = self._projection(tenant, key, text, target, resolved, 0, require_cached, None)
            # the source entry the projection was made from: known now for a text ingested by this call, and another
            # than the one looked up above when that was deleted meanwhile (a prefix entry then, a segment entry now)
            if (base.source_key, base.document_index) != (source_key, lead):
                source_key, lead = base.source_key, base.document_index
                tag = self._correction_tag(label, chosen, correction, target, lead)
            serial = base.source_serial
            with self._single_flight(f"{tenant}\0{tag}#{source_key}"):  # a correction at once per entry and mode
                warm = self._cached_projection(tenant, source_key, tag, target, fresh(out)) \
                    or self._replica_correction(tenant, base, tag, target)
                if warm is None:
                    warm = self._computed_correction(tenant, target, base, correction, chosen, tag, lead)
                else:
                    self._count("correction", reused=warm[1].num_tokens)
        else:
            self._count("correction", reused=warm[1].num_tokens)
        placed = self._placed(target, chosen, warm[0], warm[1], source_key, label, offset, lead)
        return replace(placed, mode=str(correction), source_serial=serial,
                       recomputed=tuple(recomputed_of(warm[0].annotations, warm[1].num_tokens)))

    def _correction_tag(self, label: str, chosen: Adapter, correction: Correction, target: ServedModel,
                        lead: int) -> str:
        """A stored correction's namespace is "<tag>#<source key>": the adapter, the correction, a prior other than
        the target's shipped one, and for a segment entry's (computed after the start token, `_correct`)
        "/after-start": what servers before that stored for one (computed without a start token) is never adopted
        through Redis."""
        return (f"{cache_label(label, chosen)}|{correction}{self.corrections.prior_tag(target.lm)}"
                f"{'' if lead else '/after-start'}")

    def _computed_correction(self, tenant: str, target: ServedModel, base: CacheResult, correction: Correction,
                             chosen: Adapter, tag: str, lead: int) -> tuple[EntryInfo, KVSegment]:
        """The correction of `base` (the projection) computed by the target and stored, linked to the source entry
        the projection was made from (NotFound when it was deleted, or stored again, meanwhile)."""
        started = time.perf_counter()
        fixed = self._correct(target, base.segment, correction, chosen.digest, lead)
        log.info("correction tenant=%s mode=%s tokens=%d source=%s in %.2f s", tenant, correction,
                 fixed.segment.num_tokens, base.source_key[:16], time.perf_counter() - started)
        self._count("correction", computed=fixed.segment.num_tokens)
        info = self._put(fixed.segment, tenant, kind="prefix", adapter=f"{tag}#{base.source_key}",
                         text=base.text, source_key=base.source_key, source_serial=base.source_serial,
                         annotations={"exact_coverage": base.exact_coverage, DOCUMENT_INDEX: lead,
                                      **self.corrections.annotations(correction, fixed)})
        return info, fixed.segment

    @contextlib.contextmanager
    def _single_flight(self, name: str):
        """One holder at a time per name (a correction of one entry in one mode): a second request waits for the
        first and then finds its stored result, instead of taking another correction slot to compute it again."""
        with self._flights_lock:
            lock, users = self._flights.get(name, (None, 0))
            lock = lock or threading.Lock()
            self._flights[name] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._flights_lock:
                lock, users = self._flights[name]
                if users == 1:
                    del self._flights[name]
                else:
                    self._flights[name] = (lock, users - 1)

    def _correct(self, target: ServedModel, projected: KVSegment, correction: Correction, digest: str, lead: int
                 ) -> Corrected:
        """The correction of a projection by the target. A segment entry's (`lead` 0: its document tokens alone, at
        0..n-1) is computed as a stored document's is, after the target's own start token (where a prompt places it:
        prompt_place) with the document moved to 1..n, then kept without the start token at 0..n-1 (keys moved back
        by RoPE: placed after a start token it is that correction exactly; its recomputed positions are document
        tokens only)."""
        if lead:
            return self.corrections.compute(target.lm, projected, correction, digest, lock=target.lock)
        lm = target.lm
        with target.lock:
            start = kvcache.extract(lm.model, lm.spec, torch.tensor([start_token_id(lm.tokenizer)]))
        doc = place(projected, lm.rope, 1)
        fixed = self.corrections.compute(lm, KVSegment.concat([start.to(device=doc.device, dtype=doc.dtype), doc]),
                                         correction, digest, lock=target.lock)
        out = place(fixed.segment.slice(1, fixed.segment.num_tokens), lm.rope, int(projected.positions[0]))
        return replace(fixed, segment=out, still_projected=fixed.still_projected[1:])

    def _replica_correction(self, tenant: str, base: CacheResult, tag: str, target: ServedModel
                            ) -> tuple[EntryInfo, KVSegment] | None:
        """The correction another replica stored through Redis, adopted by its content key (the projection's target
        tokens in the correction's namespace), when the store shares entries; None otherwise."""
        if self.store.redis is None:
            return None
        spec = target.lm.spec
        found = self.store.lookup(base.segment.token_ids, tenant, spec.identity, spec.dtype,
                                  adapter=f"{tag}#{base.source_key}")
        if found.key is None:
            return None
        try:
            return self.store.info(found.key, tenant), self.store.get(found.key, tenant)
        except NotFound:  # evicted or deleted in between: compute it here
            return None

    def _projection(self, tenant: str, key: str | None, text: str | None, target: ServedModel,
                    resolved: tuple[str, Adapter], offset: int, require_cached: bool, out: KVOut | None
                    ) -> CacheResult:
        """`projected_cache` in mode replace: the projection as the adapter makes it (`resolved`: (label, adapter)
        as the registry resolved the request's adapter, once per fetch)."""
        label, chosen = resolved
        ident = cache_label(label, chosen)  # what the stored projection (and so the wire and shm caches) is keyed by
        source_key = key or self._cached_source_key(tenant, text)
        warm = self._warm_projection(tenant, source_key, ident, chosen, label, target, offset, fresh(out))
        if warm is not None:
            return warm
        # one projection at once per entry and adapter: a request that comes while another projects it waits, then
        # serves what that one stored, instead of taking a projection slot to compute the same KV again. A request by
        # text holds the text's flight first (it may ingest the text), then the entry's once the entry is known: so
        # it waits for a request of the same text that ingested it and is projecting it, or is still ingesting it
        with contextlib.ExitStack() as flights:
            if key is None:
                digest = hashlib.sha256((text or "").encode("utf-8", "surrogatepass")).hexdigest()
                flights.enter_context(self._single_flight(f"{tenant}\0{ident}#text:{digest}"))
                source_key = self._cached_source_key(tenant, text)  # ingested meanwhile by the one waited for
            if source_key is not None:
                flights.enter_context(self._single_flight(f"{tenant}\0{ident}#{source_key}"))
            return self._warm_projection(tenant, source_key, ident, chosen, label, target, offset, fresh(out)) \
                or self._projected_now(tenant, key, text, target, resolved, offset, require_cached)

    def _warm_projection(self, tenant: str, source_key: str | None, ident: str, chosen: Adapter, label: str,
                         target: ServedModel, offset: int, out: KVOut | None) -> CacheResult | None:
        """A projection of the entry made before, placed at offset (no source read, no alignment, no projection);
        None when the store holds none (or no entry is named)."""
        if source_key is None:
            return None
        # read before the projection: its kind and serial (None: expired or evicted, which a projection outlives)
        held = self._source_info(tenant, source_key)
        warm = self._cached_projection(tenant, source_key, ident, target, None if offset else out)
        if warm is None:
            return None
        info, projected = warm
        self._count("projection", reused=projected.num_tokens)
        lead = int(held.kind == "prefix") if held is not None else _document_index(info)
        return replace(self._placed(target, chosen, info, projected, source_key, label, offset, lead),
                       source_serial=held.serial if held is not None else None)

    def _projected_now(self, tenant: str, key: str | None, text: str | None, target: ServedModel,
                       resolved: tuple[str, Adapter], offset: int, require_cached: bool) -> CacheResult:
        """The projection computed now (reusing what stored projections of a shared source prefix hold) and
        stored, placed at offset."""
        source = self.models[self.source_name]
        label, chosen = resolved
        ident = cache_label(label, chosen)
        # a failure after an ingest of the text is undone by projected_cache (server/undo)
        source_key, segment, known, _, held = self._source_entry(tenant, key, text, require_cached)
        if segment.model != source.lm.spec.identity:
            raise FailedPrecondition(f"entry {source_key[:16]}... holds KV of {segment.model.name!r}; adapters map "
                                     f"from the source model {source.lm.name!r}")
        tspec = target.lm.spec
        lead = int(held.kind == "prefix")
        if lead:
            paired = self._paired(source.lm, target.lm, segment, known)
        else:  # a piece of a text, at its positions there
            paired = self._paired_segment(source.lm, target.lm, segment, known)
        t_t = paired.target_ids.numel()
        if offset + t_t > target.max_positions:
            raise ValueError(f"offset {offset} + {t_t} projected tokens exceeds {tspec.name!r}'s "
                             f"{target.max_positions} positions")
        kvcache.check_rope_window(tspec, offset + t_t)  # a longrope target's tables switch below that: refused now
        namespace = f"{ident}#{source_key}"  # projected KV of this source entry through this adapter
        with self._projecting:
            projected, reused = self._project_reusing(tenant, source_key, segment, paired, ident, chosen, source,
                                                      target)
        self._count("projection", reused=reused, computed=t_t - reused)
        # linked to its source entry (a Delete of that removes it too); a no-op when already there
        info = self._put(projected, tenant, kind="prefix", adapter=namespace, text=paired.text,
                         source_key=source_key, source_serial=held.serial,
                         annotations={"exact_coverage": paired.alignment.exact_coverage, DOCUMENT_INDEX: lead})
        return replace(self._placed(target, chosen, info, projected, source_key, label, offset, lead),
                       source_serial=held.serial)

    def _project_reusing(self, tenant: str, source_key: str, segment: KVSegment, paired: PairedText, label: str,
                         chosen: Adapter, source: ServedModel, target: ServedModel) -> tuple[KVSegment, int]:
        """The projection of a source entry at target positions 0.., reusing the projected KV of target tokens that
        a stored projection of an entry sharing its source prefix already holds: (projection, target tokens
        reused). A target token's projected KV depends only on the KV of the source token it is aligned to (and, with
        a context branch, on the tokens before it: the same ones here), so it is reused where both texts have the
        same target token, aligned to the same source token, inside the shared source prefix (the tokens at the
        boundary, which either tokenizer may cut differently, fail this), and every token before it is reused too."""
        dtype = getattr(torch, target.lm.spec.dtype)
        t_t = paired.target_ids.numel()
        reuse, old = 0, None
        for other_key, shared in self.store.sharing_prefix(source_key, tenant):
            warm = self._cached_projection(tenant, other_key, label, target)
            if warm is None or warm[0].text is None:
                continue
            old_paired = pair_text(warm[0].text, source.lm.tokenizer, target.lm.tokenizer)
            n = min(t_t, old_paired.target_ids.numel(), warm[1].num_tokens)
            a, b = paired.alignment, old_paired.alignment
            same = ((paired.target_ids[:n] == old_paired.target_ids[:n]) & (a.source_index[:n] == b.source_index[:n])
                    & (a.kind[:n] == b.kind[:n]) & (a.target_special[:n] == b.target_special[:n])
                    & (a.source_index[:n] < shared))
            reuse, old = int(same.to(torch.int64).cumprod(0).sum()), warm[1]
            if reuse:
                break
        if reuse == t_t:
            return old.slice(0, t_t), reuse
        # project target tokens reuse.. from the source tokens they use (the ones before are not unrotated); an
        # adapter's context branch (format 4) also reads the `halo` target tokens before them: projected and dropped
        halo = min(reuse, chosen.context_halo)
        start = reuse - halo
        rest = paired.alignment
        index = rest.source_index[start:]
        first = int(index[index >= 0].min()) if bool((index >= 0).any()) else 0
        tail = Alignment(source_index=torch.where(index >= 0, index - first, index), kind=rest.kind[start:],
                         target_special=rest.target_special[start:], num_source_tokens=segment.num_tokens - first)
        fresh = project(chosen, segment.slice(first, segment.num_tokens), tail, paired.target_ids[start:],
                        source.lm.rope, target.lm.rope, offset=start, dtype=dtype)
        fresh = fresh.slice(halo, fresh.num_tokens)
        if not reuse:
            return fresh, 0
        kv = torch.cat((old.kv[:, :, :, :reuse].to(fresh.kv.device), fresh.kv), dim=3)  # [L, 2, H, T_t, D]
        return KVSegment(kv=kv, token_ids=paired.target_ids, positions=torch.arange(t_t, dtype=torch.int64),
                         model=fresh.model, rotated=True), reuse

    def _cached_source_key(self, tenant: str, text: str | None) -> str | None:
        """The source entry of this text: the prefix entry of its tokenization, else a segment entry of it."""
        if text is None:
            return None
        served = self.model("", "source")
        spec = served.lm.spec
        ids = self._source_ids(served, text, None)
        key = self.store.lookup(ids, tenant, spec.identity, spec.dtype).key
        if key is None:
            alone = tokenize(served.lm.tokenizer, text, add_special_tokens=False).ids
            if alone.numel():
                key = self.store.lookup(alone, tenant, spec.identity, spec.dtype, kind="segment").key
        return key

    def _cached_projection(self, tenant: str, source_key: str, label: str, target: ServedModel,
                           out: KVOut | None = None) -> tuple[EntryInfo, KVSegment] | None:
        """The projection of this source entry through this adapter into this target, when the store has it
        (gathered into out's buffer when it offers one)."""
        namespace, spec = f"{label}#{source_key}", target.lm.spec
        for info in self.store.derived(source_key, tenant):
            if info.adapter == namespace and info.model == spec.identity.key:
                try:
                    return info, self._gathered(info, tenant, spec, out)
                except NotFound:  # evicted or expired in between: project again
                    return None
        return None

    def _gathered(self, info: EntryInfo, tenant: str, spec, out: KVOut | None) -> KVSegment:
        """A stored entry of the target's (info), gathered into out's buffer when it offers one; a same-host segment
        that holds this entry from an earlier fetch is reused as it is. NotFound when the entry is gone."""
        shape = (spec.num_layers, 2, spec.num_kv_heads, info.num_tokens, spec.head_dim)
        dtype = getattr(torch, spec.dtype)
        held = out is not None and self.store.device.type == "cpu"
        kept = out.reuse((info.key, info.serial), shape, dtype) if held else None
        if kept is not None:  # the destination has this entry's KV from an earlier fetch
            return self.store.touch(info.key, tenant, kept, info.serial)
        dest = out.out if isinstance(out, OnceOut) else out
        want = dest.dtype if isinstance(dest, PendingSegment) else None
        if held and want is not None and want != dtype:  # a same-host segment in another dtype (the engine's bf16):
            # converted into it once, kept under the tag, so later fetches copy nothing
            buffer = out.tensor(shape, want)
            if buffer is not None:
                stored = self.store.get(info.key, tenant)
                buffer.copy_(stored.kv)
                out.written(0, shape[0])
                return replace(stored, kv=buffer)
        buffer = out.tensor(shape, dtype) if held else None
        return self.store.get(info.key, tenant, out=buffer, written=out.written if buffer is not None else None)

    def _placed(self, target: ServedModel, adapter: Adapter, info: EntryInfo, projected: KVSegment,
                source_key: str, label: str, offset: int, lead: int) -> CacheResult:
        """The projection at positions offset.. (keys shifted by the target's RoPE when offset > 0); `lead`: 1 when it
        begins with the target's start token, 0 when with the document (`_lead`)."""
        t_t = projected.num_tokens
        if offset + t_t > target.max_positions:
            raise ValueError(f"offset {offset} + {t_t} projected tokens exceeds {target.lm.name!r}'s "
                             f"{target.max_positions} positions")
        if offset:
            moved = torch.arange(offset, offset + t_t)
            keys = target.lm.rope.shift_all(projected.keys.to(adapter.wk.device).float(), projected.positions, moved)
            projected = projected.with_keys(keys.to(projected.dtype).to(projected.device), moved, rotated=True)
        return CacheResult(segment=projected, entry_key=info.key, source_key=source_key, adapter=label,
                           adapter_digest=adapter.digest,
                           text=info.text, exact_coverage=float(info.annotations.get("exact_coverage", 0.0)),
                           mode="replace", document_index=lead)

    def _source_info(self, tenant: str, source_key: str | None) -> EntryInfo | None:
        """The source entry's info; None when there is none (or no key)."""
        if source_key is None:
            return None
        try:
            return self.store.info(source_key, tenant)
        except NotFound:
            return None

    def _lead(self, tenant: str, source_key: str | None) -> int:
        """1 when the projection of this source entry begins with the target's start token (a prefix entry), 0 when
        it holds the document's tokens alone (a "segment" entry of an Ingest with DETECT_SEGMENTS)."""
        if source_key is None:
            return 1
        try:
            return 0 if self.store.info(source_key, tenant).kind == "segment" else 1
        except NotFound:
            return 1
