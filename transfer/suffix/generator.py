"""SuffixReuseGenerator: multi-turn generation on the target that assembles each request's cache from its own
cached segments, projected segments for designated context (documents, system prompts) and fresh prefill of the
rest, then generates; with per-request metrics.

A request is a list of parts. Every part but the last is context:
- a `projected` part's KV comes from the context source (the gRPC client, or anything with `projected_segment`);
  with `recompute_fraction` > 0 it is blended (`blend`, its default rule): that fraction of its tokens
  recomputed through every layer in one forward, its last 16, its first 4 and those its last tokens' queries
  attend to most in the deeper layers;
- another part is reused from the session's segments when the manager has its tokens (of this model, in this
  dtype): exact when it was computed at the same positions after identical KV (the same tokens, each part of them
  made the same way: plain, or projected with the same KV and prior, or shifted alike; `provenance`), otherwise
  placed by RoPE shift (an approximation: its KV saw another prefix) with its first `recompute_k` tokens and its
  `recompute_fraction` most deviating tokens (at a checked layer) recomputed;
- else it is prefilled after the context so far (consecutive such parts in one forward) and offered to the
  manager.
The last part (the new turn) is always prefilled, then generation starts. Positions run 0.. over the whole
request and the mask is the model's causal one, as for a plain prefill. Every forward that reads projected KV (a
projected part's blend recompute, the prefill of later parts, the recompute of a shifted part, the new turn,
generation; not the attention that chooses a blend's tokens) reads it with the target's induction prior
(`induction`: the target's induction heads get back from the tokens the match their projected keys blur) unless
`induction_prior=False`.

A request is checked before anything runs (`limits`): its arguments, and that the context, the new turn and
max_new_tokens fit the model's positions (and a longrope target's original window); a projected segment when the
context source returns it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import start_token_id
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.blend import BlendConfig, blend
from kvbridge.transfer.suffix.cache_manager import SuffixCacheManager
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.limits import check_options, check_positions, check_projected, check_recompute
from kvbridge.transfer.suffix.provenance import Provenance
from kvbridge.transfer.suffix.reuse import place, prefill_after, recompute_first, recompute_most_deviating
from kvbridge.transfer.suffix.value_score import ROLES
from torch import nn

__all__ = ["Part", "RequestMetrics", "SuffixReuseGenerator", "ContextSource", "model_lock"]
log = logging.getLogger(__name__)

_model_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the RLock its generators hold
_model_locks_guard = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock SuffixReuseGenerator.generate holds around a request's forwards of `model` (one per model object):
    while an induction prior reads, the model's attention is switched and a hook sees every forward, so no other
    forward of the model may run meanwhile. Hold it around forwards of your own on a model a generator may be running
    on in another thread."""
    with _model_locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


class ContextSource(Protocol):
    """May also tell, of its last segment, `adapter_digest` (str): the digest of the adapter it was projected by, which
    the generator checks its induction prior against, and `still_projected` ([T] bool): its positions whose KV is the
    projection's (a served correction recomputed the others with the target; none given: all of them)
    (server.projected_context.ProjectedContext tells both)."""

    def projected_segment(self, text: str, offset: int) -> KVSegment:
        """The target's KV for `text` (its target tokens) at positions offset.., projected from the source."""


@dataclass(frozen=True)
class Part:
    text: str
    role: str = "turn"  # "system", "document", "turn" or "other" (a feature of the value scorer)
    projected: bool = False  # take the KV from the context source

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise ValueError(f"Part.text must be a str, got {type(self.text).__name__}")
        if self.role not in ROLES:
            raise ValueError(f"Part.role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.projected, bool):
            raise ValueError(f"Part.projected must be a bool, got {self.projected!r}")


@dataclass
class RequestMetrics:
    tokens_total: int = 0  # context + new turn
    tokens_reused_local: int = 0  # taken from the session's segments
    tokens_reused_exact: int = 0  # of which reused at the same positions after identical KV (provenance)
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
    """Multi-turn generation on `lm` (see the module docstring).

    Threads: generate may be called from several threads, on one generator or on several over the same model; each
    request holds the model's lock (`model_lock`) from its first forward to its last, so requests on one model run
    one at a time and never through another's induction prior. Other code running forwards of the same model at the
    same time must hold that lock too. The manager is the caller's (shared by generators, or not): close it when done.
    """

    def __init__(self, lm: LoadedModel, manager: SuffixCacheManager | None = None,
                 context_source: ContextSource | None = None, recompute_k: int = 0, recompute_fraction: float = 0.0,
                 start_token: int | None = None, induction_prior: InductionPrior | bool = True):
        if lm.tokenizer is None:
            raise ValueError(f"{lm.name!r} has no tokenizer")
        check_recompute(recompute_k, recompute_fraction)
        self.lm = lm
        self.manager = manager
        self.context_source = context_source
        self.recompute_k = recompute_k  # shifted segments: recompute their first k tokens
        self.recompute_fraction = recompute_fraction  # and this fraction of their (and projected parts') tokens
        # every request starts with it (SmolLM2's tokenizer adds no BOS itself)
        self.start_token = start_token if start_token is not None else start_token_id(lm.tokenizer)
        # True: the model's own prior (its probe runs at the first projected part); False: projected KV read as is
        self.induction_prior = induction_prior
        self._stale_told: set[str] = set()  # adapter digests a stale prior was said for

    def tokens(self, text: str) -> torch.Tensor:
        return torch.tensor(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    @torch.no_grad()
    def generate(self, session: str, parts: list[Part], max_new_tokens: int = 32, **generate_kwargs
                 ) -> tuple[torch.Tensor, RequestMetrics]:
        """New token ids ([N]) and the request's metrics.

        The context's KV is written into one preallocated [L, 2, H, T, D] buffer, part by part; runs of parts
        that must be computed are prefilled in one forward each (without a manager, the whole context is one
        forward: a plain prefill). generate_kwargs: greedy options of model.generate only (limits.GREEDY_OPTIONS).
        Bad arguments, and a request past the model's positions, raise ValueError before anything runs."""
        t0 = time.perf_counter()
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        if not isinstance(parts, list | tuple) or not parts:
            raise ValueError("a request needs at least one part (the new turn)")
        for i, part in enumerate(parts):
            if not isinstance(part, Part):
                raise ValueError(f"parts[{i}] must be a Part, got {type(part).__name__}")
        check_options(max_new_tokens, generate_kwargs)
        check_recompute(self.recompute_k, self.recompute_fraction)
        if any(part.projected for part in parts[:-1]) and self.context_source is None:
            raise ValueError("a projected part needs a context source")
        blank = [i for i, part in enumerate(parts[:-1]) if part.projected and not part.text.strip()]
        if blank:  # refused here, before any turn begins: the server projects text, never whitespace alone
            raise ValueError(f"parts[{blank[0]}] is projected but holds whitespace only: prefill it (projected=False)")
        pieces = [torch.tensor([self.start_token])] + [self.tokens(part.text) for part in parts[:-1]]
        tail = self.tokens(parts[-1].text)
        if tail.numel() == 0:
            raise ValueError("the last part (the new turn) has no tokens")
        ids = torch.cat(pieces)  # [T_ctx]: the start token and every context part
        check_positions(self.lm, ids.numel() + tail.numel(), max_new_tokens)
        with model_lock(self.lm.model):
            return self._generate(session, parts, ids, pieces, tail, max_new_tokens, generate_kwargs, t0)

    def _generate(self, session: str, parts: list[Part], ids: torch.Tensor, pieces: list[torch.Tensor],
                  tail: torch.Tensor, max_new_tokens: int, generate_kwargs: dict, t0: float
                  ) -> tuple[torch.Tensor, RequestMetrics]:
        # ids: [T_ctx] the start token and every context part; pieces: their [T_i]; tail: [T_new] the new turn
        metrics = RequestMetrics()
        if self.manager is not None:
            self.manager.begin_turn(session, parts[-1].text)
        lm, spec = self.lm, self.lm.spec
        bounds = torch.tensor([0] + [p.numel() for p in pieces]).cumsum(0).tolist()
        param = next(lm.model.parameters())
        buf = torch.empty(spec.num_layers, 2, spec.num_kv_heads, ids.numel(), spec.head_dim, dtype=param.dtype,
                          device=param.device)  # [L, 2, H, T_ctx, D]

        def context(end: int) -> KVSegment | None:  # the KV written so far, as a segment (a view of buf)
            return KVSegment(kv=buf[:, :, :, :end], token_ids=ids[:end], positions=torch.arange(end),
                             model=spec.identity, rotated=True) if end else None

        still = torch.zeros(ids.numel(), dtype=torch.bool)  # [T_ctx] positions whose KV is projected (not recomputed)
        made = Provenance()  # how the parts whose KV the target did not compute from the tokens before them were made

        def reading(end: int):  # forwards over context(end) read its projected KV with the prior
            prior = self._prior()
            if prior is None or not bool(still[:end].any()):
                return contextlib.nullcontext()
            return prior.reading(lm, ids[:end], still[:end])

        pending: list[int] = [0]  # part indices (0 = the start token) waiting to be prefilled together

        def flush() -> None:
            if not pending:
                return
            start, end = bounds[pending[0]], bounds[pending[-1] + 1]
            with reading(start):
                seg = prefill_after(lm, context(start), ids[start:end])
            buf[:, :, :, start:end] = seg.kv.to(buf)
            metrics.tokens_prefilled += end - start
            for index in pending:
                if index == 0 or self.manager is None:
                    continue
                a, b = bounds[index], bounds[index + 1]
                part_kv = KVSegment(kv=buf[:, :, :, a:b], token_ids=ids[a:b], positions=torch.arange(a, b),
                                    model=spec.identity, rotated=True)
                self.manager.offer(session, part_kv, ids[:a], role=parts[index - 1].role, provenance=made.text(a))
            pending.clear()

        for index, part in enumerate(parts[:-1], start=1):
            a, b = bounds[index], bounds[index + 1]
            if b == a:
                metrics.parts.append("empty")
                continue
            if part.projected:
                flush()
                seg = self.context_source.projected_segment(part.text, a)
                check_projected(seg, ids[a:b], a, index, lm)
                digest = getattr(self.context_source, "adapter_digest", "")
                self._check_prior(digest)
                served = self._served_projected(b - a)
                source_kv = seg.kv
                if self.recompute_fraction:  # blend the projected KV: r recomputed, chosen by attention
                    blended = blend(lm, context(a), seg.to(device=buf.device, dtype=buf.dtype),
                                    BlendConfig(fraction=self.recompute_fraction), prior=self._prior(),
                                    context_projected=still[:a], placed_projected=served)
                    seg, redone = blended.segment, blended.selected.numel()
                    still[a:b] = blended.still_projected & served
                else:
                    redone = 0
                    still[a:b] = served
                made.projected(a, b, source_kv, digest, self.recompute_fraction, still[a:b], self._prior())
                buf[:, :, :, a:b] = seg.kv.to(buf)
                metrics.tokens_projected += b - a - redone
                metrics.tokens_prefilled += redone
                metrics.parts.append("projected")
                continue
            found = (self.manager.find(session, ids[a:b], spec.identity, buf.dtype) if self.manager is not None
                     else None)
            if found is None:
                pending.append(index)
                metrics.parts.append("prefilled")
                continue
            flush()
            if int(found.segment.positions[0]) == a and found.prefix_hash == made.key(ids[:a]):
                buf[:, :, :, a:b] = found.segment.kv.to(buf)  # computed here after identical KV: exact
                metrics.tokens_reused_local += b - a
                metrics.tokens_reused_exact += b - a
                metrics.parts.append("exact")
                continue
            with reading(b):  # its recompute reads the context's projected KV as every other forward does
                fixed, redone = self._shifted(found.segment, context(a), metrics)
            buf[:, :, :, a:b] = fixed.kv.to(buf)
            made.shifted(a, b, found.key, found.prefix_hash, int(found.segment.positions[0]), self.recompute_k,
                         self.recompute_fraction, redone)
        flush()
        streamer = _FirstToken()
        generate_kwargs.setdefault("do_sample", False)
        with reading(ids.numel()):
            new = kvcache.generate(lm.model, spec, context(ids.numel()), tail, max_new_tokens=max_new_tokens,
                                   streamer=streamer, **generate_kwargs)
        metrics.tokens_prefilled += tail.numel()
        metrics.tokens_total = ids.numel() + tail.numel()
        metrics.ttft_s = (streamer.at or time.perf_counter()) - t0
        metrics.parts.append("prefilled")
        return new, metrics

    def _shifted(self, cached: KVSegment, context: KVSegment, metrics: RequestMetrics
                 ) -> tuple[KVSegment, torch.Tensor]:
        """A cached segment computed after other KV than `context`, placed at its end by RoPE shift, with its first
        recompute_k and its recompute_fraction most deviating tokens recomputed; and the recomputed indices ([R])."""
        assert cached.model == self.lm.spec.identity, (cached.model, self.lm.spec.identity)
        n, offset = cached.num_tokens, context.num_tokens
        placed = place(cached.to(device=context.device, dtype=context.dtype), self.lm.rope, offset)
        k = min(self.recompute_k, n)
        fixed = recompute_first(self.lm, context, placed, k)
        chosen = torch.zeros(0, dtype=torch.int64)
        if self.recompute_fraction:
            fixed, chosen = recompute_most_deviating(self.lm, context, fixed, self.recompute_fraction)
        redone = torch.tensor(sorted(set(range(k)) | set(chosen.tolist())), dtype=torch.int64)
        metrics.tokens_reused_local += n - redone.numel()
        metrics.tokens_prefilled += redone.numel()
        metrics.parts.append("shifted")
        return fixed, redone

    def _served_projected(self, tokens: int) -> torch.Tensor:
        """[tokens] bool: the context source's last segment's positions whose KV is the projection's (its
        `still_projected`: a served correction recomputed the others); every one where it does not tell."""
        served = getattr(self.context_source, "still_projected", None)
        if served is None:
            return torch.ones(tokens, dtype=torch.bool)
        served = torch.as_tensor(served).bool().cpu()
        if tuple(served.shape) != (tokens,):
            raise ValueError(f"the context source's still_projected has shape {tuple(served.shape)}; its segment holds "
                             f"{tokens} tokens")
        return served

    def _check_prior(self, digest: str) -> None:
        """Say once per adapter when the prior projected KV is read with was fitted for another adapter than the one
        that projected it (`digest`: Adapter.digest, "" where the context source does not tell)."""
        prior = self._prior() if digest and digest not in self._stale_told else None
        stale = prior.stale_for(digest) if prior is not None else None
        if stale:
            self._stale_told.add(digest)
            log.warning("%s", stale)

    def _prior(self) -> InductionPrior | None:
        if self.induction_prior is True:
            self.induction_prior = InductionPrior.for_model(self.lm)
        return self.induction_prior or None
