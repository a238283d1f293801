"""kvbridge eval rouge and kvbridge demo on the tiny preset: the harness end to end through a real server, the
table's structure, `full` against identity-adapter `replace` (exactly the same summaries), determinism, and the
demo as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from kvbridge.eval.cost import PairCost
from kvbridge.eval.flops import FlopModel
from kvbridge.eval.modes import parse_modes
from kvbridge.eval.records import read_records
from kvbridge.eval.report import (
    ROUGE_TYPES,
    bootstrap_mean,
    greedy_agreement,
    repeated_ngram_share,
    rouge,
    top1_agreement,
)
from kvbridge.eval.run import RunOptions, evaluate
from kvbridge.eval.summaries import EvalConfig, SummaryEvaluator, prepare
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path
from kvbridge.transfer.suffix.induction import InductionPrior
from rouge_score import rouge_scorer

SAMPLE = data_path("pydoc_summaries_sample.jsonl")
ALL_MODES = ("full,none,replace,recompute:0.1,tail:0.1,blend:0.1,recompute:0.25,tail:0.25,blend:0.25,blend-sdev:0.25,"
             "fuse,served:blend:0.1")
TINY = EvalConfig(max_doc_tokens=96, continuation_tokens=16, max_new_tokens=10, fuse_steps=3)


def test_modes_parse_and_bad_modes_are_named():
    modes = parse_modes("full, none,replace,recompute:0.10,tail:0.1,fuse")
    assert [m.name for m in modes] == ["full", "none", "replace", "recompute:0.1", "tail:0.1", "fuse"]
    assert modes[3].kind == "recompute" and modes[3].fraction == pytest.approx(0.1)
    assert all(m.prior == "model" for m in modes)
    plain = parse_modes("replace/noprior,blend:0.10/noprior,blend:0.1,recompute:0.1/probe")
    assert [(m.name, m.kind, m.prior) for m in plain] == [
        ("replace/noprior", "replace", "none"), ("blend:0.1/noprior", "blend", "none"), ("blend:0.1", "blend", "model"),
        ("recompute:0.1/probe", "recompute", "probe")]
    served = parse_modes("served:blend:0.10,served:recompute:0.1/noprior")
    assert [(m.name, m.kind, m.correction, m.prior) for m in served] == [
        ("served:blend:0.1", "served", "blend:0.1", "model"),
        ("served:recompute:0.1/noprior", "served", "recompute:0.1", "none")]
    for bad, words in (("served", "served takes a correction"), ("served:blend:2", "served takes a correction"),
                       ("full:0.1", "takes no fraction"), ("recompute", "needs a fraction"),
                       ("full/noprior", "for the modes that read projected KV"),
                       ("blend:0.1/prior", "suffixes are /noprior and /probe"),
                       ("tail:0.1/noprior", "for the modes that read projected KV"),
                       ("tail:1.5", "(0, 1]"), ("blend", "needs a fraction"), ("mix:0.1", "unknown mode .mix:0.1."),
                       ("full,full", "twice"), ("rounded", "rounded takes one of bf16, fp16, fp8"),
                       ("rounded:int4", "rounded takes one of"), ("rounded:fp8/noprior", "read projected KV"),
                       ("layers:0", "layers takes a number of layers >= 1"), ("layers:0.5", "layers takes"),
                       ("exact:3", "exact takes a range"), ("exact:4-2", "a < b"),
                       ("exact:0-2/noprior", "read projected"),
                       (" , ", "no modes")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("]", r"\]")):
            parse_modes(bad)


def test_rounded_modes_read_fulls_own_kv_through_a_narrower_dtype(tiny_target):
    """rounded:T is the target's own KV of the document rounded to T and back: the perturbation deployments accept
    (a bf16 or fp8 KV cache), against which a projection's fidelity is read."""
    modes = parse_modes("full,rounded:bf16,rounded:fp8")
    assert [(m.kind, m.correction) for m in modes[1:]] == [("rounded", "bfloat16"), ("rounded", "float8_e4m3fn")]
    evaluator = SummaryEvaluator(tiny_target, modes, TINY, None)  # no projection: no source needed
    doc = prepare(read_records(SAMPLE)[0], tiny_target, TINY)
    own, own_s = evaluator._own(doc.target_ids)
    contexts = [evaluator._context(m, doc, own, own_s, None, 0.0, 0, None)[0] for m in modes]
    assert contexts[0] is own
    assert torch.equal(contexts[1].kv, own.kv.to(torch.bfloat16).float())
    assert torch.equal(contexts[2].kv, own.kv.to(torch.float8_e4m3fn).float())
    err = [float((c.kv - own.kv).abs().mean()) for c in contexts[1:]]
    assert 0 < err[0] < err[1]  # fp8 rounds coarser than bf16
    result = evaluator.run(doc)
    nll = {name: m.nll for name, m in result.modes.items()}
    assert abs(nll["rounded:bf16"] - nll["full"]) < 0.01 * nll["full"]


def test_layers_mode_makes_the_first_k_layers_the_targets_own_and_leaves_the_rest_projected(tiny_target):
    """layers:k: the target's own KV of the document in its first k layers (a forward through those layers only), the
    projected KV above them; with every layer, full's own KV."""
    modes = parse_modes("layers:1,layers:2/noprior,layers:99")
    assert [(m.name, m.kind, m.layers, m.prior) for m in modes] == [("layers:1", "layers", 1, "model"),
                                                                  ("layers:2/noprior", "layers", 2, "none"),
                                                                  ("layers:99", "layers", 99, "model")]
    evaluator = SummaryEvaluator(tiny_target, parse_modes("full"), TINY, None)  # _context is given the projection
    doc = prepare(read_records(SAMPLE)[0], tiny_target, TINY)
    own, own_s = evaluator._own(doc.target_ids)
    torch.manual_seed(0)
    kv = own.kv + 0.5 * torch.randn_like(own.kv)
    kv[:, :, :, 0] = own.kv[:, :, :, 0]  # the start token's KV is the target's own in a projection too
    projected = replace(own, kv=kv)
    layers = tiny_target.spec.num_layers
    for mode, k in zip(modes, (1, 2, layers)):
        context, _, forwards, _, still = evaluator._context(mode, doc, own, own_s, projected, 0.0, 0, None)
        assert torch.allclose(context.kv[:k], own.kv[:k], rtol=1e-4, atol=1e-4)  # the target's own (float order)
        assert torch.equal(context.kv[k:], projected.kv[k:])  # projected above them
        assert forwards == [(doc.doc_tokens, 1, k)] and still[1:].all() and not still[0]
    # exact:a-b (analysis): full's own KV in layers a..b-1, the projection elsewhere, read without a prior
    band = parse_modes("exact:1-2")[0]
    context, _, _, _, still = evaluator._context(band, doc, own, own_s, projected, 0.0, 0, None)
    assert torch.equal(context.kv[1:2], own.kv[1:2]) and still is None
    assert torch.equal(context.kv[:1], projected.kv[:1]) and torch.equal(context.kv[2:], projected.kv[2:])


@pytest.mark.parametrize("modes, words", [("full,blend:0.1", "'blend:0.1' does not run with --engine vllm"),
                                          ("full,fuse", "'fuse' does not run with --engine vllm"),
                                          ("replace/probe", "only /noprior")])
def test_engine_vllm_refuses_the_modes_it_cannot_run_before_it_starts(modes, words, tmp_path):
    """Named at once, before records are read, a server or an engine starts (the data file does not even exist)."""
    with pytest.raises(ValueError, match=words):
        evaluate(RunOptions(data=str(tmp_path / "missing.jsonl"), modes=modes, engine="vllm"))
    with pytest.raises(ValueError, match="engine must be transformers or vllm"):
        RunOptions(data="x", engine="sglang")


def test_each_mode_reads_with_the_prior_its_suffix_names(tiny_target):
    """A mode without a suffix reads with the model's prior (for_model: the shipped one, else the probe's), /probe
    with the probe's, /noprior with none; only the priors some mode reads with are built."""
    source = object()  # modes that read projected KV need one; the priors are built before any fetch
    modes = parse_modes("full,replace,blend:0.1/probe,recompute:0.1/noprior")
    both = SummaryEvaluator(tiny_target, modes, TINY, source)
    assert set(both.priors) == {"model", "probe"} and both.prior is both.priors["model"]
    assert both.priors["probe"].origin.startswith("probe")
    probe_only = SummaryEvaluator(tiny_target, parse_modes("replace/probe,replace/noprior"), TINY, source)
    assert set(probe_only.priors) == {"probe"} and probe_only.prior is None
    off = SummaryEvaluator(tiny_target, parse_modes("replace,replace/probe"), replace(TINY, induction_prior=False),
                           source)
    assert off.priors == {} and off.prior is None


def test_recompute_and_blend_read_the_projected_kv_with_the_prior_while_they_recompute(tiny_target):
    """recompute:r's tail prefill and blend:r's recompute forward read the KV that stays projected with the mode's
    prior, as the request after them does; blend-sdev's from the layer its selection pass made exact on."""
    lm, calls = tiny_target, []

    class Spy:  # an InductionPrior that records what it reads
        def __init__(self, prior, first=0):
            self.prior, self.first = prior, first

        def from_layer(self, first):
            return Spy(self.prior.from_layer(first), first)

        def reading(self, lm_, ids, still):
            calls.append((self.first, ids.numel(), still.clone()))
            return self.prior.reading(lm_, ids, still)

    class Noisy:  # the target's own KV, a little wrong everywhere: what a projection gives
        def fetch(self, text, mode="replace"):
            ids = doc.target_ids
            seg = kvcache.extract(lm.model, lm.spec, ids)
            noisy = seg.kv + 0.1 * seg.kv.std() * torch.randn(seg.kv.shape, generator=torch.Generator().manual_seed(0))
            fetched = SimpleNamespace(segment=replace(seg, kv=noisy), wire_bytes=0, exact_coverage=None)
            return fetched, 0.0, 0.0, ids.numel()

    doc = prepare(read_records(SAMPLE)[0], lm, TINY)
    d = doc.doc_tokens
    evaluator = SummaryEvaluator(lm, parse_modes("recompute:0.25,blend:0.25,blend-sdev:0.25"), TINY, Noisy())
    evaluator.priors["model"] = Spy(InductionPrior.from_weights(
        torch.ones(lm.spec.num_layers, lm.model.config.num_attention_heads), 2.0, 2.0))
    evaluator.run(doc)
    k = round(0.25 * d)
    (tail, tail_read), (blended, blend_read), (dev, dev_read) = calls[:2], calls[2:4], calls[4:]
    assert tail[:2] == (0, 1 + d - k) and tail[2].sum() == d - k and not tail[2][0]  # the head, but the start token
    assert tail_read[:2] == (0, 1 + d) and torch.equal(tail_read[2][:1 + d - k], tail[2])
    assert not tail_read[2][1 + d - k:].any()
    assert blended[:2] == (0, 1 + d) and int(blended[2].sum()) == d - k and torch.equal(blended[2], blend_read[2])
    assert dev[0] == dev_read[0] == 1 and int(dev[2].sum()) == d - k  # its first layer is the target's own


def test_records_are_checked(tmp_path):
    records = read_records(SAMPLE)
    assert len(records) == 12 and all(r.document and r.summary for r in records)
    bad = tmp_path / "bad.jsonl"
    for text, words in (('{"id": "a", "document": "x"}', "field 'summary'"), ("[1]", "JSON object"),
                        ("{not json", "not JSON"), ('{"id": "a", "document": " ", "summary": "y"}', "'document'")):
        bad.write_text(text + "\n")
        with pytest.raises(ValueError, match=words):
            read_records(bad)
    a, b = '{"id": "a", "document": "x", "summary": "y"}', '{"id": "a", "document": "z", "summary": "w"}'
    bad.write_text("\n".join((a, b, a, b)) + "\n")  # repeats dropped, another record under a taken id renamed
    assert [(r.id, r.document) for r in read_records(bad)] == [("a", "x"), ("a#2", "z")]
    skip = tmp_path / "skip.jsonl"
    skip.write_text('{"id": "a", "document": "x", "summary": "y"}\n')
    with pytest.raises(ValueError, match="holds no records outside"):  # the record renamed a#2 is excluded too
        read_records(bad, exclude=skip)
    rest = read_records(SAMPLE, exclude=SAMPLE.parent / "pydoc_heldout.jsonl")
    assert len(rest) < len(records) and not {r.id for r in rest} & {r.id for r in read_records(
        SAMPLE.parent / "pydoc_heldout.jsonl")}


def test_rouge_is_the_librarys_and_the_bootstrap_brackets_the_mean():
    ref, pred = "Unix filename pattern matching", "The fnmatch module matches Unix filenames against patterns."
    lib = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True).score(ref, pred)
    assert rouge(ref, pred) == {k: lib[k].fmeasure for k in ROUGE_TYPES}
    assert rouge(ref, pred)["rouge1"] > 0  # stemming: filenames ~ filename, patterns ~ pattern
    # two answers without a word say the same (rouge-score would give 0): full's fidelity to itself is 1
    assert rouge("", "") == rouge("...", "") == dict.fromkeys(ROUGE_TYPES, 1.0)
    assert rouge("", pred) == rouge(ref, "") == dict.fromkeys(ROUGE_TYPES, 0.0)
    # words of every script: different answers in Cyrillic or Japanese share nothing (they scored 1.0: no [a-z0-9]
    # word in either, taken for two empty answers); the same answer scores 1
    for a, b in (("Кошка сидит на ковре", "Собака бежит по улице"), ("日本語の文書です", "全く違う答え")):
        assert rouge(a, b) == dict.fromkeys(ROUGE_TYPES, 0.0) and rouge(a, a) == dict.fromkeys(ROUGE_TYPES, 1.0)
    assert rouge("Кошка сидит на ковре", "") == dict.fromkeys(ROUGE_TYPES, 0.0)
    assert rouge("Кошка сидит", "Кошка спит")["rouge1"] == 0.5
    mean, lo, hi = bootstrap_mean([0.1, 0.2, 0.3, 0.9], 500, 0)
    assert lo <= mean <= hi and mean == pytest.approx(0.375)
    assert bootstrap_mean([0.1, 0.2, 0.3, 0.9], 500, 0) == (mean, lo, hi)  # seeded


def test_repetition_and_agreement_are_counted():
    assert repeated_ngram_share([1, 2, 3, 1, 2, 3]) == pytest.approx(1 / 4)  # (1,2,3) twice among 4 trigrams
    assert repeated_ngram_share([5, 5, 5, 5, 5]) == pytest.approx(2 / 3)
    assert repeated_ngram_share([1, 2, 3, 4]) == repeated_ngram_share([1, 2]) == 0.0
    assert top1_agreement([1, 2, 3, 4], [1, 0, 3, 0]) == 0.5
    assert top1_agreement(None, [1]) is None and top1_agreement([1, 2], [1]) is None
    assert greedy_agreement([1, 2, 9], [1, 2, 3, 4]) == 0.5  # the missing 4th token counts as different
    assert greedy_agreement([5] * 30, [5] * 30) == 1.0 and greedy_agreement([1], []) is None
    assert greedy_agreement(list(range(30)), list(range(24)) + [0] * 6) == 1.0  # the first 24 only


def test_system_cost_amortises_the_source_and_the_projection(tiny_source, tiny_target, tiny_adapter_file):
    from kvbridge.adapters.io import load_adapter

    adapter = load_adapter(tiny_adapter_file)
    cost = PairCost.of(tiny_source.model.config, tiny_target.model.config, adapter)
    d_s = tiny_source.spec.num_kv_heads * tiny_source.spec.head_dim
    d_t = tiny_target.spec.num_kv_heads * tiny_target.spec.head_dim
    k = adapter.layer_map.shape[1]
    assert cost.projection(10) == 10 * tiny_target.spec.num_layers * 4 * (k * d_s + d_s * d_t)
    assert cost.ceiling(100) == cost.target.prefill(100) / cost.projection(100)
    once = cost.source.prefill(101) + cost.projection(100)
    assert cost.system(5_000, 101, 100, 1) == 5_000 + once
    assert cost.system(5_000, 101, 100, 10) == pytest.approx(5_000 + once / 10)
    with pytest.raises(ValueError, match="uses must be >= 1"):
        cost.system(1, 1, 1, 0)


def test_prefill_flops_add_up(tiny_target):
    f = FlopModel.from_config(tiny_target.model.config)
    head = 2 * f.hidden * f.vocab  # one position's logits per forward
    assert f.prefill(100, 0) + f.prefill(30, 100) - head == f.prefill(130, 0)
    assert f.prefill(0, 50) == 0
    assert f.prefill(10, 1000) > f.prefill(10, 0)  # attention to the cache costs
    with pytest.raises(ValueError, match="new=-1"):
        f.prefill(-1)


@pytest.fixture(scope="module")
def identity_run(tiny_target, tmp_path_factory):
    from kvbridge.adapters.identity import identity_adapter

    out = tmp_path_factory.mktemp("eval-identity")
    options = RunOptions(data=str(SAMPLE), preset="tiny", modes=ALL_MODES, limit=3, out=str(out), progress=False,
                         bootstrap=200)
    return evaluate(options, source=tiny_target, target=tiny_target, adapter=identity_adapter(tiny_target),
                    config=TINY)


def test_eval_writes_the_table_json_and_plot(identity_run, tiny_target):
    paths, summary = identity_run["paths"], identity_run["summary"]
    table = paths["markdown"].read_text().split("\n\n")
    quality, cost = [t.splitlines() for t in table[1:3]]
    assert [c.strip() for c in quality[0].strip("|").split("|")] == [
        "mode", "ROUGE-L vs reference", "NLL recovery", "fidelity ROUGE-L vs full", "top-1 agreement with full",
        "greedy agreement with full", "repeated 3-grams"]
    assert [c.strip() for c in cost[0].strip("|").split("|")] == [
        "mode", "ROUGE-1", "ROUGE-2", "prefill FLOPs saved", "system FLOPs × full (N=1)",
        "system FLOPs × full (N=10)", "TTFT median, cold (× full)", "warm (× full)", "KV bytes moved"]
    rows = [line.split("|")[1].strip() for line in quality[2:]]
    assert rows == [m.name for m in parse_modes(ALL_MODES)] == [line.split("|")[1].strip() for line in cost[2:]]
    assert "FLOP ceiling of this pair and adapter" in table[3]
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["documents"] == 3 and len(data["documents"]) == 3
    assert set(data["documents"][0]["modes"]) == set(rows)
    modes = summary["modes"]
    for name, e in modes.items():
        for kind in ROUGE_TYPES:
            assert e[kind]["low"] <= e[kind]["mean"] <= e[kind]["high"], (name, kind)
    assert modes["full"]["flops_saved_vs_full"] == 0 and modes["full"]["kv_bytes_mean"] == 0
    # replace prefills only the instruction; recompute adds its share of the document; fuse prefills everything
    assert modes["replace"]["flops_saved_vs_full"] > modes["recompute:0.1"]["flops_saved_vs_full"] > \
        modes["recompute:0.25"]["flops_saved_vs_full"] > 0
    # blend recomputes as many tokens as recompute does, and pays for its selection pass: the attention rule a
    # window of 16 tokens through every layer (none when r covers no more than the window: then it is recompute), the
    # deviation rule one layer of a prefill
    flops = FlopModel.from_config(tiny_target.model.config)
    for doc in identity_run["results"]:
        d, modes_of = doc.doc_tokens, doc.modes
        assert round(0.1 * d) <= 16 and modes_of["blend:0.1"].prefill_flops == modes_of["recompute:0.1"].prefill_flops
        extra = modes_of["blend:0.25"].prefill_flops - modes_of["recompute:0.25"].prefill_flops
        assert extra == flops.prefill(16, d + 1 - 16), doc.id
        extra = modes_of["blend-sdev:0.25"].prefill_flops - modes_of["recompute:0.25"].prefill_flops
        assert extra == flops.prefill(d, 1, layers=1), doc.id
    assert modes["fuse"]["flops_saved_vs_full"] == 0 and modes["replace"]["kv_bytes_mean"] > 0
    assert modes["none"]["nll_recovery"]["value"] == 0 and modes["full"]["nll_recovery"]["value"] == 1
    assert identity_run["meta"]["gates"]["windows"] == 8
    prior = identity_run["meta"]["induction_prior"]  # recorded, though a random model has few induction heads
    assert prior["origin"].startswith("probe") and all(isinstance(h, list) for h in prior["heads"].values())
    # the whole system's cost: full is itself; a projected mode pays the source and the projection, less of them the
    # more requests share one projected context
    system = {name: {n: e["system_flops"][n]["vs_full"] for n in ("1", "10")} for name, e in modes.items()}
    assert system["full"] == {"1": 1, "10": 1} and system["none"]["1"] == system["none"]["10"] < 1
    assert system["replace"]["1"] > system["replace"]["10"] > 1 - modes["replace"]["flops_saved_vs_full"]
    assert summary["flop_ceiling"]["target_prefill_over_projection"] > 1


def test_full_and_identity_replace_agree_exactly(identity_run):
    """The identity adapter hands the target its own KV through the service: every mode built on the projected
    cache gives the summaries of the target's own prefill, token for token, and the same NLL to float tolerance."""
    for doc in identity_run["results"]:
        full = doc.modes["full"]
        for name in ("replace", "recompute:0.1", "recompute:0.25", "blend:0.1", "fuse", "served:blend:0.1"):
            got = doc.modes[name]
            assert got.summary_ids == full.summary_ids, (doc.id, name)
            assert got.rouge == full.rouge
            assert got.nll == pytest.approx(full.nll, rel=1e-4, abs=1e-4)
        assert doc.modes["tail:0.1"].prefill_tokens < doc.modes["tail:0.25"].prefill_tokens < full.prefill_tokens
        served = doc.modes["served:blend:0.1"]  # read from the server's store: no target pass at request time
        assert served.prefill_tokens == doc.modes["replace"].prefill_tokens and served.ttft_warm_s > 0
    modes = identity_run["summary"]["modes"]
    for kind in ROUGE_TYPES:
        assert modes["replace"][kind] == modes["full"][kind]
    assert modes["replace"]["nll_recovery"]["value"] == pytest.approx(1, abs=1e-3)
    for name in ("full", "replace", "recompute:0.1", "fuse"):  # measured against full's own output
        assert modes[name]["fidelity_rougeL"]["mean"] == modes[name]["top1_agreement"]["mean"] == 1, name
        assert modes[name]["greedy_agreement"]["mean"] == 1, name
        assert modes[name]["repeated_3gram_share"] == modes["full"]["repeated_3gram_share"]


def test_two_runs_give_the_same_numbers(identity_run, tiny_target, tmp_path):
    from kvbridge.adapters.identity import identity_adapter

    options = RunOptions(data=str(SAMPLE), preset="tiny", modes=ALL_MODES, limit=3, out=str(tmp_path),
                         progress=False, bootstrap=200)
    again = evaluate(options, source=tiny_target, target=tiny_target, adapter=identity_adapter(tiny_target),
                     config=TINY)
    for a, b in zip(identity_run["results"], again["results"]):
        for name in a.modes:
            assert (a.modes[name].summary_ids, a.modes[name].nll) == (b.modes[name].summary_ids, b.modes[name].nll)
    for name, e in identity_run["summary"]["modes"].items():
        f = again["summary"]["modes"][name]
        assert [e[k] for k in ROUGE_TYPES] == [f[k] for k in ROUGE_TYPES]
        assert e.get("nll_recovery") == f.get("nll_recovery")
    # eval compare: the two runs, paired, differ by nothing; a mode against another gives each run's own figures
    from kvbridge.eval.compare import compare, parse_pairs, read_run

    assert parse_pairs("replace,blend:0.1=replace/noprior") == [("replace", "replace"),
                                                               ("blend:0.1", "replace/noprior")]
    a, b = read_run(identity_run["paths"]["json"]), read_run(tmp_path)
    paired = compare(a, b, parse_pairs("replace,none=full"), samples=100)["pairs"]
    same = paired["replace vs replace"]
    assert same["recovery_diff"] == {"value": 0.0, "low": 0.0, "high": 0.0} and same["worse_on"] == 0
    assert same["recovery_a"]["value"] == pytest.approx(identity_run["summary"]["modes"]["replace"]["nll_recovery"]
                                                        ["value"])
    apart = paired["none vs full"]
    assert apart["recovery_diff"]["value"] == pytest.approx(-1)
    assert apart["worse_on"] == sum(d.modes["none"].nll > d.modes["full"].nll for d in identity_run["results"])
    assert apart["top1_b"]["value"] == 1 and apart["fidelity_diff"]["value"] < 0
    with pytest.raises(ValueError, match="mode 'fuse:9' is not in the run"):
        compare(a, b, [("fuse:9", "full")], samples=10)
    # a run without `none` (fidelity only): no recovery, the same fidelity and top-1 figures
    from kvbridge.eval.compare import Run, markdown

    lean = Run(b.path, {i: {**row, "modes": {m: v for m, v in row["modes"].items() if m != "none"}}
                        for i, row in b.documents.items()}, b.meta)
    fidelity_only = compare(a, lean, [("replace", "replace")], samples=100)
    entry = fidelity_only["pairs"]["replace vs replace"]
    assert entry["recovery_diff"] is None and entry["worse_on"] is None
    assert entry["fidelity_b"] == same["fidelity_b"] and entry["top1_diff"] == same["top1_diff"]
    assert "| replace vs replace | – | – | – | – of" in markdown(fidelity_only, a, lean)


def test_eval_rouge_command_on_the_tiny_pair(tiny_adapter_file, tmp_path, capsys):
    """The CLI with a fitted (not identity) adapter: a projection is an approximation, so replace differs from
    full, and recompute of every token is exact again."""
    from kvbridge.cli import main

    out = tmp_path / "out"
    rc = main(["eval", "rouge", "--data", str(SAMPLE), "--preset", "tiny", "--adapter", str(tiny_adapter_file),
               "--modes", "full,none,replace,recompute:1", "--limit", "2", "--max-doc-tokens", "64",
               "--continuation-tokens", "8", "--max-new-tokens", "6", "--out", str(out), "--no-progress",
               "--bootstrap", "100", "--instruction", r"\n\nIn short:"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| recompute:1 |" in printed and str(out / "table.md") in printed
    written = json.loads((out / "results.json").read_text())
    assert written["meta"]["config"]["instruction"] == "\n\nIn short:"  # typed escapes are line breaks
    docs = written["documents"]
    for doc in docs:
        m = doc["modes"]
        assert m["replace"]["nll"] != pytest.approx(m["full"]["nll"], rel=1e-3)
        assert m["recompute:1"]["nll"] == pytest.approx(m["full"]["nll"], rel=1e-4)
    assert main(["eval", "rouge", "--data", str(tmp_path / "missing.jsonl"), "--preset", "tiny"]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    # an instruction of only line breaks asks nothing: refused by name before a model loads
    assert main(["eval", "rouge", "--data", str(SAMPLE), "--preset", "tiny", "--instruction", r"\n\n "]) == 2
    assert "asks nothing" in capsys.readouterr().err


def _tiny_fuser(adapter_file, path, scale: float):
    """A fuser file for the tiny pair: the adapter's layer mix, B scaled (0: the untrained fuser)."""
    import torch
    from kvbridge.adapters.fuser import FuserConfig, FuserMaps, save_fuser
    from kvbridge.adapters.io import load_adapter

    a = load_adapter(adapter_file)
    lt, d_s, d_t = a.wk.shape
    torch.manual_seed(0)
    maps = FuserMaps(a.layer_map, {"k": a.mix_k, "v": a.mix_v}, {m: torch.zeros(lt, d_s) for m in "kv"}, None,
                     {m: torch.ones(lt) for m in "kv"}, a.meta.target["num_kv_heads"], d_t, FuserConfig(rank=4))
    with torch.no_grad():
        maps.b_k.normal_(std=scale)
        maps.b_v.normal_(std=scale)
    return save_fuser(maps, a.meta, path, dtype=torch.float32)


def test_fuser_mode_adds_to_the_targets_own_prefill(tiny_adapter_file, tmp_path, capsys):
    """Mode `fuser` with an untrained fuser is `full` exactly; a non-zero one changes the scores; no --fuser, no
    mode."""
    from kvbridge.cli import main

    common = ["eval", "rouge", "--data", str(SAMPLE), "--preset", "tiny", "--adapter", str(tiny_adapter_file),
              "--modes", "full,fuser", "--limit", "2", "--max-doc-tokens", "48", "--continuation-tokens", "8",
              "--max-new-tokens", "4", "--no-progress", "--bootstrap", "50"]
    for scale, same in ((0.0, True), (1.0, False)):
        out = tmp_path / f"out{scale}"
        fuser = _tiny_fuser(tiny_adapter_file, tmp_path / f"f{scale}.safetensors", scale)
        assert main([*common, "--fuser", str(fuser), "--out", str(out)]) == 0
        for doc in json.loads((out / "results.json").read_text())["documents"]:
            m = doc["modes"]
            assert (m["fuser"]["nll"] == pytest.approx(m["full"]["nll"], rel=1e-5)) is same
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "none")]) == 2
    assert "needs --fuser FILE" in capsys.readouterr().err


def test_demo_runs_with_a_background_server(tmp_path):
    """`kvbridge demo --preset tiny`: fits an adapter into an empty folder, serves in the background, prints the
    side-by-side table, and the server stops cleanly; a second run uses the cached adapter."""
    env = {**os.environ, "KVBRIDGE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "kvbridge.cli", "demo", "--preset", "tiny", "--adapters",
           str(tmp_path / "adapters"), "--max-doc-tokens", "64", "--max-new-tokens", "8"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    for words in ("fitting a ridge adapter", "TTFT", "ROUGE-L vs ref", "fidelity vs full", "greedy = full",
                  "repeated 3-grams",
                  "served:blend:0.1", "TTFT cold", "TTFT warm", "reference:",
                  "server: stopped cleanly (exit 0)"):
        assert words in first.stdout, words
    assert any((tmp_path / "adapters").glob("*.safetensors"))
    second = subprocess.run(cmd + ["--no-selfcheck"], capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(cached in" in second.stdout and "fitting" not in second.stdout
    table = [line for line in second.stdout.splitlines()
             if line.startswith(("full ", "replace ", "served:blend:0.1 ", "served:recompute:0.1 ", "none "))]
    assert len(table) == 5


def test_eval_needs_an_adapter(tiny_source, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HOME", str(tmp_path))
    options = RunOptions(data=str(SAMPLE), preset="tiny", modes="full,replace", limit=1, out=str(tmp_path / "o"),
                         progress=False)
    with pytest.raises(FileNotFoundError, match="--fit-adapter"):
        evaluate(options, source=tiny_source, target=tiny_target, config=TINY)
    assert not (tmp_path / "o").exists()
