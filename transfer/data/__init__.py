"""Text shipped with kvbridge: excerpts of the Python 3.11 documentation (Debian python3.11-doc, PSF licence).

- tiny_corpus.txt: the tutorial's informal introduction, about 26 KB (tiny tokenizers, self-check text)
- pydoc_corpus_sample.txt: 400 KB of library documentation prose (the default adapter-fitting corpus)
- pydoc_heldout.jsonl: 46 library pages with one-line summaries (held-out documents for evaluation)
- pydoc_summaries_sample.jsonl: 12 records {id, document, summary} of the project's pydoc_summaries.jsonl (227
  library module pages, their first 600 words, and each module's one-line title as the summary; every 19th from
  the 4th), used by `kvbridge demo` and the tests; the full `kvbridge eval rouge` run takes the other 215
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def data_path(name: str) -> Path:
    """Path of a shipped data file by name."""
    path = Path(str(importlib.resources.files(__name__) / name))
    if not path.is_file():
        raise FileNotFoundError(f"kvbridge ships no data file {name!r}")
    return path
