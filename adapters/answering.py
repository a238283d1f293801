"""How the target answers, and how close an answer is to the target's own: the instruction after a document, greedy
decoding over a cache, and the measures of fidelity — ROUGE-L (rouge-score, Porter stemming) of an answer against
another, top-1 agreement over scored positions, and greedy agreement over the first answer tokens. The trainer's
answer probe and the evaluation read them here, so a checkpoint is chosen on what the report measures."""

from __future__ import annotations

import re
import time
from functools import cache

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def instruction_ids(target: LoadedModel, instruction: str) -> torch.Tensor:
    """[Q] the instruction after the document, as plain text (see EvalConfig.instruction)."""
    return torch.tensor(target.tokenizer(instruction, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def stop_ids(target: LoadedModel) -> set[int]:
    tokenizer = target.tokenizer
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return ids


@torch.no_grad()
def greedy(target: LoadedModel, context: KVSegment, prompt: torch.Tensor, max_new_tokens: int,
           stop: set[int], one_line: bool = False, scores: list[torch.Tensor] | None = None
           ) -> tuple[list[int], float]:
    """Greedy tokens after `context` (rotated KV at 0..C-1) and `prompt` ([Q], prefilled here); returns the tokens
    (without the stop token) and the seconds from the prompt's forward to the first token. one_line: a token with
    a line break ends the answer once it has begun. scores: a list that receives, for each returned token, the
    float32 logits [V] it was chosen from (the teacher's distributions over its own answer)."""
    answers, first_s = greedy_rows(target, [context], prompt[None], max_new_tokens, stop, one_line,
                                   None if scores is None else [scores])
    return answers[0], first_s


@torch.no_grad()
def greedy_rows(target: LoadedModel, contexts: list[KVSegment], prompts: torch.Tensor, max_new_tokens: int,
                stop: set[int], one_line: bool = False, scores: list[list[torch.Tensor]] | None = None
                ) -> tuple[list[list[int]], float]:
    """`greedy` of B rows in one batch: row b continues contexts[b] (all of one length) after prompts[b] ([B, Q]).
    Each row stops by the rules of one answer; the batch steps on until every row has stopped (a stopped row's
    further tokens are computed and dropped). Decoding B rows at once costs little more than one on a CPU (a step of 8
    rows of SmolLM2-135M: 2x the time of one), and a row's answer is the one it gives alone up to float ties (a batch
    sums in another order). Returns the answers and the seconds to the first tokens."""
    cache = kvcache.to_cache(contexts if len(contexts) > 1 else contexts[0], target.model, target.spec)
    device = target.device
    rows, pos = prompts.shape[0], contexts[0].num_tokens
    t0 = time.perf_counter()
    logits = target.model(input_ids=prompts.to(device),
                          position_ids=torch.arange(pos, pos + prompts.shape[1], device=device)[None].expand(rows, -1),
                          cache=cache, use_cache=True, logits_to_keep=1).logits
    tokens = logits[:, -1].argmax(-1).tolist()
    first_s = time.perf_counter() - t0
    pos += prompts.shape[1]
    out: list[list[int]] = [[] for _ in range(rows)]
    going = [True] * rows
    while True:
        for b in range(rows):
            if not going[b]:
                continue
            token, decode = tokens[b], target.tokenizer.decode
            if (token in stop or len(out[b]) >= max_new_tokens
                    or one_line and "\n" in decode([token]) and decode(out[b]).strip()):
                going[b] = False
                continue
            out[b].append(token)
            if scores is not None:
                scores[b].append(logits[b, -1].float().cpu())
            going[b] = len(out[b]) < max_new_tokens
        if not any(going):
            return out, first_s
        logits = target.model(input_ids=torch.tensor(tokens, device=device)[:, None],
                              position_ids=torch.full((rows, 1), pos, device=device), cache=cache,
                              use_cache=True).logits
        tokens = logits[:, -1].argmax(-1).tolist()
        pos += 1


def greedy_alike(target: LoadedModel, contexts: list[KVSegment], prompts: list[torch.Tensor], max_new_tokens: int,
                 stop: set[int], one_line: bool = False, scores: list[list[torch.Tensor]] | None = None
                 ) -> list[list[int]]:
    """`greedy` of every (contexts[i], prompts[i]), the rows of one context length and one prompt length decoded
    together (greedy_rows); the answers (and scores) in the order given."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (context, prompt) in enumerate(zip(contexts, prompts, strict=True)):
        groups.setdefault((context.num_tokens, prompt.numel()), []).append(i)
    out: list[list[int]] = [[] for _ in contexts]
    for rows in groups.values():
        answers, _ = greedy_rows(target, [contexts[i] for i in rows], torch.stack([prompts[i] for i in rows]),
                                 max_new_tokens, stop, one_line, None if scores is None else [scores[i] for i in rows])
        for i, answer in zip(rows, answers):
            out[i] = answer
    return out


# words of any script, lowercased: runs of letters and digits (so ASCII text is cut exactly as rouge-score's own
# tokenizer cuts it, [a-z0-9]+), and each Han character or kana alone (those scripts put no space between words).
# rouge-score's tokenizer keeps [a-z0-9] only: Cyrillic, Greek or CJK text had no words at all, and two different
# answers in it scored 1.0 ("they say the same, nothing").
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORDS = re.compile(f"[{_CJK}]|[^\\W_{_CJK}]+")


class WordTokenizer:
    """rouge-score's Tokenizer for text of any script; Porter stemming of ASCII words longer than 3 characters, as
    rouge-score's default does."""

    def __init__(self):
        from nltk.stem import porter

        self._stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        words = _WORDS.findall(text.lower())
        return [self._stemmer.stem(w) if len(w) > 3 and w.isascii() else w for w in words]


@cache
def _scorer():
    from rouge_score import rouge_scorer  # here, not at import: it loads nltk (a second at every CLI start)

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=_tokenizer())


@cache
def _tokenizer() -> WordTokenizer:
    return WordTokenizer()


def _has_words(text: str) -> bool:
    return bool(_tokenizer().tokenize(text))


def rouge(reference: str, prediction: str) -> dict[str, float]:
    """F1 of ROUGE-1, -2 and -L (rouge-score, Porter stemming; words of every script: WordTokenizer, which cuts
    ASCII text as rouge-score's own tokenizer does). Two texts without a word (empty, or punctuation
    only) score 1: they say the same, nothing (rouge-score gives 0, so `full`'s fidelity to itself was below 1 where
    its answer was empty)."""
    if not _has_words(reference) and not _has_words(prediction):
        return dict.fromkeys(ROUGE_TYPES, 1.0)
    scores = _scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def top1_agreement(mode: list[int] | None, full: list[int] | None) -> float | None:
    """Share of continuation positions where the mode's top-1 token is full's."""
    if not mode or not full or len(mode) != len(full):
        return None
    return sum(a == b for a, b in zip(mode, full)) / len(full)


GREEDY_TOKENS = 24  # greedy agreement compares the first 24 answer tokens (EvalConfig.max_new_tokens' default)


def greedy_agreement(mode: list[int], full: list[int], tokens: int = GREEDY_TOKENS) -> float | None:
    """Share of full's first `tokens` greedy answer tokens that the mode's answer has at the same place (a shorter
    answer misses the rest); None when full's answer is empty."""
    reference = full[:tokens]
    if not reference:
        return None
    return sum(a == b for a, b in zip(mode, reference)) / len(reference)
