"""Answer windows: a document, an instruction after it and the target's own greedy answer — the task users run — as
teacher data for the `answer` objective (teacher-forced KL over the answer tokens, losses.answer_loss) and for the
dev probe's fidelity (answer_probe.py).

One window (target tokens): [start] + document (C tokens: the document's first C, C drawn per window from
`AnswerConfig.lengths` among those the document holds) + instruction (Q tokens: one of INSTRUCTIONS, chosen by a hash
of the window id; a term of the document fills the ones that ask about a term) + answer (A tokens: the target's
greedy answer over its own prefill of all that, at most `max_answer_tokens`, one line, the stop token not kept).
Its cache file holds only what the objective reads — no queries, keys or values of the target:

  xk, xv            [L_s, 1 + C, d_s] bf16  source features of start + document (teacher.source_features)
  start_mask        [1 + C] bool            positions that take the adapter's exact start KV
  ids               [1 + C + Q + A] int64   start, document, instruction, answer
  lengths           [3] int64               C, Q, A
  top_logp, top_idx [A, topk]               the target's own log-probs of its top-k tokens where it chose answer
                                            tokens 0..A-1 (the last instruction token, then answer tokens 0..A-2)

AnswerCache computes ROWS windows at a time: each document is read alone, and the greedy answers of windows with as
many document and instruction tokens are decoded as one batch (answering.greedy_rows; equal to one window's own
decoding up to float ties). A window answered with nothing is listed as empty in the index (computed once).

The evaluation's instruction (eval.summaries.EvalConfig.instruction) is not among INSTRUCTIONS, nor is the dev
windows' DEV_INSTRUCTION: fidelity measured with either is fidelity on a wording no training step saw.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

import torch
from kvbridge.adapters.adapter import has_text_source
from kvbridge.adapters.answering import greedy_alike, stop_ids
from kvbridge.adapters.pairs import pair_text
from kvbridge.adapters.teacher import TeacherCache, Window, source_features
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel

# Wordings of the three tasks: summarise, answer a question about the document, explain a term it uses. {term} is a
# word of the document (document_term).
INSTRUCTIONS = (
    "\n\nSummarize the text above in one sentence:",
    # until 2026-12-05 "In one line, what is the text above about?", which the target answered with nothing on 60 of
    # 60 pages (its windows were dropped); this one got an answer on all 60 (experiments/instruction/run.sh WORK
    # WORDING ...: docs/answers.md, "Training for answers")
    "\n\nThe text above is about",
    "\n\nTL;DR:",
    "\n\nQuestion: What is the main purpose of what the text above describes?\nAnswer:",
    "\n\nQuestion: According to the text above, what is {term}?\nAnswer:",
    "\n\nExplain \"{term}\" as the text above uses it, in one sentence:",
)
# The dev answer windows' one wording, in none of the training windows nor the evaluation's: the dev probe (and the
# checkpoint an `answer` stage keeps) measures fidelity under a wording no step trained on, as the evaluation does.
# Probed on pydoc pages 100-159 at 256 tokens (experiments/instruction/run.sh): the target's own answer had content on
# all 60 pages, none repeated the request.
DEV_INSTRUCTION = "\n\nIn one sentence, the text above explains"
DEV_MARK = "/answer-dev-"  # in a dev window's id (answer_windows(..., dev=True))
TERM = re.compile(r"\b[A-Za-z][A-Za-z0-9_.]{4,}[A-Za-z0-9]\b")


@dataclass(frozen=True)
class AnswerConfig:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)  # document tokens a window may hold (past Gemma's window)
    max_answer_tokens: int = 24  # as the evaluation's summaries (EvalConfig.max_new_tokens)
    topk: int = 32  # teacher log-probs kept per answer position (the KL is renormalised over them)

    def __post_init__(self):
        if isinstance(self.lengths, list):  # from a saved index's JSON
            object.__setattr__(self, "lengths", tuple(self.lengths))
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths must be document token counts >= 2, got {self.lengths}")
        if self.max_answer_tokens < 1 or self.topk < 1:
            raise ValueError(f"max_answer_tokens and topk must be >= 1, got {self.max_answer_tokens}, {self.topk}")


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def document_term(text: str, seed: int) -> str:
    """A word of the text that it uses at least twice (a name, an identifier), chosen by the seed; the most frequent
    longer word when none repeats."""
    words = TERM.findall(text)
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    repeated = sorted(w for w, n in counts.items() if n >= 2)
    if repeated:
        return repeated[seed % len(repeated)]
    return max(sorted(counts), key=counts.get) if counts else "it"


def instruction_for(window_id: str, text: str) -> str:
    """The instruction of a window: DEV_INSTRUCTION for a dev window, else one of INSTRUCTIONS by a hash of its id, a
    term of the text filled in."""
    if DEV_MARK in window_id:
        return DEV_INSTRUCTION
    seed = _seed(window_id)
    wording = INSTRUCTIONS[seed % len(INSTRUCTIONS)]
    return wording.format(term=document_term(text, seed // len(INSTRUCTIONS))) if "{term}" in wording else wording


def answer_windows(docs: list[tuple[str, str]], target_tokenizer, config: AnswerConfig, per_document: int = 1,
                   dev: bool = False) -> list[Window]:
    """Up to per_document windows of every document (ids "<doc id>/answer-<n>", dev: "<doc id>/answer-dev-<n>",
    asked in DEV_INSTRUCTION): its first C target tokens, C drawn (seeded by the window id alone: an answer cache,
    which records no seed, holds the same window under one id whatever the run's --seed) among config.lengths that
    the document holds, cut at a token boundary; documents shorter than the shortest length give none."""
    out = []
    for doc_id, text in docs:
        offsets = target_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        fits = [n for n in config.lengths if n <= len(offsets)]
        for n in range(per_document if fits else 0):
            wid = f"{doc_id}{DEV_MARK if dev else '/answer-'}{n}"
            c = random.Random(_seed(wid)).choice(fits)  # (a --seed 0 run's draws, as before)
            out.append(Window(wid, doc_id, text[:offsets[c - 1][1]]))
    return out


ROWS = 8  # answer windows whose greedy answers are decoded in one batch (AnswerCache.batch_windows)


@torch.no_grad()
def answer_window(source: LoadedModel, target: LoadedModel, window: Window, config: AnswerConfig,
                  start_token: int) -> dict[str, torch.Tensor] | None:
    """Every tensor of one answer window's cache file (see the module docstring); None when the target's answer is
    empty (it stopped at once)."""
    return answer_window_rows(source, target, [window], config, start_token)[0]


@torch.no_grad()
def answer_window_rows(source: LoadedModel, target: LoadedModel, windows: list[Window], config: AnswerConfig,
                       start_token: int) -> list[dict[str, torch.Tensor] | None]:
    """`answer_window` of several windows: each document read alone (the source's features, the target's prefill),
    the greedy answers of windows with as many document and instruction tokens decoded together
    (answering.greedy_rows: the decoding was half of a window's time one at a time)."""
    made = []
    for window in windows:
        paired = pair_text(window.text, source.tokenizer, target.tokenizer)
        ids = paired.target_ids  # [1 + C]: start + document
        assert int(ids[0]) == start_token
        xk, xv = source_features(source, paired.source_ids, paired.alignment.source_index)
        prompt = torch.tensor(target.tokenizer(instruction_for(window.id, window.text),
                                               add_special_tokens=False)["input_ids"], dtype=torch.int64)
        made.append({"paired": paired, "xk": xk, "xv": xv, "prompt": prompt,
                     "own": kvcache.extract(target.model, target.spec, ids)})
    scores: list[list[torch.Tensor]] = [[] for _ in made]
    answers = greedy_alike(target, [m["own"] for m in made], [m["prompt"] for m in made], config.max_answer_tokens,
                           stop_ids(target), one_line=True, scores=scores)
    out: list[dict[str, torch.Tensor] | None] = [None] * len(windows)
    bf16 = torch.bfloat16
    for i, (m, answer) in enumerate(zip(made, answers)):
        if not answer:
            continue
        ids = m["paired"].target_ids
        top = torch.stack(scores[i]).log_softmax(-1).topk(config.topk, dim=-1)  # [A, k]
        out[i] = {"xk": m["xk"].to(bf16), "xv": m["xv"].to(bf16),
                  "start_mask": (~has_text_source(m["paired"].alignment.kind)) & (ids == start_token),
                  "ids": torch.cat((ids, m["prompt"], torch.tensor(answer, dtype=torch.int64))),
                  "lengths": torch.tensor([ids.numel() - 1, m["prompt"].numel(), len(answer)]),
                  "top_logp": top.values, "top_idx": top.indices}
    return out


class AnswerCache(TeacherCache):
    """TeacherCache of answer windows (its config an AnswerConfig), ROWS windows at a time."""

    config_class = AnswerConfig
    batch_windows = ROWS

    def window_tensors(self, source, target, window, config, start_token, keep_kv=True):
        return answer_window(source, target, window, config, start_token)  # (an answer window keeps no target KV)

    def batch_tensors(self, source, target, windows, config, start_token, keep_kv):
        return answer_window_rows(source, target, windows, config, start_token)  # (no target KV to keep)

    def batch_order(self, windows, target):
        """Windows of one document length and one instruction length side by side, so that a batch decodes them
        together (the length a window was cut at, and its instruction's tokens)."""
        def key(w: Window) -> tuple[int, int]:
            return (len(target.tokenizer(w.text, add_special_tokens=False)["input_ids"]),
                    len(target.tokenizer(instruction_for(w.id, w.text), add_special_tokens=False)["input_ids"]))
        return sorted(windows, key=key)

    def wordings(self) -> dict:
        """The instructions the windows drew from: a window's id chooses one of them (a dev window's is
        DEV_INSTRUCTION), so a folder of windows drawn from other wordings (before 2026-12-05, one of them answered
        with nothing; before the dev windows had a wording of their own) is another cache."""
        return {"instructions": list(INSTRUCTIONS), "dev_instruction": DEV_INSTRUCTION}
