"""Evaluation sets of long documents no training or tuning step reads: `kvbridge eval heldout`.

Three sources, written as records (id, document, summary) for `kvbridge eval rouge` (one or more in one file):
  man     manual pages installed on this machine (section 1, rendered by man(1) and col(1)): text of another kind
          than every training corpus (DESIGN: man pages stay out of training sets). The document is the page from its
          DESCRIPTION on (NAME and SYNOPSIS left out), paragraphs on one line each; the reference summary is the
          NAME line's description ("tar - an archiving utility" -> "an archiving utility"). Which pages exist depends
          on the packages installed: the file's records name them, and the command prints its sha256.
  corpus  the documents of the training corpora held out from training *and* from the trainer's dev windows
          (adapters.chain's split: blake2b of the id under heldout_fraction, and not among the dev half); no
          reference summary (fidelity is measured against the target's own answer). The split is the adapter's
          (`--adapter`, default the one that ships for the preset's pair): its file records how its trainer cut the
          corpora into documents and which fraction it held out (`training_split`), and names the corpora it read.
  summaries  the pages among the first 100 records of `data/pydoc_summaries.jsonl` (held out from every training
          and tuning step: docs/adapters.md) that are not in the packaged sample or held-out set, with their
          summaries.
Only documents with at least `min_tokens` target tokens are kept, so a run at --max-doc-tokens N below that reads
N tokens of every one.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import random
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

MAN1 = Path("/usr/share/man/man1")
SECTION = re.compile(r"^[A-Z][A-Z0-9 /-]*$")  # a heading at column 0
SKIPPED_SECTIONS = ("NAME", "SYNOPSIS")
log = logging.getLogger(__name__)


def render_man(path: Path) -> str:
    """The page as plain text (man -l, no pager, wide lines, overstrikes removed)."""
    env = dict(os.environ, MANWIDTH="10000", LC_ALL="C.UTF-8", MAN_KEEP_FORMATTING="0")
    shown = subprocess.run(["man", "-l", "-P", "cat", str(path)], capture_output=True, env=env, timeout=60)
    plain = subprocess.run(["col", "-bx"], input=shown.stdout, capture_output=True, timeout=60)
    return plain.stdout.decode("utf-8", errors="replace")


def man_record(name: str, text: str) -> dict | None:
    """{id, document, summary} of a rendered page; None without a NAME description or a body after SYNOPSIS."""
    sections: dict[str, list[str]] = {}
    current = None
    lines = text.rstrip().splitlines()
    for line in lines[1:-1]:  # the first line is the page's header, the last its footer
        if SECTION.match(line.rstrip()) and line.strip():
            current = line.strip()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line.strip())
    head = " ".join(w for w in sections.get("NAME", []) if w)
    if " - " not in head:
        return None
    summary = head.split(" - ", 1)[1].strip()
    paragraphs = []
    for title, lines in sections.items():
        if title in SKIPPED_SECTIONS:
            continue
        for block in "\n".join(lines).split("\n\n"):
            joined = " ".join(block.split())  # (groff puts two spaces after a sentence)
            if joined:
                paragraphs.append(joined)
    document = "\n\n".join(paragraphs)
    if not summary or not document:
        return None
    return {"id": f"man:{name}", "document": document, "summary": summary}


def man_records(tokenizer, count: int, min_tokens: int, seed: int = 0, root: Path = MAN1) -> list[dict]:
    """Up to `count` records of pages under root with at least min_tokens target tokens, in a seeded order of the
    page files, one page per family (the name up to its first "_" or "-": one gcloud or git page, not hundreds)."""
    pages = sorted(p for p in root.glob("*.1*.gz") if p.is_file())
    random.Random(seed).shuffle(pages)
    out, families, seen = [], set(), set()
    for path in pages:
        if len(out) == count:
            break
        family = re.split(r"[_-]", path.name.split(".1", 1)[0])[0]
        if family in families:
            continue
        with gzip.open(path, "rb") as f:  # a page that only includes another (".so") is that other's copy
            if f.read(3) == b".so":
                continue
        record = man_record(path.name.split(".1", 1)[0], render_man(path))
        if record is None or record["document"] in seen:  # (egrep's page is grep's: one of them)
            continue
        if len(tokenizer(record["document"], add_special_tokens=False)["input_ids"]) >= min_tokens:
            out.append(record)
            families.add(family)
            seen.add(record["document"])
    return out


DEFAULT_DOC_CHARS, DEFAULT_HELDOUT = 8000, 0.08  # adapters.chain.ChainConfig's, for adapters that record neither


@dataclass(frozen=True)
class TrainingSplit:
    """How an adapter's trainer split its corpora (adapters.chain): documents of ~doc_chars characters of consecutive
    paragraphs, held out when blake2b of the id is under heldout_fraction; as the adapter file records it."""

    adapter: str  # the adapter file's name, for messages
    doc_chars: int
    heldout_fraction: float
    files: dict[str, str | None] = field(default_factory=dict)  # corpus file name -> sha256 recorded (None: not)

    def check_corpus(self, path: str | Path) -> None:
        """ValueError unless `path` is a corpus the adapter records it read, with the bytes it read (where the
        adapter records corpora at all): only there are the held-out documents known."""
        name = Path(path).name
        if not self.files:
            return
        if name not in self.files:
            raise ValueError(f"corpus {path}: adapter {self.adapter} was not trained on it (it read "
                             f"{', '.join(sorted(self.files))}): which of its documents it held out cannot be "
                             "established")
        want = self.files[name]
        if want is not None and hashlib.sha256(Path(path).read_bytes()).hexdigest() != want:
            raise ValueError(f"corpus {path}: not the file adapter {self.adapter} was trained on (sha256 differs from "
                             f"the recorded {want[:16]}): its documents are not the ones the adapter's split held out")


def _recorded(corpus: dict, key: str, pattern: str, kind: type, adapter: str):
    """A split setting of an adapter's corpus record: its own field, else read from the "documents" sentence
    (adapters/cli.py wrote doc_chars only there before it recorded the field); None where neither says it;
    ValueError where it is malformed."""
    value = corpus.get(key)
    if value is None and isinstance(corpus.get("documents"), str):
        found = re.search(pattern, corpus["documents"])
        value = found.group(1) if found else None
    if value is None:
        return None
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"adapter {adapter}: its metadata's corpus.{key} is not a number: {value!r}") from None
    ok = 0 < value < 1 if key == "heldout_fraction" else value >= 1
    if not ok or isinstance(corpus.get(key), bool):
        raise ValueError(f"adapter {adapter}: its metadata's corpus.{key} {value!r} is out of range")
    return value


def training_split(adapter_file: str | Path) -> TrainingSplit:
    """The split the adapter file's metadata records (corpus.heldout_fraction; doc_chars, or the "documents"
    sentence that names it; the corpus files and their sha256). A setting it lacks (an adapter trained before they
    were recorded) is the trainer's default, with a warning; ValueError for a file that is not an adapter."""
    from kvbridge.adapters.io import read_adapter_meta

    path = Path(adapter_file)
    if not path.is_file():
        raise FileNotFoundError(f"adapter {path}: no such file")
    meta = read_adapter_meta(path)
    if meta is None:
        raise ValueError(f"{path} is not a kvbridge adapter file (no kvbridge_adapter metadata)")
    corpus = meta.get("corpus") or {}
    if not isinstance(corpus, dict):
        raise ValueError(f"adapter {path.name}: its metadata's corpus is not an object")
    fraction = _recorded(corpus, "heldout_fraction", r"blake2b\(id\) < ([0-9.eE+-]+)", float, path.name)
    doc_chars = _recorded(corpus, "doc_chars", r"runs of ~(\d+) characters", int, path.name)
    lacking = [k for k, v in (("heldout_fraction", fraction), ("doc_chars", doc_chars)) if v is None]
    if lacking:
        log.warning("adapter %s records no %s of its training split: assuming the trainer's defaults (%d-character "
                    "documents, %g held out); if it was trained with others, its held-out documents are not these",
                    path.name, " or ".join(lacking), DEFAULT_DOC_CHARS, DEFAULT_HELDOUT)
    names = corpus.get("files") if isinstance(corpus.get("files"), list) else []
    sums = corpus.get("sha256") if isinstance(corpus.get("sha256"), dict) else {}
    files = {Path(str(f)).name: sums.get(Path(str(f)).name) for f in names}
    return TrainingSplit(path.name, DEFAULT_DOC_CHARS if doc_chars is None else doc_chars,
                         DEFAULT_HELDOUT if fraction is None else fraction, files)


def corpus_records(files: list[str], tokenizer, min_tokens: int, adapter: str | Path | None) -> list[dict]:
    """The corpora's documents held out from training and from the dev windows, with at least min_tokens, by the
    split of the adapter file `adapter` (ValueError for None: without the adapter the split is not known)."""
    from kvbridge.adapters.chain import corpus_name
    from kvbridge.adapters.teacher import is_heldout, split_documents

    if adapter is None:
        raise ValueError("--corpus needs --adapter FILE (none ships for this pair): the held-out documents are those "
                         "of the adapter's training split")
    split = training_split(adapter)
    for path in files:
        split.check_corpus(path)
    out = []
    for path in files:
        for doc_id, text in split_documents(path, corpus_name(path), split.doc_chars):
            if not is_heldout(doc_id, split.heldout_fraction) or is_heldout(doc_id, 0.5, salt="dev"):
                continue
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= min_tokens:
                out.append({"id": doc_id, "document": text, "summary": ""})
    return out


HELD_OUT_SUMMARIES = 100  # the first records of pydoc_summaries.jsonl: no training or tuning step read them
PACKAGED = ("pydoc_summaries_sample.jsonl", "pydoc_heldout.jsonl")  # what eval runs exclude (--exclude)


def summaries_records(path: str, tokenizer, min_tokens: int) -> list[dict]:
    """The summaries file's held-out pages (its first 100 records, less the packaged ones) with >= min_tokens."""
    from kvbridge.eval.records import read_records
    from kvbridge.transfer.data import data_path

    packaged = {r.id for name in PACKAGED for r in read_records(data_path(name))}
    out = []
    for r in read_records(path)[:HELD_OUT_SUMMARIES]:
        if r.id not in packaged and len(tokenizer(r.document, add_special_tokens=False)["input_ids"]) >= min_tokens:
            out.append({"id": r.id, "document": r.document, "summary": r.summary})
    return out


def add_parser(esub) -> None:
    from kvbridge.transfer.presets import PRESETS

    p = esub.add_parser("heldout", help="write an evaluation set of long held-out documents (man pages, or the "
                                        "corpora's documents no training step read)")
    p.add_argument("--man", type=int, metavar="N", help="N manual pages of section 1 installed here")
    p.add_argument("--corpus", nargs="+", metavar="FILE", help="the training corpora: their held-out documents")
    p.add_argument("--adapter", metavar="FILE", help="--corpus: the adapter whose training split holds the documents "
                                                     "out (default: the one that ships for the preset's pair)")
    p.add_argument("--summaries", metavar="FILE", help="data/pydoc_summaries.jsonl: its held-out pages (the first "
                                                       "100 records, less the packaged sample and held-out set)")
    p.add_argument("--min-tokens", type=int, default=1056,
                   help="keep documents of at least this many target tokens (1,024 + the 32-token continuation)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="whose target tokenizer counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records to write (a new file; see --force)")
    p.add_argument("--force", action="store_true", help="write over an existing --out file")
    p.set_defaults(func=cmd_eval_heldout)


def cmd_eval_heldout(args: argparse.Namespace) -> int:
    from kvbridge.transfer.presets import load_pair

    if not (args.man or args.corpus or args.summaries):
        raise ValueError("give --man N, --corpus FILE... or --summaries FILE (or several)")
    if Path(args.out).exists() and not args.force:
        raise ValueError(f"--out {args.out} exists: choose another file, or pass --force to write over it")
    source, target = load_pair(args.preset, device="cpu", source_weights=False)
    tokenizer = target.tokenizer
    records = []
    if args.man:
        records += man_records(tokenizer, args.man, args.min_tokens, args.seed)
    if args.corpus:
        from kvbridge.adapters.shipped import find_shipped

        adapter = getattr(args, "adapter", None) or find_shipped(source.spec, target.spec)
        records += corpus_records(args.corpus, tokenizer, args.min_tokens, adapter)
    if args.summaries:
        records += summaries_records(args.summaries, tokenizer, args.min_tokens)
    if not records:
        raise ValueError(f"no document of at least {args.min_tokens} target tokens found")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # `--out data/...` on a fresh clone
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"{len(records)} documents of >= {args.min_tokens} target tokens -> {args.out} "
          f"(sha256 {hashlib.sha256(text.encode()).hexdigest()})")
    return 0
