"""The fuse mode's per-layer gates: g [L, 2] (K and V) in (0, 1), fitted so that the blended cache
(1 - g) · own + g · projected predicts held-out continuations best. Fitted on windows of the adapter-fitting
corpus sample (never the evaluation documents) by Adam on the mean continuation NLL, gradients flowing through the
cache into the target's attention; the model's weights stay frozen."""

from __future__ import annotations

import torch
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.scoring import continuation_nll
from kvbridge.eval.summaries import ProjectedSource, clean_cut, fuse_gated
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import tokenize
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel
from tqdm import tqdm


def calibration_texts(target: LoadedModel, count: int = 8, context_tokens: int = 256,
                      continuation_tokens: int = 32) -> list[tuple[str, torch.Tensor]]:
    """(context text, continuation ids [N]) windows of consecutive paragraphs of the packaged corpus sample,
    evenly spread over it."""
    paragraphs = [p.strip() for p in data_path("pydoc_corpus_sample.txt").read_text().split("\n\n") if p.strip()]
    need = context_tokens + continuation_tokens
    blocks, buffer = [], []
    for paragraph in paragraphs:  # blocks of whole paragraphs, each long enough for a window
        buffer.append(paragraph)
        if sum(len(p) for p in buffer) >= 6 * need:  # about 4 characters per token: ample
            blocks.append("\n\n".join(buffer))
            buffer = []
    if len(blocks) < count:
        raise ValueError(f"the corpus sample gives {len(blocks)} windows of {need} target tokens, {count} wanted")
    windows = []
    for i in range(count):
        text = blocks[int(i * len(blocks) / count)]
        tok = tokenize(target.tokenizer, text, add_special_tokens=False)
        if len(tok) < need:
            raise ValueError(f"a corpus window has {len(tok)} target tokens, fewer than {need}")
        cut = clean_cut(tok.offsets, context_tokens)  # not inside a character its byte tokens share
        windows.append((text[:int(tok.offsets[cut - 1, 1])], tok.ids[cut:cut + continuation_tokens]))
    return windows


def fit_gates(target: LoadedModel, source: ProjectedSource, count: int = 8, steps: int = 30, lr: float = 0.1,
              init: float = 0.1, progress: bool = True) -> tuple[torch.Tensor, dict]:
    """Gates [L, 2] and a report {"nll_own", "nll_fused", "windows", "tokens"} (mean NLL per scored token)."""
    start = torch.tensor([start_token_id(target.tokenizer)])
    data = []
    for text, cont in calibration_texts(target, count):
        fetched = source.fetch(text)[0]
        own = kvcache.extract(target.model, target.spec, fetched.segment.token_ids)
        if not torch.equal(fetched.segment.token_ids[:1], start):
            raise RuntimeError("the projected calibration window does not begin with the target's start token")
        data.append((own, fetched.segment.to(dtype=own.dtype), cont))
    logit = torch.full((target.spec.num_layers, 2), float(torch.logit(torch.tensor(init))), requires_grad=True)
    optimizer = torch.optim.Adam([logit], lr=lr)
    frozen = [p.requires_grad for p in target.model.parameters()]
    for p in target.model.parameters():
        p.requires_grad_(False)
    tokens = sum(c.numel() - 1 for _, _, c in data)

    def loss_of(gates: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for own, projected, cont in data:
            total = total + continuation_nll(target, fuse_gated(own, projected, gates), cont).cpu()
        return total / tokens

    try:
        with torch.no_grad():
            nll_own = float(loss_of(torch.zeros(target.spec.num_layers, 2)))
        for _ in tqdm(range(steps), desc="fitting fuse gates", disable=not progress):
            optimizer.zero_grad()
            loss = loss_of(torch.sigmoid(logit))
            loss.backward()
            optimizer.step()
        gates = torch.sigmoid(logit.detach())
        with torch.no_grad():
            nll_fused = float(loss_of(gates))
    finally:
        for p, flag in zip(target.model.parameters(), frozen):
            p.requires_grad_(flag)
    return gates, {"nll_own": nll_own, "nll_fused": nll_fused, "windows": len(data), "tokens": tokens,
                   "steps": steps, "gate_mean_k": float(gates[:, 0].mean()), "gate_mean_v": float(gates[:, 1].mean())}
