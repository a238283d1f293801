"""The evaluation's measurements on synthetic inputs: TTFT bookkeeping of both harnesses, record ids, and the
report's degenerate cases."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from kvbridge.eval.modes import parse_modes
from kvbridge.eval.records import read_records
from kvbridge.eval.report import markdown_table, summarise
from kvbridge.eval.summaries import (
    DocumentResult,
    EvalConfig,
    ModeResult,
    ProjectedSource,
    SummaryEvaluator,
    prepare,
)
from kvbridge.eval.vllm_eval import VLLMEvaluator
from kvbridge.server.replies import FetchedCache
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path
from kvbridge.transfer.suffix.correction import Correction

SAMPLE = data_path("pydoc_summaries_sample.jsonl")

# a store read, a projection's first fetch (the server projects), the correction computed over a stored projection
COLD_FETCH_S, WARM_FETCH_S, CORRECT_S, ENGINE_S = 1.0, 0.1, 0.5, 0.05


def store_fetch_s(stored: set[str], mode: str) -> float:
    """Seconds of a server fetch of one document's cache in `mode` from a store holding `stored` (modes), which it
    adds to: a served correction (any mode but replace) is computed over the plain projection, projected first
    where the store has none (as server/projecting.py does)."""
    seconds = WARM_FETCH_S if "replace" in stored else COLD_FETCH_S
    if mode != "replace" and mode not in stored:
        seconds += CORRECT_S
    stored.update(("replace", mode))
    return seconds


class StoreEngine:
    """Stands in for kvbridge.vllm.engine.EngineProcess (a vLLM child process, minutes to start): every request
    fetches its kvbridge cache from a server store that computes a cache at its first fetch and serves it from then on
    (store_fetch_s); the answer is the prompt's last token. `recomputed`: a served mode's correction -> the document
    tokens the server says it recomputed (the connector's count; None: not said, as before the connector said it)."""

    def __init__(self, recomputed=None):
        self.stored: dict[str, set[str]] = {}  # document key -> the modes stored
        self.recomputed = recomputed or (lambda mode: None)

    def _fetch(self, kvbridge: dict | None) -> float:
        if not kvbridge:
            return 0.0
        return store_fetch_s(self.stored.setdefault(kvbridge["key"], set()), kvbridge["mode"])

    def generate(self, prompt: list[int], max_tokens: int = 16, kvbridge: dict | None = None) -> dict:
        fetch_s = self._fetch(kvbridge)
        return {"token_ids": prompt[-1:] * max_tokens, "seconds": fetch_s + ENGINE_S, "kvbridge_error": None,
                "kvbridge_fetch_s": fetch_s, "kvbridge_wire_bytes": 100 if kvbridge else 0,
                "loaded_tokens": len(prompt) - 8 if kvbridge else 0,
                "kvbridge_recomputed_tokens": self.recomputed(kvbridge["mode"]) if kvbridge else None}

    def score(self, prompt: list[int], score_from: int, kvbridge: dict | None = None) -> dict:
        reply = self.generate(prompt, 1, kvbridge)
        reply["prompt_scores"] = [[-1.0, t] for t in prompt[score_from:]]
        return reply


class IngestClient:
    def ingest(self, text: str):
        return SimpleNamespace(entries=[SimpleNamespace(key="doc-key", num_tokens=len(text.split()))])


def test_vllm_cold_ttft_of_a_mode_reading_an_earlier_modes_cache_counts_the_cold_fetch(tiny_target):
    """recompute:r reads replace's projection: after replace fetched it, recompute's first request is a store hit.
    Its cold TTFT counts the document's cold fetch, as the in-process harness counts it (it was a warm one)."""
    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    record = SimpleNamespace(id="d", document=" ".join(f"word{i} tells" for i in range(60)), summary="")
    doc = prepare(record, tiny_target, config)
    modes = parse_modes("full,replace,recompute:0.5,served:blend:0.1,served:blend:0.1/noprior")
    result = VLLMEvaluator(StoreEngine(), IngestClient(), tiny_target, modes, config).run(doc)
    cold = COLD_FETCH_S + ENGINE_S
    warm = WARM_FETCH_S + ENGINE_S
    assert result.modes["full"].ttft_s == pytest.approx(ENGINE_S)
    for name in ("replace", "recompute:0.5", "served:blend:0.1", "served:blend:0.1/noprior"):
        served = CORRECT_S if name.startswith("served") else 0.0
        assert result.modes[name].ttft_s == pytest.approx(cold + served), name
        assert result.modes[name].ttft_warm_s == pytest.approx(warm), name
    assert (result.fetch_s, result.warm_fetch_s) == (COLD_FETCH_S, WARM_FETCH_S)


def test_vllm_cold_ttft_of_a_served_correction_after_replace_counts_the_projection(tiny_target):
    """served:C after replace: the server found replace's projection in its store and computed only the correction,
    a store hit a new user's first served request does not get. Its cold TTFT (and served:C/noprior's, the same
    stored correction) is now what it is when no mode ran before it; warm TTFTs are the warm fetch's."""
    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    record = SimpleNamespace(id="d", document=" ".join(f"word{i} tells" for i in range(60)), summary="")
    doc = prepare(record, tiny_target, config)
    alone = VLLMEvaluator(StoreEngine(), IngestClient(), tiny_target, parse_modes("served:blend:0.1"), config)
    first = alone.run(doc).modes["served:blend:0.1"]
    assert first.ttft_s == pytest.approx(COLD_FETCH_S + CORRECT_S + ENGINE_S)
    modes = parse_modes("replace,served:blend:0.1,served:blend:0.1/noprior")
    result = VLLMEvaluator(StoreEngine(), IngestClient(), tiny_target, modes, config).run(doc)
    for name in ("served:blend:0.1", "served:blend:0.1/noprior"):
        assert result.modes[name].ttft_s == pytest.approx(first.ttft_s), name
        assert result.modes[name].ttft_warm_s == pytest.approx(WARM_FETCH_S + ENGINE_S), name


def test_vllm_served_correction_counts_the_servers_correction_pass_once_per_document(tiny_target):
    """A served correction through vLLM had the instruction's FLOPs alone: the server's target forwards (the same
    `correct` run here on the document's KV) are its shared_flops now, apart from what vLLM prefills."""
    from kvbridge.eval.flops import FlopModel
    from kvbridge.transfer.suffix.correction import Correction, correct

    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    record = SimpleNamespace(id="d", document=" ".join(f"word{i} tells" for i in range(60)), summary="")
    doc = prepare(record, tiny_target, config)
    modes = parse_modes("replace,served:blend:0.5,served:recompute:0.5")  # 20 of 40 tokens: blend's window runs
    result = VLLMEvaluator(StoreEngine(), IngestClient(), tiny_target, modes, config).run(doc)
    flops = FlopModel.from_config(tiny_target.model.config)
    own = kvcache.extract(tiny_target.model, tiny_target.spec, doc.target_ids)
    for correction in ("blend:0.5", "recompute:0.5"):
        forwards = correct(tiny_target, own, Correction.parse(correction)).forwards  # (new, past, every layer)
        assert all(layers == tiny_target.spec.num_layers for _, _, layers in forwards)
        m = result.modes[f"served:{correction}"]
        assert m.shared_flops == sum(flops.prefill(new, past) for new, past, _ in forwards) > 0, correction
        assert m.prefill_flops == result.modes["replace"].prefill_flops
    assert len(correct(tiny_target, own, Correction.parse("blend:0.5")).forwards) == 2
    assert result.modes["replace"].shared_flops == 0


class NothingLoaded(StoreEngine):
    """StoreEngine whose connector loaded nothing (and said no error): a count it reports is not the request's."""

    def generate(self, prompt: list[int], max_tokens: int = 16, kvbridge: dict | None = None) -> dict:
        return {**super().generate(prompt, max_tokens, kvbridge), "loaded_tokens": 0}


def test_vllm_served_correction_refuses_a_recomputed_count_other_than_the_plans(tiny_target):
    """The connector says how many document tokens the server's correction recomputed: a count other than the
    correction's plan stops the document, as the in-process harness does (before: through vLLM it was never
    checked); the plan's own count is taken, with the FLOPs of a count not said; where nothing was loaded, unchecked."""
    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    record = SimpleNamespace(id="d", document=" ".join(f"word{i} tells" for i in range(60)), summary="")
    doc = prepare(record, tiny_target, config)
    modes = parse_modes("replace,served:blend:0.5,served:recompute:0.25")
    plan = {"replace": 0} | {c: Correction.parse(c).tokens(doc.doc_tokens) for c in ("blend:0.5", "recompute:0.25")}
    assert plan["blend:0.5"] == 20 and plan["recompute:0.25"] == 10

    def run(engine):
        return VLLMEvaluator(engine, IngestClient(), tiny_target, modes, config).run(doc)

    said, unsaid = run(StoreEngine(plan.get)), run(StoreEngine())
    for name in ("served:blend:0.5", "served:recompute:0.25"):
        assert said.modes[name].shared_flops == unsaid.modes[name].shared_flops > 0, name
    for wrong in ("blend:0.5", "recompute:0.25"):
        off = {**plan, wrong: plan[wrong] + 1}  # the start token counted too, say
        with pytest.raises(ValueError, match=f"correction '{wrong}' of 40 document tokens recomputes "
                                             f"{plan[wrong]} of them; the server says it recomputed {plan[wrong] + 1}"):
            run(StoreEngine(off.get))
        name = f"served:{wrong}"  # nothing loaded: the plan's FLOPs, as before
        assert run(NothingLoaded(off.get)).modes[name].shared_flops == unsaid.modes[name].shared_flops


def test_a_renamed_record_never_takes_an_id_the_file_gives_another(tmp_path):
    """A second record under id `a` was named `a#2` even where the file has a record `a#2`: two records under one id
    (results.json's rows, `eval compare`'s pairing and --exclude read documents by id)."""
    path = tmp_path / "records.jsonl"
    rows = [{"id": "a", "document": "x", "summary": ""}, {"id": "a", "document": "y", "summary": ""},
            {"id": "a#2", "document": "z", "summary": ""}, {"id": "a", "document": "w", "summary": ""}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = read_records(path)
    assert [r.document for r in records] == ["x", "y", "z", "w"]
    assert len({r.id for r in records}) == 4
    assert [r.id for r in records] == ["a", "a#3", "a#2", "a#4"]


def test_records_with_a_line_separator_inside_a_string_are_read_whole(tmp_path):
    """JSON leaves U+2028, U+2029 and U+0085 raw inside strings (json.dumps with ensure_ascii=False, as `eval heldout
    --out` writes); str.splitlines cut the record there and refused it as not JSON."""
    path = tmp_path / "records.jsonl"
    rows = [{"id": f"d{i}", "document": f"first sentence.{ch}Second sentence.", "summary": "s"}
            for i, ch in enumerate("\u2028\u2029\x85")]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert [(r.id, r.document) for r in read_records(path)] == [(r["id"], r["document"]) for r in rows]


def test_a_document_is_never_cut_inside_a_character_its_byte_tokens_share(smollm2_tokenizer):
    """SmolLM2 spells "∞" in two byte tokens that share the character's offsets: a cut after the first kept the whole
    character in the document (one token over max_doc_tokens) and began the continuation with its second byte. The
    cut moves back to before the character; the continuation starts with it, after the document's last token."""
    from kvbridge.eval.records import Record
    from kvbridge.eval.summaries import EvalConfig, prepare
    from kvbridge.transfer.align import tokenize

    document = "The branch cut runs along the negative real axis to -∞, continuous from above. " * 40
    tok = tokenize(smollm2_tokenizer, document, add_special_tokens=False)
    inside = next(i for i in range(1, len(tok)) if int(tok.offsets[i, 0]) < int(tok.offsets[i - 1, 1]))
    target = SimpleNamespace(tokenizer=smollm2_tokenizer)
    doc = prepare(Record("r", document, ""), target, EvalConfig(max_doc_tokens=inside, min_doc_tokens=8))
    assert doc.doc_tokens == inside - 1  # the character's first byte token goes to the continuation
    assert doc.continuation[:2].tolist() == tok.ids[inside - 1:inside + 1].tolist()
    assert document.startswith(doc.text) and document[len(doc.text)] == "∞"


class StoreSource:
    """Stands in for ProjectedSource over a server (its clock staged: a test may not time one): the target's own KV
    as every cache, computed at a cache's first fetch and served from the store after (store_fetch_s); fetch's two
    fetches as ProjectedSource's."""

    def __init__(self, lm, ids):
        self.segment = kvcache.extract(lm.model, lm.spec, ids)
        self.stored: set[str] = set()

    def fetch(self, text: str, mode: str = "replace"):
        cold = store_fetch_s(self.stored, mode)
        d = self.segment.num_tokens - 1  # the document's positions 1..d: a correction recomputes k of them
        k = Correction.parse(mode).tokens(d)
        fetched = FetchedCache(segment=self.segment, entry_key="e", source_key="s", adapter="fitted@1", text=text,
                               exact_coverage=1.0, wire_bytes=100, num_chunks=1, mode=mode,
                               recomputed=torch.arange(d + 1 - k, d + 1), document_position=1)
        return fetched, cold, WARM_FETCH_S, self.segment.num_tokens


def test_in_process_cold_ttft_of_a_served_correction_fetched_again_is_the_first_fetchs(tiny_target):
    """served:C/noprior after served:C (one stored correction, read two ways) fetched it from the store: its cold
    TTFT was a warm fetch's. Both count the first (cold) fetch now (with the projection replace's fetch stored);
    their warm TTFTs the warm fetch."""
    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    doc = prepare(read_records(SAMPLE)[0], tiny_target, config)
    modes = parse_modes("replace/noprior,served:blend:0.1/noprior,served:blend:0.1/probe")
    result = SummaryEvaluator(tiny_target, modes, config, StoreSource(tiny_target, doc.target_ids)).run(doc)
    for name in ("replace/noprior", "served:blend:0.1/noprior", "served:blend:0.1/probe"):
        m = result.modes[name]  # ttft_s - ttft_warm_s: the cold fetch's seconds less the warm one's
        served = CORRECT_S if name.startswith("served") else 0.0
        assert m.ttft_s - m.ttft_warm_s == pytest.approx(COLD_FETCH_S - WARM_FETCH_S + served), name


class FetchLog(ProjectedSource):
    """ProjectedSource with the seconds of each fetch kept: (mode, cold, warm)."""

    def __init__(self, client, target):
        super().__init__(client, target)
        self.fetches: list[tuple[str, float, float]] = []

    def fetch(self, text: str, mode: str = "replace"):
        fetched, cold_s, warm_s, tokens = super().fetch(text, mode)
        self.fetches.append((mode, cold_s, warm_s))
        return fetched, cold_s, warm_s, tokens


@pytest.mark.integration  # identity_server
def test_in_process_cold_ttft_of_a_served_correction_after_replace_counts_the_projection(identity_server,
                                                                                          tiny_target):
    """replace fetched the plain projection first, so the server only corrected it for served:C: a store hit for
    the projection, which a new user's first served request does not get. Through a real server, served:C's cold
    TTFT (and served:C/probe's, the same stored correction) adds the projection's cold fetch over a warm one."""
    from kvbridge.server.client import KVBridgeClient

    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    text = " ".join(f"served{i} after replace" for i in range(60))  # a document no other test stores
    doc = prepare(SimpleNamespace(id="d", document=text, summary=""), tiny_target, config)
    modes = parse_modes("replace/noprior,served:blend:0.1/noprior,served:blend:0.1/probe")
    with KVBridgeClient(identity_server.address) as client:
        source = FetchLog(client, tiny_target)
        result = SummaryEvaluator(tiny_target, modes, config, source).run(doc)
    (plain, plain_cold, plain_warm), (served, served_cold, _), (_, _, probe_warm) = source.fetches
    assert (plain, served) == ("replace", "blend:0.1") and (result.fetch_s, result.warm_fetch_s) == (plain_cold,
                                                                                                     plain_warm)
    for name, warm in (("served:blend:0.1/noprior", source.fetches[1][2]), ("served:blend:0.1/probe", probe_warm)):
        m = result.modes[name]  # the first served fetch and the projection's cold cost, less this mode's warm fetch
        assert m.ttft_s - m.ttft_warm_s == pytest.approx(served_cold + plain_cold - plain_warm - warm), name


def _row(summary_ids: list[int], nll: float) -> ModeResult:
    return ModeResult(summary="", summary_ids=summary_ids, ttft_s=1.0, prefill_tokens=1, prefill_flops=1,
                      kv_bytes=0, nll=nll, nll_tokens=3, continuation_top1=[1, 2, 3])


def test_recovery_is_none_not_nan_where_full_gains_nothing_over_none():
    """One document whose continuation `none` reads as well as `full` (or documents whose gains cancel): recovery
    is 0 / 0. It was NaN: "nan [nan, nan]" in the table, a bare NaN in results.json (not JSON) and a RuntimeWarning;
    now None ("–"). A document of equal NLLs beside others is no division: recovery is pooled over documents."""
    results = [DocumentResult("d", "", 10, {"full": _row([1], 2.0), "none": _row([1], 2.0), "replace": _row([1], 3.0)})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = summarise(results, samples=50)
    assert all(e["nll_recovery"] is None for e in summary["modes"].values())
    json.dumps(summary, allow_nan=False)
    assert "nan" not in markdown_table(summary)
    second = DocumentResult("e", "", 10, {"full": _row([1], 1.0), "none": _row([1], 3.0), "replace": _row([1], 1.5)})
    pooled = summarise(results + [second], samples=50)["modes"]["replace"]["nll_recovery"]
    # (Σ none − Σ replace) / (Σ none − Σ full): 0.25; a mean of per-document ratios would give e's alone, 0.75
    assert pooled["value"] == pytest.approx((5 - 4.5) / (5 - 3))
    assert math.isfinite(pooled["low"]) and math.isfinite(pooled["high"])


def test_bootstrap_intervals_are_the_percentiles_of_resampled_document_means_and_paired_recoveries():
    """Exact intervals, not just ones that bracket the mean: the resampled documents' means (each draw a row), and
    for recovery each draw's sums of one document set for none, full and the mode alike (paired)."""
    import numpy as np
    from kvbridge.adapters.scoring import bootstrap_draws, bootstrap_mean, bootstrap_recovery

    x = np.array([0.1, 0.2, 0.3, 0.9])
    _, lo, hi = bootstrap_mean(list(x), 500, 0)
    means = x[bootstrap_draws(4, 500, 0)].mean(axis=1)
    assert (lo, hi) == (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))
    rng = np.random.default_rng(1)
    none = rng.uniform(10, 20, 12)
    full, mode = none - rng.uniform(1, 3, 12), none - rng.uniform(0, 3, 12)
    _, lo, hi = bootstrap_recovery(list(none), list(full), list(mode), 400, 0)
    idx = bootstrap_draws(12, 400, 0)
    r = (none[idx].sum(1) - mode[idx].sum(1)) / (none[idx].sum(1) - full[idx].sum(1))
    assert (lo, hi) == pytest.approx((np.percentile(r, 2.5), np.percentile(r, 97.5)))
