"""The project's text corpora rebuilt from Debian documentation packages, and the `kvbridge data build` command.

Three files, byte for byte those the shipped adapter was trained and the project evaluated on (their sha256 are
recorded in kvbridge/transfer/data/corpus_sha256.json with the package versions they were built from):

- pydoc_summaries.jsonl: one record {id, document, summary} per Python 3.11 library module page whose first
  line is its title ":mod:`NAME` --- SUMMARY" and whose text has at least MIN_SUMMARY_WORDS words: id "pydoc:NAME",
  document the page's first DOCUMENT_WORDS words after the title (and a first "Source code:" line), summary the
  title's text after the dashes. Pages in file name order.
- pydoc_corpus.txt: every other page of the Python documentation (all but library/), as text, in path order,
  pages of fewer than MIN_PAGE_WORDS words left out, one blank line between pages. Disjoint from the above.
- kernel_docs_corpus.txt: English prose paragraphs of the Linux kernel's Documentation/**/*.rst in path order
  (translations/ and devicetree/ left out), each on one line, blank lines between, each paragraph once
  (its first place); `is_prose` says which paragraphs count.

Sources: the reStructuredText that Debian's python3.11-doc ships beside its HTML (html/_sources/) and the
.rst.gz of linux-doc-6.1, converted by kvbridge.transfer.rst_text. Nothing here needs the network: the packages do.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

from kvbridge.transfer.rst_text import rst_to_text, title_text

PACKAGES = ("python3.11-doc", "linux-doc-6.1")
PYTHON_DOC = Path("/usr/share/doc/python3.11/html/_sources")  # python3.11-doc's reStructuredText sources
KERNEL_DOC = Path("/usr/share/doc/linux-doc-6.1/Documentation")  # linux-doc-6.1's, gzipped
SUMMARIES, PYDOC_CORPUS, KERNEL_CORPUS = "pydoc_summaries.jsonl", "pydoc_corpus.txt", "kernel_docs_corpus.txt"
OUTPUTS = (SUMMARIES, PYDOC_CORPUS, KERNEL_CORPUS)
HASHES_FILE = "corpus_sha256.json"  # in kvbridge.transfer.data

DOCUMENT_WORDS = 600  # a summary record's document: the page's first 600 words
MIN_SUMMARY_WORDS = 120  # pages shorter than this (urllib, tty, keyword: an index or a few lines) make no record
MIN_PAGE_WORDS = 10  # pydoc_corpus.txt leaves out pages that are a bare title (whatsnew/changelog)
KERNEL_SKIPPED = ("translations", "devicetree")  # not English; the devicetree guides are not in the shared corpus
MIN_PARAGRAPH_CHARS = 300  # counted with trailing spaces removed
MIN_LETTER_FRACTION = 0.88  # letters and whitespace over all characters: tables and code fall below
MAX_BARS = 2  # more "|" than this is a table row or |substitution| references

MODULE_TITLE = re.compile(r"^:mod:`!?([^`]+)` ---? (.+)$")


def summary_record(page: str) -> dict[str, str] | None:
    """The record of a library page's reStructuredText source, or None if it is no module page (its first line is
    not ":mod:`NAME` --- SUMMARY") or has fewer than MIN_SUMMARY_WORDS words."""
    title = MODULE_TITLE.match(page.strip().split("\n", 1)[0])
    if title is None:
        return None
    lines = "\n\n".join(rst_to_text(page).split("\n\n")[1:]).split("\n")  # the text below the title
    if lines[0].startswith("Source code:"):
        lines = lines[1:]
    words = " ".join(lines).split()
    if len(words) < MIN_SUMMARY_WORDS:
        return None
    return {"id": f"pydoc:{title.group(1)}", "document": " ".join(words[:DOCUMENT_WORDS]),
            "summary": title_text(title.group(2))}


def is_prose(paragraph: str) -> bool:
    """Whether a converted kernel paragraph (lines as in the source) goes into the corpus: long enough, no line
    indented by two spaces or a tab (code, literal blocks, definitions), mostly letters, not a table."""
    lines = paragraph.split("\n")
    if len("\n".join(line.rstrip() for line in lines)) < MIN_PARAGRAPH_CHARS:
        return False
    if any(line.startswith(("  ", "\t")) for line in lines):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return letters / len(paragraph) >= MIN_LETTER_FRACTION and paragraph.count("|") <= MAX_BARS


def prose_paragraphs(text: str) -> Iterator[str]:
    """The prose paragraphs of a converted kernel page, each on one line."""
    for paragraph in re.split(r"\n\s*\n", text):
        if is_prose(paragraph):
            yield " ".join(line.strip() for line in paragraph.split("\n"))


def _files(root: Path, pattern: str) -> list[Path]:
    """Files under root matching pattern, in the order of their path's parts (deterministic, locale-free)."""
    return sorted(root.rglob(pattern), key=lambda p: p.relative_to(root).parts)


def _decode(path: Path, data: bytes) -> str:
    """A source page's text; ValueError naming the file when it is not UTF-8 (the packages' sources all are: a
    damaged file or another folder than the package's; skipping it would change the corpus)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 ({exc.reason} at byte {exc.start}): a damaged file, or not the "
                         f"Debian package's sources; nothing was written") from None


def _read_page(path: Path) -> str:
    return _decode(path, path.read_bytes())


def _read_gzipped_page(path: Path) -> str:
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as exc:  # truncated, or damaged inside (zlib.error)
        raise ValueError(f"{path} is not a complete gzip file ({exc}); nothing was written") from None
    return _decode(path, data)


def pydoc_summaries(python_doc: Path = PYTHON_DOC) -> str:
    """pydoc_summaries.jsonl's text."""
    pages = sorted((python_doc / "library").glob("*.rst.txt"))  # one folder: name order
    records = (summary_record(_read_page(p)) for p in pages)
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records if r is not None)


def pydoc_corpus(python_doc: Path = PYTHON_DOC) -> str:
    """pydoc_corpus.txt's text."""
    pages = (rst_to_text(_read_page(p)) for p in _files(python_doc, "*.rst.txt")
             if p.relative_to(python_doc).parts[0] != "library")
    return "\n\n".join(page for page in pages if len(page.split()) >= MIN_PAGE_WORDS) + "\n"


def kernel_corpus(kernel_doc: Path = KERNEL_DOC) -> str:
    """kernel_docs_corpus.txt's text."""
    seen: set[str] = set()
    out = []
    for path in _files(kernel_doc, "*.rst.gz"):
        if path.relative_to(kernel_doc).parts[0] in KERNEL_SKIPPED:
            continue
        for paragraph in prose_paragraphs(rst_to_text(_read_gzipped_page(path))):
            if paragraph not in seen:
                seen.add(paragraph)
                out.append(paragraph)
    return "\n\n".join(out) + "\n"


def check_sources(python_doc: Path = PYTHON_DOC, kernel_doc: Path = KERNEL_DOC) -> None:
    """Raise FileNotFoundError naming the packages to install if a source folder is missing."""
    missing = [f"{folder} (package {package})" for folder, package in ((python_doc, PACKAGES[0]),
                                                                       (kernel_doc, PACKAGES[1]))
               if not folder.is_dir()]
    if missing:
        raise FileNotFoundError(f"no {' and no '.join(missing)}: install them with `apt-get install -y "
                                f"--no-install-recommends {' '.join(PACKAGES)}` as root (or `kvbridge data build "
                                f"--install`), or unpack the .deb files (apt-get download, dpkg-deb -x) and pass "
                                f"--python-doc and --kernel-doc")


def install_packages() -> None:
    """apt-get install the source packages (needs root and Debian's package mirrors)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        print("+", " ".join(command), flush=True)
        if subprocess.run(command, env=env).returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (it needs root and Debian's package mirrors)")


def package_versions() -> dict[str, str | None]:
    """The installed version of each source package (None: not installed, or no dpkg here)."""
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        versions[package] = None
        try:
            done = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        except FileNotFoundError:
            continue
        if done.returncode == 0 and done.stdout.strip():
            versions[package] = done.stdout.strip()
    return versions


def build_texts(python_doc: Path = PYTHON_DOC, kernel_doc: Path = KERNEL_DOC) -> dict[str, bytes]:
    """The three files' bytes by name; ValueError naming the file and its source folder when one holds no
    document (a wrong --python-doc or --kernel-doc)."""
    check_sources(python_doc, kernel_doc)
    texts = {SUMMARIES: pydoc_summaries(python_doc), PYDOC_CORPUS: pydoc_corpus(python_doc),
             KERNEL_CORPUS: kernel_corpus(kernel_doc)}
    sources = {SUMMARIES: python_doc / "library", PYDOC_CORPUS: python_doc, KERNEL_CORPUS: kernel_doc}
    for name, text in texts.items():
        if not text.strip():
            raise ValueError(f"{name}: no document from {sources[name]} (is it the package's sources folder? "
                             f"{PYTHON_DOC} and {KERNEL_DOC} by default); nothing was written")
    return {name: text.encode("utf-8") for name, text in texts.items()}


def write(out: Path, texts: dict[str, bytes], force: bool = False) -> dict[str, Path]:
    """Write the files into out (created if needed), all or none: a file already there with other content is
    replaced only with force (FileExistsError naming it and both hashes before anything is written); a file with
    the same content is left as it is. Returns their paths by name."""
    paths = {name: out / name for name in texts}
    differ = [f"{path} (sha256 {sha256_of(path)}, the build's {hashlib.sha256(texts[name]).hexdigest()})"
              for name, path in paths.items() if path.exists() and path.read_bytes() != texts[name]]
    if differ and not force:
        raise FileExistsError(f"{'; '.join(differ)}: already there with other content; nothing was written "
                              "(--force replaces them; --check only compares)")
    out.mkdir(parents=True, exist_ok=True)
    partials = {}
    try:
        for name, path in paths.items():
            if not (path.exists() and path.read_bytes() == texts[name]):
                partials[path] = path.with_name(path.name + ".partial")
                partials[path].write_bytes(texts[name])
        for path, partial in partials.items():
            os.replace(partial, path)
    finally:
        for partial in partials.values():
            partial.unlink(missing_ok=True)
    return paths


def build(out: Path, python_doc: Path = PYTHON_DOC, kernel_doc: Path = KERNEL_DOC,
          force: bool = False) -> dict[str, Path]:
    """Build the three files and write them into out (`write`); returns their paths by name."""
    return write(out, build_texts(python_doc, kernel_doc), force)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded() -> dict:
    """corpus_sha256.json: {"sha256": {name: hex}, "packages": {package: version}}."""
    from kvbridge.transfer.data import data_path

    return json.loads(data_path(HASHES_FILE).read_text(encoding="utf-8"))


def cmd_data_build(args: argparse.Namespace) -> int:
    if args.install:
        install_packages()
    out = Path(args.out)
    texts = build_texts(Path(args.python_doc), Path(args.kernel_doc))
    if not args.check:
        write(out, texts, args.force)
    record = recorded()
    want = record["sha256"]
    differ = 0
    for name, data in texts.items():
        digest = hashlib.sha256(data).hexdigest()
        differ += digest != want[name]
        verdict = "equals the recorded hash" if digest == want[name] else f"DIFFERS from the recorded {want[name]}"
        there = ""
        if args.check:  # nothing written: say what the folder holds
            path = out / name
            there = (f"; {path}: absent" if not path.exists() else f"; {path}: the same" if path.read_bytes() == data
                     else f"; {path}: other content, sha256 {sha256_of(path)}, kept")
        print(f"{name}: {len(data)} bytes, sha256 {digest}: {verdict}{there}")
    if differ:
        print(f"built from {package_versions()}; the recorded hashes are of {record['packages']}")
    return 1 if differ and args.check else 0


def add_parsers(sub) -> None:
    data = sub.add_parser("data", help="rebuild the text corpora that training and evaluation read")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("build", help=f"write {', '.join(OUTPUTS)} from Debian's {' and '.join(PACKAGES)} and "
                                      "say for each whether its sha256 equals the recorded one")
    p.add_argument("--out", required=True,
                   help="folder to write the three files into (the one training reads: $KVBRIDGE_DATA)")
    p.add_argument("--check", action="store_true",
                   help="write nothing: compare the built files with the recorded hashes (exit 1 if one differs) and "
                        "with the files in --out")
    p.add_argument("--force", action="store_true",
                   help="replace files in --out whose content differs from the build (refused otherwise)")
    p.add_argument("--install", action="store_true",
                   help=f"first apt-get install {' '.join(PACKAGES)} (root; python3.11-doc wants the python3.11 "
                        "packages of its own version and may upgrade them)")
    p.add_argument("--python-doc", default=str(PYTHON_DOC), help=f"python3.11-doc's sources (default {PYTHON_DOC})")
    p.add_argument("--kernel-doc", default=str(KERNEL_DOC), help=f"linux-doc-6.1's Documentation (default "
                                                                 f"{KERNEL_DOC})")
    p.set_defaults(func=cmd_data_build)
