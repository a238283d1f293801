"""The evaluation's whole-system FLOPs of a served correction: the server's correction pass counts, computed once per
document and shared by the N requests that read it (as the source's prefill and the projection are); through a real
in-process server and the tiny pair, against the in-process mode of the same correction."""

from __future__ import annotations

import json

import pytest
from kvbridge.eval.cost import PairCost
from kvbridge.eval.report import _system_flops
from kvbridge.eval.run import RunOptions, evaluate
from kvbridge.eval.summaries import EvalConfig, served_forwards
from kvbridge.transfer.data import data_path

SAMPLE = data_path("pydoc_summaries_sample.jsonl")
# 0.25 of a 96-token document is 24 tokens, more than blend's window of 16: blend's scoring pass runs too
MODES = "full,blend:0.25,served:blend:0.25,recompute:0.25,served:recompute:0.25"
PAIRS = (("blend:0.25", "served:blend:0.25"), ("recompute:0.25", "served:recompute:0.25"))
CONFIG = EvalConfig(max_doc_tokens=96, continuation_tokens=8, max_new_tokens=4)


@pytest.fixture(scope="module")
def served_run(tiny_source, tiny_target, adapter, tmp_path_factory):
    options = RunOptions(data=str(SAMPLE), preset="tiny", modes=MODES, limit=2, progress=False, bootstrap=50,
                         out=str(tmp_path_factory.mktemp("eval-served-flops")))
    return evaluate(options, source=tiny_source, target=tiny_target, adapter=adapter, config=CONFIG)


@pytest.mark.integration  # an in-process server
def test_a_served_correction_costs_the_system_what_the_same_correction_costs_in_process(served_run, tiny_source,
                                                                                        tiny_target, adapter):
    """At N = 1 a served correction's system FLOPs are the in-process mode's (the same code and selection: the
    server's correction pass in place of the target's own); they were the instruction's forward alone over the
    source's prefill and the projection. At N = 8 all that is computed once per document is divided by 8."""
    cost = PairCost.of(tiny_source.model.config, tiny_target.model.config, adapter)
    summary = served_run["summary"]["modes"]
    for own, served in PAIRS:
        system = {name: {n: summary[name]["system_flops"][n]["flops"] for n in ("1", "10")} for name in (own, served)}
        assert system[served]["1"] == pytest.approx(system[own]["1"], rel=1e-12), served
        shared = sum(doc.modes[served].shared_flops for doc in served_run["results"]) / len(served_run["results"])
        # at N = 10 the in-process mode still pays its correction in full, the served one a tenth of it
        assert system[own]["10"] - system[served]["10"] == pytest.approx(0.9 * shared, rel=1e-9), served
        for doc in served_run["results"]:
            m, o = doc.modes[served], doc.modes[own]
            assert doc.doc_tokens == 96 and m.shared_flops > 0
            # the correction pass is what the in-process mode prefills beyond the instruction's forward
            assert m.shared_flops == o.prefill_flops - m.prefill_flops, (doc.id, served)
            assert _system_flops(cost, served, doc, 1) == pytest.approx(_system_flops(cost, own, doc, 1), rel=1e-12)
            once = _system_flops(cost, served, doc, 1) - m.prefill_flops  # source prefill, projection, correction
            assert once == pytest.approx(cost.system(0, doc.source_tokens, doc.doc_tokens + 1, 1) + m.shared_flops)
            assert _system_flops(cost, served, doc, 8) == pytest.approx(m.prefill_flops + once / 8, rel=1e-12)
    written = json.loads(served_run["paths"]["json"].read_text())["documents"][0]["modes"]
    assert written["served:blend:0.25"]["shared_flops"] > written["served:recompute:0.25"]["shared_flops"] > 0
    assert written["blend:0.25"]["shared_flops"] == written["full"]["shared_flops"] == 0


def test_served_forwards_are_the_corrections_and_a_count_other_than_the_plans_is_refused():
    """recompute: the tail over the head; blend: its window's scoring pass only where it recomputes more than the
    window (Correction.forwards, the plan the server's correct() runs); a count the server reports is checked."""
    assert served_forwards("recompute:0.25", 96, 30) == [(24, 73)]
    assert served_forwards("blend:0.25", 96, 30, 24) == [(16, 81), (24, 73)]
    assert served_forwards("blend:0.1", 96, 30) == [(10, 87)]  # 10 <= 16: the window is among the recomputed
    assert served_forwards("replace", 96, 30) == []
    with pytest.raises(ValueError, match="recomputes 24 of them; the server says it recomputed 97"):
        served_forwards("blend:0.25", 96, 30, 97)
