"""What the report and `kvbridge eval compare` pair: per-document ROUGE lands on its own document, two runs are paired
only where they measured the same thing (settings and documents, refused by name otherwise), a JSON that is not a
results.json is named as such; and an analysis mode's warm TTFT."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from kvbridge.eval.compare import compare, parse_pairs, read_run
from kvbridge.eval.modes import parse_modes
from kvbridge.eval.report import rouge, summarise
from kvbridge.eval.summaries import DocumentResult, EvalConfig, ModeResult, SummaryEvaluator, prepare, read_records
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path

TINY = EvalConfig(max_doc_tokens=64, continuation_tokens=8, max_new_tokens=4)


def _mode(summary: str, nll: float = 1.0) -> ModeResult:
    return ModeResult(summary=summary, summary_ids=[1, 2, 3], ttft_s=0.1, prefill_tokens=3, prefill_flops=10,
                      kv_bytes=0, nll=nll, nll_tokens=7, continuation_top1=[1, 2])


def test_per_document_rouge_lands_on_its_own_document():
    """Scores against the reference exist only for documents that have one, and each is that document's."""
    a = DocumentResult("a", "", 40, {"full": _mode("nothing alike here")})  # no reference summary
    b = DocumentResult("b", "beta gamma delta", 40, {"full": _mode("beta gamma delta")})
    c = DocumentResult("c", "one two three", 40, {"full": _mode("four five six")})
    summary = summarise([a, b, c], samples=20)
    assert a.modes["full"].rouge is None
    assert b.modes["full"].rouge == rouge(b.reference, "beta gamma delta") and b.modes["full"].rouge["rouge1"] == 1
    assert c.modes["full"].rouge == rouge(c.reference, "four five six") and c.modes["full"].rouge["rouge1"] == 0
    assert summary["modes"]["full"]["rouge1"]["mean"] == pytest.approx(0.5)  # over b and c


def _run(path, **changes) -> str:
    """A results.json of three documents with modes full, none and replace; `changes`: config fields, "data", or
    doc_tokens of a document ("doc_tokens": {id: n})."""
    doc_tokens = {"d0": 256, "d1": 256, "d2": 200, **changes.pop("doc_tokens", {})}
    config = {"max_doc_tokens": 256, "continuation_tokens": 32, "min_doc_tokens": 32, "max_new_tokens": 24,
              "fuse_steps": 20, "induction_prior": True, "instruction": "\n\nSummary (one sentence):"}
    meta = {"data": changes.pop("data", "data/pydoc_summaries.jsonl"), "target": "smollm2", "config": config}
    config.update(changes)
    docs = [{"id": i, "reference": "a page", "doc_tokens": n,
             "modes": {m: {"summary": f"{i} {m}", "continuation_top1": [1, 2, k], "nll": 10.0 + k}
                       for k, m in enumerate(("full", "replace", "none"))}} for i, n in doc_tokens.items()]
    path.write_text(json.dumps({"meta": meta, "summary": {}, "documents": docs}))
    return str(path)


def test_compare_pairs_only_runs_that_measured_the_same_thing(tmp_path, capsys):
    a = read_run(_run(tmp_path / "a.json"))
    same = compare(a, read_run(_run(tmp_path / "b.json", data="/elsewhere/pydoc_summaries.jsonl")),
                   parse_pairs("replace"), samples=20)
    assert same["documents"] == 3  # the same data file by name, read from another folder
    for changes, words in (({"max_doc_tokens": 512}, "max_doc_tokens: 256 in A, 512 in B"),
                           ({"continuation_tokens": 16}, "continuation_tokens"),
                           ({"instruction": "\n\nTL;DR:"}, "instruction"),
                           ({"max_new_tokens": 8}, "max_new_tokens"),
                           ({"data": "data/man_2048.jsonl"}, "data file"),
                           ({"doc_tokens": {"d1": 255}}, "d1: 256 document tokens in A, 255 in B")):
        b = read_run(_run(tmp_path / "b.json", **changes))
        with pytest.raises(ValueError, match=words):
            compare(a, b, parse_pairs("replace"), samples=20)
    from kvbridge.cli import main

    assert main(["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--pairs", "replace"]) == 2
    assert "256 document tokens in A, 255 in B" in capsys.readouterr().err


def test_compare_names_a_file_that_is_not_a_results_json(tmp_path, capsys):
    other = tmp_path / "other.json"
    for text in ('{"ridge": {"summary": {}}}', '{"documents": [{"modes": {}}]}', "[1, 2]", "{not json"):
        other.write_text(text)
        with pytest.raises(ValueError, match="not the results.json of a `kvbridge eval rouge` run"):
            read_run(other)
    from kvbridge.cli import main

    assert main(["eval", "compare", str(other), str(other), "--pairs", "replace"]) == 2
    assert "not the results.json" in capsys.readouterr().err
    assert main(["eval", "compare", str(other), str(other), "--pairs", "replace", "--bootstrap", "0"]) == 2
    assert "--bootstrap must be >= 1" in capsys.readouterr().err


def test_an_analysis_modes_warm_ttft_swaps_the_fetch_it_paid_for(tiny_target):
    """exact:a-b fetches the projection and prefills the target's own KV: its cold TTFT has both, its warm one the
    warm fetch in place of the cold one (never a fetch taken off a base that did not include it)."""
    doc = prepare(read_records(data_path("pydoc_summaries_sample.jsonl"))[0], tiny_target, TINY)

    cold = 1e4  # a cold fetch's reported seconds: far beyond any prefill's wall clock, so no timing is compared

    class SlowFirstFetch:
        def fetch(self, text, mode="replace"):
            seg = kvcache.extract(tiny_target.model, tiny_target.spec, doc.target_ids)
            fetched = SimpleNamespace(segment=replace(seg, kv=seg.kv * 1.01), wire_bytes=0, exact_coverage=None)
            return fetched, cold, 0.001, doc.target_ids.numel()

    evaluator = SummaryEvaluator(tiny_target, parse_modes("full,exact:0-1,replace/noprior"), TINY, SlowFirstFetch())
    result = evaluator.run(doc)
    for name in ("exact:0-1", "replace/noprior"):
        mode = result.modes[name]
        assert mode.ttft_s >= cold and 0 < mode.ttft_warm_s < cold, (name, mode.ttft_s, mode.ttft_warm_s)
    assert result.modes["full"].ttft_s < cold  # no fetch in full's
