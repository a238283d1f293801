"""Dev fidelity of a trainable map on answer windows (answer_windows.py): the target answers the window's instruction
over the map's cache of the document, greedily (one line, at most as many tokens as the teacher's answer may have),
and the answer is compared with the target's own (the teacher's, over its own prefill): ROUGE-L, greedy agreement
over the first answer tokens, top-1 agreement and KL at the teacher's answer positions (teacher-forced). The measures
are answering.py's, as the evaluation reports them."""

from __future__ import annotations

import torch
from kvbridge.adapters.answer_windows import ROWS, AnswerCache
from kvbridge.adapters.answering import greedy_agreement, greedy_alike, rouge, stop_ids
from kvbridge.adapters.losses import answer_context, answer_logits, topk_kl
from kvbridge.adapters.scoring import bootstrap_mean
from kvbridge.transfer.models import LoadedModel

MEASURES = ("rougeL", "greedy", "top1", "kl")


class AnswerProbe:
    """Answer windows held out from training, loaded once; `score(maps)` answers each over the map's cache."""

    def __init__(self, target: LoadedModel, start_kv: torch.Tensor, cache: AnswerCache, indices: list[int],
                 max_answer_tokens: int = 24):
        if len(indices) < 2:
            raise ValueError(f"an answer probe needs at least 2 windows, got {len(indices)}")
        self.target, self.start_kv, self.max_answer_tokens = target, start_kv, max_answer_tokens
        self.windows = [cache.load(i) for i in indices]
        self.stop = stop_ids(target)

    @torch.no_grad()
    def per_window(self, maps) -> dict[str, list[float]]:
        """Every measure of every window (MEASURES), in the windows' order. The answers of windows with as many
        document and instruction tokens are decoded together, ROWS at a time (answering.greedy_rows)."""
        tok = self.target.tokenizer
        shape = [tuple(w["lengths"][:2].tolist()) for w in self.windows]
        order = sorted(range(len(self.windows)), key=lambda i: shape[i])
        rows: dict[int, dict[str, float]] = {}
        for at in range(0, len(order), ROWS):
            chunk = order[at:at + ROWS]
            segs = [answer_context(maps, self.start_kv, self.windows[i], self.target) for i in chunk]
            prompts = [self.windows[i]["ids"][1 + shape[i][0]:1 + sum(shape[i])] for i in chunk]
            got = greedy_alike(self.target, segs, prompts, self.max_answer_tokens, self.stop, one_line=True)
            for i, seg, answer in zip(chunk, segs, got):  # one projection each: the answer and the logits
                w = self.windows[i]
                own = w["ids"][1 + sum(shape[i]):].tolist()  # the teacher's answer
                logits = answer_logits(maps, self.start_kv, w, self.target, seg).float()  # [A, V]
                rows[i] = {"rougeL": rouge(tok.decode(own, skip_special_tokens=True),
                                           tok.decode(answer, skip_special_tokens=True))["rougeL"],
                           "greedy": greedy_agreement(answer, own),
                           "top1": float((logits.argmax(-1) == w["top_idx"][:, 0]).float().mean()),
                           "kl": float(topk_kl(logits.log_softmax(-1), w["top_logp"], w["top_idx"]))}
        return {m: [rows[i][m] for i in range(len(self.windows))] for m in MEASURES}

    def score(self, maps, seed: int = 0) -> dict:
        """{measure: mean, measure_interval: bootstrap 95% over windows, fidelity: the mean of ROUGE-L and top-1 (the
        trainer's choice of checkpoint: ROUGE-L is what users read, top-1 steadies it on few windows), windows}."""
        rows = self.per_window(maps)
        out: dict = {"windows": len(self.windows)}
        for m, values in rows.items():
            mean, lo, hi = bootstrap_mean(values, seed=seed)
            out[m], out[f"{m}_interval"] = mean, (lo, hi)
        out["fidelity"] = (out["rougeL"] + out["top1"]) / 2
        return out
