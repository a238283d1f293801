"""`kvbridge prior fit` / `prior check` (kvbridge.eval.prior_fit, prior_answers, prior_cli): the fit resumes exactly,
refuses another recipe's checkpoint, and the shipped prior of the small pair reproduces from its recorded recipe; the
answer objective's windows hold the target's own answers, and only those are scored."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvbridge.eval import prior_cli, prior_fit
from kvbridge.eval.prior_fit import Recipe, compare, fit, recorded
from kvbridge.transfer import corpus, kvcache
from kvbridge.transfer.suffix.induction import InductionPrior

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "transfer" / "suffix" / "priors" / "smollm2-135m-instruct-q4_1.safetensors"


class OwnWindows:
    """Windows of the tiny target's own KV with a seeded disturbance (what a projection leaves), for `fit`: the same
    keys (ids, cont, kv, tail) as prior_fit.Windows builds from a server's projections."""

    def __init__(self, recipe: Recipe, target):
        self.recipe, self.items = recipe, {}
        g = torch.Generator().manual_seed(0)
        vocab = target.model.config.vocab_size
        for i in range(recipe.windows):
            pattern = torch.randint(3, vocab, (12,), generator=g)
            ids = torch.cat((torch.tensor([1]), pattern.repeat(4)))  # repeats: what induction heads read
            cont = pattern.repeat(3)[:32]
            kv = kvcache.extract(target.model, target.spec, ids).kv.float()
            kv = kv + 0.3 * kv.std() * torch.randn(kv.shape, generator=g)
            self.items[i] = {"ids": ids, "cont": cont, "kv": kv.to(torch.bfloat16),
                             "tail": kv[:, :, :, -5:].to(torch.bfloat16)}
        self.built: set[int] = set()

    def build(self, needed, log=print):
        self.built |= set(needed)

    def __getitem__(self, index):
        return self.items[index]


def test_a_resumed_fit_gives_the_same_prior_as_one_run(tiny_target, tmp_path):
    recipe = Recipe(preset="tiny", windows=6, dev=2, steps=6, dev_every=2)
    windows = OwnWindows(recipe, tiny_target)
    init = torch.ones_like(prior_fit.initial_terms(tiny_target))  # the tiny model has no head of induction score
    init[:, 0] = 0  # a layer with no biased head: a fit reads every layer through the prior, so it moves too
    theta, trajectory = fit(recipe, tiny_target, windows, tmp_path / "one", log=lambda _: None, init=init)
    assert sorted(trajectory, key=int) == ["0", "2", "4", "6"]
    assert windows.built >= {0, 1} and windows.built <= set(range(6))
    assert (theta - init).abs().min() > 0, "six Adam steps left a term of the prior where it was"
    assert bool((theta[:, 0] != 0).all())
    assert trajectory["6"] != trajectory["0"]

    _, first = fit(recipe, tiny_target, windows, tmp_path / "two", until=4, log=lambda _: None, init=init)
    assert sorted(first, key=int) == ["0", "2", "4"]
    resumed, whole = fit(recipe, tiny_target, windows, tmp_path / "two", log=lambda _: None, init=init)
    assert torch.equal(resumed, theta)
    assert whole == trajectory

    other = Recipe(preset="tiny", windows=6, dev=2, steps=6, dev_every=2, lam=0.5)
    with pytest.raises(ValueError, match="another recipe"):
        fit(other, tiny_target, windows, tmp_path / "two", log=lambda _: None, init=init)


def test_the_draws_are_those_of_the_original_fit():
    # the shipped prior was fitted with random.Random(0).choice over the training windows, then .random() < 0.7
    import random

    rng = random.Random(0)
    recipe = Recipe()
    training = list(range(recipe.dev, recipe.windows))
    expected = []
    for _ in range(20):
        index = rng.choice(training)
        expected.append((index, "recompute" if rng.random() < 0.7 else "replace"))
    assert prior_fit.draws(recipe, 20) == expected


def test_compare_names_the_difference_and_the_tolerance():
    assert compare([100.0, 200.0], [100.01, 199.99], 2e-4) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="more than the recorded tolerance"):
        compare([100.0, 200.0], [100.1, 200.0], 2e-4)
    for got in ([100.0, math.nan], [math.nan, 200.0]):  # a rerun of no number reproduces nothing (it passed)
        with pytest.raises(ValueError, match="nan relative"):
            compare([100.0, 200.0], got, 2e-4)


def test_a_check_until_step_0_runs_no_step(tiny_target):
    """`prior check --until 0` compares the start's dev NLL: it ran every step of the recipe (until 0 read as none)."""
    recipe = Recipe(preset="tiny", windows=6, dev=2, steps=6, dev_every=2)
    windows = OwnWindows(recipe, tiny_target)
    init = torch.ones_like(prior_fit.initial_terms(tiny_target))
    theta, trajectory = fit(recipe, tiny_target, windows, None, until=0, log=lambda _: None, init=init)
    assert list(trajectory) == ["0"] and windows.built == {0, 1} and torch.equal(theta, init)


def test_the_shipped_prior_records_its_recipe_and_command():
    meta = recorded(SHIPPED)
    recipe = Recipe(**meta["recipe"])
    assert meta["command"].startswith("kvbridge prior fit ") and f"--steps {recipe.steps}" in meta["command"]
    assert str(recipe.steps) in meta["dev_nll"] and "0" in meta["dev_nll"]
    start, end = meta["dev_nll"]["0"], meta["dev_nll"][str(recipe.steps)]
    assert all(e < s for s, e in zip(start, end, strict=True)), "the fit did not lower the dev NLL"
    assert InductionPrior.load(SHIPPED).terms.shape[0] == 4
    # fitted for the adapter that ships beside it, which `prior check` and every reader of the prior compare against
    from kvbridge.adapters.io import load_adapter

    shipped_adapter = ROOT / "adapters" / "shipped" / f"{meta['adapter']['name']}.safetensors"
    digest = load_adapter(shipped_adapter).digest
    assert meta["adapter"] == {"name": shipped_adapter.stem, "digest": digest}
    assert InductionPrior.load(SHIPPED).stale_for(digest) is None


def _corpora(tmp_path_factory) -> Path:
    """A folder with the two training corpora, byte for byte those recorded: $KVBRIDGE_DATA, data/ of the checkout,
    the shared data beside it, or built from the Debian packages of the recorded versions; else the test skips."""
    want = corpus.recorded()
    names = (corpus.PYDOC_CORPUS, corpus.KERNEL_CORPUS)
    candidates = [Path(p) for p in (os.environ.get("KVBRIDGE_DATA"),) if p] + [ROOT / "data",
                                                                                 ROOT.parent / "shared" / "data"]
    for folder in candidates:
        if all((folder / n).is_file() and corpus.sha256_of(folder / n) == want["sha256"][n] for n in names):
            return folder
    installed = corpus.package_versions()
    if installed != want["packages"]:
        pytest.skip(f"no corpora of the recorded hashes here ($KVBRIDGE_DATA, data/) and the Debian packages are "
                    f"{installed}, not the recorded {want['packages']}")
    out = tmp_path_factory.mktemp("corpora")
    corpus.build(out)
    return out


@pytest.mark.slow
def test_the_shipped_prior_reproduces_from_its_recipe(tmp_path_factory):
    data = _corpora(tmp_path_factory)
    work = tmp_path_factory.mktemp("prior-work")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run([sys.executable, "-m", "kvbridge.cli", "prior", "check", str(SHIPPED), "--data", str(data),
                           "--work", str(work), "--until", "50"], capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "step 50: dev NLL" in done.stdout and "relative difference" in done.stdout


def test_the_windows_and_the_prior_are_of_one_adapter(tmp_path, tiny_source, tiny_target, tiny_adapter_file, adapter):
    import argparse
    import dataclasses
    import json

    from kvbridge.adapters.io import save_adapter

    recipe = Recipe(preset="tiny", windows=6, dev=2, steps=6, dev_every=2)
    folder = tmp_path / "windows"
    windows = prior_fit.Windows(recipe, tmp_path, folder, tiny_source, tiny_target, tiny_adapter_file)
    assert windows.adapter == {"name": tiny_adapter_file.stem, "digest": adapter.digest}
    assert json.loads((folder / "adapter.json").read_text()) == windows.adapter
    other = tmp_path / "other.safetensors"
    save_adapter(dataclasses.replace(adapter, bk=adapter.bk + 1), other)
    with pytest.raises(ValueError, match="projected by adapter .* not by other"):
        prior_fit.Windows(recipe, tmp_path, folder, tiny_source, tiny_target, other)  # another adapter's windows
    old = tmp_path / "old"
    old.mkdir()
    (old / "0000.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="record no adapter"):
        prior_fit.Windows(recipe, tmp_path, old, tiny_source, tiny_target, tiny_adapter_file)

    # `prior check` projects with the adapter the file was fitted for, or refuses before building anything
    fitted = tmp_path / "prior.safetensors"
    InductionPrior(prior_fit.initial_terms(tiny_target)).save(fitted, {
        "target": {"name": tiny_target.name, "config_hash": tiny_target.spec.identity.config_hash},
        "adapter": {"name": "other", "digest": prior_fit.adapter_record(other)["digest"]},
        "recipe": dataclasses.asdict(recipe), "dev_nll": {"0": [1.0, 1.0], "6": [1.0, 1.0]}, "tolerance": 1e-4})
    args = argparse.Namespace(file=str(fitted), data=tmp_path, work=tmp_path / "check", until=None,
                              adapter=str(tiny_adapter_file))
    with pytest.raises(ValueError, match="was fitted for adapter other .* pass --adapter the file it was fitted with"):
        prior_cli.cmd_prior_check(args)
    assert not (tmp_path / "check").exists()


def test_an_evaluation_says_when_its_prior_was_fitted_for_another_adapter(tmp_path, tiny_source, tiny_target,
                                                                          tiny_adapter_file, adapter, monkeypatch):
    import json

    from kvbridge.eval.run import RunOptions, evaluate
    from kvbridge.eval.summaries import EvalConfig
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.suffix import induction

    folder = tmp_path / "priors"
    folder.mkdir()
    target = {"name": tiny_target.name, "config_hash": tiny_target.spec.identity.config_hash}
    InductionPrior(prior_fit.initial_terms(tiny_target) + 0.5).save(
        folder / "tiny.safetensors", {"target": target, "adapter": {"name": "other", "digest": "0" * 64}})
    monkeypatch.setattr(induction, "PRIORS", folder)
    config = EvalConfig(max_doc_tokens=64, continuation_tokens=8, max_new_tokens=4)
    for name, out in (("other", tmp_path / "stale"), (None, tmp_path / "own")):
        if name is None:  # the same prior, recorded as fitted for the adapter the run projects with
            InductionPrior(prior_fit.initial_terms(tiny_target) + 0.5).save(
                folder / "tiny.safetensors", {"target": target, "adapter": {"name": "x", "digest": adapter.digest}})
        options = RunOptions(data=str(data_path("pydoc_summaries_sample.jsonl")), preset="tiny", modes="full,replace",
                             limit=1, out=str(out), progress=False, adapter=str(tiny_adapter_file))
        evaluate(options, source=tiny_source, target=tiny_target, config=config)
        meta = json.loads((out / "results.json").read_text())["meta"]["induction_prior"]
        table = (out / "table.md").read_text()
        if name:
            assert meta["adapter"]["name"] == "other" and adapter.digest[:16] in meta["stale"]
            assert "read one made for another adapter: the induction prior tiny.safetensors was fitted for " \
                   "adapter other" in table
        else:
            assert meta["stale"] is None and "another adapter" not in table
    # --prior FILE: a fitted file in place of the shipped one, checked to be the target's
    given = tmp_path / "given.safetensors"
    InductionPrior(prior_fit.initial_terms(tiny_target) + 0.25).save(
        given, {"target": target, "adapter": {"name": "x", "digest": adapter.digest}})
    options = RunOptions(data=str(data_path("pydoc_summaries_sample.jsonl")), preset="tiny", modes="full,replace",
                         limit=1, out=str(tmp_path / "given"), progress=False, adapter=str(tiny_adapter_file),
                         prior=str(given))
    evaluate(options, source=tiny_source, target=tiny_target, config=config)
    meta = json.loads((tmp_path / "given" / "results.json").read_text())["meta"]["induction_prior"]
    assert meta["origin"] == "given.safetensors" and meta["stale"] is None


def _answer_windows(tmp_path, tiny_source, tiny_target, tiny_adapter_file, recipe):
    """AnswerWindows over three windows of the tiny target's own float32 KV (written as prior_fit.Windows writes its
    projections, so the build only adds the answers)."""
    from kvbridge.eval.prior_answers import AnswerWindows
    from safetensors.torch import save_file

    windows = AnswerWindows(recipe, tmp_path, tmp_path / "windows", tiny_source, tiny_target, tiny_adapter_file)
    windows.max_new_tokens = 6
    g = torch.Generator().manual_seed(1)
    for i in range(recipe.windows):
        ids = torch.cat((torch.tensor([1]), torch.randint(3, tiny_target.model.config.vocab_size, (40,), generator=g)))
        kv = kvcache.extract(tiny_target.model, tiny_target.spec, ids).kv.float().contiguous()
        save_file({"ids": ids, "cont": ids[:8].clone(), "kv": kv, "tail": kv[:, :, :, -4:].contiguous()},
                  str(windows.path(i)), metadata={"id": f"doc:{i}/0"})
    windows.build(set(range(recipe.windows)), log=lambda _: None)
    return windows


def test_answer_windows_hold_the_targets_own_answer_and_the_objective_scores_only_it(tmp_path, tiny_source,
                                                                                      tiny_target, tiny_adapter_file):
    from kvbridge.adapters.answer_windows import DEV_INSTRUCTION, INSTRUCTIONS
    from kvbridge.eval.prior_fit import window_nll
    from safetensors import safe_open

    recipe = Recipe(preset="tiny", windows=3, dev=1, steps=4, dev_every=2, objective="answer")
    windows = _answer_windows(tmp_path, tiny_source, tiny_target, tiny_adapter_file, recipe)
    model = tiny_target.model
    lengths = []
    for i in range(recipe.windows):
        w = windows[i]
        with safe_open(str(windows.answer_path(i)), "pt") as f:
            instruction = f.metadata()["instruction"]
        if i < recipe.dev:
            assert instruction == DEV_INSTRUCTION
        else:
            assert any(instruction == wording or "{term}" in wording and
                       instruction.startswith(wording.split("{term}")[0]) for wording in INSTRUCTIONS)
        assert w["prompt"].tolist() == tiny_target.tokenizer(instruction, add_special_tokens=False)["input_ids"]
        # the answer is the target's own greedy choice at every step: a plain argmax over whole forwards, no cache
        seq = torch.cat((w["ids"], w["prompt"]))
        with torch.no_grad():
            for token in w["answer"].tolist():
                assert int(model(input_ids=seq[None]).logits[0, -1].argmax()) == token
                seq = torch.cat((seq, torch.tensor([token])))
            logits = model(input_ids=seq[None]).logits[0].float()
        lengths.append(w["answer"].numel())
        if not lengths[-1]:
            continue
        # the objective: the answer tokens' NLL after the instruction, over the own cache with every term 0 (the
        # model's own attention), equals a plain forward's over the whole sequence; the instruction is not scored
        q, t = w["prompt"].numel(), w["ids"].numel()
        expected = torch.nn.functional.cross_entropy(logits[t + q - 1:-1], w["answer"], reduction="sum")
        nll, scored = window_nll(tiny_target, w, "replace", torch.zeros_like(prior_fit.initial_terms(tiny_target)))
        assert scored == lengths[-1]
        assert float(nll) == pytest.approx(float(expected), rel=1e-4)
    assert max(lengths) > 0 and max(lengths) <= windows.max_new_tokens

    # a fit of the answer objective moves the prior and records the dev windows' answer NLL; a checkpoint of the
    # continuation objective is another recipe
    init = torch.ones_like(prior_fit.initial_terms(tiny_target))
    theta, trajectory = fit(recipe, tiny_target, windows, tmp_path / "answer", log=lambda _: None, init=init)
    assert sorted(trajectory, key=int) == ["0", "2", "4"] and trajectory["4"] != trajectory["0"]
    assert (theta - init).abs().max() > 0
    with pytest.raises(ValueError, match="another recipe"):
        fit(Recipe(**{**dataclasses.asdict(recipe), "objective": "continuation"}), tiny_target, windows,
            tmp_path / "answer", log=lambda _: None, init=init)
    with pytest.raises(ValueError, match="objective is one of continuation, answer"):
        Recipe(objective="summary")
    from kvbridge.eval.prior_answers import AnswerWindows

    # the folder's answers under another --dev: a window asked in the dev wording there is a training one here (and
    # kept its answer to the other instruction); it is asked again
    other = Recipe(**{**dataclasses.asdict(recipe), "dev": 2})
    again = AnswerWindows(other, tmp_path, tmp_path / "windows", tiny_source, tiny_target, tiny_adapter_file)
    again.max_new_tokens = windows.max_new_tokens
    again.build(set(range(other.windows)), log=lambda _: None)
    with safe_open(str(again.answer_path(1)), "pt") as f:
        assert f.metadata()["instruction"] == DEV_INSTRUCTION
    assert again[1]["prompt"].tolist() == tiny_target.tokenizer(DEV_INSTRUCTION, add_special_tokens=False)["input_ids"]


def test_prior_check_recomputes_where_the_fit_left_its_checkpoint(tmp_path, tiny_target, tiny_adapter_file,
                                                                   monkeypatch):
    """`prior check` reruns the recipe: a checkpoint in --work at or past --until (the fit's, in the default
    prior-work both share) is neither read nor written. A file whose record only that checkpoint repeats fails; the
    true record passes."""
    import argparse
    import dataclasses

    from safetensors import safe_open
    from safetensors.torch import save_file

    recipe = Recipe(preset="tiny", windows=6, dev=2, steps=6, dev_every=2)
    work = tmp_path / "prior-work"
    _, trajectory = fit(recipe, tiny_target, OwnWindows(recipe, tiny_target), work, log=lambda _: None)
    checkpoint = work / "checkpoint.safetensors"
    bogus = {step: [1.5 * v for v in nll] for step, nll in trajectory.items()}
    with safe_open(str(checkpoint), "pt") as f:  # the checkpoint records what the file claims
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(checkpoint), metadata={**meta, "trajectory": json.dumps(bogus)})
    before = checkpoint.read_bytes()
    monkeypatch.setattr(prior_cli, "_windows", lambda recipe, data, work, source, target, adapter:
                        OwnWindows(recipe, target))
    target = {"name": tiny_target.name, "config_hash": tiny_target.spec.identity.config_hash}
    for record, passes in ((bogus, False), (trajectory, True)):
        prior = tmp_path / "prior.safetensors"
        InductionPrior(prior_fit.initial_terms(tiny_target)).save(prior, {
            "target": target, "adapter": prior_fit.adapter_record(tiny_adapter_file),
            "recipe": dataclasses.asdict(recipe), "dev_nll": record, "tolerance": 1e-4})
        args = argparse.Namespace(file=str(prior), data=tmp_path, work=work, until=4, adapter=str(tiny_adapter_file))
        if passes:
            assert prior_cli.cmd_prior_check(args) == 0
        else:
            with pytest.raises(ValueError, match="differs from the recorded"):
                prior_cli.cmd_prior_check(args)
        assert checkpoint.read_bytes() == before


def test_prior_fit_keeps_an_existing_out_unless_forced(tmp_path, capsys, monkeypatch):
    from kvbridge.cli import main
    from kvbridge.transfer import presets

    def loading(*args, **kwargs):
        raise RuntimeError("models loading")

    monkeypatch.setattr(presets, "load_pair", loading)
    out = tmp_path / "prior.safetensors"
    out.write_bytes(b"mine")
    command = ["prior", "fit", "--preset", "tiny", "--data", str(tmp_path), "--out", str(out)]
    assert main(command) == 2
    assert f"--out {out} exists" in capsys.readouterr().err and out.read_bytes() == b"mine"
    assert main([*command, "--force"]) == 2
    assert "models loading" in capsys.readouterr().err  # past the refusal
