"""The evaluation's measurements on synthetic inputs: TTFT bookkeeping of the vLLM harness, record ids, and the
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
from kvbridge.eval.summaries import DocumentResult, EvalConfig, ModeResult, SummaryEvaluator, prepare
from kvbridge.eval.vllm_eval import VLLMEvaluator
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path

SAMPLE = data_path("pydoc_summaries_sample.jsonl")

COLD_FETCH_S, WARM_FETCH_S, ENGINE_S = 1.0, 0.1, 0.05


class StoreEngine:
    """Stands in for kvbridge.vllm.engine.EngineProcess (a vLLM child process, minutes to start): every request
    fetches its kvbridge cache from a server store that computes a cache at its first fetch (COLD_FETCH_S) and
    serves it from then on (WARM_FETCH_S); the answer is the prompt's last token."""

    def __init__(self):
        self.stored: set[tuple] = set()

    def _fetch(self, kvbridge: dict | None) -> float:
        if not kvbridge:
            return 0.0
        cache = (kvbridge["key"], kvbridge["mode"])
        cold = cache not in self.stored
        self.stored.add(cache)
        return COLD_FETCH_S if cold else WARM_FETCH_S

    def generate(self, prompt: list[int], max_tokens: int = 16, kvbridge: dict | None = None) -> dict:
        fetch_s = self._fetch(kvbridge)
        return {"token_ids": prompt[-1:] * max_tokens, "seconds": fetch_s + ENGINE_S, "kvbridge_error": None,
                "kvbridge_fetch_s": fetch_s, "kvbridge_wire_bytes": 100 if kvbridge else 0,
                "loaded_tokens": len(prompt) - 8 if kvbridge else 0}

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
        assert result.modes[name].ttft_s == pytest.approx(cold), name
        assert result.modes[name].ttft_warm_s == pytest.approx(warm), name
    assert (result.fetch_s, result.warm_fetch_s) == (COLD_FETCH_S, WARM_FETCH_S)


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


class StoreSource:
    """Stands in for ProjectedSource over a server (its clock staged: a test may not time one): the target's own KV
    as every cache, computed at a cache's first fetch (COLD_FETCH_S) and served from the store after (WARM_FETCH_S);
    fetch's two fetches as ProjectedSource's."""

    def __init__(self, lm, ids):
        self.segment = kvcache.extract(lm.model, lm.spec, ids)
        self.stored: set[str] = set()

    def fetch(self, text: str, mode: str = "replace"):
        cold = WARM_FETCH_S if mode in self.stored else COLD_FETCH_S
        self.stored.add(mode)
        fetched = SimpleNamespace(segment=self.segment, mode=mode, recomputed=torch.tensor([1]), wire_bytes=100,
                                  exact_coverage=None, adapter_digest="")
        return fetched, cold, WARM_FETCH_S, self.segment.num_tokens


def test_in_process_cold_ttft_of_a_served_correction_fetched_again_is_the_first_fetchs(tiny_target):
    """served:C/noprior after served:C (one stored correction, read two ways) fetched it from the store: its cold
    TTFT was a warm fetch's. Both count the first (cold) fetch now; their warm TTFTs the warm fetch."""
    config = EvalConfig(max_doc_tokens=40, min_doc_tokens=8, continuation_tokens=4, max_new_tokens=3)
    doc = prepare(read_records(SAMPLE)[0], tiny_target, config)
    modes = parse_modes("replace/noprior,served:blend:0.1/noprior,served:blend:0.1/probe")
    result = SummaryEvaluator(tiny_target, modes, config, StoreSource(tiny_target, doc.target_ids)).run(doc)
    for name in ("replace/noprior", "served:blend:0.1/noprior", "served:blend:0.1/probe"):
        m = result.modes[name]  # ttft_s - ttft_warm_s: the cold fetch's seconds less the warm one's
        assert m.ttft_s - m.ttft_warm_s == pytest.approx(COLD_FETCH_S - WARM_FETCH_S), name


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
