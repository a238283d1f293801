"""Files of tensors that kvbridge wrote and reads back, damaged (a copy cut short, a full disk) or foreign: each is
refused with an error that names the file, a cache of windows makes a damaged one again, and an adapter folder never
lists a file that resolves outside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from kvbridge.transfer.tensor_files import read_tensors, readable
from safetensors.torch import save_file


def _cut(path: Path, keep: int = 300) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def test_read_tensors_names_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(3)}, str(path), metadata={"m": "1"})
    tensors, meta = read_tensors(path, names=("b",))
    assert list(tensors) == ["b"] and meta == {"m": "1"} and readable(path)
    with pytest.raises(ValueError, match=r"x.safetensors lacks tensors \['c'\]"):
        read_tensors(path, names=("b", "c"))
    _cut(path, 100)
    assert not readable(path) and not readable(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="x.safetensors is not a readable safetensors file"):
        read_tensors(path)
    with pytest.raises(FileNotFoundError, match="none.safetensors"):
        read_tensors(tmp_path / "none.safetensors")


def test_a_damaged_prior_file_is_named(tmp_path, tiny_target):
    from kvbridge.server.corrections import CorrectionLimits, Corrections
    from kvbridge.transfer.suffix.induction import InductionPrior, find_fitted

    path = tmp_path / "fitted.safetensors"
    InductionPrior.for_model(tiny_target).save(path, {"target": {"config_hash": "x"}})
    _cut(path)
    for read in (lambda: InductionPrior.load(path), lambda: InductionPrior.load_for(path, tiny_target),
                 lambda: find_fitted(tiny_target, tmp_path)):
        with pytest.raises(ValueError, match="fitted.safetensors is not a readable safetensors file"):
            read()
    # what `kvbridge serve --correction-prior-file` checks at start
    corrections = Corrections(CorrectionLimits(prior_file=str(path)))
    with pytest.raises(ValueError, match="fitted.safetensors"):
        corrections.check_prior_file([tiny_target])
    # a file in the priors folder that is no prior is passed over
    path.unlink()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    assert find_fitted(tiny_target, tmp_path) is None


def test_a_damaged_fuser_or_teacher_window_is_named(tmp_path):
    from kvbridge.adapters.fuser import load_fuser
    from kvbridge.adapters.teacher import TeacherCache

    path = tmp_path / "f.safetensors"
    save_file({"x": torch.zeros(64)}, str(path), metadata={"kvbridge_adapter": json.dumps({"kind": "fuser"})})
    _cut(path)
    with pytest.raises(ValueError, match="f.safetensors is not a readable safetensors file"):
        load_fuser(path)
    save_file({"x": torch.zeros(64)}, str(path), metadata={"kvbridge_adapter": "{1"})
    with pytest.raises(ValueError, match="f.safetensors: its kvbridge_adapter metadata is not a JSON object"):
        load_fuser(path)

    cache = TeacherCache.__new__(TeacherCache)
    cache.root, cache.entries = tmp_path, [{"id": "w", "file": "f.safetensors"}]
    save_file({"k": torch.zeros(64)}, str(path))
    assert cache.load_tensor(0, "k").shape == (64,)
    _cut(path)
    for read in (lambda: cache.load(0), lambda: cache.load_tensor(0, "k")):
        with pytest.raises(ValueError, match="f.safetensors is not a readable safetensors file"):
            read()


def test_a_damaged_or_foreign_trainer_checkpoint_is_named(tmp_path):
    from kvbridge.adapters.trainer import TrainerConfig, check_resume

    stage = tmp_path / "stage-0-kl"
    stage.mkdir()
    last = stage / "last.safetensors"
    config = TrainerConfig(objective="kl", max_iters=4, warmup_iters=1)
    writes = {"cut short": lambda: (save_file({"maps.w": torch.zeros(64)}, str(last), metadata={"state": "{}"}),
                                    _cut(last, 40)),
              "no metadata": lambda: save_file({"x": torch.zeros(4)}, str(last)),
              "another tool's": lambda: save_file({"x": torch.zeros(4)}, str(last), metadata={"a": "b"}),
              "state not JSON": lambda: save_file({"x": torch.zeros(4)}, str(last), metadata={"state": "{"})}
    for write in writes.values():
        write()
        with pytest.raises(ValueError, match="last.safetensors.*not a kvbridge trainer checkpoint"):
            check_resume(stage, config)


def test_a_prior_window_cut_short_is_made_again(tmp_path, tiny_source, tiny_target, tiny_adapter_file):
    from kvbridge.eval.prior_fit import Recipe, Windows

    recipe = Recipe(preset="tiny", windows=2, dev=1, steps=1, dev_every=1)
    windows = Windows(recipe, tmp_path / "data", tmp_path / "windows", tiny_source, tiny_target, tiny_adapter_file)
    save_file({"ids": torch.arange(600), "cont": torch.arange(32)}, str(windows.path(0)), metadata={"id": "x"})
    _cut(windows.path(0))
    with pytest.raises(ValueError, match="0000.safetensors is not a readable safetensors file"):
        windows[0]
    # the rerun takes the damaged window for one to make (here from corpora that hold none), not for one made
    windows._candidates = lambda: iter(())
    with pytest.raises(ValueError, match="give 0 of the 1 windows asked for"):
        windows.build({0}, log=lambda _: None)


def test_an_adapter_folder_lists_no_file_outside_it(tmp_path, tiny_source, tiny_target, tiny_adapter_file):
    from kvbridge.server.adapter_registry import AdapterRegistry

    folder = tmp_path / "adapters"
    folder.mkdir()
    os.symlink(tiny_adapter_file, folder / "escape.safetensors")
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    assert registry.available() == [] and registry.autoload() == []
    with pytest.raises(ValueError, match="outside the adapter folder"):
        registry.load("escape")
