"""reStructuredText source to plain text, line by line: the conversion every kvbridge text corpus was made with.

It is not a reStructuredText parser. It reads the sources that Sphinx copies into its HTML output (Debian's
python3.11-doc ships them as html/_sources/**/*.rst.txt) and the kernel's Documentation/**/*.rst, and keeps what a
reader of the rendered page reads, with the markup's punctuation removed. Its rules are exactly those that made
the project's corpora (kvbridge.transfer.corpus rebuilds them byte for byte), so a change here changes the recorded
hashes in kvbridge/transfer/data/corpus_sha256.json:

- explicit markup (a line starting with ".. " after its indent: a directive, comment, target or footnote) is dropped,
  with the lines right below it indented by three spaces or more (arguments, options, a comment's continuation) and
  one blank line after them; the body after that blank line stays, indented as written. The directives whose text
  follows at once (note, warning, versionadded, versionchanged, deprecated) keep it;
- a line of three or more of ``-=+~^*#"'` `` alone (title adornment, transition, table border) is dropped;
- inline markup becomes its text, one line at a time (markup broken over two lines stays as written): a role
  (``:func:`len```, ``:ref:`title <target>```) its text without a leading ``~`` or ``!``, a hyperlink with a target
  (```text <url>`_``) its text, ````literal```` and ``**strong**`` their text; footnote references ``[#]_`` go, and
  "::" becomes ":";
- runs of blank lines become one; the page is stripped at both ends.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`<\n]*?)(?:\s*<[^>`\n]*>)?`")
# A page title's roles: only those without an explicit target become their text (":ref:`import <importsystem>`"
# stays as written in the summary of `imp`, as in the shared records).
TITLE_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`[!~]?([^`<]*)`")
LINK = re.compile(r"`([^`<\n]*?)\s*<[^>`\n]*>`__?")
LITERAL = re.compile(r"``([^`\n]*)``")
STRONG = re.compile(r"\*\*([^*\n]*)\*\*")
FOOTNOTE_REF = re.compile(r"\[#[\w-]*\]_")
ADORNMENT = re.compile(r"^\s*[-=+~^*#\"'`]{3,}\s*$")
EXPLICIT_MARKUP = re.compile(r"^\s*\.\. ")
DIRECTIVE = re.compile(r"^\s*\.\. ([\w:-]+)::")
# Directives whose text may start on the next line without a blank one, and is kept.
TEXT_DIRECTIVES = frozenset({"note", "warning", "versionadded", "versionchanged", "deprecated"})


def inline_text(line: str) -> str:
    """One source line with its inline markup replaced by the text it shows."""
    line = ROLE.sub(lambda m: m.group(1).lstrip("~!"), line)
    line = LINK.sub(r"\1", line)
    line = LITERAL.sub(r"\1", line)
    line = STRONG.sub(r"\1", line)
    line = FOOTNOTE_REF.sub("", line)
    return line.replace("::", ":")


def title_text(title: str) -> str:
    """A page title's text: roles without a target become their text, escaped spaces ("\\ ") go."""
    return TITLE_ROLE.sub(r"\1", title).replace("\\ ", "").strip()


def rst_to_text(source: str) -> str:
    """A page's reStructuredText source as plain text (the rules are in the module docstring)."""
    out = []
    in_markup_block = False  # inside the lines that belong to a dropped explicit-markup line
    for line in source.split("\n"):
        if in_markup_block:
            if line.strip() and line.startswith("   "):
                continue
            in_markup_block = False
            if not line.strip():
                continue
        if EXPLICIT_MARKUP.match(line):
            directive = DIRECTIVE.match(line)
            in_markup_block = not (directive and directive.group(1) in TEXT_DIRECTIVES)
            continue
        if ADORNMENT.match(line):
            continue
        out.append(inline_text(line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()
