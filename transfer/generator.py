"""SuffixReuseGenerator: multi-turn generation on the target that assembles each request's cache from its own
cached segments, projected segments for designated context (documents, system prompts) and fresh prefill of the
rest, then generates; with per-request metrics.

A request is a list of parts. Every part but the last is context: a `projected` part's KV comes from the context
source (the gRPC client, or anything with `projected_segment`); another part is reused from the session's
segments when the manager has its tokens — exact when it was computed after the same tokens at the same
positions, otherwise placed by RoPE shift (an approximation: its KV saw another prefix) with its first
`recompute_k` tokens and its `recompute_fraction` most deviating tokens (at a checked layer) recomputed — else prefilled after the context so far and offered to the manager. The last
part (the new turn) is always prefilled, then generation starts. Positions run 0.. over the whole request and
the mask is the model's causal one, as for a plain prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.reuse import place, prefill_after, recompute_first, recompute_most_deviating
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix_cache import SuffixCacheManager, token_hash

__all__ = ["Part", "RequestMetrics", "SuffixReuseGenerator", "ContextSource"]


class ContextSource(Protocol):
    def projected_segment(self, text: str, offset: int) -> KVSegment:
        """The target's KV for `text` (its target tokens) at positions offset.., projected from the source."""


@dataclass(frozen=True)
class Part:
    text: str
    role: str = "turn"  # "system", "document", "turn" or "other" (a feature of the value scorer)
    projected: bool = False  # take the KV from the context source


@dataclass
class RequestMetrics:
    tokens_total: int = 0  # context + new turn
    tokens_reused_local: int = 0  # taken from the session's segments
    tokens_reused_exact: int = 0  # of which reused after the same prefix at the same positions
    tokens_projected: int = 0  # from the context source
    tokens_prefilled: int = 0  # computed by the target in this request (recomputed tokens included)
    ttft_s: float = 0.0  # request start to the first generated token
    parts: list[str] = field(default_factory=list)  # per part: "exact", "shifted", "projected", "prefilled"


class _FirstToken:
    """A `generate` streamer that notes when the first new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.calls = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class SuffixReuseGenerator:
    def __init__(self, lm: LoadedModel, manager: SuffixCacheManager | None = None,
                 context_source: ContextSource | None = None, recompute_k: int = 0, recompute_fraction: float = 0.0,
                 start_token: int | None = None):
        if lm.tokenizer is None:
            raise ValueError(f"{lm.name!r} has no tokenizer")
        self.lm = lm
        self.manager = manager
        self.context_source = context_source
        self.recompute_k = recompute_k  # shifted segments: recompute their first k tokens
        self.recompute_fraction = recompute_fraction  # and this fraction of their most deviating tokens
        if start_token is None:
            from_tok = lm.tokenizer.bos_token_id if lm.tokenizer.bos_token_id is not None else \
                lm.tokenizer.eos_token_id
            start_token = from_tok
        self.start_token = start_token  # every request starts with it (SmolLM2's tokenizer adds no BOS itself)

    def tokens(self, text: str) -> torch.Tensor:
        return torch.tensor(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    @torch.no_grad()
    def generate(self, session: str, parts: list[Part], max_new_tokens: int = 32, **generate_kwargs
                 ) -> tuple[torch.Tensor, RequestMetrics]:
        """New token ids ([N]) and the request's metrics."""
        if not parts:
            raise ValueError("a request needs at least one part (the new turn)")
        t0 = time.perf_counter()
        metrics = RequestMetrics()
        if self.manager is not None:
            self.manager.begin_turn(session, parts[-1].text)
        lm = self.lm
        context = kvcache.extract(lm.model, lm.spec, torch.tensor([self.start_token]))
        metrics.tokens_prefilled += 1
        for part in parts[:-1]:
            offset = context.num_tokens
            if part.projected:
                if self.context_source is None:
                    raise ValueError("a projected part needs a context source")
                seg = self.context_source.projected_segment(part.text, offset)
                if int(seg.positions[0]) != offset or seg.model != lm.spec.identity:
                    raise ValueError(f"the context source returned KV of {seg.model.name!r} at position "
                                     f"{int(seg.positions[0])}, expected {lm.name!r} at {offset}")
                metrics.tokens_projected += seg.num_tokens
                metrics.parts.append("projected")
            else:
                seg = self._local(session, part, context, metrics)
            context = KVSegment.concat([context, seg.to(device=context.device, dtype=context.dtype)])
        tail = self.tokens(parts[-1].text)
        if tail.numel() == 0:
            raise ValueError("the last part (the new turn) has no tokens")
        streamer = _FirstToken()
        generate_kwargs.setdefault("do_sample", False)
        new = kvcache.generate(lm.model, lm.spec, context, tail, max_new_tokens=max_new_tokens, streamer=streamer,
                               **generate_kwargs)
        metrics.tokens_prefilled += tail.numel()
        metrics.tokens_total = context.num_tokens + tail.numel()
        metrics.ttft_s = (streamer.at or time.perf_counter()) - t0
        metrics.parts.append("prefilled")
        return new, metrics

    def _local(self, session: str, part: Part, context: KVSegment, metrics: RequestMetrics) -> KVSegment:
        ids = self.tokens(part.text)
        offset = context.num_tokens
        found = self.manager.find(session, ids) if self.manager is not None else None
        if found is not None:
            cached = found.segment
            same_place = int(cached.positions[0]) == offset and found.prefix_hash == token_hash(context.token_ids)
            if same_place:
                metrics.tokens_reused_local += ids.numel()
                metrics.tokens_reused_exact += ids.numel()
                metrics.parts.append("exact")
                return cached
            placed = place(cached.to(device=context.device, dtype=context.dtype), self.lm.rope, offset)
            k = min(self.recompute_k, ids.numel())
            fixed = recompute_first(self.lm, context, placed, k)
            chosen = torch.zeros(0, dtype=torch.int64)
            if self.recompute_fraction:
                fixed, chosen = recompute_most_deviating(self.lm, context, fixed, self.recompute_fraction)
            redone = len(set(range(k)) | set(chosen.tolist()))
            metrics.tokens_reused_local += ids.numel() - redone
            metrics.tokens_prefilled += redone
            metrics.parts.append("shifted")
            return fixed
        seg = prefill_after(self.lm, context, ids)
        metrics.tokens_prefilled += ids.numel()
        metrics.parts.append("prefilled")
        if self.manager is not None:
            self.manager.offer(session, seg, context.token_ids, role=part.role)
        return seg
