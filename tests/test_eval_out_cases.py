"""Eval rouge's --out, more cases: a run's own engine.log does not move its report; --force over an old report
writes over it when nobody touched --out meanwhile; a file there when the run began that another run rewrote
meanwhile moves the report."""

from __future__ import annotations

import logging
import os

from kvbridge.eval import run as eval_run
from kvbridge.eval.run import RunOptions, evaluate
from kvbridge.eval.summaries import EvalConfig
from kvbridge.transfer.data import data_path

TINY = EvalConfig(max_doc_tokens=96, continuation_tokens=16, max_new_tokens=10, fuse_steps=3)


def _run(out, tiny_target, monkeypatch, meanwhile, force=False):
    from kvbridge.adapters.identity import identity_adapter

    real_summarise = eval_run.summarise

    def summarise(*args, **kwargs):
        meanwhile()
        return real_summarise(*args, **kwargs)

    monkeypatch.setattr(eval_run, "summarise", summarise)
    options = RunOptions(data=str(data_path("pydoc_summaries_sample.jsonl")), preset="tiny", modes="full,replace",
                         limit=1, out=str(out), progress=False, bootstrap=50, force=force)
    report = evaluate(options, source=tiny_target, target=tiny_target, adapter=identity_adapter(tiny_target),
                      config=TINY)
    return report["paths"]["json"].parent


def test_the_runs_own_engine_log_does_not_move_its_report(tiny_target, tmp_path, monkeypatch):
    """A --vllm run's engine writes out/engine.log while the run works."""
    out = tmp_path / "eval-out"

    def engine_log():
        out.mkdir(exist_ok=True)
        (out / "engine.log").write_text("engine started\n")
    assert _run(out, tiny_target, monkeypatch, engine_log) == out


def test_force_over_an_old_report_nobody_touched_writes_into_out(tiny_target, tmp_path, monkeypatch):
    """--force writes over the old report."""
    out = tmp_path / "eval-out"
    out.mkdir()
    (out / "results.json").write_text('{"old": true}')
    assert _run(out, tiny_target, monkeypatch, lambda: None, force=True) == out
    assert (out / "results.json").read_text() != '{"old": true}'


def test_a_file_there_at_the_start_rewritten_meanwhile_moves_the_report(tiny_target, tmp_path, monkeypatch, caplog):
    """With --force over an old report, another run's rewrite of results.json meanwhile is
    another run's report, not this one's to write over."""
    out = tmp_path / "eval-out"
    out.mkdir()
    (out / "results.json").write_text('{"old": true}')
    st = os.stat(out / "results.json")
    os.utime(out / "results.json", ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # an old file

    def other_run():
        (out / "results.json").write_text('{"the other run": true}')
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        folder = _run(out, tiny_target, monkeypatch, other_run, force=True)
    assert folder != out and (out / "results.json").read_text() == '{"the other run": true}'
