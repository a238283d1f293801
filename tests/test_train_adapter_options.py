"""train-adapter's options: a bad one is refused by name before any expensive work (teacher windows, the ridge
fit); --save-dtype holds for every trainer; the default --out and --work stay single names under KVBRIDGE_HOME;
--stats is written at the end and at most every interval, and a run stopped between resumes from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from kvbridge.adapters import chain, train
from kvbridge.adapters.cli import main
from kvbridge.adapters.io import load_adapter, read_adapter_meta, save_adapter
from test_adapters import random_adapter
from test_chain_cli import _args, _eval_docs, corpus  # noqa: F401  (the module's corpus fixture)


@pytest.fixture
def no_work(monkeypatch):
    """Computing teacher windows or a ridge fit fails the test: a refusal must come before that work."""
    def expensive(*args, **kwargs):
        raise AssertionError("expensive work started before the refusal")

    monkeypatch.setattr(chain, "build_teacher_cache", expensive)
    monkeypatch.setattr(train, "train_adapter", expensive)


CHAIN = ("--trainer", "chain", "--stages", "kl:2")


@pytest.mark.parametrize("extra, says", [
    (("--trainer", "fuser", "--stages", "ce:2", "--fuser-rank", "0"), "--fuser-rank must be >= 1"),
    ((*CHAIN, "--stage-lr", "kl=0"), "--stage-lr kl=0"),
    ((*CHAIN, "--stage-lr", "kll=5"), "--stage-lr names 'kll', not a stage: the stages are attention, kl, ce"),
    ((*CHAIN, "--batch-windows", "0"), "--batch-windows must be >= 1, got 0"),
    ((*CHAIN, "--exact-tail", "1"), "--exact-tail must be in [0, 1), got 1.0"),
    ((*CHAIN, "--k", "0"), "--k must be >= 1, got 0"),
    (("--trainer", "ridge", "--k", "0", "--layer-map", "mix"), "--k must be >= 1, got 0"),
    ((*CHAIN, "--out", "x.pt"), "--out x.pt"),
    (("--trainer", "ridge", "--out", "x.pt"), "--out x.pt"),
    ((*CHAIN, "--context-tokens", "4096"), "--eval-docs 4"),
    (("--trainer", "ridge", "--context-tokens", "4096"), "--eval-docs 4"),
    (("--trainer", "ridge", "--eval-docs", "1"), "--eval-docs 1"),
    ((*CHAIN, "--init", "absent.safetensors"), "absent.safetensors"),
    # an option of the other trainer was ignored: --trainer ridge --init X fitted a fresh ridge
    (("--trainer", "ridge", "--stages", "kl:2"), "--stages is an option of --trainer chain or fuser; --trainer ridge"),
    (("--trainer", "ridge", "--exact-tail", "0.5"), "--exact-tail is an option of --trainer chain or fuser"),
    (("--trainer", "fuser", "--stages", "ce:2", "--token-rank", "8"), "--token-rank is an option of --trainer chain;"),
    ((*CHAIN, "--refine-steps", "3"), "--refine-steps is an option of --trainer ridge; --trainer chain does not"),
    ((*CHAIN, "--stats", "s.safetensors"), "--stats is an option of --trainer ridge"),
])
def test_bad_options_are_refused_before_any_work(corpus, tmp_path, no_work, capsys, extra, says):  # noqa: F811
    work = tmp_path / "work"
    assert main(_args(corpus, work, tmp_path / "a.safetensors", *extra)) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert not work.exists() and not (tmp_path / "a.safetensors").exists()


def test_an_init_adapter_of_another_pair_is_refused_before_any_work(corpus, tmp_path, no_work, capsys,  # noqa: F811
                                                                     tiny_source, tiny_target):
    a = random_adapter(tiny_source, tiny_target)
    other = save_adapter(dataclasses.replace(a, meta=dataclasses.replace(
        a.meta, target=dict(a.meta.target, config_hash="0" * 64))), tmp_path / "other.safetensors")
    assert main(_args(corpus, tmp_path / "work", tmp_path / "a.safetensors", *CHAIN, "--init", str(other))) == 2
    assert "was fitted for target" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
    assert main(_args(corpus, tmp_path / "work", tmp_path / "a.safetensors", "--trainer", "ridge", "--init",
                      str(other))) == 2
    assert "--init is an option of --trainer chain or fuser; --trainer ridge does not read it" in \
        capsys.readouterr().err


def test_the_ridge_trainer_writes_its_maps_in_the_save_dtype(corpus, tmp_path, tiny_source, tiny_target):  # noqa: F811
    """--save-dtype bfloat16 for --trainer ridge: the file's maps are bfloat16 and its recorded recovery is that of
    the file as it loads."""
    from kvbridge.adapters.evaluate import evaluate_recovery

    out = tmp_path / "r.safetensors"
    assert main(["--preset", "tiny", "--corpus", corpus[0][0], "--max-tokens", "1024", "--window-tokens", "128",
                 "--eval", corpus[1], "--eval-docs", "4", "--out", str(out), "--save-dtype", "bfloat16", "-q"]) == 0
    saved = load_adapter(out)
    assert saved.wk.dtype == saved.bv.dtype == saved.mix_k.dtype == torch.bfloat16
    assert saved.layer_map.dtype == torch.int64 and saved.start_kv.dtype == torch.float32
    loaded = evaluate_recovery(tiny_source, tiny_target, saved, _eval_docs(corpus, tiny_source, tiny_target),
                               progress=False)
    assert loaded.recovery["projected"] == pytest.approx(saved.meta.metrics["recovery"]["projected"], abs=1e-9)


@pytest.mark.parametrize("source, target", [("/models/x/src", "/models/y/tgt/"), ("Qwen/Qwen2-7B", "meta/Llama-3"),
                                            ("..", "a/../.."), ("tiny-qwen2", "tiny-phi3")])
def test_default_paths_are_single_names_under_home(tmp_path, source, target):
    from kvbridge.adapters.cli import default_out, default_work, model_component

    out, work = default_out(tmp_path, source, target, "chain"), default_work(tmp_path, source, target)
    assert out.parent == tmp_path / "adapters" and work.parent == tmp_path / "train"
    assert out.name.endswith("--chain.safetensors") and not out.name.startswith(".")
    for name in (out.name, work.name):
        assert "/" not in name and "\\" not in name and name not in (".", "..")
    if "/" not in source + target:  # a plain name stays as it is
        assert work.name == f"{source}--{target}"
    assert model_component("Qwen/Qwen2-7B") != model_component("other/Qwen2-7B")  # the hash keeps them apart
    assert model_component("Qwen/Qwen2-7B").startswith("Qwen2-7B-")


def test_the_default_out_of_models_given_by_path_lands_under_home(tmp_path, monkeypatch, capsys, tiny_source,
                                                                  tiny_target):
    from kvbridge.transfer import presets

    def renamed(model, name):
        spec = model.spec
        return dataclasses.replace(model, spec=dataclasses.replace(spec, identity=dataclasses.replace(
            spec.identity, name=name)))

    models = tmp_path / "models"
    monkeypatch.setattr(presets, "load_pair", lambda *a, **k: (renamed(tiny_source, f"{models}/src"),
                                                               renamed(tiny_target, f"{models}/tgt")))
    home = tmp_path / "home"
    monkeypatch.setenv("KVBRIDGE_HOME", str(home))
    assert main(["--source", f"{models}/src", "--target", f"{models}/tgt", "--max-tokens", "1024",
                 "--window-tokens", "128", "--eval-docs", "0", "-q"]) == 0
    written = list((home / "adapters").iterdir())
    assert len(written) == 1 and written[0].name.startswith("src-") and written[0].suffix == ".safetensors"
    assert not models.exists()
    assert read_adapter_meta(written[0])["source"]["name"] == f"{models}/src"


def test_stats_are_written_at_the_end_and_at_most_every_interval(tmp_path, monkeypatch, tiny_source, tiny_target):
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.transfer.selfcheck import sample_text

    corpus_file = tmp_path / "c.txt"
    corpus_file.write_text(sample_text())
    cfg = TrainConfig(max_tokens=1024, window_tokens=128, layer_map="mix", k=2)
    plain, _ = train_adapter(tiny_source, tiny_target, [corpus_file], cfg, progress=False)
    writes = []
    write_tensors = train.write_tensors
    monkeypatch.setattr(train, "write_tensors", lambda path, *a, **k: (writes.append(path), write_tensors(path, *a,
                                                                                                         **k)))
    train_adapter(tiny_source, tiny_target, [corpus_file], cfg, stats_path=tmp_path / "s.safetensors",
                  progress=False)
    assert len(writes) == 1  # the fit takes less than the interval: the statistics are written once, at the end

    ticks = iter(range(10_000))  # a clock that moves one second at every reading
    real = train.kv_pairs
    calls = []

    def stopped(*args, **kwargs):  # the run is stopped at its fourth training window
        calls.append(1)
        if len(calls) == 1 + 4:  # (one held-out window before them)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "kv_pairs", stopped)
    writes.clear()
    with pytest.raises(KeyboardInterrupt):
        train_adapter(tiny_source, tiny_target, [corpus_file], cfg, stats_path=tmp_path / "t.safetensors",
                      progress=False, save_every_s=2.0, clock=lambda: float(next(ticks)))
    assert 1 <= len(writes) < 4
    monkeypatch.setattr(train, "kv_pairs", real)
    resumed, _ = train_adapter(tiny_source, tiny_target, [corpus_file], cfg, stats_path=tmp_path / "t.safetensors",
                               progress=False)
    for name in ("wk", "bk", "wv", "bv", "mix_k"):
        assert torch.equal(getattr(resumed, name), getattr(plain, name)), name
    assert Path(tmp_path / "t.safetensors").is_file()
