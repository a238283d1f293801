"""The answer objective of `kvbridge prior fit --objective answer`: the induction prior fitted on what users read.

The continuation objective (prior_fit.py) lowers the NLL of the 31 tokens right after the context, and a prior fitted
so raised NLL recovery everywhere and fidelity nowhere (docs/quality.md, "The prior and what users read"). This one
lowers the NLL of the target's own greedy answer to an instruction after the context: the same windows (projected by
the adapter's server, their last 10% recomputed), each with

  prompt  [Q] int64  the instruction's tokens: a training window's one of adapters.answer_windows.INSTRUCTIONS, by a
                     hash of its document id (a term of the document filled in where the wording asks about one); a
                     dev window's DEV_INSTRUCTION. The evaluation's instruction is neither.
  answer  [A] int64  the target's greedy answer after its own prefill of the window's tokens and the prompt, as the
                     evaluation decodes `full` (at most EvalConfig.max_new_tokens, the first line break after some
                     text ends it, the stop token not kept); A may be 0 (the target stopped at once: the window
                     scores nothing)

in NNNN.answer.safetensors beside the window's NNNN.safetensors. The answers are the target's own, so they do not
depend on the adapter; the folder's adapter record still covers the projected windows they go with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvbridge.adapters.answer_windows import DEV_INSTRUCTION, instruction_for
from kvbridge.adapters.answering import greedy, instruction_ids, stop_ids
from kvbridge.eval.prior_fit import Windows
from kvbridge.eval.summaries import EvalConfig
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.suffix.reuse import prefill_after
from kvbridge.transfer.tensor_files import read_metadata, read_tensors, readable, save_tensors


def window_instruction(window_id: str, text: str, dev: bool) -> str:
    """The instruction of a prior window: DEV_INSTRUCTION for a dev window, else the answer windows' wording for the
    document's id."""
    return DEV_INSTRUCTION if dev else instruction_for(f"{window_id}/answer-0", text)


@torch.no_grad()
def own_answer(target: LoadedModel, ids: torch.Tensor, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """[A] the target's greedy answer after its own prefill of ids ([T], from its start token) and prompt ([Q])."""
    own = prefill_after(target, None, ids)
    tokens, _ = greedy(target, own, prompt, max_new_tokens, stop_ids(target), one_line=True)
    return torch.tensor(tokens, dtype=torch.int64)


class AnswerWindows(Windows):
    """prior_fit.Windows with each window's instruction and the target's own answer (module docstring)."""

    max_new_tokens = EvalConfig.max_new_tokens

    def answer_path(self, index: int) -> Path:
        return self.folder / f"{index:04d}.answer.safetensors"

    def build(self, needed: set[int], log=print) -> None:
        super().build(needed, log)
        for index in sorted(needed):
            path = self.answer_path(index)
            tensors, meta = read_tensors(self.path(index), names=("ids",))
            window_id, ids = meta.get("id", str(index)), tensors["ids"]
            text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
            instruction = window_instruction(window_id, text, index < self.recipe.dev)
            if readable(path):  # made before: kept when asked as this recipe asks it (its --dev decides which are)
                if read_metadata(path).get("instruction") == instruction:
                    continue
                log(f"answer {index} {window_id}: made for another instruction (another --dev); made again")
            prompt = instruction_ids(self.target, instruction)
            answer = own_answer(self.target, ids, prompt, self.max_new_tokens)
            save_tensors(path, {"prompt": prompt, "answer": answer}, metadata={"id": window_id,
                                                                              "instruction": instruction})
            log(f"answer {index} {window_id}: {answer.numel()} tokens")

    def __getitem__(self, index: int) -> dict:
        if index not in self._loaded:
            self._loaded[index] = {**read_tensors(self.path(index))[0], **read_tensors(self.answer_path(index))[0]}
        return self._loaded[index]
