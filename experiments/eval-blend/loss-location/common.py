"""What the loss-location scripts share: the pages build.py cached, a cache segment of the target, the tail
recompute, and the report (recovery = ratio of sums over pages, paired bootstrap intervals against a reference)."""

import random
from collections.abc import Iterator
from pathlib import Path

import torch
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.reuse import prefill_after


def pages(folder: Path, start: int, end: int) -> Iterator[tuple[str, dict]]:
    """(index, cached page) for pages start..end-1 of build.py's folder (ids, cont, kv, nll_full, nll_none, ...)."""
    for f in sorted(Path(folder).glob("*.pt")):
        if start <= int(f.stem) < end:
            yield f.stem, torch.load(f, weights_only=True)


def seg_of(target, kv: torch.Tensor, ids: torch.Tensor) -> KVSegment:
    # kv: [L, 2, H, T, D] rotated, ids: [T] from position 0
    return KVSegment(kv=kv, token_ids=ids, positions=torch.arange(ids.numel()), model=target.spec.identity,
                     rotated=True)


def recompute_tail(target, kv: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """kv with its last k tokens recomputed by the target over the rest (recompute:r's cache)."""
    t = ids.numel()
    tail = prefill_after(target, seg_of(target, kv, ids).slice(0, t - k), ids[t - k:]).kv.float()
    return torch.cat((kv[:, :, :, :t - k], tail), 3)


def recovery(rows: list[dict], name: str) -> float:
    none = sum(r["none"] for r in rows)
    full = sum(r["full"] for r in rows)
    return (none - sum(r[name] for r in rows)) / (none - full)


def report(rows: list[dict], names: list[str], ref=lambda name: "rec") -> None:
    """One line per name: recovery, and its difference from ref(name) with a 95% bootstrap interval over pages."""
    rng = random.Random(0)
    samples = [[rng.choice(rows) for _ in rows] for _ in range(300)]
    for name in names:
        r = ref(name)
        boot = sorted(recovery(s, name) - recovery(s, r) for s in samples)
        print(f"{name:40s} recovery {recovery(rows, name):.3f}  vs {r} {recovery(rows, name) - recovery(rows, r):+.3f} "
              f"[{boot[7]:+.3f}, {boot[292]:+.3f}]")
