"""experiments/context-map/train.py reads its work folder through the chain's own steps (chain_start's
start_inputs, read_start, ridge_start): the ridge fit it makes records what it was made from, and a folder made for
other options is refused by the option's name, as `train-adapter --trainer chain` refuses it. Run on the tiny pair
(the experiment's `load_pair("small")` answered with it) and two small corpus files under the experiment's names."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from kvbridge.adapters import chain
from kvbridge.transfer import presets

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the a model reads text once and keeps its cache in blocks while another model of a different family "
         "generates from the projected keys and values without reading the document again").split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(2)
    for name in ("pydoc_corpus.txt", "kernel_docs_corpus.txt"):
        (root / name).write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(120)) + "."
                                             for _ in range(1500)))
    return root


def _experiment():
    spec = importlib.util.spec_from_file_location("context_map_train", ROOT / "experiments/context-map/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_experiments_ridge_fit_records_its_inputs_and_other_options_are_refused(
        data, tmp_path, monkeypatch, tiny_source, tiny_target):
    monkeypatch.setattr(presets, "load_pair", lambda *a, **k: (tiny_source, tiny_target))
    threads = torch.get_num_threads()  # (load sets 2 for the experiment's machine)
    experiment = _experiment()
    work = tmp_path / "w"
    try:
        got = experiment.load(work, 12, data, ridge_windows=6, token_rank=8)
        recorded = json.loads((work / "ridge" / "fit.json").read_text())["inputs"]
        assert recorded is not None and recorded["ridge_windows"] == 6 and recorded["token_rank"] == 8
        assert set(recorded["corpus"]) == {"pydoc_corpus.txt", "kernel_docs_corpus.txt"}
        assert json.loads((work / "teacher" / "index.json").read_text()).get("corpus") is not None
        again = experiment.load(work, 12, data, ridge_windows=6, token_rank=8)  # read back: the same fit
        assert torch.equal(got[6].wk, again[6].wk) and got[7].count == again[7].count
        with pytest.raises(ValueError, match="--ridge-windows 6; this run asks --ridge-windows 5"):
            experiment.load(work, 12, data, ridge_windows=5, token_rank=8)
        with pytest.raises(ValueError, match="--token-rank 8; this run asks --token-rank 4"):
            experiment.load(work, 12, data, ridge_windows=6, token_rank=4)
    finally:
        torch.set_num_threads(threads)
    assert not hasattr(chain, "_ridge")  # the wrapper that let it fit without inputs is gone
