"""The summarisation harness: one document, every mode (modes.py), measured. The target summarises a document whose
KV it got one way or another, then the same cache scores a held-out continuation of that document.

Layout of every request (target tokens): [start] + document + instruction, then greedy decoding of one line. The
document's KV differs by mode (modes.py: full, none, replace, recompute:r, tail:r, fuse, fuser, blend:r and its
variants, served:MODE); the instruction is always prefilled by the target over it. Modes that read projected KV read
it with the evaluator's induction prior unless their suffix says otherwise (modes.py).
The continuation (the document's next tokens after the truncated context) is scored with the same caches: its
first token is the input after the context in every mode, NLL is summed over the others (adapters.scoring, as the
adapter's own recovery is), and the target's top-1 prediction at each of those positions is kept (its agreement with
`full`'s is reported).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import torch
from kvbridge.adapters.answering import greedy as greedy  # re-exported: tests and the vLLM evaluation read it here
from kvbridge.adapters.answering import instruction_ids as instruction_ids
from kvbridge.adapters.answering import stop_ids as stop_ids
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.scoring import continuation_logits, summed_nll
from kvbridge.eval.flops import FlopModel
from kvbridge.eval.modes import BLEND_RULES, FRACTION_KINDS, NEEDS_PROJECTION, READS_PROJECTED, Mode
from kvbridge.eval.records import Record
from kvbridge.eval.records import read_records as read_records  # re-exported: tests and experiments read it here
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import tokenize
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.blend import BlendConfig
from kvbridge.transfer.suffix.correction import Correction, correct
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.reuse import first_layers_kv

# the modes that need the target's own prefill of the document
OWN_KINDS = ("full", "rounded", "exact", "fuse", "fuser")


@dataclass(frozen=True)
class EvalConfig:
    max_doc_tokens: int = 512  # the document is cut to this many target tokens (at a token boundary)
    continuation_tokens: int = 32  # held out after the cut, for NLL; shorter documents give up context for it
    min_doc_tokens: int = 32  # documents with less context than this are skipped
    max_new_tokens: int = 24  # greedy summary length; the first line break after some text also ends it
    # A completion prompt, not the chat template: SmolLM2's template puts its default system prompt between the
    # document and the request, and the model then describes itself. Until 2026-12-05 "\n\nOne-line summary of the
    # text above:", whose own answer (`full`) was a repeated request ("The one-line summary of the text above is:",
    # the content on a next line no answer reached) on 57 of the 100 held-out pydoc pages: fidelity compared those
    # preambles. This one was chosen among 6 wordings (none an answer window's) on pages 100-159 of
    # pydoc_summaries.jsonl by `full`'s answers alone (no preamble: 2 of 60; ROUGE-L vs the reference 0.142, the old
    # 0.061): docs/quality.md, "The instruction".
    instruction: str = "\n\nSummary (one sentence):"
    fuse_steps: int = 20  # Adam steps fitting fuse's gates (eval.gates)
    # Modes that read projected KV read it with the target's induction prior (transfer.suffix.induction), but for
    # those named with /noprior (or /probe: the probe's prior); False: every mode reads it as it is.
    induction_prior: bool = True

    def __post_init__(self):
        if self.min_doc_tokens < 2 or self.max_doc_tokens < self.min_doc_tokens:
            raise ValueError(f"need 2 <= min_doc_tokens ({self.min_doc_tokens}) <= max_doc_tokens "
                             f"({self.max_doc_tokens})")
        if self.continuation_tokens < 2:
            raise ValueError(f"continuation_tokens must be >= 2 (the first is input), got {self.continuation_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.instruction.strip():
            raise ValueError(f"the instruction asks the target for its answer after the document; got "
                             f"{self.instruction!r}, which asks nothing")


@dataclass(frozen=True)
class PreparedDoc:
    record: Record
    text: str  # the document cut to the context
    target_ids: torch.Tensor  # [1 + D]: start token + the context's target tokens
    continuation: torch.Tensor  # [N] the document's next target tokens

    @property
    def doc_tokens(self) -> int:
        return self.target_ids.numel() - 1


def prepare(record: Record, target: LoadedModel, config: EvalConfig) -> PreparedDoc | None:
    """The record cut to at most max_doc_tokens of context plus a held-out continuation; None if too short."""
    tok = tokenize(target.tokenizer, record.document, add_special_tokens=False)
    n = len(tok)
    context = clean_cut(tok.offsets, min(config.max_doc_tokens, n - config.continuation_tokens))
    if context < config.min_doc_tokens:
        return None
    text = record.document[:int(tok.offsets[context - 1, 1])]
    ids = tokenize(target.tokenizer, text, add_special_tokens=False).ids  # as the service tokenizes the text
    start = torch.tensor([start_token_id(target.tokenizer)])
    cont = tok.ids[context:context + config.continuation_tokens]
    return PreparedDoc(record, text, torch.cat((start, ids)), cont)


def clean_cut(offsets: torch.Tensor, context: int) -> int:
    """The most tokens, up to `context`, after which the text can be cut: a tokenizer that spells a character in
    several byte tokens gives each of them the whole character's offsets, and a cut after the first would keep the
    whole character in the text (one token more than asked) and its other bytes in the continuation too."""
    while 1 < context < offsets.shape[0] and int(offsets[context, 0]) < int(offsets[context - 1, 1]):
        context -= 1
    return context


@torch.no_grad()
def continuation_scores(target: LoadedModel, context: KVSegment, continuation: torch.Tensor
                        ) -> tuple[float, list[int]]:
    """(summed NLL (nats) of continuation[1:] after `context` with continuation[0] as the first input, the target's
    top-1 token at each of those positions)."""
    scored = continuation_logits(target, context, continuation)[0, :-1].float()  # [N - 1, V] predicting [1:]
    return float(summed_nll(scored, continuation[1:])), scored.argmax(-1).tolist()


def fuse_gated(own: KVSegment, projected: KVSegment, gates: torch.Tensor) -> KVSegment:
    """fuse: (1 - g) · own + g · projected per layer, K and V apart (gates [L, 2] in [0, 1]); the start token
    (index 0) keeps the target's own KV."""
    if own.kv.shape != projected.kv.shape or not torch.equal(own.token_ids, projected.token_ids):
        raise ValueError("fuse needs the target's own KV and the projected KV of the same tokens")
    g = gates.to(own.kv)[:, :, None, None, None]  # [L, 2, 1, 1, 1]
    kv = own.kv.clone()
    kv[:, :, :, 1:] = (1 - g) * own.kv[:, :, :, 1:] + g * projected.kv[:, :, :, 1:].to(own.kv)
    return KVSegment(kv=kv, token_ids=own.token_ids, positions=own.positions, model=own.model, rotated=True)


@dataclass
class ModeResult:
    summary: str
    summary_ids: list[int]
    ttft_s: float  # fetch + the target's own prefills + the instruction's forward to the first token (the first
    #                fetch of a document: the server projects it, and computes a served correction from that)
    prefill_tokens: int  # target tokens prefilled before the first token (context part + instruction)
    prefill_flops: int
    kv_bytes: int  # KV bytes received from the service for this request
    nll: float | None  # summed NLL of the continuation (None: no continuation)
    nll_tokens: int
    continuation_top1: list[int] | None = None  # the target's argmax at each scored continuation position
    ttft_warm_s: float | None = None  # the same with a warm fetch (the server's store has the projected KV)
    loaded_tokens: int | None = None  # --engine vllm: prompt tokens the connector loaded into vLLM (whole blocks)
    # FLOPs the server computed once for this document in this mode and shares with every later request: a served
    # correction's target forwards (report._system_flops divides them by N, as the projection); not in prefill_flops
    shared_flops: int = 0
    rouge: dict[str, float] | None = None  # F1 by type, filled in by eval.report.summarise


@dataclass
class DocumentResult:
    id: str
    reference: str
    doc_tokens: int
    modes: dict[str, ModeResult] = field(default_factory=dict)
    fetch_s: float = 0.0  # the first (cold) fetch of the projection
    warm_fetch_s: float = 0.0  # a second fetch of it (a store hit)
    exact_coverage: float | None = None
    source_tokens: int | None = None  # tokens the source read for the projected modes (None: none projected)


def served_forwards(correction: str, doc_tokens: int, layers: int, recomputed: int | None = None) -> list[tuple]:
    """The target's forwards of the server's correction `correction` ("blend:0.1", "recompute:0.1") of a projected
    document of `doc_tokens` tokens, on a target of `layers` layers: the plan the server's `correct` runs
    (Correction.forwards), in the form SummaryEvaluator._context gives FlopModel.prefill the forwards of the same
    correction run in process: (new, past) through every layer, (new, past, layers) for a pass through fewer.
    `recomputed`: the document tokens the server says it recomputed (None where it does not say), checked against
    the plan's."""
    parsed = Correction.parse(correction, "correction")
    k = parsed.tokens(doc_tokens)
    if recomputed is not None and recomputed != k:
        raise ValueError(f"correction {correction!r} of {doc_tokens} document tokens recomputes {k} of them; "
                         f"the server says it recomputed {recomputed}")
    return [f[:2] if f[2] == layers else f for f in parsed.forwards(doc_tokens, layers)]


def run_documents(run, docs: list[PreparedDoc], desc: str, progress: bool = True
                  ) -> tuple[list[DocumentResult], tuple[str, BaseException] | None]:
    """`run` (an evaluator's) over `docs` in order, with a progress bar, until one raises (or the user interrupts):
    (the results of the documents before it, (its id, the exception) or None when every one finished)."""
    from tqdm import tqdm

    results = []
    for doc in tqdm(docs, desc=desc, disable=not progress):
        try:
            results.append(run(doc))
        except (Exception, KeyboardInterrupt) as exc:
            return results, (doc.record.id, exc)
    return results, None


class ProjectedSource:
    """Where projected documents come from: a KVBridgeClient (ingest once, then fetch the projection by key)."""

    def __init__(self, client, target: LoadedModel, adapter: str = ""):
        self.client, self.target, self.adapter = client, target, adapter
        self.adapter_digest = ""  # of the adapter the last fetch was projected by (its header's), for the prior check

    def fetch(self, text: str, mode: str = "replace"):
        """(the cache the server serves in `mode`, seconds of the first fetch (cold: the server projects, and
        corrects), seconds of a second one (warm: a store hit), source tokens the server read)."""
        entry = self.client.ingest(text=text).entries[0]  # the source reads the document once; not in TTFT
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            fetched = self.client.fetch_projected(key=entry.key, target_model=self.target.name,
                                                  adapter=self.adapter, mode=mode)
            seconds.append(time.perf_counter() - t0)
        self.adapter_digest = fetched.adapter_digest
        return fetched, seconds[0], seconds[1], entry.num_tokens


class SummaryEvaluator:
    """Runs every mode on prepared documents. `source` gives projected documents (None: only full, none and tail
    modes can run); `gates` [L, 2] are fuse's; `fuser` (adapters.fuser.Fuser) is the fuser mode's."""

    def __init__(self, target: LoadedModel, modes: list[Mode], config: EvalConfig | None = None,
                 source: ProjectedSource | None = None, gates: torch.Tensor | None = None, fuser=None,
                 prior_file: str | None = None):
        if source is None and any(m.kind in NEEDS_PROJECTION for m in modes):
            raise ValueError("replace, recompute and fuse modes need a projected source (a kvbridge server)")
        if any(m.kind == "fuse" for m in modes) and gates is None:
            raise ValueError("the fuse mode needs gates (eval.gates.fit_gates)")
        if any(m.kind == "fuser" for m in modes) and fuser is None:
            raise ValueError("the fuser mode needs a trained fuser (train-adapter --trainer fuser; --fuser FILE)")
        self.fuser = fuser
        self.config = config or EvalConfig()
        wanted = {m.prior for m in modes if m.kind in READS_PROJECTED} if self.config.induction_prior else set()
        # the priors the modes read with, by Mode.prior; self.prior is the one the modes without a suffix read with
        # (prior_file: a fitted file in place of the one that ships for the target, checked to be the target's)
        model = (lambda lm: InductionPrior.load_for(prior_file, lm)) if prior_file else InductionPrior.for_model
        self.priors = {name: make(target) for name, make in (("model", model),
                                                              ("probe", InductionPrior.probed)) if name in wanted}
        self.prior = self.priors.get("model")
        self.target, self.modes, self.source, self.gates = target, modes, source, gates
        self.prompt = instruction_ids(target, self.config.instruction)
        self.stop = stop_ids(target)
        self.flops = FlopModel.from_config(target.model.config)

    def _own(self, ids: torch.Tensor) -> tuple[KVSegment, float]:
        t0 = time.perf_counter()
        seg = kvcache.extract(self.target.model, self.target.spec, ids)
        return seg, time.perf_counter() - t0

    def run(self, doc: PreparedDoc) -> DocumentResult:
        result = DocumentResult(doc.record.id, doc.record.summary, doc.doc_tokens)
        projected, fetch_s, wire = None, 0.0, 0
        if any(m.kind in NEEDS_PROJECTION for m in self.modes):
            fetched, fetch_s, result.warm_fetch_s, result.source_tokens = self.source.fetch(doc.text)
            projected, wire = fetched.segment, fetched.wire_bytes
            if not torch.equal(projected.token_ids, doc.target_ids):
                raise RuntimeError(f"{doc.record.id}: the service projected other target tokens than the target's "
                                   "own tokenization of the document")
            kvcache.check_compatible(projected, self.target.spec)
            result.fetch_s, result.exact_coverage = fetch_s, fetched.exact_coverage
        own, own_s = (self._own(doc.target_ids) if any(m.kind in OWN_KINDS for m in self.modes)
                      else (None, 0.0))
        served_cold: dict[str, float] = {}  # a served correction -> its first (cold) fetch's seconds, this document
        for mode in self.modes:
            prior = self.priors.get(mode.prior)
            warm_s = None  # base seconds with a warm fetch
            if mode.kind == "served":
                context, base_s, warm_s, kv_bytes, still = self._served(mode, doc)
                recomputed = int((~still[1:]).sum())  # document tokens the server's correction recomputed
                shared = sum(self.flops.prefill(*f) for f in served_forwards(mode.correction, doc.doc_tokens,
                                                                              self.flops.layers, recomputed))
                if projected is not None:  # found stored (fetched above): a new user's first request projects too
                    base_s += fetch_s - result.warm_fetch_s
                # served:C/noprior after served:C fetched a stored correction: its cold is the first fetch's
                base_s = served_cold.setdefault(mode.correction, base_s)
                prefills = []  # no target pass at request time: the server corrected the KV once, before (shared)
            else:
                shared = 0
                context, base_s, prefills, kv_bytes, still = self._context(mode, doc, own, own_s, projected,
                                                                           fetch_s, wire, prior)
                if mode.kind in NEEDS_PROJECTION:  # each of them counts the cold fetch in its base seconds
                    warm_s = base_s - fetch_s + result.warm_fetch_s
            if prior is not None and mode.kind in BLEND_RULES:  # blend's selection pass made the first m layers exact
                prior = prior.from_layer(BlendConfig(fraction=mode.fraction, rule=BLEND_RULES[mode.kind]).exact_layers)
            if prior is not None and mode.kind == "layers":  # the first k layers are the target's own
                prior = prior.from_layer(mode.layers)
            reading = (prior.reading(self.target, context.token_ids, still)
                       if prior is not None and still is not None else contextlib.nullcontext())
            with reading:
                ids, first_s = greedy(self.target, context, self.prompt, self.config.max_new_tokens, self.stop,
                                      one_line=True)
                nll, top1 = (continuation_scores(self.target, context, doc.continuation)
                             if doc.continuation.numel() >= 2 else (None, None))
            prefills.append((self.prompt.numel(), context.num_tokens))  # (new, past[, layers of a partial pass])
            result.modes[mode.name] = ModeResult(
                summary=self.target.tokenizer.decode(ids, skip_special_tokens=True).strip(), summary_ids=ids,
                ttft_s=base_s + first_s, prefill_tokens=sum(f[0] for f in prefills if len(f) == 2),
                prefill_flops=sum(self.flops.prefill(*f) for f in prefills), kv_bytes=kv_bytes,
                nll=nll, nll_tokens=max(doc.continuation.numel() - 1, 0), continuation_top1=top1,
                ttft_warm_s=(warm_s if warm_s is not None else base_s) + first_s, shared_flops=shared)
        return result

    def _served(self, mode: Mode, doc: PreparedDoc):
        """(context, cold seconds, warm seconds, KV bytes, [C] still projected) of a served correction."""
        fetched, cold_s, warm_s, _ = self.source.fetch(doc.text, mode=mode.correction)
        if fetched.mode != mode.correction or not torch.equal(fetched.segment.token_ids, doc.target_ids):
            raise RuntimeError(f"{doc.record.id}: the server served {fetched.mode!r} of other tokens, asked for "
                               f"{mode.correction!r} of the document")
        still = fetched.still_projected()  # the start token and the recomputed tokens are the target's own KV
        return fetched.segment, cold_s, warm_s, fetched.wire_bytes, still

    def _context(self, mode: Mode, doc: PreparedDoc, own, own_s, projected, fetch_s, wire, prior):
        """(context KV at 0..C-1, seconds spent building it, [(prefilled, past)] target forwards, KV bytes, [C] bool:
        the positions whose KV is still projected, or None where the target computed all of it). The forwards that
        recompute tokens over projected KV read it with `prior` (None: as it is)."""
        d = doc.doc_tokens
        k = max(1, round(mode.fraction * d)) if mode.kind in FRACTION_KINDS else 0
        still = torch.zeros(d + 1, dtype=torch.bool)  # the start token's KV is the target's own
        if mode.kind == "full":
            return own, own_s, [(d + 1, 0)], 0, None
        if mode.kind == "rounded":  # full's KV through a narrower dtype and back
            rounded = own.kv.to(getattr(torch, mode.correction)).to(own.kv.dtype)
            return replace(own, kv=rounded), own_s, [(d + 1, 0)], 0, None
        if mode.kind == "exact":  # analysis: full's own KV in layers a..b-1, projected elsewhere, no prior; it
            # fetches the projection and prefills the document: both in its seconds, as fuse's
            kv = projected.slice(0, d + 1).kv.clone()
            kv[mode.layers:mode.upto] = own.kv[mode.layers:mode.upto].to(kv)
            return replace(projected.slice(0, d + 1), kv=kv), fetch_s + own_s, [(d + 1, 0)], wire, None
        if mode.kind == "none":
            seg, s = self._own(doc.target_ids[:1])
            return seg, s, [(1, 0)], 0, None
        if mode.kind == "replace":
            still[1:] = True
            return projected, fetch_s, [], wire, still
        if mode.kind == "tail":
            seg, s = self._own(torch.cat((doc.target_ids[:1], doc.target_ids[d + 1 - k:])))
            return seg, s, [(k + 1, 0)], 0, None
        if mode.kind == "recompute" or mode.kind in BLEND_RULES:  # the same code as the server's corrections
            t0 = time.perf_counter()
            kind = "recompute" if mode.kind == "recompute" else "blend"
            rule = BLEND_RULES.get(mode.kind, "attention")
            fixed = correct(self.target, projected.slice(0, d + 1), Correction(kind, k / d, rule), prior=prior,
                            probe_ids=self.prompt if rule == "prompt" else None)
            # a forward through every layer counts its tokens as prefilled; a selection pass over the first
            # layers keeps its layer count
            layers = self.target.spec.num_layers
            forwards = [f[:2] if f[2] == layers else f for f in fixed.forwards]
            return fixed.segment, fetch_s + time.perf_counter() - t0, forwards, wire, fixed.still_projected
        if mode.kind == "layers":  # the target's own first k layers over the document, projected above them
            t0 = time.perf_counter()
            seg = projected.slice(0, d + 1)
            m = min(mode.layers, self.target.spec.num_layers)
            own_first = first_layers_kv(self.target, seg.slice(0, 1), doc.target_ids[1:d + 1], m)  # [m, 2, H, d, D]
            kv = seg.kv.clone()
            kv[:m, :, :, 1:] = own_first.to(kv)
            still[1:] = True  # per token: still projected in the layers from m on
            return replace(seg, kv=kv), fetch_s + time.perf_counter() - t0, [(d, 1, m)], wire, still
        if mode.kind == "fuse":  # every token's KV mixes the target's own with the projected: no prior
            t0 = time.perf_counter()
            seg = fuse_gated(own, projected, self.gates)
            return seg, fetch_s + own_s + time.perf_counter() - t0, [(d + 1, 0)], wire, None
        if mode.kind == "fuser":  # the source's prefill and the fuser's maps run here too: in neither its TTFT nor
            # its FLOPs (report._system_flops counts a source prefill only for the modes that fetch a projection)
            seg = self.fuser.fuse(own, doc.text)
            return seg, own_s, [(d + 1, 0)], 0, None
        raise AssertionError(mode.kind)
