"""End-to-end refinement: gradient steps on the adapter's K and V maps through the frozen target, minimising
KL(target with its own prefill ‖ target with the projected context) over the next-token distributions of the
continuation tokens. Starts from the ridge solution; the source and target weights never change.

The loss is the trainer's `kl` objective (losses.teacher_kl on scoring.continuation_logits), over the whole vocabulary
instead of a cached top-k; the loop differs in what it trains: the adapter's own weights through `adapter.project`
(a plain Adam step, one document a step), where the trainer trains a residual on them (residual.ResidualMaps) from
a teacher cache, with a schedule, dev recovery and checkpoints (`train-adapter --trainer chain`)."""

from __future__ import annotations

import dataclasses
import random

import torch
from kvbridge.adapters.adapter import Adapter, project
from kvbridge.adapters.evaluate import prepare_documents
from kvbridge.adapters.losses import teacher_kl
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.scoring import continuation_logits
from kvbridge.adapters.train import corpus_windows
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from tqdm import tqdm


def refine_adapter(source: LoadedModel, target: LoadedModel, adapter: Adapter, texts: list[str], steps: int,
                   seed: int = 0, lr: float = 1e-5, context_tokens: int = 192, continuation_tokens: int = 64,
                   max_documents: int = 64, progress: bool = True) -> tuple[Adapter, list[float]]:
    """Returns the refined adapter (a copy) and the KL of every step.

    lr: Adam's step is about lr per weight whatever the gradient's scale, and each output sums d_s inputs of
    magnitude up to ~10: 1e-3 wrecked the ridge solution on the small pair (KL 0.41 -> 4.8 at once); 1e-5 improved
    held-out recovery from 0.44 to 0.51 in 100 steps."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    # documents cut from the training texts: context + continuation tokens each
    chunk = context_tokens + continuation_tokens
    pieces = corpus_windows(texts, target.tokenizer, chunk, 4 * max_documents * chunk, seed)
    docs = prepare_documents(pieces, source, target, context_tokens, continuation_tokens, limit=max_documents)
    if not docs:
        raise ValueError(f"the refinement texts hold no piece of {chunk} target tokens")
    start = torch.tensor([start_token_id(target.tokenizer)])
    device = target.device
    with torch.no_grad():
        prepared = []
        for doc in docs:
            seg = kvcache.extract(source.model, source.spec, doc.source.ids)
            full = torch.cat((start, doc.target_context, doc.continuation))
            teacher = continuation_logits(target, None, full)[0, -continuation_tokens:-1].float().log_softmax(-1)
            prepared.append((doc, seg, teacher))
    params = {n: getattr(adapter, n).detach().clone().to(device).requires_grad_(True) for n in ("wk", "bk", "wv", "bv")}
    trainable = dataclasses.replace(adapter, **params)
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    frozen = [p for p in target.model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    rng = random.Random(seed)
    losses = []
    dtype = next(target.model.parameters()).dtype
    try:
        for _ in tqdm(range(steps), desc="refining", disable=not progress):
            doc, seg, teacher = prepared[rng.randrange(len(prepared))]
            target_ids = torch.cat((start, doc.target_context))
            projected = project(trainable, seg, doc.alignment, target_ids, source.rope, target.rope, dtype=dtype)
            student = continuation_logits(target, projected, doc.continuation)[0, :-1].float().log_softmax(-1)
            loss = teacher_kl(student, teacher)  # the trainer's KL, over the whole vocabulary
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().item())
    finally:
        for p in frozen:
            p.requires_grad_(True)
    refined = dataclasses.replace(adapter, **{n: t.detach().cpu() for n, t in params.items()},
                                  meta=dataclasses.replace(adapter.meta, metrics=dict(adapter.meta.metrics)))
    refined.meta.metrics["refine"] = {"steps": steps, "lr": lr, "kl_first": losses[0], "kl_last": losses[-1]}
    return refined, losses
