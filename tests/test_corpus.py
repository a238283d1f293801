"""kvbridge.transfer.rst_text and .corpus: the conversion and record rules on small inline sources, a build of a small
source tree (twice, same bytes), the `kvbridge data build` command, and the real build from Debian's packages
against the recorded hashes where the packages are installed."""

from __future__ import annotations

import argparse
import gzip
import json

import pytest
from kvbridge.transfer import corpus
from kvbridge.transfer.rst_text import rst_to_text, title_text

PAGE = """\
.. _about:

=================
About these pages
=================

These pages are made from `reStructuredText`_ sources by `Sphinx <https://www.sphinx-doc.org/>`_.
See :ref:`the tracker <using-the-tracker>` and :func:`~os.path.join`, :c:func:`PyObject_New`,
``None`` is **not** *False*; :PEP:`7` stays, [#]_ goes.

.. In the online version
   this comment goes.

.. seealso::

   :mod:`os`
      Operating system interfaces.

.. versionchanged:: 3.5
   Raises :exc:`ValueError` now.

.. deprecated-removed:: 3.3 3.12
   Part of the old API.

For example::

    x = 1



Last :term:`broken
role <glossary>` line.
+-----+-----+
| a   | b   |
+=====+=====+
"""

PAGE_TEXT = """\
About these pages

These pages are made from `reStructuredText`_ sources by Sphinx.
See the tracker and os.path.join, PyObject_New,
None is not *False*; :PEP:`7` stays,  goes.

   os
      Operating system interfaces.

   Raises ValueError now.

For example:

    x = 1

Last :term:`broken
role <glossary>` line.
| a   | b   |"""


def test_rst_to_text_keeps_what_the_rendered_page_shows():
    assert rst_to_text(PAGE) == PAGE_TEXT


def test_title_text_keeps_roles_with_a_target_as_written():
    assert title_text(r"Utilities for :keyword:`!with`\ -statement contexts") == "Utilities for with-statement contexts"
    assert title_text("Access the :ref:`import <importsystem>` internals") == \
        "Access the :ref:`import <importsystem>` internals"
    assert title_text("Generate and parse Apple ``.plist`` files") == "Generate and parse Apple ``.plist`` files"


def module_page(name: str, title: str, words: int, first_line: str | None = None) -> str:
    filler = [f"w{i}" for i in range(words)]
    lines = [" ".join(filler[i:i + 10]) for i in range(0, words, 10)]
    head = first_line or f":mod:`{name}` --- {title}"
    return "\n".join([head, "=" * len(head), "", f".. module:: {name.lstrip('!')}", "   :synopsis: Short.", "",
                      "**Source code:** :source:`Lib/x.py`", "", "--------------", "",
                      "This module provides :class:`Thing` for you.", *lines, ""])


def test_summary_record_is_the_title_and_the_first_600_words_below_it():
    record = corpus.summary_record(module_page("!contextlib", r"Utilities for :keyword:`!with`\ -statement contexts",
                                               700))
    assert set(record) == {"id", "document", "summary"}
    assert record["id"] == "pydoc:contextlib"
    assert record["summary"] == "Utilities for with-statement contexts"
    words = record["document"].split()
    assert len(words) == corpus.DOCUMENT_WORDS
    assert words[:7] == ["This", "module", "provides", "Thing", "for", "you.", "w0"]  # no title, no "Source code:"
    assert words[-1] == f"w{corpus.DOCUMENT_WORDS - 7}"
    assert corpus.summary_record(module_page("importlib.resources", "Resources", 200))["id"] == \
        "pydoc:importlib.resources"  # "--" as well as "---"


def test_summary_record_skips_pages_that_are_no_module_page_or_too_short():
    assert corpus.summary_record(".. _debugger:\n\n" + module_page("pdb", "The Python Debugger", 300)) is None
    assert corpus.summary_record(module_page("2to3", "x", 300, first_line="2to3 --- Automated translation")) is None
    assert corpus.summary_record(module_page("tty", "Terminal control functions", 100)) is None
    assert corpus.summary_record(module_page("tty", "Terminal control functions", 120)) is not None


SENTENCE = "The kernel keeps a list of the devices it knows, and each driver binds to the ones it can handle."


def prose(lines: int = 4) -> str:
    return "\n".join([SENTENCE] * lines)


def test_prose_paragraphs_keeps_long_plain_paragraphs_on_one_line():
    code = prose(2) + "\n  if (x) return;\n" + prose(2)
    table = "\n".join(["| name | meaning of the field in this table |"] * 8)
    numbers = "\n".join(["0x1000 0x2000 0x3000 0x4000 0x5000 0x6000 0x7000 0x8000 0x9000 0xa000"] * 5)
    text = "\n\n".join([prose(4), code, table, numbers, prose(3), prose(5)])  # prose(3): 296 characters
    assert list(corpus.prose_paragraphs(text)) == [" ".join([SENTENCE] * 4), " ".join([SENTENCE] * 5)]


def test_is_prose_counts_length_without_trailing_spaces():
    line = "word " * 14 + "end"  # 73 characters
    short = "\n".join([line + "   "] * 4)  # 295 characters without the trailing spaces, 307 with them
    assert len(short) >= corpus.MIN_PARAGRAPH_CHARS and not corpus.is_prose(short)
    assert corpus.is_prose("\n".join([line] * 3 + [line + " and so on."]))  # 306


def write_tree(root, python_files: dict[str, str], kernel_files: dict[str, str]):
    python_doc, kernel_doc = root / "python", root / "kernel"
    for name, text in python_files.items():
        (python_doc / name).parent.mkdir(parents=True, exist_ok=True)
        (python_doc / name).write_text(text, encoding="utf-8")
    for name, text in kernel_files.items():
        (kernel_doc / name).parent.mkdir(parents=True, exist_ok=True)
        (kernel_doc / name).write_bytes(gzip.compress(text.encode("utf-8")))
    return python_doc, kernel_doc


P1, P2, P3 = prose(4), prose(5), prose(6)


@pytest.fixture
def small_tree(tmp_path):
    return write_tree(tmp_path, {
        "about.rst.txt": "About\n=====\n\nSome words about these documents, enough of them to count as a page.\n",
        "c-api/intro.rst.txt": "Introduction\n============\n\nThe C API lets C code use Python objects, and "
                               ":c:func:`Py_Initialize` starts the interpreter.\n",
        "whatsnew/changelog.rst.txt": "+++++++++\nChangelog\n+++++++++\n\n.. miscnews:: ../build/NEWS\n",
        "library/abc.rst.txt": module_page("abc", "Abstract Base Classes", 150),
        "library/pdb.rst.txt": ".. _debugger:\n\n" + module_page("pdb", "The Python Debugger", 150),
        "library/zlib.rst.txt": module_page("zlib", "Compression compatible with :program:`gzip`", 150),
    }, {
        "b/two.rst.gz": f"Two\n===\n\n{P2}\n\n{P3}\n",
        "a/one.rst.gz": f"One\n===\n\n{P1}\n\n.. code-block:: c\n\n   int x;\n\n{P2}\n",
        "translations/it_IT/one.rst.gz": "Uno\n===\n\n" + "\n".join(["Il kernel tiene una lista dei dispositivi."] * 9),
        "devicetree/usage.rst.gz": f"Usage\n=====\n\n{prose(7)}\n",
        "notes.txt.gz": prose(8),
    })


def test_build_of_a_small_tree_is_deterministic_and_follows_the_rules(tmp_path, small_tree):
    first = corpus.build(tmp_path / "first", *small_tree)
    second = corpus.build(tmp_path / "second", *small_tree)
    assert set(first) == set(corpus.OUTPUTS)
    for name in corpus.OUTPUTS:
        assert first[name].read_bytes() == second[name].read_bytes(), name
    records = [json.loads(line) for line in first[corpus.SUMMARIES].read_text(encoding="utf-8").splitlines()]
    assert [(r["id"], r["summary"]) for r in records] == [("pydoc:abc", "Abstract Base Classes"),
                                                          ("pydoc:zlib", "Compression compatible with gzip")]
    assert first[corpus.PYDOC_CORPUS].read_text(encoding="utf-8") == (
        "About\n\nSome words about these documents, enough of them to count as a page.\n\n"
        "Introduction\n\nThe C API lets C code use Python objects, and Py_Initialize starts the interpreter.\n")
    joined = [" ".join(p.split("\n")) for p in (P1, P2, P3)]  # path order, each paragraph once, two folders skipped
    assert first[corpus.KERNEL_CORPUS].read_text(encoding="utf-8") == "\n\n".join(joined) + "\n"


def test_missing_sources_name_the_packages_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="python3.11-doc.*linux-doc-6.1.*apt-get install"):
        corpus.build(tmp_path / "out", tmp_path / "no-python-doc", tmp_path / "no-kernel-doc")


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    corpus.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_data_build_says_whether_each_hash_equals_the_recorded_one(tmp_path, small_tree, capsys):
    argv = ["data", "build", "--out", str(tmp_path / "out"), "--python-doc", str(small_tree[0]),
            "--kernel-doc", str(small_tree[1])]
    assert run_command(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in corpus.OUTPUTS:
        line = next(line for line in lines if line.startswith(name + ":"))
        assert corpus.sha256_of(tmp_path / "out" / name) in line and "DIFFERS from the recorded" in line
    assert run_command([*argv, "--check"]) == 1


def test_kvbridge_command_has_data_build():
    from kvbridge.cli import build_parser

    args = build_parser().parse_args(["data", "build", "--out", "somewhere", "--check"])
    assert args.func is corpus.cmd_data_build and args.check and not args.install


def test_recorded_hashes_name_the_three_files_and_their_packages():
    record = corpus.recorded()
    assert set(record["sha256"]) == set(corpus.OUTPUTS)
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in record["sha256"].values())
    assert set(record["packages"]) == set(corpus.PACKAGES)


def test_real_build_from_the_debian_packages_gives_the_recorded_hashes(tmp_path):
    if not (corpus.PYTHON_DOC.is_dir() and corpus.KERNEL_DOC.is_dir()):
        pytest.skip(f"{' and '.join(corpus.PACKAGES)} are not installed (apt-get install -y --no-install-recommends "
                    f"{' '.join(corpus.PACKAGES)}, or `kvbridge data build --install`)")
    record = corpus.recorded()
    installed = corpus.package_versions()
    if any(installed[p] not in (None, record["packages"][p]) for p in corpus.PACKAGES):
        pytest.skip(f"installed {installed}, the hashes are recorded for {record['packages']}: rebuild, compare "
                    f"with the shared data and record the new hashes")
    paths = corpus.build(tmp_path, corpus.PYTHON_DOC, corpus.KERNEL_DOC)
    assert {name: corpus.sha256_of(path) for name, path in paths.items()} == record["sha256"]


def small_argv(out, small_tree, *more: str) -> list[str]:
    return ["data", "build", "--out", str(out), "--python-doc", str(small_tree[0]), "--kernel-doc", str(small_tree[1]),
            *more]


def test_check_compares_and_never_replaces(tmp_path, small_tree, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / corpus.PYDOC_CORPUS).write_text("the real corpus\n")
    assert run_command(small_argv(out, small_tree, "--check")) == 1
    assert (out / corpus.PYDOC_CORPUS).read_text() == "the real corpus\n"
    assert sorted(p.name for p in out.iterdir()) == [corpus.PYDOC_CORPUS]  # nothing written
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(corpus.PYDOC_CORPUS))
    assert "DIFFERS from the recorded" in line and corpus.sha256_of(out / corpus.PYDOC_CORPUS) in line


def test_build_refuses_to_replace_a_different_file_unless_forced(tmp_path, small_tree):
    out = tmp_path / "out"
    out.mkdir()
    (out / corpus.KERNEL_CORPUS).write_text("the real corpus\n")
    theirs = corpus.sha256_of(out / corpus.KERNEL_CORPUS)
    with pytest.raises(FileExistsError, match=f"{out / corpus.KERNEL_CORPUS}.*{theirs}.*--force"):
        run_command(small_argv(out, small_tree))
    assert (out / corpus.KERNEL_CORPUS).read_text() == "the real corpus\n"
    assert sorted(p.name for p in out.iterdir()) == [corpus.KERNEL_CORPUS]  # all or nothing
    assert run_command(small_argv(out, small_tree, "--force")) == 0
    assert (out / corpus.KERNEL_CORPUS).read_text() != "the real corpus\n"
    assert run_command(small_argv(out, small_tree)) == 0  # the same bytes again: nothing to refuse


def test_an_empty_build_is_refused_by_name(tmp_path, small_tree):
    wrong = tmp_path / "html"  # --python-doc given the HTML folder: no .rst.txt sources in it
    (wrong / "library").mkdir(parents=True)
    with pytest.raises(ValueError, match=f"{corpus.SUMMARIES}: no document.*{wrong}"):
        corpus.build(tmp_path / "out", wrong, small_tree[1])
    assert not (tmp_path / "out").exists()


def test_a_page_that_is_not_utf8_is_named_and_nothing_is_written(tmp_path, small_tree):
    page = small_tree[0] / "library" / "abc.rst.txt"
    page.write_bytes(page.read_bytes() + b"caf\xe9\n")
    with pytest.raises(ValueError, match=f"{page} is not UTF-8"):
        corpus.build(tmp_path / "out", *small_tree)
    assert not (tmp_path / "out").exists()
    kernel_page = small_tree[1] / "a" / "one.rst.gz"
    kernel_page.write_bytes(gzip.compress(b"One\n===\n\n\xff\n"))
    with pytest.raises(ValueError, match=f"{kernel_page} is not UTF-8"):
        corpus.kernel_corpus(small_tree[1])
    # damaged inside its deflate data (zlib.error, neither OSError nor EOFError): named too, not a traceback
    damaged = bytearray(gzip.compress(("One\n===\n\n" + "The kernel keeps a list. " * 40).encode()))
    damaged[10] ^= 0xFF  # the first byte of the deflate stream
    kernel_page.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"{kernel_page} is not a complete gzip file"):
        corpus.kernel_corpus(small_tree[1])


def test_a_failed_write_leaves_no_partial_files(tmp_path, small_tree, monkeypatch):
    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(corpus.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        corpus.build(tmp_path / "out", *small_tree)
    assert list((tmp_path / "out").iterdir()) == []
