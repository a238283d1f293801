"""Where a projected document sits in a target prompt.

A stored projection is the target's start token then the document's target tokens (`pair_text`), at positions 0..
Prompts as users send them put other tokens first (a chat template, a system prompt, an instruction), or lack the
start token (a text prompt to a tokenizer that adds none). `locate` finds the document in the prompt; the server
then serves the target's own KV of the prompt's tokens before it (computed exactly, `Projecting.prompt_cache`) and
the projected document after them, its keys moved to its positions in the prompt by RoPE.

Tokenizers may cut the document's first tokens differently when text precedes it ("Document: The" makes " The");
such tokens belong to the head (the target computes them) and the document is served from its first token that
the prompt has as it is.

What is placed is kept: the head's own KV under the namespace "prompt-head" (a chat template and a system prompt
repeat across requests), and the whole placed cache (head, then the document moved) as an entry of its own, linked
to the source entry (deleted with it) under "placed|<adapter>|<correction>#<source key>", so that the next prompt with
the same head and document is a warm fetch like a plain one: gathered into the same-host segment, or not copied at
all when the segment holds it already. Each distinct head costs the store one more copy of the document's projected
KV (evicted like any entry).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from kvbridge.server.corrections import MODE, RECOMPUTED, recomputed_of
from kvbridge.server.projecting import CacheResult, KVOut, ServedModel, decoded_text, digest_label
from kvbridge.server.undo import undoable
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import start_token_id, tokenize
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.segment import KVSegment

HEADS = "prompt-head"  # the store namespace of the target's own KV of prompts' heads
PLACED = "placed"  # the store namespaces of placed caches: "placed|<adapter label>|<correction>#<source key>"
PROJECTION = "projection"  # a placed cache's annotations: the key of the projected entry it was placed from,
ADAPTER = "adapter"  # and the adapter's "name@version"
DIGEST = "adapter_digest"  # and its content digest (Adapter.digest: what a reader checks its prior against)
PROBE = 8  # document tokens that must follow one another in the prompt for it to be placed there
MAX_SKIP = 4  # leading document tokens the prompt may cut otherwise (merged with the text before it)
NO_START = -1  # in the start token's place before a segment entry's document tokens (never a prompt's token)


@dataclass(frozen=True)
class Located:
    head: int  # prompt tokens before the served document tokens: the target computes their own KV
    skip: int  # leading document tokens not served (the prompt cuts them otherwise; they are in the head)
    as_stored: bool  # the prompt begins with the stored cache's own tokens (start token, document): serve it as is
    cut: int = 0  # last document tokens not served: the prompt ends, or goes on otherwise (an edit), before them


def _common(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def locate(prompt: Sequence[int], cache_ids: Sequence[int], probe: int = PROBE, max_skip: int = MAX_SKIP) -> Located:
    """Where the document of a stored projection (`cache_ids`: start token, then the document's target tokens)
    begins in `prompt`: the first place where `probe` of its tokens (all of them when it has fewer), from the
    `skip`-th on, follow one another, for the smallest skip < max_skip. The served cache ends where the prompt stops
    holding the document (`cut`: the prompt ends before the document does, or goes on otherwise: an edited text, a
    last token merged with the text after it), so it never holds KV of tokens the prompt does not have; the prompt's
    tokens after it are the caller's to prefill. ValueError (a sentence) when there is no such place."""
    if probe < 1 or max_skip < 1:
        raise ValueError(f"probe and max_skip must be >= 1, got {probe} and {max_skip}")
    prompt, doc = list(prompt), list(cache_ids[1:])
    if not doc:
        raise ValueError("the projected cache holds no document tokens")
    n = min(probe, len(doc))
    if prompt[:n + 1] == list(cache_ids[:n + 1]):
        cut = len(doc) - _common(prompt[1:], doc)
        return Located(head=1, skip=0, as_stored=not cut, cut=cut)
    for skip in range(min(max_skip, len(doc))):
        run = doc[skip:skip + probe]
        if len(run) < n:  # a short document's last tokens: fewer than the run the error names (a "." would do)
            break
        first = run[0]
        for h in range(len(prompt) - len(run) + 1):
            if prompt[h] == first and prompt[h:h + len(run)] == run:
                held = _common(prompt[h:], doc[skip:])
                return Located(head=h, skip=skip, as_stored=False, cut=len(doc) - skip - held)
    raise ValueError(f"the prompt ({len(prompt)} tokens) does not hold the document's target tokens: none of its "
                     f"first {min(max_skip, len(doc))} tokens starts a run of {n} of them in the prompt (is it the "
                     "same text, tokenized by the target's tokenizer?)")


class Placing:
    """Prompt placement, a part of KVBridgeService beside `Projecting` (whose store, models, adapters, corrections
    and projected caches it uses)."""

    @undoable
    def prompt_cache(self, tenant: str, prompt: list[int], key: str | None = None, text: str | None = None,
                     target_model: str = "", adapter: str = "", require_cached: bool = False, out: KVOut | None = None,
                     mode: str = "") -> CacheResult:
        """The projected (and corrected) cache for a target prompt that holds the document (server/prompt_place.py):
        the target's own KV of the prompt's tokens before the document, then the document's projected KV at its
        positions in the prompt. A prompt that begins with the stored cache's tokens gets `projected_cache` at
        offset 0 (gathered into `out` when warm)."""
        target = self.model(target_model, "target")
        spec = target.lm.spec
        if not prompt:
            raise ValueError("prompt: no token ids")
        bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside {spec.name!r}'s vocabulary of {spec.vocab_size}")
        if len(prompt) > target.max_positions:
            raise ValueError(f"prompt: {len(prompt)} tokens exceed {spec.name!r}'s {target.max_positions} positions")
        key = key or self._cached_source_key(tenant, text)
        lead = self._lead(tenant, key)  # 1: the stored projection begins with the start token; 0: a segment entry's
        document = self._document_ids(tenant, target, key, text, lead)
        if document is not None:  # a prompt that does not hold it, or holds it past the target's positions, is
            where = locate(prompt, document)  # refused here, before anything is computed or stored
            if where.as_stored:  # the warm fast path
                return self.projected_cache(tenant, key, text, target_model, adapter, 0, require_cached, out, mode)
            _check_fits(where, len(document) - 1 - where.skip - where.cut, target)
            namespace = self._placed_namespace(tenant, target, key, text, adapter, mode)
            if namespace is not None:  # placed before for this head: as warm as a plain fetch
                kept = self._kept_placement(tenant, target, namespace, prompt[:where.head]
                                            + document[1 + where.skip:len(document) - where.cut], out, where.head,
                                            where.cut)
                if kept is not None:
                    return kept
        base = self.projected_cache(tenant, key, text, target_model, adapter, 0, require_cached, None, mode)
        seg = base.segment
        lead = base.document_index  # as the source entry the projection was made from is
        where = locate(prompt, [NO_START] * (1 - lead) + seg.token_ids.tolist())
        if where.as_stored:
            return base
        first = lead + where.skip  # the first served document token in the stored cache
        end = seg.num_tokens - where.cut  # and the last's end
        served = end - first
        _check_fits(where, served, target)
        doc = seg.slice(first, end)
        moved = torch.arange(where.head, where.head + served)
        keys = target.lm.rope.shift_all(doc.keys.float(), doc.positions, moved)
        doc = doc.with_keys(keys.to(doc.dtype), moved, rotated=True)
        parts = [doc]
        if where.head:
            parts.insert(0, self._own_head(tenant, target, prompt[:where.head]).to(device=doc.device, dtype=doc.dtype))
        shift = where.head - first
        placed = replace(base, segment=KVSegment.concat(parts),
                         recomputed=tuple(p + shift for p in base.recomputed if first <= p < end),
                         document_index=where.head, document_cut=where.cut)
        # the namespace of the adapter that made `base` (a default changed since, LoadAdapter make_default, must not
        # file this placement under another adapter's name)
        namespace = self._namespace(target, base.source_key, base.adapter, base.adapter_digest, mode, lead)
        self._put(placed.segment, tenant, kind="prefix", adapter=namespace, text=base.text,
                  source_key=base.source_key, source_serial=base.source_serial,
                  annotations={"exact_coverage": base.exact_coverage, MODE: placed.mode, ADAPTER: base.adapter,
                               DIGEST: base.adapter_digest, RECOMPUTED: ",".join(map(str, placed.recomputed)),
                               PROJECTION: base.entry_key})
        self._count("placement", computed=placed.segment.num_tokens)
        return placed

    def _placed_namespace(self, tenant: str, target: ServedModel, key: str | None, text: str | None, adapter: str,
                          mode: str) -> str | None:
        """The store namespace of this source entry's placed caches through this adapter and correction; None when
        the server holds no source entry for the text."""
        source_key = key or self._cached_source_key(tenant, text)
        if source_key is None:
            return None
        label, chosen = self.adapters.resolve(adapter, self.models[self.source_name].lm.spec, target.lm.spec, tenant)
        return self._namespace(target, source_key, label, chosen.digest, mode, self._lead(tenant, source_key))

    def _namespace(self, target: ServedModel, source_key: str, label: str, digest: str, mode: str, lead: int) -> str:
        """A placed cache's store namespace: its source entry, the adapter (label and digest: `digest_label`) and
        the correction, with the prior a correction's KV was computed with and, for a segment entry's (`lead` 0),
        "/after-start", as the stored corrections' say: a placement that a server before it made from such a
        correction (computed without the start token) is never adopted through Redis."""
        correction = self.corrections.resolve(mode)
        prior = self.corrections.prior_tag(target.lm) if correction.kind != "replace" else ""
        after = "/after-start" if correction.kind != "replace" and not lead else ""
        return f"{PLACED}|{digest_label(label, digest)}|{correction}{prior}{after}#{source_key}"

    def _kept_placement(self, tenant: str, target: ServedModel, namespace: str, ids: list[int],
                        out: KVOut | None, head: int, cut: int) -> CacheResult | None:
        """The placed cache of these tokens (the prompt's `head` tokens, then the document but for its last `cut`)
        when the store holds it, gathered as a warm plain fetch is; None otherwise."""
        spec = target.lm.spec
        found = self.store.lookup(torch.tensor(ids, dtype=torch.int64), tenant, spec.identity, spec.dtype,
                                  adapter=namespace).key
        if found is None:
            return None
        try:
            info = self.store.info(found, tenant)
            segment = self._gathered(info, tenant, spec, out)
        except NotFound:  # evicted or deleted in between: placed again
            return None
        notes = info.annotations
        self._count("placement", reused=segment.num_tokens)
        return CacheResult(segment=segment, entry_key=str(notes.get(PROJECTION, info.key)),
                           source_key=namespace.rsplit("#", 1)[1], adapter=str(notes.get(ADAPTER, "")),
                           text=info.text, exact_coverage=float(notes.get("exact_coverage", 0.0)),
                           mode=str(notes.get(MODE, "")),
                           recomputed=tuple(recomputed_of(notes, segment.num_tokens)),
                           adapter_digest=str(notes.get(DIGEST, "")), document_index=head, document_cut=cut)

    def _own_head(self, tenant: str, target: ServedModel, ids: list[int]) -> KVSegment:
        """The target's own KV of a prompt's tokens before its document, at positions 0..: computed once, then kept in
        the store like any entry (namespace HEADS: a chat template and system prompt repeat across requests)."""
        spec = target.lm.spec
        tokens = torch.tensor(ids, dtype=torch.int64)
        found = self.store.lookup(tokens, tenant, spec.identity, spec.dtype, adapter=HEADS).key
        if found is not None:
            try:
                head = self.store.get(found, tenant)
                self._count("prompt_head", reused=len(ids))
                return head
            except NotFound:  # evicted in between: compute it again
                pass
        with target.lock:
            head = kvcache.extract(target.lm.model, spec, tokens)
        self._count("prompt_head", computed=len(ids))
        self._put(head, tenant, kind="prefix", adapter=HEADS)
        return head

    def _document_ids(self, tenant: str, target: ServedModel, key: str | None, text: str | None,
                      lead: int = 1) -> list[int] | None:
        """The stored projection's target ids (start token, document) from the text, without fetching (a segment
        entry's, `lead` 0, with NO_START in the start token's place: `locate` then never serves it as stored);
        an uploaded entry's (PutSourceKV keeps no text) from the text its source ids decode to, as its projection
        pairs it (`Projecting._paired`); None when the server does not know the text."""
        if text is None and key is not None:
            try:
                info = self.store.info(key, tenant)
                if info.text is None and info.kind == "prefix" and not info.adapter:
                    ids = self._uploaded_ids(tenant, target, key)
                    return None if ids is None else list(ids)
            except NotFound:
                return None
            text = info.text
        if not text or not text.strip():
            return None
        # every prompt-carrying fetch asks (each connector load): ~10 ms of tokenizing for 1,024 tokens, kept
        # per tenant: how fast a refused probe of a text is answered must not tell whether another tenant asked it
        digest = (tenant, target.lm.name, hashlib.blake2b(text.encode(), digest_size=16).digest())
        ids = self.document_ids.get(digest)
        if ids is None:
            ids = _target_ids(target, text)
            self.document_ids.put(digest, ids)
        return [ids[0] if lead else NO_START, *ids[1:]]

    def _uploaded_ids(self, tenant: str, target: ServedModel, key: str) -> tuple[int, ...] | None:
        """The target ids of an uploaded source entry's projection: its source ids decoded and tokenized again,
        kept by the entry's key (a content key: the same key holds the same tokens); None when they do not come
        back from their text (its projection is refused then, before anything is stored)."""
        kept = (target.lm.name, "entry", key)
        ids = self.document_ids.get(kept)
        if ids is None:
            source = self.models[self.source_name].lm
            if source.tokenizer is None:
                return None
            text = decoded_text(source, self.store.token_ids(key, tenant))
            if text is None or not text.strip():
                return None
            ids = _target_ids(target, text)
            self.document_ids.put(kept, ids)
        return ids


def _target_ids(target: ServedModel, text: str) -> tuple[int, ...]:
    """A stored projection's target ids: the target's start token, then the text's target tokens."""
    tokenizer = target.lm.tokenizer
    return start_token_id(tokenizer), *tokenize(tokenizer, text, add_special_tokens=False).ids.tolist()


def _check_fits(where: Located, served: int, target: ServedModel) -> None:
    """ValueError when the document's `served` tokens, placed where the prompt has them, pass the target's
    positions."""
    if where.head + served > target.max_positions:
        raise ValueError(f"prompt: the document at position {where.head} ({served} tokens) exceeds "
                         f"{target.lm.spec.name!r}'s {target.max_positions} positions")
    kvcache.check_rope_window(target.lm.spec, where.head + served)


class KeptIds:
    """A small LRU map (tenant, target name, text digest) -> the target ids of that document, thread-safe."""

    def __init__(self, size: int = 1024):  # a few KB per document
        self.size, self._ids, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key: tuple) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids

    def put(self, key: tuple, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._ids[key] = ids
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)
