"""Where a projected document sits in a target prompt.

A stored projection is the target's start token then the document's target tokens (`pair_text`), at positions 0..
Prompts as users send them put other tokens first (a chat template, a system prompt, an instruction), or lack the
start token (a text prompt to a tokenizer that adds none). `locate` finds the document in the prompt; the server
then serves the target's own KV of the prompt's tokens before it (computed exactly, `Projecting.prompt_cache`) and
the projected document after them, its keys moved to its positions in the prompt by RoPE.

Tokenizers may cut the document's first tokens differently when text precedes it ("Document: The" makes " The");
such tokens belong to the head (the target computes them) and the document is served from its first token that
the prompt has as it is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

PROBE = 8  # document tokens that must follow one another in the prompt for it to be placed there
MAX_SKIP = 4  # leading document tokens the prompt may cut otherwise (merged with the text before it)


@dataclass(frozen=True)
class Located:
    head: int  # prompt tokens before the served document tokens: the target computes their own KV
    skip: int  # leading document tokens not served (the prompt cuts them otherwise; they are in the head)
    as_stored: bool  # the prompt begins with the stored cache's own tokens (start token, document): serve it as is


def locate(prompt: Sequence[int], cache_ids: Sequence[int], probe: int = PROBE, max_skip: int = MAX_SKIP) -> Located:
    """Where the document of a stored projection (`cache_ids`: start token, then the document's target tokens)
    begins in `prompt`: the first place where `probe` of its tokens (all of them when it has fewer), from the
    `skip`-th on, follow one another, for the smallest skip < max_skip. ValueError (a sentence) when there is none."""
    if probe < 1 or max_skip < 1:
        raise ValueError(f"probe and max_skip must be >= 1, got {probe} and {max_skip}")
    prompt, doc = list(prompt), list(cache_ids[1:])
    if not doc:
        raise ValueError("the projected cache holds no document tokens")
    n = min(probe, len(doc))
    if prompt[:n + 1] == list(cache_ids[:n + 1]):
        return Located(head=1, skip=0, as_stored=True)
    for skip in range(min(max_skip, len(doc))):
        run = doc[skip:skip + probe]
        first = run[0]
        for h in range(len(prompt) - len(run) + 1):
            if prompt[h] == first and prompt[h:h + len(run)] == run:
                return Located(head=h, skip=skip, as_stored=False)
    raise ValueError(f"the prompt ({len(prompt)} tokens) does not hold the document's target tokens: none of its "
                     f"first {min(max_skip, len(doc))} tokens starts a run of {n} of them in the prompt (is it the "
                     "same text, tokenized by the target's tokenizer?)")


class KeptIds:
    """A small LRU map (target name, text digest) -> the target ids of that document, thread-safe."""

    def __init__(self, size: int = 1024):  # a few KB per document
        self.size, self._ids, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key: tuple) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids

    def put(self, key: tuple, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._ids[key] = ids
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)
