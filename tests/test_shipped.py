"""Adapters shipped inside the package: a pair whose adapter folder has none serves with the shipped one, a folder
adapter still wins, and only a file fitted for exactly these two models is taken."""

from __future__ import annotations

import shutil

import pytest
from kvbridge.adapters import shipped as shipped_module
from kvbridge.adapters.shipped import find_shipped


@pytest.fixture()
def shipped_dir(tmp_path, monkeypatch, tiny_adapter_file):
    folder = tmp_path / "shipped"
    folder.mkdir()
    shutil.copy(tiny_adapter_file, folder / "tiny-qwen2--tiny-phi3.safetensors")
    monkeypatch.setattr(shipped_module, "SHIPPED_FOLDER", folder)
    return folder


def _service(tmp_path, source, target, folder_name="adapters"):
    from kvbridge.server.app import build_service
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", selfcheck=False, adapters=str(tmp_path / folder_name), store_capacity_mb=64,
                         store_device="cpu")
    return build_service(config, source=source, targets=[target])


def test_a_pair_without_a_folder_adapter_serves_with_the_shipped_one(shipped_dir, tmp_path, tiny_source,
                                                                    tiny_target):
    assert find_shipped(tiny_source.spec, tiny_target.spec) == shipped_dir / "tiny-qwen2--tiny-phi3.safetensors"
    service = _service(tmp_path, tiny_source, tiny_target)
    assert service.adapters.default_for(tiny_target.spec) == "tiny-qwen2--tiny-phi3"
    result = service.projected_cache("t", text="The json module encodes Python objects as JSON text.")
    assert result.adapter.startswith("tiny-qwen2--tiny-phi3@") and result.segment.num_tokens > 1


def test_a_folder_adapter_wins_over_the_shipped_one(shipped_dir, tmp_path, tiny_source, tiny_target,
                                                   tiny_adapter_file):
    folder = tmp_path / "adapters"
    folder.mkdir()
    shutil.copy(tiny_adapter_file, folder / "mine.safetensors")
    service = _service(tmp_path, tiny_source, tiny_target)
    assert service.adapters.default_for(tiny_target.spec) == "mine"


def test_only_an_adapter_for_exactly_these_models_is_taken(shipped_dir, tiny_source, tiny_target):
    assert find_shipped(tiny_target.spec, tiny_source.spec) is None  # the other direction
    assert find_shipped(tiny_source.spec, tiny_source.spec) is None
    (shipped_dir / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert find_shipped(tiny_source.spec, tiny_target.spec).name == "tiny-qwen2--tiny-phi3.safetensors"
    assert find_shipped(tiny_source.spec, tiny_target.spec, folder=shipped_dir / "absent") is None


SMALL_PAIR_FILE = "gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors"
SHARED_DATA = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "data"


def test_the_shipped_small_pair_adapter_says_how_it_was_made():
    import hashlib

    import torch
    from kvbridge.adapters.average import from_scratch_seconds, runs
    from kvbridge.adapters.io import load_adapter
    from kvbridge.transfer.corpus import recorded

    path = shipped_module.SHIPPED_FOLDER / SMALL_PAIR_FILE
    assert path.is_file() and path.stat().st_size <= 16 << 20
    adapter = load_adapter(path)
    assert {getattr(adapter, n).dtype for n in ("wk", "bk", "wv", "bv", "tok_table", "wk_tok", "wv_tok", "ctx_mu",
                                                 "ctx_g", "ctx_a", "ctx_b")} == {torch.bfloat16}
    assert adapter.token_rank == 64  # the maps read the target's token ids
    # and the 4 tokens before each token, through a rank-24 branch without a norm (format 5: GEMMs in a projection)
    assert adapter.meta.format_version == 5 and not adapter.context_norm
    assert adapter.ctx_lags.tolist() == [1, 2, 3, 4] and adapter.ctx_a.shape[-1] == 24
    assert tuple(adapter.tok_table.shape) == (49152, 64)  # one row per SmolLM2 embedding row
    meta = adapter.meta
    assert meta.source["name"] == "gemma-3-270m-q4_k_m" and meta.target["name"] == "smollm2-135m-instruct-q4_1"
    assert set(meta.corpus["sha256"]) == {"pydoc_corpus.txt", "kernel_docs_corpus.txt"}
    command = meta.training["command"]
    assert command.startswith(("train-adapter ", "kvbridge adapter average ")) and (
        "--trainer chain" in command or "average" in meta.training)
    # trained from scratch in under two hours: its runs (this one, those of the adapter it started from, --init, and
    # of an average's inputs, each once), with the teacher caches they reused from an earlier run (their own time)
    made = runs(meta.training)
    assert made and all(r["command"].startswith("train-adapter ") and "--trainer chain" in r["command"] for r in made)
    seconds = from_scratch_seconds(meta.training)
    assert 0 < seconds <= 2 * 3600
    value, low, high = meta.metrics["recovery_heldout"]["pydoc_summaries_100_docs"]["projected"]
    assert low <= value <= high
    # trained on the corpora the repository records (what `kvbridge data build` rebuilds and checks against)
    want = recorded()["sha256"]
    assert {name: want.get(name) for name in meta.corpus["sha256"]} == meta.corpus["sha256"]
    present = [name for name in meta.corpus["sha256"] if (SHARED_DATA / name).is_file()]
    for name in present:  # and the files themselves, where this checkout has them beside it
        assert hashlib.sha256((SHARED_DATA / name).read_bytes()).hexdigest() == meta.corpus["sha256"][name], name


@pytest.mark.slow
def test_the_small_pair_serves_with_the_shipped_adapter_by_default(tmp_path, smollm2, gemma):
    assert find_shipped(gemma.spec, smollm2.spec) == shipped_module.SHIPPED_FOLDER / SMALL_PAIR_FILE
    service = _service(tmp_path, gemma, smollm2)
    assert service.adapters.default_for(smollm2.spec) == SMALL_PAIR_FILE.removesuffix(".safetensors")
