"""Two `eval rouge` runs given one --out: the one that ends second wrote its report over the first's (--out was
checked empty only when it began), or mixed its files with the other's. Now a run that finds files added or changed
in --out since it began writes its report to a new folder beside it and says so."""

from __future__ import annotations

import logging

from kvbridge.eval import run as eval_run
from kvbridge.eval.run import RunOptions, evaluate
from kvbridge.eval.summaries import EvalConfig
from kvbridge.transfer.data import data_path

TINY = EvalConfig(max_doc_tokens=96, continuation_tokens=16, max_new_tokens=10, fuse_steps=3)  # test_eval.py's


def test_a_report_written_to_out_meanwhile_is_not_written_over(tiny_target, tmp_path, monkeypatch, caplog):
    from kvbridge.adapters.identity import identity_adapter

    out = tmp_path / "eval-out"
    real_summarise = eval_run.summarise

    def summarise(*args, **kwargs):  # while this run works, another run finishes into the same --out
        out.mkdir(exist_ok=True)
        (out / "results.json").write_text('{"the other run": true}')
        return real_summarise(*args, **kwargs)

    monkeypatch.setattr(eval_run, "summarise", summarise)
    options = RunOptions(data=str(data_path("pydoc_summaries_sample.jsonl")), preset="tiny", modes="full,replace",
                         limit=1, out=str(out), progress=False, bootstrap=50)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        report = evaluate(options, source=tiny_target, target=tiny_target, adapter=identity_adapter(tiny_target),
                          config=TINY)
    folder = report["paths"]["json"].parent
    assert folder != out and folder.parent == out.parent and folder.name.startswith("eval-out-")
    assert (out / "results.json").read_text() == '{"the other run": true}'  # the other run's report, whole
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    assert "written there by another run" in caplog.text and str(folder) in caplog.text
