"""The weighted average of adapters fine-tuned from one another (`kvbridge adapter average`): a "model soup"
(Wortsman et al., 2022) of, say, an adapter and its answer-tuned descendant, which keeps most of what the fine-tune
added to the likelihood and less of what it moved elsewhere (docs/answers.md).

Averaging is meaningful only between adapters of one pair and one shape whose fixed parts are the same: the integer
tensors (the layer map, the context branch's lags) and what an adapter fits to the data and keeps fixed while its
maps train (the token table `tok_table` and the source basis `src_basis`, the bases the maps read; the context
branch's input mean `ctx_mu`: a fine-tune from `--init` keeps all three) must be equal, or the average is refused
by the tensor's name: maps that read other bases are in other coordinates, and their average is none of them.
Every floating tensor is averaged in float32 and saved in the first file's dtype. The result records its inputs
(file name, digest, weight, each one's own training record) in `training.average`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
from kvbridge.adapters.io import OPTIONAL, TENSORS, load_adapter, save_adapter
from kvbridge.adapters.weights import Adapter

# tensors an average must find equal in every input: not weights (indices, lags), the bases the maps read (fitted to
# the data and kept fixed by training), or statistics of the data folded into the maps (a different one makes the
# maps incomparable)
FIXED = ("layer_map", "ctx_lags", "ctx_mu", "tok_table", "src_basis")


def _weights(n: int, weights: list[float] | None) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"adapter average: {len(weights)} weights for {n} adapters")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"adapter average: weights must be finite, >= 0 and not all 0, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def _check_alike(first: Adapter, other: Adapter, name: str) -> None:
    for side in ("source", "target"):
        a, b = getattr(first.meta, side), getattr(other.meta, side)
        if (a["name"], a["config_hash"]) != (b["name"], b["config_hash"]):
            raise ValueError(f"adapter average: {name} maps {side} {b['name']} ({b['config_hash'][:12]}), the first "
                             f"adapter {a['name']} ({a['config_hash'][:12]}): only adapters of one pair average")
    if first.meta.start_token != other.meta.start_token:
        raise ValueError(f"adapter average: {name} has start token {other.meta.start_token}, the first "
                         f"{first.meta.start_token}")
    for tensor in TENSORS + OPTIONAL:
        a, b = getattr(first, tensor), getattr(other, tensor)
        if (a is None) != (b is None):
            raise ValueError(f"adapter average: {name} {'has' if b is not None else 'lacks'} {tensor}, the first "
                             f"adapter {'has' if a is not None else 'lacks'} it: different formats do not average")
        if a is None:
            continue
        if a.shape != b.shape:
            raise ValueError(f"adapter average: {name}'s {tensor} has shape {tuple(b.shape)}, the first adapter's "
                             f"{tuple(a.shape)}")
        if tensor in FIXED and not torch.equal(a, b):
            raise ValueError(f"adapter average: {name}'s {tensor} differs from the first adapter's: only adapters "
                             "fine-tuned from one another (`train-adapter --init`) average, whose "
                             f"{', '.join(FIXED)} are the same")
    if first.ctx_lags is not None and first.context_norm != other.context_norm:
        raise ValueError(f"adapter average: {name}'s context branch {'has' if other.context_norm else 'lacks'} the "
                         "norm the first adapter's does not: different formats do not average")


def average(adapters: list[Adapter], weights: list[float] | None = None, names: list[str] | None = None
            ) -> Adapter:
    """The weighted average of `adapters` (weights normalised to sum 1; equal by default); the first one's
    metadata, with `training.average` recording the inputs."""
    if len(adapters) < 2:
        raise ValueError("adapter average: give two adapters or more")
    names = names or [f"adapter {i + 1}" for i in range(len(adapters))]
    w = _weights(len(adapters), weights)
    first = adapters[0]
    for adapter, name in zip(adapters[1:], names[1:]):
        _check_alike(first, adapter, name)
    tensors = {}
    for tensor in TENSORS + OPTIONAL:
        parts = [getattr(a, tensor) for a in adapters]
        if parts[0] is None:
            tensors[tensor] = None
        elif tensor in FIXED or not parts[0].is_floating_point():
            tensors[tensor] = parts[0].clone()
        else:
            mean = sum(wi * p.float() for wi, p in zip(w, parts))
            tensors[tensor] = mean.to(parts[0].dtype)
    inputs = [{"file": name, "digest": a.digest, "weight": wi, "training": a.meta.training}
              for a, name, wi in zip(adapters, names, w)]
    meta = dataclasses.replace(first.meta, training={"average": inputs}, metrics={})
    return Adapter(meta=meta, **tensors)


def runs(training: dict) -> list[dict]:
    """The distinct training runs behind an adapter's `training` record, each once: the run itself, the runs of the
    adapter it started from (`init`), and an average's inputs' (`average`), which often share them (an answer-tuned
    adapter's `init` is the adapter it is averaged with)."""
    out: list[dict] = []
    seen: set[str] = set()

    def walk(record: dict) -> None:
        while record:
            if "average" in record:
                for item in record["average"]:
                    walk(item.get("training") or {})
                return
            key = json.dumps(record, sort_keys=True)
            if key in seen:
                return
            seen.add(key)
            out.append(record)
            record = (record.get("init") or {}).get("training") or {}

    walk(training)
    return out


def from_scratch_seconds(training: dict) -> int:
    """What an adapter took to make from nothing, by its record: every distinct run's wall time, with the teacher
    caches it reused from an earlier run (their own time, `teacher_cache_reused_s`)."""
    return sum(int(r["record"]["wall_s"]) + int(r["record"].get("teacher_cache_reused_s", 0)) for r in runs(training))


def cmd_average(args) -> int:
    paths = [Path(p) for p in args.adapters]
    adapters = [load_adapter(p) for p in paths]
    try:
        weights = [float(x) for x in args.weights.split(",")] if args.weights else None
    except ValueError:
        raise ValueError(f"--weights takes comma-separated numbers, one per adapter, got {args.weights!r}") from None
    result = average(adapters, weights, [p.name for p in paths])
    if args.version:
        result.meta.version = args.version
    command = " ".join(["kvbridge adapter average", *map(str, paths), *(["--weights", args.weights]
                        if args.weights else []), *(["--version", args.version] if args.version else []),
                        "--out", str(args.out)])
    result.meta.training["command"] = command
    out = save_adapter(result, args.out)
    parts = ", ".join(f"{i['file']} x {i['weight']:.3g}" for i in result.meta.training["average"])
    made = from_scratch_seconds(result.meta.training) / 60
    print(f"wrote {out}: the average of {parts}; digest {load_adapter(out).digest[:16]}; its runs took "
          f"{made:.0f} minutes in all, by their records", file=sys.stdout)
    return 0


def add_parsers(sub) -> None:
    """`kvbridge adapter average A B [...] --out FILE [--weights 0.5,0.5]`."""
    group = sub.add_parser("adapter", help="work with adapter files")
    asub = group.add_subparsers(dest="adapter_command", required=True)
    p = asub.add_parser("average", help="the weighted average of adapters fine-tuned from one another (a soup)")
    p.add_argument("adapters", nargs="+", help="adapter files of one pair, one fine-tuned from the other")
    p.add_argument("--out", required=True, help="the averaged adapter file (.safetensors)")
    p.add_argument("--weights", default=None, help="comma-separated weights, one per adapter (default: equal)")
    p.add_argument("--version", default=None, help="the result's version (default: the first adapter's)")
    p.set_defaults(func=cmd_average)
