"""Held-out recovery of a trainable map, fast: the source features and the full and none NLLs of the documents are
computed once, then every evaluation builds the map's context cache (map_kv.py) and scores the continuations. The
NLLs and the recovery with its bootstrap interval are scoring.py's, as evaluate.py reports them for an adapter."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvbridge.adapters.adapter import has_text_source
from kvbridge.adapters.evaluate import EvalDocument
from kvbridge.adapters.map_kv import context_kv
from kvbridge.adapters.scoring import bootstrap_draws, continuation_nll, interval95, recovery_ratio
from kvbridge.adapters.teacher import TeacherCache, source_features
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment


@dataclass
class ProbeItem:
    xk: torch.Tensor  # [L_s, 1 + C, d_s] source features of start + context
    xv: torch.Tensor
    start_mask: torch.Tensor  # [1 + C]
    context_ids: torch.Tensor  # [1 + C] start + context target ids
    continuation: torch.Tensor  # [N]
    k: torch.Tensor | None = None  # [L_t, H_t, 1 + C, D_t] the target's own K (rotated) / V of start + context:
    v: torch.Tensor | None = None  # what a fuser adds to


class RecoveryProbe:
    """Held-out recovery of a map, fast: source features and the full / none NLLs are computed once."""

    def __init__(self, target: LoadedModel, start_kv: torch.Tensor, items: list[ProbeItem]):
        if len(items) < 2:
            raise ValueError(f"a recovery probe needs at least 2 documents, got {len(items)}")
        self.target, self.start_kv, self.items = target, start_kv, items
        self.full, self.none = [], []
        with torch.no_grad():  # start + context + continuation, and start + continuation, as plain tokens
            for it in items:
                self.full.append(float(continuation_nll(target, None, torch.cat((it.context_ids, it.continuation)),
                                                        it.context_ids.numel())))
                self.none.append(float(continuation_nll(target, None, torch.cat((it.context_ids[:1], it.continuation)),
                                                        1)))
        self.tokens = sum(it.continuation.numel() - 1 for it in items)

    @classmethod
    def from_documents(cls, source: LoadedModel, target: LoadedModel, start_kv, docs: list[EvalDocument],
                       start_token: int, own: bool = False) -> "RecoveryProbe":
        """own: also keep the target's own K/V of every context (for a fuser)."""
        items = []
        for d in docs:
            xk, xv = source_features(source, d.source.ids, d.alignment.source_index)
            ids = torch.cat((torch.tensor([start_token]), d.target_context))
            mask = (~has_text_source(d.alignment.kind)) & (ids == start_token)
            k = v = None
            if own:
                seg = kvcache.extract(target.model, target.spec, ids)
                k, v = seg.keys.float().cpu(), seg.values.float().cpu()
            items.append(ProbeItem(xk, xv, mask, ids, d.continuation, k, v))
        return cls(target, start_kv, items)

    @classmethod
    def from_cache(cls, target: LoadedModel, start_kv, cache: TeacherCache, indices: list[int],
                   context_tokens: int) -> "RecoveryProbe":
        c, items = context_tokens, []
        cache.require_kv(indices, "the recovery probe of the dev windows")
        for i in indices:
            w = cache.load(i)
            items.append(ProbeItem(w["xk"][:, :1 + c].float(), w["xv"][:, :1 + c].float(), w["start_mask"][:1 + c],
                                   w["ids"][:1 + c], w["ids"][1 + c:], w["k"][:, :, :1 + c].float(),
                                   w["v"][:, :, :1 + c].float()))
        return cls(target, start_kv, items)

    @torch.no_grad()
    def per_document(self, maps, shift: int = 0, exact: int = 0) -> list[float]:
        """Summed continuation NLL per document. shift > 0: the wrong-document control, document i's context
        cache built from document (i + shift)'s source features (a fuser keeps document i's own K/V). exact > 0:
        the context's last `exact` tokens are prefilled by the target with the continuation (`recompute:r`)."""
        out = []
        n = len(self.items)
        for i, it in enumerate(self.items):
            src = self.items[(i + shift) % n]
            if src.xk.shape != it.xk.shape:
                raise ValueError("the wrong-document control needs contexts of one length")
            p = it.context_ids.numel() - exact
            if not 1 < p <= it.context_ids.numel():
                raise ValueError(f"exact must leave start + one context token projected, got {exact}")
            own = (it.k[:, :, :p], it.v[:, :, :p]) if it.k is not None else (None, None)
            k, v = context_kv(maps, self.start_kv, src.xk[:, :p], src.xv[:, :p], it.start_mask[:p], self.target,
                              src.context_ids[:p], *own)
            seg = KVSegment(kv=torch.stack((k, v), dim=1), token_ids=it.context_ids[:p], positions=torch.arange(p),
                            model=self.target.spec.identity, rotated=True)
            rest = torch.cat((it.context_ids[p:], it.continuation))  # the exact tail, then the continuation
            out.append(float(continuation_nll(self.target, seg, rest, exact)))
        return out

    def recovery(self, maps, seed: int = 0, wrong: bool = False, exact: int = 0) -> dict:
        """Recovery with a bootstrap 95% interval over documents; wrong: also the wrong-document control and the
        paired difference (own document minus wrong document) with its interval. exact: the context's last
        `exact` tokens prefilled by the target (see per_document)."""
        got = self.per_document(maps, exact=exact)
        none, full, x = (np.asarray(c, dtype=np.float64) for c in (self.none, self.full, got))
        every, draws = np.arange(len(got))[None], bootstrap_draws(len(got), seed=seed)
        value, boot = float(recovery_ratio(none, full, x, every)[0]), recovery_ratio(none, full, x, draws)
        out = {"recovery": value, "interval": interval95(boot), "documents": len(got),
               "nll": {name: sum(column) / self.tokens
                       for name, column in (("none", self.none), ("full", self.full), ("projected", got))}}
        if wrong:  # the same draws: a paired difference
            w = np.asarray(self.per_document(maps, shift=1, exact=exact), dtype=np.float64)
            value_w, boot_w = float(recovery_ratio(none, full, w, every)[0]), recovery_ratio(none, full, w, draws)
            out |= {"wrong": value_w, "wrong_interval": interval95(boot_w), "own_minus_wrong": value - value_w,
                    "own_minus_wrong_interval": interval95(boot - boot_w)}
        return out
