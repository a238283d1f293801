"""The chain trainer's work folder (adapters/work_folder.py): every checkpoint records what it was made from, and a
rerun that asks for something else is refused by the option's name before any teacher window is computed, never
served the old weights; a checkpoint left incomplete is computed again; the recorded command is the one given."""

from __future__ import annotations

import json
import logging
import shlex
import shutil

import pytest
import torch
from kvbridge.adapters import chain
from kvbridge.adapters.cli import main
from kvbridge.adapters.io import load_adapter, read_adapter_meta
from kvbridge.adapters.work_folder import differences
from safetensors import safe_open
from safetensors.torch import save_file
from test_chain_cli import _args, corpus  # noqa: F401  (the module's corpus fixture)


@pytest.fixture(scope="module")
def made(corpus, tmp_path_factory):  # noqa: F811
    """One chain run (kl:2 from a ridge fit; mix of k 3, the default): its work folder, adapter and arguments."""
    root = tmp_path_factory.mktemp("made")
    work, out = root / "work", root / "a.safetensors"
    args = _args(corpus, work, out, "--trainer", "chain", "--stages", "kl:2", "--token-rank", "0")
    assert main(args) == 0
    return work, out, args


@pytest.fixture
def no_teacher(monkeypatch):
    """Computing teacher windows fails the test: a refusal must come before that work."""
    def build(*args, **kwargs):
        raise AssertionError("teacher windows computed before the refusal")

    monkeypatch.setattr(chain, "build_teacher_cache", build)


def test_the_recorded_command_is_the_one_given(made):
    _, out, args = made
    assert read_adapter_meta(out)["training"]["command"] == "train-adapter " + shlex.join(args)


@pytest.mark.parametrize("change, says", [
    (("--k", "2"), "was made with --k 3; this run asks --k 2"),
    (("--layer-map", "nearest"), "was made with --layer-map mix; this run asks --layer-map nearest"),
    (("--ridge-windows", "6"), "was made with --ridge-windows 8; this run asks --ridge-windows 6"),
    (("--train-windows", "20"), "was made with --train-windows 16; this run asks --train-windows 20"),
    (("--dev-per-corpus", "3"), "was made with --dev-per-corpus 2; this run asks --dev-per-corpus 3"),
    (("--stages", "kl:3", "--stage-lr", "kl=1e-2"), "another config"),
])
def test_a_rerun_asking_other_options_is_refused_by_name(made, no_teacher, capsys, change, says):
    work, _, args = made
    files = sorted(p.relative_to(work) for p in work.rglob("*"))
    assert main([*args, *change]) == 2
    err = capsys.readouterr().err
    assert says in err and f"use another --work or remove {work}" in err, err
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == files  # nothing written


def test_a_changed_corpus_file_is_refused_by_name(made, corpus, tmp_path, capsys):  # noqa: F811
    work, out, args = made
    files = []
    for f in corpus[0]:
        copy = tmp_path / f.rsplit("/", 1)[1]
        shutil.copy(f, copy)
        files.append(str(copy))
    with open(files[0], "a") as fh:
        fh.write("\n\nthe model reads the text again.")
    changed = [files[0] if a == corpus[0][0] else a for a in args]
    assert main(changed) == 2
    assert "the corpus file alpha_corpus.txt has changed since" in capsys.readouterr().err
    # a folder that kept only the teacher cache refuses it too, before computing a window
    teacher_only = tmp_path / "teacher-only"
    shutil.copytree(work / "teacher", teacher_only / "teacher")
    again = _args((files, corpus[1]), teacher_only, tmp_path / "b.safetensors", "--trainer", "chain", "--stages",
                  "kl:2", "--token-rank", "0")
    assert main(again) == 2
    assert "alpha_corpus.txt" in capsys.readouterr().err
    assert sorted(p.name for p in teacher_only.iterdir()) == ["teacher"]


def test_init_in_the_folder_of_a_plain_run_is_refused(made, corpus, no_teacher, tmp_path, capsys):  # noqa: F811
    work, out, _ = made
    assert main(_args(corpus, work, tmp_path / "b.safetensors", "--trainer", "chain", "--stages", "kl:2",
                      "--init", str(out))) == 2
    err = capsys.readouterr().err
    assert "was made from a ridge fit (no --init); this run starts with an --init adapter" in err, err
    assert not (work / "init").exists()


@pytest.mark.parametrize("lost", ["fit.json", "stats.safetensors"])
def test_an_incomplete_ridge_checkpoint_is_computed_again(made, tmp_path, caplog, lost):
    work, out, args = made
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    (copy / "ridge" / lost).unlink()
    rerun = [str(copy) if a == str(work) else str(tmp_path / "b.safetensors") if a == str(out) else a for a in args]
    with caplog.at_level(logging.WARNING):
        assert main(rerun) == 0
    assert "incomplete checkpoint" in caplog.text and lost in caplog.text
    assert (copy / "ridge" / lost).is_file()
    assert torch.equal(load_adapter(tmp_path / "b.safetensors").wk, load_adapter(out).wk)


def test_an_incomplete_init_checkpoint_is_computed_again(made, corpus, tmp_path, caplog):  # noqa: F811
    _, first, _ = made
    work, out = tmp_path / "work", tmp_path / "b.safetensors"
    args = _args(corpus, work, out, "--trainer", "chain", "--stages", "kl:1", "--init", str(first))
    assert main(args) == 0
    (work / "init" / "init.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert main(args) == 0
    assert "incomplete checkpoint" in caplog.text and (work / "init" / "init.json").is_file()


def test_a_folder_of_an_older_kvbridge_resumes_unchecked_with_a_warning(made, tmp_path, caplog):
    """Checkpoints that record no inputs (written before they did) are read back as they are, and the log says so."""
    work, out, args = made
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    index = json.loads((copy / "teacher" / "index.json").read_text())
    del index["corpus"]
    (copy / "teacher" / "index.json").write_text(json.dumps(index))
    fit = json.loads((copy / "ridge" / "fit.json").read_text())
    (copy / "ridge" / "fit.json").write_text(json.dumps({"seconds": fit["seconds"]}))
    last = copy / "stage-0-kl" / "last.safetensors"
    with safe_open(str(last), "pt") as f:
        state, tensors = json.loads(f.metadata()["state"]), {k: f.get_tensor(k) for k in f.keys()}
    del state["inputs"]
    save_file(tensors, str(last), metadata={"state": json.dumps(state)})
    rerun = [str(copy) if a == str(work) else str(tmp_path / "b.safetensors") if a == str(out) else a for a in args]
    with caplog.at_level(logging.WARNING):
        assert main(rerun) == 0
    assert "records no corpus" in caplog.text and caplog.text.count("records no inputs") == 2
    assert torch.equal(load_adapter(tmp_path / "b.safetensors").wk, load_adapter(out).wk)
    assert "corpus" in json.loads((copy / "teacher" / "index.json").read_text())  # recorded from now on


def test_differences_name_the_options():
    saved = {"start": {"corpus": {"a.txt": "1" * 64}, "init": "", "k": 3, "windows": "w"}, "train_windows": 16}
    wanted = {"start": {"corpus": {"a.txt": "2" * 64}, "init": "", "k": 2, "windows": "x"}, "train_windows": 16}
    said = differences(saved, wanted)
    assert said[0].startswith("the corpus file a.txt has changed since (sha256 111111111111... then")
    assert said[1:] == ["was made with --k 3; this run asks --k 2"]  # (the windows follow from the options)
    assert differences(saved, saved) == []
    other_windows = {"start": dict(saved["start"], windows="y"), "train_windows": 20}
    assert differences(saved, other_windows) == [
        "was made from other windows (the dev and ridge windows another --train-windows selects)",
        "was made with --train-windows 16; this run asks --train-windows 20"]
    init = {"start": {"corpus": {"a.txt": "1" * 64}, "init": "f" * 64, "windows": "w"}, "train_windows": 16}
    assert differences(saved, init) == [
        "was made from a ridge fit (no --init); this run starts with an --init adapter of sha256 ffffffffffff..."]


def test_a_stage_after_a_kl_stage_of_another_exact_tail_is_refused_too(tmp_path):
    """A stage's inputs name the stages before it; --exact-tail changes what a kl (or ce) stage trains, and only the
    kl stage was refused: once its folder was removed (as the refusal says), the answer stage after it resumed its
    finished checkpoint, made on top of the kl stage of the other exact tail, and the run wrote that old adapter."""
    import dataclasses

    from kvbridge.adapters.trainer import _save, check_resume

    first = chain.ChainConfig(stages=(("kl", 10), ("answer", 10)), answer_windows=4, exact_tail=0.2)
    start = {"corpus": {"x.txt": "0" * 64}, "init": "", "seed": 0}
    for tc, name, inputs in chain.stage_plan(first, start, None):  # the first run's finished stages
        (tmp_path / name).mkdir()
        _save(tmp_path / name / "last.safetensors", torch.nn.Linear(1, 1), None,
              {"iter": tc.max_iters, "config": dataclasses.asdict(tc), "inputs": inputs, "best": 0.5,
               "best_iter": tc.max_iters, "elapsed_s": 0.0, "stale": 0})
    for tc, name, inputs in chain.stage_plan(dataclasses.replace(first, exact_tail=0.4), start, None):
        with pytest.raises(ValueError, match="exact_tail"):
            check_resume(tmp_path / name, tc, inputs)
    # a run without exact tails records its stages as runs before this change did
    plain = chain.stage_plan(dataclasses.replace(first, exact_tail=0.0), start, None)
    assert plain[1][2]["before"] == [["kl", 10, chain.DEFAULT_LR["kl"]]]
