"""`kvbridge eval rouge`'s options, on the tiny pair: what the served modes read with, what a run against a running
server refuses, mistakes named before any model loads, existing output kept unless --force, a run stopped by one
document still writes what finished (marked partial), the adapter recorded by digest and path, no adapter asked for
when no mode projects, and id-only --exclude files."""

from __future__ import annotations

import json
from dataclasses import replace

import grpc
import pytest
from kvbridge.eval.records import read_records
from kvbridge.eval.run import RunOptions, evaluate
from kvbridge.eval.summaries import EvalConfig
from kvbridge.transfer.data import data_path

SAMPLE = data_path("pydoc_summaries_sample.jsonl")
TINY = EvalConfig(max_doc_tokens=64, continuation_tokens=8, max_new_tokens=4, fuse_steps=2)


class ModelsLoaded(Exception):
    """Raised in place of loading the models: a check that should come first did not."""


@pytest.fixture
def no_models(monkeypatch):
    """load_pair raises ModelsLoaded: a test that expects a refusal before any model loads sees it otherwise."""
    from kvbridge.transfer import presets

    def refuse(*args, **kwargs):
        raise ModelsLoaded(kwargs)

    monkeypatch.setattr(presets, "load_pair", refuse)


def _served_service(monkeypatch) -> list:
    """The services eval's in-process servers are built as (appended as they are built)."""
    from kvbridge.server import app

    built, original = [], app.build_service

    def spy(config, **kwargs):
        service = original(config, **kwargs)
        built.append((config, service))
        return service

    monkeypatch.setattr(app, "build_service", spy)
    return built


@pytest.mark.integration  # served:* modes start an in-process server
def test_served_modes_read_with_the_runs_induction_prior_setting(tiny_source, tiny_target, tiny_adapter_file,
                                                                tmp_path, monkeypatch):
    """--no-induction-prior and --prior FILE reach the in-process server's corrections (served:*), as they reach the
    modes computed here; results.json records what the served corrections read with."""
    from kvbridge.adapters.io import load_adapter
    from kvbridge.eval.prior_fit import initial_terms
    from kvbridge.transfer.suffix.induction import InductionPrior

    built = _served_service(monkeypatch)
    common = dict(data=str(SAMPLE), preset="tiny", modes="full,served:blend:0.1", limit=1, progress=False,
                  bootstrap=20, adapter=str(tiny_adapter_file))
    run = evaluate(RunOptions(**common, out=str(tmp_path / "off")), source=tiny_source, target=tiny_target,
                   config=replace(TINY, induction_prior=False))
    config, service = built[-1]
    assert config.correction_prior is False and service.corrections.prior(tiny_target) is None
    assert run["meta"]["served_correction_prior"] is None

    given = tmp_path / "given.safetensors"
    InductionPrior(initial_terms(tiny_target) + 0.25).save(given, {
        "target": {"name": tiny_target.name, "config_hash": tiny_target.spec.identity.config_hash},
        "adapter": {"name": "x", "digest": load_adapter(tiny_adapter_file).digest}})
    run = evaluate(RunOptions(**common, out=str(tmp_path / "given"), prior=str(given)), source=tiny_source,
                   target=tiny_target, config=TINY)
    config, service = built[-1]
    assert config.correction_prior is True and config.correction_prior_file == str(given)
    assert service.corrections.prior(tiny_target).origin == "given.safetensors"
    assert run["meta"]["served_correction_prior"] == str(given)


@pytest.mark.parametrize("extra, words", [({"adapter": "mine.safetensors"}, "--adapter"),
                                          ({"fit_adapter": True}, "--fit-adapter"),
                                          ({"modes": "full,served:blend:0.1", "prior": "p.safetensors"}, "--prior")])
def test_a_running_server_is_not_given_options_it_would_ignore(extra, words, tmp_path, no_models):
    """--server projects with the server's own default adapter and corrects with its own prior: --adapter,
    --fit-adapter (and --prior with a served mode) are refused by name, before the data is read or a model loads."""
    with pytest.raises(ValueError, match=words):
        evaluate(RunOptions(**{"data": str(tmp_path / "missing.jsonl"), "preset": "tiny", "server": "127.0.0.1:9",
                               "out": str(tmp_path / "o"), **extra}))


@pytest.mark.integration  # identity_server
def test_a_run_against_a_server_loads_no_source_weights_and_records_the_adapter(identity_server, tiny_target,
                                                                                tmp_path, monkeypatch):
    """--server: the source runs there, so this process loads it without weights; the adapter the server projected
    with is recorded by its digest (its path is the server's)."""
    from kvbridge.transfer import presets

    calls, original = [], presets.load_pair

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(presets, "load_pair", spy)
    run = evaluate(RunOptions(data=str(SAMPLE), preset="tiny", modes="full,replace", limit=1, progress=False,
                              bootstrap=20, out=str(tmp_path / "o"), server=identity_server.address), config=TINY)
    assert calls and all(c.get("source_weights") is False for c in calls)
    _, served = identity_server.service.adapters.resolve("", tiny_target.spec, tiny_target.spec)
    assert run["meta"]["adapter_digest"] == served.digest and run["meta"]["adapter_path"] is None


def test_the_adapter_is_recorded_by_digest_and_path(tiny_source, tiny_target, tiny_adapter_file, tmp_path):
    from kvbridge.adapters.io import load_adapter

    run = evaluate(RunOptions(data=str(SAMPLE), preset="tiny", modes="full,replace", limit=1, progress=False,
                              bootstrap=20, out=str(tmp_path / "o"), adapter=str(tiny_adapter_file)),
                   source=tiny_source, target=tiny_target, config=TINY)
    written = json.loads((tmp_path / "o" / "results.json").read_text())["meta"]
    assert written["adapter_digest"] == load_adapter(tiny_adapter_file).digest == run["meta"]["adapter_digest"]
    assert written["adapter_path"] == str(tiny_adapter_file.resolve())


def test_modes_that_project_nothing_need_no_adapter(tiny_source, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HOME", str(tmp_path / "home"))  # an empty adapter folder
    run = evaluate(RunOptions(data=str(SAMPLE), preset="tiny", modes="full,none,tail:0.5", limit=1, progress=False,
                              bootstrap=20, out=str(tmp_path / "o")), source=tiny_source, target=tiny_target,
                   config=TINY)
    assert set(run["summary"]["modes"]) == {"full", "none", "tail:0.5"} and run["meta"]["adapter"] == ""


@pytest.mark.parametrize("flags, words", [(["--bootstrap", "0"], "--bootstrap must be >= 1"),
                                          (["--limit", "0"], "--limit must be >= 1"),
                                          (["--out", "FILE"], "is a file"),
                                          (["--out", "FULL"], "--force"),
                                          (["--modes", "full,fuser"], "needs --fuser FILE")])
def test_bad_options_are_named_before_any_model_loads(flags, words, tmp_path, capsys, no_models):
    from kvbridge.cli import main

    (tmp_path / "FILE").write_text("mine")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "results.json").write_text("{}")
    flags = [str(tmp_path / f) if f in ("FILE", "FULL") else f for f in flags]
    assert main(["eval", "rouge", "--data", str(SAMPLE), "--preset", "tiny", "--no-progress",
                 "--out", str(tmp_path / "o"), *flags]) == 2
    assert words in capsys.readouterr().err
    assert (tmp_path / "FILE").read_text() == "mine" and (tmp_path / "FULL" / "results.json").read_text() == "{}"
    assert not (tmp_path / "o").exists()


def test_force_writes_into_a_folder_that_holds_files(tmp_path, no_models):
    """--force: past the refusal (to the models, here refused by the fixture); an empty folder needs none."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "results.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for out, force in ((tmp_path / "full", True), (tmp_path / "empty", False)):
        with pytest.raises(ModelsLoaded):
            evaluate(RunOptions(data=str(SAMPLE), preset="tiny", out=str(out), force=force))


def test_a_document_that_fails_leaves_the_finished_ones_written_as_a_partial_run(tiny_target, tmp_path,
                                                                                 monkeypatch):
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.eval import summaries

    original, seen = summaries.SummaryEvaluator.run, []

    def second_fails(self, doc):
        seen.append(doc.record.id)
        if len(seen) == 2:
            raise RuntimeError("the server went away")
        return original(self, doc)

    monkeypatch.setattr(summaries.SummaryEvaluator, "run", second_fails)
    out = tmp_path / "o"
    with pytest.raises(RuntimeError, match="the server went away.*partial") as info:
        evaluate(RunOptions(data=str(SAMPLE), preset="tiny", modes="full,replace", limit=3, progress=False,
                            bootstrap=20, out=str(out)), source=tiny_target, target=tiny_target,
                 adapter=identity_adapter(tiny_target), config=TINY)
    assert seen[1] in str(info.value) and str(out) in str(info.value)
    written = json.loads((out / "results.json").read_text())
    assert [d["id"] for d in written["documents"]] == seen[:1]
    partial = written["meta"]["partial"]
    assert partial["failed_document"] == seen[1] and "the server went away" in partial["error"]
    assert (partial["documents_done"], partial["documents_planned"]) == (1, 3)
    assert (out / "table.md").read_text().startswith("PARTIAL")


def test_server_errors_end_in_a_message_not_a_traceback(monkeypatch, capsys):
    from kvbridge.eval import cli as eval_cli
    from kvbridge.server.client import KVBridgeError

    def unreachable(args):
        raise KVBridgeError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", "Ingest")

    monkeypatch.setattr(eval_cli, "cmd_eval_rouge", unreachable)
    from kvbridge.cli import main

    assert main(["eval", "rouge", "--data", str(SAMPLE), "--server", "127.0.0.1:9"]) == 2
    assert "kvbridge eval: error: Ingest: UNAVAILABLE: failed to connect" in capsys.readouterr().err


def test_an_exclude_file_may_hold_ids_alone(tmp_path):
    records = read_records(SAMPLE)
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"id": r.id}) + "\n" for r in records[:2]))
    assert [r.id for r in read_records(SAMPLE, exclude=ids)] == [r.id for r in records[2:]]
    ids.write_text(json.dumps({"document": "no id"}) + "\n")
    with pytest.raises(ValueError, match="ids.jsonl:1: field 'id' must be a non-empty string"):
        read_records(SAMPLE, exclude=ids)


def test_eval_heldout_keeps_an_existing_file_unless_forced(tmp_path, monkeypatch):
    import argparse

    from kvbridge.eval import heldout

    out = tmp_path / "long.jsonl"
    out.write_text("mine\n")
    monkeypatch.setattr(heldout, "corpus_records", lambda *a, **k: [{"id": "a", "document": "x", "summary": ""}])
    args = argparse.Namespace(man=None, corpus=["c.txt"], summaries=None, min_tokens=1, preset="tiny", seed=0,
                              out=str(out), force=False)
    with pytest.raises(ValueError, match="exists.*--force"):
        heldout.cmd_eval_heldout(args)
    assert out.read_text() == "mine\n"
    assert heldout.cmd_eval_heldout(argparse.Namespace(**{**vars(args), "force": True})) == 0
    assert [r.id for r in read_records(out)] == ["a"]
