"""Text shipped with kvbridge: excerpts of the Python 3.11 documentation (Debian python3.11-doc, PSF licence).

- tiny_corpus.txt: the tutorial's informal introduction, about 26 KB (tiny tokenizers, self-check text)
- pydoc_corpus_sample.txt: 400 KB of library documentation prose (the default adapter-fitting corpus)
- pydoc_heldout.jsonl: 46 library pages with one-line summaries (held-out documents for evaluation)
- pydoc_summaries_sample.jsonl: 12 records {id, document, summary} of the project's pydoc_summaries.jsonl (227
  library module pages, their first 600 words, and each module's one-line title as the summary; every 19th from
  the 4th), used by `kvbridge demo` and the tests; the full `kvbridge eval rouge` run takes the other 215

`jsonl_rows` reads a JSONL file, these or a user's (corpora, evaluation records).
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Iterator
from pathlib import Path


def data_path(name: str) -> Path:
    """Path of a shipped data file by name."""
    path = Path(str(importlib.resources.files(__name__) / name))
    if not path.is_file():
        raise FileNotFoundError(f"kvbridge ships no data file {name!r}")
    return path


def jsonl_rows(path: Path, text: str | None = None) -> Iterator[tuple[int, object]]:
    """(line number from 1, parsed value) of every non-blank line of a JSONL file (`text`: its contents, when the
    caller has read them already); a line that is not JSON raises ValueError naming the file and the line."""
    if text is None:
        text = path.read_text(encoding="utf-8")
    # lines end at "\n" only: str.splitlines also cuts at U+2028, U+2029 and U+0085, which JSON leaves raw in strings
    # (json.dumps(..., ensure_ascii=False) writes them so; a "\r" before "\n" is JSON whitespace)
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
