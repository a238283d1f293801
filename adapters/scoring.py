"""The target's reading of a held-out continuation, and NLL recovery: the one place each is computed.

A continuation is scored after a context the target reads as a cache (its own KV, projected KV, a blend of them) or
as plain tokens: its first token is the input after the context, so the NLL is summed over the others.
recovery = (NLL_none - NLL_x) / (NLL_none - NLL_full), each NLL summed over the documents (pooled tokens, not a mean
of per-document ratios), with a bootstrap 95% interval over documents (`bootstrap_draws`, `interval95`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment

BOOTSTRAP_SAMPLES = 1000


def continuation_logits(target: LoadedModel, context: KVSegment | Sequence[KVSegment] | None,
                        rest: torch.Tensor) -> torch.Tensor:
    """rest [R] (or [B, R]: one context segment per row) prefilled by the target over a cache of `context` (rotated KV
    at positions 0..C-1; None: no cache, rest starts at position 0) -> logits [B, R, V] of the positions C..C+R-1.
    Differentiable (through projected or gated KV, never the model's weights unless they train): scoring callers
    run it under torch.no_grad."""
    rows = rest.reshape(-1, rest.shape[-1])  # [B, R]
    device = target.device
    past, kwargs = 0, {}
    if context is not None:
        segments = [context] if isinstance(context, KVSegment) else list(context)
        past = segments[0].num_tokens
        kwargs = {"cache": kvcache.to_cache(segments, target.model, target.spec), "use_cache": True}
    pos = torch.arange(past, past + rows.shape[1], device=device)[None].expand(rows.shape[0], -1)
    return target.model(input_ids=rows.to(device), position_ids=pos, **kwargs).logits


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, V] predicting targets [N] -> the summed NLL (nats), a float32 0-d tensor on the logits' device."""
    return F.cross_entropy(logits.float(), targets.to(logits.device), reduction="sum")


def continuation_nll(target: LoadedModel, context: KVSegment | None, rest: torch.Tensor,
                     scored_from: int = 0) -> torch.Tensor:
    """Summed NLL of rest[scored_from + 1:] when the target reads rest ([R]) after `context` (see
    `continuation_logits`): rest[:scored_from + 1] is input only (the continuation's first token; with scored_from > 0
    also what comes before it: a prefix read without a cache, or a recomputed tail of the context)."""
    logits = continuation_logits(target, context, rest)[0, scored_from:-1]  # [R - scored_from - 1, V]
    return summed_nll(logits, rest[scored_from + 1:])


def recovery_ratio(none: np.ndarray, full: np.ndarray, mode: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(NLL_none - NLL_mode) / (NLL_none - NLL_full) over the summed NLLs of each row of document indices idx
    ([R, N] -> [R]; NaN where the gap is 0). none, full, mode: [D] summed NLL per document."""
    gap = none[idx].sum(-1) - full[idx].sum(-1)
    return (none[idx].sum(-1) - mode[idx].sum(-1)) / np.where(gap == 0, np.nan, gap)


def bootstrap_draws(documents: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
    """[samples, documents] document indices drawn with replacement, a function of the seed."""
    return np.random.default_rng(seed).integers(0, documents, size=(samples, documents))


def interval95(values: np.ndarray) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of bootstrap values [R] (NaNs left out)."""
    return float(np.nanpercentile(values, 2.5)), float(np.nanpercentile(values, 97.5))


def bootstrap_recovery(none: list[float], full: list[float], mode: list[float], samples: int = BOOTSTRAP_SAMPLES,
                       seed: int = 0) -> tuple[float, float, float]:
    """(recovery, low, high) of `mode` from summed NLLs per document, with a document bootstrap."""
    n, f, m = (np.asarray(v, dtype=np.float64) for v in (none, full, mode))
    value = float(recovery_ratio(n, f, m, np.arange(len(n))[None])[0])
    return (value, *interval95(recovery_ratio(n, f, m, bootstrap_draws(len(n), samples, seed))))


def bootstrap_mean(values: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the 2.5 and 97.5 percentiles of the mean over resampled documents."""
    x = np.asarray(values, dtype=np.float64)
    means = x[bootstrap_draws(len(x), samples, seed)].mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))
