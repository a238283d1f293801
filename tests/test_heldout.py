"""`kvbridge eval heldout`: man pages rendered and cut into records (the NAME line as the reference), the corpora's
documents that neither training nor the dev windows read, and records without a reference summary."""

from __future__ import annotations

import gzip
import json
import random
import shutil

import pytest
from kvbridge.adapters.teacher import is_heldout, split_documents
from kvbridge.eval.heldout import corpus_records, man_record, man_records, render_man, summaries_records
from kvbridge.eval.records import read_records
from test_eval_split import split_adapter

PAGE = r""".TH FROB 1 "2026-12-01" "frob 1.0" "User Commands"
.SH NAME
frob \- twist the knobs of a widget
.SH SYNOPSIS
.B frob
[\fB\-v\fR] \fIWIDGET\fR
.SH DESCRIPTION
.B frob
turns every knob of the named widget by one notch.
It reads the widget's state first and writes it back when it is done.
.PP
With \fB\-v\fR it says which knobs it turned.
.SH EXIT STATUS
Zero when every knob turned.
"""


class Words:
    """A tokenizer stand-in that counts words (the module only asks for input_ids)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


@pytest.mark.skipif(shutil.which("man") is None or shutil.which("col") is None, reason="man(1) or col(1) missing")
def test_a_man_page_becomes_a_record_of_its_body_and_name_line(tmp_path):
    for name, body in (("frob", "frob"), ("frob-extra", "frobx"), ("frobnicate", "frobn"), ("same", "frobn")):
        with gzip.open(tmp_path / f"{name}.1.gz", "wt") as f:
            f.write(PAGE.replace("FROB", name.upper()).replace(".B frob\nturns", f".B {body}\nturns"))
    with gzip.open(tmp_path / "alias.1.gz", "wt") as f:
        f.write(".so man1/frob.1\n")
    record = man_record("frob", render_man(tmp_path / "frob.1.gz"))
    assert record["id"] == "man:frob" and record["summary"] == "twist the knobs of a widget"
    doc = record["document"]
    assert doc.startswith("frob turns every knob of the named widget by one notch. It reads")
    assert "With -v it says which knobs it turned." in doc and "Zero when every knob turned." in doc
    assert "SYNOPSIS" not in doc and "[-v]" not in doc and "2026-12-01" not in doc
    picked = man_records(Words(), 10, 10, root=tmp_path)
    # one page per family (frob, frob-extra), no text twice (frobnicate, same), no ".so" alias
    assert len(picked) == 2 and len({r["document"] for r in picked}) == 2
    assert sum(r["id"] in ("man:frob", "man:frob-extra") for r in picked) == 1
    assert sum(r["id"] in ("man:frobnicate", "man:same") for r in picked) == 1
    assert man_records(Words(), 10, 10_000, root=tmp_path) == []  # too short


def test_corpus_records_are_the_documents_no_training_or_dev_step_reads(tmp_path, adapter):
    rng = random.Random(0)
    path = tmp_path / "alpha_corpus.txt"
    path.write_text("\n\n".join(" ".join(rng.choice("a model reads text once".split()) for _ in range(200))
                                for _ in range(600)))
    trained = split_adapter(adapter, tmp_path / "a.safetensors", [path])  # the trainer's defaults, recorded
    records = corpus_records([str(path)], Words(), min_tokens=100, adapter=trained)
    ids = {doc_id for doc_id, _ in split_documents(path, "alpha")}
    assert records and {r["id"] for r in records} <= ids
    for r in records:
        assert is_heldout(r["id"], 0.08) and not is_heldout(r["id"], 0.5, salt="dev") and r["summary"] == ""
    out = tmp_path / "records.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r.summary for r in read_records(out)] == [""] * len(records)  # no reference: fidelity only


def test_the_command_writes_into_a_folder_that_does_not_exist_yet(tmp_path, capsys, adapter):
    """`kvbridge eval heldout --out data/FILE` on a fresh clone, before `data build` made `data/`."""
    import argparse

    from kvbridge.eval.heldout import cmd_eval_heldout

    rng = random.Random(1)
    corpus = tmp_path / "alpha_corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice("a model reads text once".split()) for _ in range(200))
                                  for _ in range(300)))
    out = tmp_path / "data" / "sub" / "long.jsonl"
    args = argparse.Namespace(man=None, corpus=[str(corpus)], summaries=None, min_tokens=100, preset="tiny", seed=0,
                              out=str(out), force=False,
                              adapter=str(split_adapter(adapter, tmp_path / "a.safetensors", [corpus])))
    assert cmd_eval_heldout(args) == 0
    records = read_records(out)
    assert records and f"{len(records)} documents of >= 100 target tokens -> {out}" in capsys.readouterr().out


def test_summaries_records_are_the_first_hundred_pages_less_the_packaged_ones(tmp_path):
    """The summaries file's held-out pages: its first 100 records (later ones were read by tuning), not the packaged
    sample or held-out pages (eval runs --exclude them), long enough; their reference summaries kept."""
    from kvbridge.transfer.data import data_path

    packaged = [r for name in ("pydoc_summaries_sample.jsonl", "pydoc_heldout.jsonl") for r in read_records(
        data_path(name))]
    mine = [{"id": f"pydoc:page{i}", "document": " ".join(["word"] * (50 + i)), "summary": f"page {i}"}
            for i in range(120)]
    rows = [{"id": r.id, "document": r.document + " word" * 200, "summary": r.summary} for r in packaged[:3]] + mine
    path = tmp_path / "summaries.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = summaries_records(str(path), Words(), min_tokens=140)
    # records 0-99 of the file: 3 packaged (left out, however long), then pages 0-96, of which 90-96 are long enough
    assert [r["id"] for r in records] == [f"pydoc:page{i}" for i in range(90, 97)]
    assert records[0]["summary"] == "page 90"


def test_a_record_needs_a_string_summary(tmp_path):
    out = tmp_path / "bad.jsonl"
    out.write_text(json.dumps({"id": "x", "document": "text"}) + "\n")
    with pytest.raises(ValueError, match="'summary' must be a string"):
        read_records(out)
