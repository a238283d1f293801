"""End-to-end quality of projected caches: NLL recovery on held-out continuations.

For each document: the target's first `context_tokens` tokens are the context, the next `continuation_tokens`
the continuation. Conditions, all starting with the target's start token:
  full       the target prefills start + context + continuation itself (upper bound)
  none       start + continuation, no context (lower bound)
  projected  start (exact) + the context's projected KV as a cache, then the continuation
  wrong      as projected, with another document's context (shows the gain is about the content)
The first continuation token is the input after the context in every condition (in `projected` there are no
target logits at the last context position), so NLL is taken over the other continuation tokens, the same
tokens in every condition. recovery = (NLL_none − NLL_x) / (NLL_none − NLL_full), over the pooled tokens, with a
bootstrap 95% interval over documents (both computed in scoring.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvbridge.adapters.adapter import Adapter, project
from kvbridge.adapters.pairs import start_token_id, with_start_token
from kvbridge.adapters.scoring import bootstrap_recovery, continuation_nll
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import Alignment, TokenizedText, align_tokens, tokenize
from kvbridge.transfer.models import LoadedModel
from tqdm import tqdm


@dataclass
class RecoveryResult:
    documents: int
    scored_tokens: int  # per condition
    nll: dict = field(default_factory=dict)  # condition -> mean NLL per scored token (nats)
    recovery: dict = field(default_factory=dict)  # condition -> recovery
    interval: dict = field(default_factory=dict)  # condition -> (low, high) bootstrap 95%
    per_document: list = field(default_factory=list)  # [{condition: summed NLL}]

    def lines(self) -> list[str]:
        out = [f"{self.documents} documents, {self.scored_tokens} scored tokens per condition: " + ", ".join(
            f"NLL {c} {v:.3f}" for c, v in self.nll.items())]
        for c in self.recovery:
            lo, hi = self.interval[c]
            out.append(f"recovery {c}: {self.recovery[c]:.3f} (95% CI {lo:.3f} to {hi:.3f})")
        return out


@dataclass(frozen=True)
class EvalDocument:
    context_text: str
    source: TokenizedText  # the context through the source tokenizer (with its specials)
    target_context: torch.Tensor  # [C] target ids of the context (no specials)
    alignment: Alignment  # [1 + C]: start token (unmapped) + context tokens
    continuation: torch.Tensor  # [N] target ids


def prepare_documents(texts: list[str], source: LoadedModel, target: LoadedModel, context_tokens: int = 192,
                      continuation_tokens: int = 64, limit: int | None = None) -> list[EvalDocument]:
    """Documents long enough for context + continuation (shorter ones are skipped), at most `limit` of them."""
    docs = []
    for text in texts:
        if limit is not None and len(docs) >= limit:
            break
        tgt = tokenize(target.tokenizer, text, add_special_tokens=False)
        if len(tgt) < context_tokens + continuation_tokens:
            continue
        end = int(tgt.offsets[context_tokens - 1, 1])
        context_text = text[:end]
        src = tokenize(source.tokenizer, context_text, add_special_tokens=True)
        ctx = TokenizedText(ids=tgt.ids[:context_tokens], offsets=tgt.offsets[:context_tokens],
                            special=tgt.special[:context_tokens], roles=tgt.roles[:context_tokens])
        docs.append(EvalDocument(context_text, src, ctx.ids, with_start_token(align_tokens(src, ctx)),
                                 tgt.ids[context_tokens:context_tokens + continuation_tokens]))
    return docs


@torch.no_grad()
def evaluate_recovery(source: LoadedModel, target: LoadedModel, adapter: Adapter, docs: list[EvalDocument],
                      seed: int = 0, progress: bool = True, wrong: bool = True) -> RecoveryResult:
    if len(docs) < 2:
        raise ValueError(f"recovery needs at least 2 documents long enough for context + continuation, got {len(docs)}")
    start = torch.tensor([start_token_id(target.tokenizer)])
    per_doc = []
    projected = []
    for doc in tqdm(docs, desc="projecting contexts", disable=not progress):
        seg = kvcache.extract(source.model, source.spec, doc.source.ids)
        target_ids = torch.cat((start, doc.target_context))
        projected.append(project(adapter, seg, doc.alignment, target_ids, source.rope, target.rope,
                                 dtype=next(target.model.parameters()).dtype))
    for i, doc in enumerate(tqdm(docs, desc="scoring", disable=not progress)):
        full = torch.cat((start, doc.target_context))  # read as plain tokens: no cache
        row = {"full": float(continuation_nll(target, None, torch.cat((full, doc.continuation)), full.numel())),
               "none": float(continuation_nll(target, None, torch.cat((start, doc.continuation)), 1)),
               "projected": float(continuation_nll(target, projected[i], doc.continuation))}
        if wrong:
            row["wrong"] = float(continuation_nll(target, projected[(i + 1) % len(docs)], doc.continuation))
        per_doc.append(row)
    n_tok = sum(doc.continuation.numel() - 1 for doc in docs)
    conditions = list(per_doc[0])
    result = RecoveryResult(documents=len(docs), scored_tokens=n_tok, per_document=per_doc)
    result.nll = {c: sum(r[c] for r in per_doc) / n_tok for c in conditions}
    column = {c: [r[c] for r in per_doc] for c in conditions}
    for cond in [c for c in conditions if c not in ("full", "none")]:
        value, lo, hi = bootstrap_recovery(column["none"], column["full"], column[cond], seed=seed)
        result.recovery[cond] = value
        result.interval[cond] = (lo, hi)
    return result
