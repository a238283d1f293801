"""Prefix-hit benchmark (issue 16, part 1): the time of an Ingest of 2,048 + 256 tokens whose first 2,048 are
cached, against a fresh Ingest of the same 2,304 tokens, measured in one run as a ratio (goal <= 0.15), through
KVBridgeService (the library side of the Ingest RPC: lookup, source model, store). The two sides alternate over
several rounds, each round on its own tenants (no round reads another's cache); medians are reported.

    .venv/bin/python bench/bench_prefix.py [--quick] [--rounds N]

--quick: the tiny random pair (seconds); default: the small preset (Gemma-3-270M as the source). One torch thread
unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.service import KVBridgeService, ServiceLimits
from kvbridge.transfer.data import data_path
from kvbridge.transfer.store import PagedStore, StoreConfig
from machine import machine_line

PREFIX_TOKENS, NEW_TOKENS = 2048, 256


def _service(preset: str) -> KVBridgeService:
    from kvbridge.transfer.presets import load_pair

    source, target = load_pair(preset, device="cpu")
    store = PagedStore(StoreConfig(capacity_bytes=1 << 30, device="cpu"))
    return KVBridgeService(source, [target], store, AdapterRegistry(None, source.spec, [target.spec]),
                           ServiceLimits())


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny pair: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (fresh, prefix-extending) ingests")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine two threads stall)")
    args = parser.parse_args(argv)
    preset = "tiny" if args.quick else "small"
    rounds = args.rounds if args.rounds is not None else 3 if args.quick else 5
    for name, value in (("--rounds", rounds), ("--threads", args.threads)):
        if value < 1:  # --rounds 0 is refused, not taken for the default
            parser.error(f"{name} must be >= 1, got {value}")
    torch.set_num_threads(args.threads)
    service = _service(preset)
    lm = service.models[service.source_name].lm
    print(machine_line("quick" if args.quick else "full", f"source {lm.name} on {lm.device}"), flush=True)
    text = data_path("pydoc_corpus_sample.txt").read_text()
    ids = torch.as_tensor(lm.tokenizer(text)["input_ids"])
    total = PREFIX_TOKENS + NEW_TOKENS
    if ids.numel() < total + rounds:
        raise SystemExit(f"the sample corpus has {ids.numel()} tokens, fewer than {total + rounds}")
    service.ingest("warmup", token_ids=ids[:256].tolist())  # first-call costs of torch
    fresh_s, extend_s = [], []
    def fresh(r: int, tokens: list[int]) -> None:
        t0 = time.perf_counter()
        service.ingest(f"fresh-{r}", token_ids=tokens)
        fresh_s.append(time.perf_counter() - t0)

    def extend(r: int, tokens: list[int]) -> None:
        service.ingest(f"extend-{r}", token_ids=tokens[:PREFIX_TOKENS])  # the cached prefix (not timed)
        t0 = time.perf_counter()
        service.ingest(f"extend-{r}", token_ids=tokens)
        extend_s.append(time.perf_counter() - t0)

    for r in range(rounds):  # each round its own tokens, and its own tenants; the two sides alternate
        for side in ((fresh, extend) if r % 2 == 0 else (extend, fresh)):
            side(r, ids[r:r + total].tolist())
    fresh, extend = statistics.median(fresh_s), statistics.median(extend_s)
    reused = service.token_counts[("ingest", "reused")]
    print(f"prefix  Ingest of {PREFIX_TOKENS} cached + {NEW_TOKENS} new tokens vs a fresh {total}-token Ingest "
          f"({lm.name}, median of {rounds}): {1e3 * extend:.0f} ms vs {1e3 * fresh:.0f} ms = "
          f"{extend / fresh:.3f} (goal <= 0.15); {reused} source tokens reused in all", flush=True)
    return {"ratio": extend / fresh, "extend_s": extend, "fresh_s": fresh}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
