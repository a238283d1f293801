"""Every benchmark in one process, one after the other, and one table of the ratios they measured in this run, on
the machine named in the first line (STYLE rule 9).

    .venv/bin/python bench/bench_all.py [--quick] [--full] [--adapter FILE] [--json OUT.json] [--threads 1]
    kvbridge bench [same options]

1. ttft (bench_ttft.py): TTFT with the context's KV replaced by the server's projection vs the target's full
   prefill, at 256, 1024 and 2048 context tokens on the small pair (warm and cold fetch).
2. projection (bench_projection.py): projection throughput vs the target's prefill, on the same loaded pair.
3. store (bench_store.py): PagedStore.get vs a torch copy, lookup per block, tokens a pool holds, the Redis tier
   on one server and on a Redis Cluster.
4. grpc (bench_grpc.py): a warm projected fetch over gRPC vs a raw loopback socket, bytes on the wire.
5. suffix (bench_suffix.py): multi-turn suffix reuse, prefilled tokens and TTFT without/with the pipeline (its quick
   settings unless --full is given).
6. fidelity (bench_fidelity.py): what users read beside those speeds: each mode's greedy answer against the
   target's own (ROUGE-L, top-1 and greedy agreement, NLL recovery) on held-out pydoc pages, through the server.

Each piece prints its own lines as it goes; a piece that fails is reported in the table and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import grpc
import torch

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # bench/ is not a package: its modules import each other by name
    sys.path.insert(0, str(BENCH_DIR))

from machine import device_label, machine_line  # noqa: E402

PROJECTION_TOKENS = {"quick": 256, "full": 2048}  # target tokens of the projection piece (the TTFT's longest)
PROJECTION_ROUNDS = {"quick": 3, "full": 5}


def load_bench(name: str) -> ModuleType:
    """One of the bench modules (bench/NAME.py) by name."""
    if not (BENCH_DIR / f"{name}.py").is_file():
        raise FileNotFoundError(f"no benchmark {name}.py in {BENCH_DIR}")
    return importlib.import_module(name)


@dataclass(frozen=True)
class Row:
    """One line of the summary table."""

    measurement: str
    ratio: str  # as printed; "FAILED" when the piece did not finish
    goal: str  # "-" when the line is information
    detail: str  # what the ratio compares, in the measured units
    value: float | None = None  # the ratio as a number (JSON)


# ---------------------------------------------------------------------------------------------------- table rows


def ttft_rows(results: list[dict], goal: float, goal_tokens: int) -> list[Row]:
    rows = []
    for r in results:
        n = r["context_tokens"]
        target = f"<= {goal:.2f}" if n == goal_tokens else "-"
        rows.append(Row(f"TTFT replace/full @{n} (warm, same host)", f"{r['ratio_shm_over_full']:.3f}", target,
                        f"{r['shm_s']:.2f} s vs {r['full_s']:.2f} s (fetch through shared memory "
                        f"{r['shm_fetch_s']:.3f} s, question prefill {r['shm_prefill_s']:.2f} s)",
                        r["ratio_shm_over_full"]))
        rows.append(Row(f"TTFT replace/full @{n} (warm, stream)", f"{r['ratio_warm_over_full']:.3f}", "-",
                        f"{r['warm_s']:.2f} s vs {r['full_s']:.2f} s (fetch {r['warm_fetch_s']:.2f} s of "
                        f"{r['wire_bytes'] / 1e6:.0f} MB, question prefill {r['warm_prefill_s']:.2f} s)",
                        r["ratio_warm_over_full"]))
        rows.append(Row(f"TTFT served blend:0.1/full @{n} (warm, same host)", f"{r['ratio_served_over_full']:.3f}",
                        target, f"{r['served_s']:.2f} s vs {r['full_s']:.2f} s (the server's stored correction; by "
                        f"stream {r['served_stream_s']:.2f} s; computed once in the first fetch, "
                        f"{r['served_first_s']:.1f} s)", r["ratio_served_over_full"]))
        rows.append(Row(f"TTFT replace/full @{n} (cold)", f"{r['ratio_cold_over_full']:.3f}",
                        "<= 0.15" if n == goal_tokens else "-",
                        f"{r['cold_s']:.2f} s vs {r['full_s']:.2f} s (the server projects again)",
                        r["ratio_cold_over_full"]))
        rows.append(Row(f"TTFT blend:0.1/full @{n} (warm)", f"{r['ratio_blend_over_full']:.3f}", "-",
                        f"{r['blend_s']:.2f} s vs {r['full_s']:.2f} s (replace + first layer over the context + 10% "
                        "recomputed)", r["ratio_blend_over_full"]))
        rows.append(Row(f"TTFT blend:0.1 with/without induction prior @{n}",
                        f"{r['ratio_blend_prior_over_plain']:.3f}", "-",
                        f"{r['blend_s']:.2f} s vs {r['blend_plain_s']:.2f} s (the prior biases {r['prior_layers']} "
                        "layers: SDPA with a per-head mask there)", r["ratio_blend_prior_over_plain"]))
    return rows


def projection_rows(r: dict) -> list[Row]:
    return [Row(f"projection/prefill speed @{r['target_tokens']}", f"{r['ratio_projection_over_prefill']:.1f}x",
                f"- (FLOP ceiling {r['flop_ceiling']:.0f}x)",
                f"{r['projection_tokens_per_s']:,.0f} vs {r['prefill_tokens_per_s']:,.0f} target tokens/s",
                r["ratio_projection_over_prefill"])]


def store_rows(r: dict) -> list[Row]:
    rows = []
    for g in r["get"]:
        rows.append(Row(f"store get/copy {g['role']} @{g['tokens']}", f"{g['ratio_get_over_copy']:.2f}", ">= 0.8",
                        f"{g['gbs']['get']:.2f} vs {g['gbs']['copy']:.2f} GB/s ({g['model']}, "
                        f"{g['bytes'] / 1e6:.1f} MB)", g["ratio_get_over_copy"]))
    lookup = r["lookup"]
    us = lookup["us_per_block"]
    rows.append(Row("store lookup per block", f"{us['prefix']:.2f} us", "<= 2 us",
                    f"{lookup['blocks_per_query']}-block prefix, {lookup['blocks_indexed']:,} blocks indexed "
                    f"(diverging {us['diverge']:.2f} us, exact key {us['exact']:.2f} us)", us["prefix"]))
    rows.append(Row("store hash_chain/lookup", f"{lookup['ratio_hash_chain_over_lookup']:.2f}", "-",
                    f"{us['hash_chain']:.2f} vs {us['prefix']:.2f} us/block",
                    lookup["ratio_hash_chain_over_lookup"]))
    for c in r["capacity"]:
        rows.append(Row(f"store tokens/pool ({c['case']})", f"{c['ratio_tokens_over_pool']:.3f}", "-",
                        f"{c['tokens']:,} tokens in {c['entries']:,} entries held by a {c['pool_tokens']:,}-token "
                        "pool before its first eviction", c["ratio_tokens_over_pool"]))
    b = r["budget"]
    rows.append(Row("store bytes held/capacity (mixed layouts)", f"{b['ratio_bytes_over_capacity']:.3f}", ">= 0.95",
                    f"{b['documents']} documents as source + projection ({b['bytes_per_token']['source']:,} and "
                    f"{b['bytes_per_token']['target']:,} B/token) in one {b['capacity_bytes'] >> 20} MiB store before "
                    f"its first eviction (a fixed quarter per layout: {b['fixed_quarter_ratio']:.3f})",
                    b["ratio_bytes_over_capacity"]))
    if not r["redis"]:
        rows.append(Row("redis tier/raw", "skipped", "near 1", "no redis-server (or valkey-server) on PATH"))
    for x in r["redis"]:
        rows.append(Row(f"redis tier/raw {x['op']}", f"{x['ratio_tier_over_raw']:.2f}", "near 1",
                        f"{x['tier_mbs']:,.0f} vs {x['raw_mbs']:,.0f} MB/s, {x['blocks']} blocks",
                        x["ratio_tier_over_raw"]))
    if r["redis"] and not r["redis_cluster"]:
        rows.append(Row("redis cluster tier/raw", "skipped", ">= 0.8", "no redis-cli (or valkey-cli) on PATH"))
    for x in r["redis_cluster"]:
        sends = (f"; its sends alone, tags taken beforehand, {x['sends_only_mbs']:,.0f} MB/s; without WAIT "
                 f"{x['without WAIT_mbs']:,.0f} MB/s" if x["op"] == "put" else "")
        rows.append(Row(f"redis cluster tier/raw {x['op']}", f"{x['ratio_tier_over_raw']:.2f}", ">= 0.8",
                        f"{x['tier_mbs']:,.0f} vs {x['raw_mbs']:,.0f} MB/s, {x['blocks']} blocks, 3 primaries + 3 "
                        f"replicas{', writes confirmed by 1 replica' if x['op'] == 'put' else ''}{sends}",
                        x["ratio_tier_over_raw"]))
    return rows


def grpc_rows(r: dict) -> list[Row]:
    return [Row("gRPC stream grpc/raw", f"{r['ratio_grpc_over_raw']:.2f}", ">= 0.5",
                f"{r['grpc_mbs']:,.0f} vs {r['raw_mbs']:,.0f} MB/s ({r['stream_bytes'] / 1e6:.1f} MB, "
                f"{r['target_tokens']} tokens, {r['preset']} pair, {r['layout']})", r["ratio_grpc_over_raw"]),
            Row("gRPC wire projected/source", f"{r['ratio_projected_over_source_wire']:.2f}", "-",
                f"{r['projected_wire_bytes']:,} vs {r['source_wire_bytes']:,} B",
                r["ratio_projected_over_source_wire"])]


def suffix_rows(r: dict) -> list[Row]:
    how = f"{r['turns']} turns, {r['preset']} pair"
    return [Row("suffix prefilled tokens without/with", f"{r['ratio_prefill_without_over_with']:.1f}x", "-",
                f"{r['prefilled_without']:,} vs {r['prefilled_with']:,} tokens, {how}",
                r["ratio_prefill_without_over_with"]),
            Row("suffix TTFT median without/with", f"{r['ratio_ttft_median_without_over_with']:.2f}x", "-",
                f"{r['ttft_median_without_s']:.2f} s vs {r['ttft_median_with_s']:.2f} s, {how}",
                r["ratio_ttft_median_without_over_with"]),
            Row("suffix TTFT sum without/with", f"{r['ratio_ttft_sum_without_over_with']:.2f}x", "-",
                f"{r['ttft_sum_without_s']:.1f} s vs {r['ttft_sum_with_s']:.1f} s, {how}",
                r["ratio_ttft_sum_without_over_with"])]


def fidelity_rows(r: dict) -> list[Row]:
    from bench_fidelity import GOALS

    rows = []
    for name, m in r["modes"].items():
        if m["fidelity"] is None:
            continue
        goal = GOALS.get(name, (None, None))[0]
        extra = "".join(f", {label} {m[key][field]:.3f}" for label, key, field in (
            ("top-1", "top1", "mean"), ("greedy agreement", "greedy", "mean"), ("NLL recovery", "recovery", "value"))
            if m[key] is not None)
        f = m["fidelity"]
        rows.append(Row(f"fidelity {name} (ROUGE-L vs full)", f"{f['mean']:.3f}", "-" if goal is None else f">= {goal}",
                        f"[{f['low']:.3f}, {f['high']:.3f}], {r['documents']} held-out pydoc pages{extra}", f["mean"]))
    return rows


def markdown_table(rows: list[Row]) -> str:
    lines = ["| measurement | ratio | goal | detail |", "|---|---|---|---|"]
    for r in rows:
        cells = (r.measurement, r.ratio, r.goal, r.detail)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # an error may hold a |
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="every piece's smoke settings (TTFT at 256 and 512 tokens): about 2 minutes on a "
                             "2-core VM")
    parser.add_argument("--full", action="store_true",
                        help="also run bench_suffix.py in full (small pair, 20 turns: about 4 more minutes) "
                             "instead of its quick settings")
    parser.add_argument("--adapter", help="a trained adapter file of the small pair (default: its shipped adapter, "
                                          "else a ridge fit once, about 25 s; passed on to the pieces)")
    parser.add_argument("--json", metavar="OUT.json", help="also write every number and the machine line here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of every piece (default 1: see bench/store.md)")
    args = parser.parse_args(argv)
    if args.quick and args.full:
        parser.error("--quick and --full contradict each other: --full runs the slow suffix benchmark in full")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.adapter and not Path(args.adapter).is_file():
        parser.error(f"--adapter {args.adapter}: no such file")
    if args.json:  # written at the end: a path that cannot be written would lose the whole run's numbers
        out = Path(args.json)
        if out.is_dir():
            parser.error(f"--json {args.json}: is a folder; name the file to write")
        if not out.resolve().parent.is_dir():
            parser.error(f"--json {args.json}: no folder {out.resolve().parent} to write it in")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "full"
    started = time.perf_counter()
    from kvbridge.transfer.devices import resolve_device

    machine = machine_line(mode, f"grpcio {grpc.__version__}", f"models on {device_label(torch.device('cpu'))}",
                           f"store on {device_label(resolve_device('auto'))}")
    print(machine, flush=True)
    pieces: dict[str, object] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def attempt(name: str, title: str, fn: Callable[[], object]) -> object | None:
        """Run one piece; a failure is printed and recorded, and the next piece runs."""
        print(f"\n### {name}: {title}", flush=True)
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every piece's failure goes into the table
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"{name}: FAILED ({errors[name]})", flush=True)
            return None
        finally:
            seconds[name] = time.perf_counter() - t0

    ttft = load_bench("bench_ttft")
    threads = ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-all-") as folder:
        adapter_path = args.adapter

        def setup():
            from kvbridge.transfer.presets import load_pair

            source, target = load_pair(ttft.PRESET, device="cpu")
            adapter, note = ttft.get_adapter(args.adapter, source, target)
            print(f"setup   {source.name} -> {target.name}; {note}", flush=True)
            return source, target, adapter, note

        loaded = attempt("setup", "the small pair and its adapter (shared by ttft, projection, and the full "
                                  "grpc and suffix runs)", setup)
        if loaded is None:
            errors["ttft"] = errors["projection"] = errors["fidelity"] = f"the setup failed: {errors['setup']}"
        else:
            source, target, adapter, note = loaded
            pieces["setup"] = {"pair": f"{source.name} -> {target.name}", "adapter": note}
            if adapter_path is None:
                from kvbridge.adapters.io import save_adapter

                adapter_path = str(Path(folder) / "bench-adapter.safetensors")
                save_adapter(adapter, adapter_path)
            tokens = list(ttft.QUICK_TOKENS if args.quick else ttft.FULL_TOKENS)
            rounds = ttft.QUICK_ROUNDS if args.quick else ttft.FULL_ROUNDS
            results = attempt("ttft", f"TTFT replace vs full prefill at {', '.join(map(str, tokens))} context tokens, "
                                      f"{rounds} rounds (bench_ttft.py)",
                              lambda: ttft.run_ttft(source, target, adapter, tokens, rounds))
            if results is not None:
                pieces["ttft"] = [r.as_dict() for r in results]
            pieces["projection"] = attempt(
                "projection", f"projection vs target prefill at {PROJECTION_TOKENS[mode]} target tokens "
                              "(bench_projection.py)",
                lambda: load_bench("bench_projection").measure(source, target, adapter, PROJECTION_TOKENS[mode],
                                                               PROJECTION_ROUNDS[mode], "float32"))
            fidelity = load_bench("bench_fidelity")
            docs = fidelity.QUICK_DOCS if args.quick else fidelity.FULL_DOCS
            pieces["fidelity"] = attempt(
                "fidelity", f"each mode's answer against the target's own on {docs} held-out pydoc pages "
                            "(bench_fidelity.py)",
                lambda: fidelity.measure(source, target, adapter, docs))
            if pieces["fidelity"] is not None:
                print("\n".join(fidelity.lines(pieces["fidelity"])), flush=True)
            del source, target, adapter, loaded
            gc.collect()

        store_args = [*threads, *(["--quick"] if args.quick else [])]
        pieces["store"] = attempt("store", f"bench_store.py {' '.join(store_args)}",
                                  lambda: load_bench("bench_store").run(store_args))
        gc.collect()
        # the small pair's adapter, where the small pair runs (quick runs use the tiny random pair); without one
        # (the setup failed), the piece fits its own
        small_adapter = ["--adapter", adapter_path] if adapter_path else []
        grpc_args = [*threads, *(["--quick"] if args.quick else small_adapter)]
        pieces["grpc"] = attempt("grpc", f"bench_grpc.py {' '.join(grpc_args)}",
                                 lambda: load_bench("bench_grpc").run(grpc_args))
        gc.collect()
        suffix_args = [*threads, *(small_adapter if args.full else ["--quick"])]
        pieces["suffix"] = attempt("suffix", f"bench_suffix.py {' '.join(suffix_args)}",
                                   lambda: load_bench("bench_suffix").run(suffix_args))

    rows: list[Row] = []
    makers: dict[str, Callable[[object], list[Row]]] = {
        "ttft": lambda r: ttft_rows(r, ttft.GOAL, ttft.GOAL_TOKENS), "projection": projection_rows,
        "fidelity": fidelity_rows, "store": store_rows, "grpc": grpc_rows, "suffix": suffix_rows}
    for name, make in makers.items():
        if name in errors:
            rows.append(Row(name, "FAILED", "-", errors[name]))
        elif pieces.get(name) is not None:
            rows.extend(make(pieces[name]))
    wall_s = time.perf_counter() - started
    if args.json:
        out = {"machine": machine, "mode": mode, "threads": args.threads, "wall_s": wall_s, "seconds": seconds,
               "errors": errors, "rows": [asdict(r) for r in rows], "pieces": pieces}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"\njson written to {args.json}", flush=True)
    took = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    print(f"\n### summary: {mode} run, done in {wall_s:.0f} s ({took}); ratios measured in this run on the machine "
          f"above\n", flush=True)
    print(markdown_table(rows), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
