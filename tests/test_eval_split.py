"""The training split the evaluation holds documents out by, and the prior fit trains on, is the adapter's: read from
its file's metadata (eval.heldout.training_split), not the trainer's defaults. An adapter trained on 3,000-character
documents with 30% held out gets its own held-out documents; a corpus it did not read, or other bytes, is refused."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import random
from pathlib import Path

import pytest
from kvbridge.adapters.io import save_adapter
from kvbridge.adapters.teacher import is_heldout, split_documents
from kvbridge.eval import prior_fit
from kvbridge.eval.heldout import cmd_eval_heldout
from kvbridge.eval.records import read_records

WORDS = ("a model reads the text once and keeps what it read in a cache of keys and values that another model "
         "borrows later").split()


def write_corpus(path: Path, paragraphs: int, seed: int = 0) -> Path:
    """Paragraphs of ~1,000 characters, blank-line separated (what split_documents cuts into documents)."""
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(190)) for _ in range(paragraphs)))
    return path


def split_adapter(adapter, out: Path, corpora: list[Path], fraction: float = 0.08, doc_chars: int = 8000) -> Path:
    """The tiny adapter, its metadata's corpus record as `train-adapter --trainer chain` writes it (adapters/cli.py)
    for a run over `corpora` with that split."""
    corpus = {"files": [p.name for p in corpora],
              "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in corpora},
              "windows": {"cached": 10, "dev": 2, "ridge": 4, "train": 8}, "heldout_fraction": fraction,
              "documents": f"runs of ~{doc_chars} characters of consecutive paragraphs; held out when blake2b(id) < "
                           f"{fraction} (dev windows come from those only)"}
    return save_adapter(dataclasses.replace(adapter, meta=dataclasses.replace(adapter.meta, corpus=corpus)), out)


def heldout_docs(path: Path, fraction: float, doc_chars: int) -> dict[str, str]:
    """{id: text} of the corpus's documents held out by that split and not among its dev half."""
    return {i: t for i, t in split_documents(path, path.stem.split("_")[0], doc_chars)
            if is_heldout(i, fraction) and not is_heldout(i, 0.5, salt="dev")}


def test_eval_heldout_holds_out_the_documents_of_the_adapters_own_split(tmp_path, adapter):
    corpus = write_corpus(tmp_path / "alpha_corpus.txt", 600)
    trained = split_adapter(adapter, tmp_path / "split.safetensors", [corpus], fraction=0.3, doc_chars=3000)
    out = tmp_path / "long.jsonl"
    args = argparse.Namespace(man=None, corpus=[str(corpus)], summaries=None, min_tokens=1, preset="tiny", seed=0,
                              out=str(out), force=False, adapter=str(trained))
    assert cmd_eval_heldout(args) == 0
    got = {r.id: r.document for r in read_records(out)}
    want = heldout_docs(corpus, 0.3, 3000)
    assert got == want and len(want) > 10
    # what the trainer's defaults hold out (the command before it read the adapter's split) has paragraphs of
    # documents this adapter trained on
    trained_on = {p for i, t in split_documents(corpus, "alpha", 3000) if not is_heldout(i, 0.3)
                  for p in t.split("\n\n")}
    assert any(set(t.split("\n\n")) & trained_on for t in heldout_docs(corpus, 0.08, 8000).values())


def test_a_split_that_cannot_be_established_is_refused_by_name(tmp_path, adapter, tiny_adapter_file, caplog):
    from kvbridge.eval.heldout import corpus_records, training_split

    corpus = write_corpus(tmp_path / "alpha_corpus.txt", 40)
    other = write_corpus(tmp_path / "beta_corpus.txt", 40, seed=1)
    trained = split_adapter(adapter, tmp_path / "split.safetensors", [corpus], fraction=0.3, doc_chars=3000)
    with pytest.raises(ValueError, match=r"beta_corpus.txt: adapter split.safetensors was not trained on it "
                                         r"\(it read alpha_corpus.txt\)"):
        corpus_records([str(other)], str.split, 1, trained)
    changed = tmp_path / "changed" / "alpha_corpus.txt"
    changed.parent.mkdir()
    write_corpus(changed, 40, seed=2)
    with pytest.raises(ValueError, match="not the file adapter split.safetensors was trained on .sha256 differs"):
        corpus_records([str(changed)], str.split, 1, trained)
    with pytest.raises(ValueError, match="--corpus needs --adapter FILE"):
        corpus_records([str(corpus)], str.split, 1, None)
    for bad, field in ((1.5, "heldout_fraction"), ("most", "heldout_fraction")):
        meta = {"files": [corpus.name], "heldout_fraction": bad, "documents": "runs of ~3000 characters"}
        broken = save_adapter(dataclasses.replace(adapter, meta=dataclasses.replace(adapter.meta, corpus=meta)),
                              tmp_path / "broken.safetensors")
        with pytest.raises(ValueError, match=f"broken.safetensors: its metadata's corpus.{field}"):
            training_split(broken)
    # an adapter whose metadata records no split (the ridge trainer's): the defaults, said in a warning
    with caplog.at_level(logging.WARNING, logger="kvbridge.eval.heldout"):
        split = training_split(tiny_adapter_file)
    assert (split.doc_chars, split.heldout_fraction) == (8000, 0.08)
    assert "records no heldout_fraction or doc_chars of its training split" in caplog.text
    # and the chain's record is read as written: the shipped adapter's split is the defaults, without a warning
    caplog.clear()
    shipped = next((Path(prior_fit.__file__).parents[1] / "adapters" / "shipped").glob("*.safetensors"))
    with caplog.at_level(logging.WARNING, logger="kvbridge.eval.heldout"):
        split = training_split(shipped)
    assert (split.doc_chars, split.heldout_fraction) == (8000, 0.08) and not caplog.text
    assert set(split.files) == {"pydoc_corpus.txt", "kernel_docs_corpus.txt"}


def test_the_prior_fit_trains_on_the_adapters_training_documents_only(tmp_path, tiny_source, tiny_target, adapter):
    data = tmp_path / "data"
    data.mkdir()
    pydoc = write_corpus(data / "pydoc_corpus.txt", 60)
    kernel = data / "kernel_docs_corpus.txt"
    kernel.write_text("A short paragraph, too short for a window.")
    trained = split_adapter(adapter, tmp_path / "split.safetensors", [pydoc, kernel], fraction=0.3, doc_chars=3000)
    recipe = prior_fit.Recipe(preset="tiny", windows=4, dev=1, window_tokens=300, min_context=100)
    windows = prior_fit.Windows(recipe, data, tmp_path / "windows", tiny_source, tiny_target, trained)
    docs = dict(split_documents(pydoc, "pydoc", 3000))
    candidates = list(windows._candidates())
    assert len(candidates) > 10
    for doc in candidates:
        doc_id = doc.record.id.split("/")[0]
        assert not is_heldout(doc_id, 0.3), doc_id  # never a document the adapter held out
        assert doc.text in docs[doc_id]  # cut from the adapter's document of that id
    assert any(is_heldout(i, 0.3) for i in docs)  # (there were held-out documents to leave out)
    other = tmp_path / "other_corpus.txt"
    write_corpus(other, 10)
    elsewhere = split_adapter(adapter, tmp_path / "elsewhere.safetensors", [other])
    windows = prior_fit.Windows(recipe, data, tmp_path / "windows2", tiny_source, tiny_target, elsewhere)
    with pytest.raises(ValueError, match="pydoc_corpus.txt: adapter elsewhere.safetensors was not trained on it"):
        list(windows._candidates())


def test_the_prior_fit_names_the_kernel_corpus_documents_as_the_trainer_does(tmp_path, tiny_source, tiny_target,
                                                                              adapter):
    """The trainer names kernel_docs_corpus.txt's documents "kernel:N" (adapters.chain.corpus_name) and holds out by
    the hash of that id; the prior fit named them "kernel_docs:N", so its split kept documents the adapter held out."""
    from kvbridge.adapters.chain import corpus_name

    data = tmp_path / "data"
    data.mkdir()
    pydoc = data / "pydoc_corpus.txt"
    pydoc.write_text("A short paragraph, too short for a window.")
    kernel = write_corpus(data / "kernel_docs_corpus.txt", 80, seed=1)
    trained = split_adapter(adapter, tmp_path / "split.safetensors", [pydoc, kernel], fraction=0.3, doc_chars=3000)
    recipe = prior_fit.Recipe(preset="tiny", windows=4, dev=1, window_tokens=300, min_context=100)
    windows = prior_fit.Windows(recipe, data, tmp_path / "windows", tiny_source, tiny_target, trained)
    name = corpus_name(kernel)
    docs = dict(split_documents(kernel, name, 3000))
    assert any(is_heldout(i, 0.3) for i in docs)
    candidates = list(windows._candidates())
    assert len(candidates) > 10
    for doc in candidates:
        doc_id = doc.record.id.split("/")[0]
        assert doc_id in docs, doc_id  # the trainer's id of that document
        assert not is_heldout(doc_id, 0.3), doc_id
