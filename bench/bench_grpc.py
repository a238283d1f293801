"""gRPC streaming benchmarks: a real kvbridge server, by default in its own process as deployed (`kvbridge serve` on
loopback port 0), a real KVBridgeClient in this process, and a baseline measured in the same run on the machine named
in the header (STYLE rule 9). The two sides of a ratio are interleaved over several rounds (the order alternates) and
each reported time is a median.

    .venv/bin/python bench/bench_grpc.py [--quick] [--preset small|tiny] [--tokens 2048] [--dtype float32|bfloat16]
                                         [--chunk-kb 1024] [--adapter FILE] [--rounds 9] [--threads 1] [--in-process]

1. stream: a warm GetProjectedCache of a ~2048-target-token entry (projected entry already in the server's store),
   timed on the client from the call to the assembled tensor, vs a raw loopback TCP socket moving the same bytes in
   the same chunk sizes (MB/s; goal grpc/raw >= 0.5, issue 16). Both sides have the same process layout: the sender (the
   kvbridge server, or the raw socket's sender) is a separate process and the receiver is this one; with
   --in-process both senders are threads of this process instead. The server keeps the messages of the first warm
   fetch (server/wire_cache.py), so the timed fetches send those again, as the raw sender sends its prepared
   payloads; with --stream-keep-mb 0 each timed fetch gathers from the store and encodes its chunks. The cold first
   fetch (projection included) as information.
2. shm: the same warm fetch on the same host through shared memory (transport="shared_memory": the server writes
   the KV to a 0600 file under /dev/shm, the client maps it and checks its size and checksum), timed from the call
   to the mapped tensor, vs a numpy copy of the same bytes (a fresh array: a `memcpy` into new memory; goal
   shm/memcpy >= 0.8) and vs the stream of 1.; a copy into an already-touched buffer as information. The server
   keeps the first fetch's file, so the timed fetches link it (a new name, nothing written); with --shm-keep-s 0
   each timed fetch gathers the KV from the store into a new file.
3. wire: bytes on the wire of the projected fetch vs the source fetch (GetSourceCache) of the same entry, measured;
   and the production pair's ratio computed from the models' KV bytes per token (not measured).

The server process and the raw-socket baseline (which moves the very chunks the server sent): grpc_loopback.py.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import torch
from bench_suffix import get_adapter  # the --adapter file, else the shipped one, else a ridge fit
from grpc_loopback import RawClient, RawSenderProcess, RawServer, ServerProcess, tail
from kvbridge.adapters.io import save_adapter
from kvbridge.server.app import build_service, start_server
from kvbridge.server.chunks import encode, plan_chunks
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.config import ServeConfig
from kvbridge.transfer.data import data_path
from kvbridge.transfer.presets import load_pair
from machine import device_label
from machine import machine_line as _machine_line

ADAPTER_NAME = "bench-adapter"  # the adapter's name in the server's adapter folder
# KV bytes per token in bf16 (layers x 2 x KV heads x head dim x 2), (source, target) of each pair
PRODUCTION_PAIR = (("Qwen2-7B", 57_344), ("Phi-3-mini-4k", 393_216))
SMALL_PAIR = (("Gemma-3-270M", 18_432), ("SmolLM2-135M", 23_040))


# ---------------------------------------------------------------------------------------------------- helpers


def machine_line(device: torch.device, mode: str) -> str:
    return _machine_line(mode, f"grpcio {grpc.__version__}", f"models on {device_label(device)}")


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn; the order alternates between rounds, so drift in the machine's load hits
    both sides of a ratio alike. The callers warm each fn up first."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def verdict(ok: bool) -> str:
    return "meets goal" if ok else "BELOW GOAL"


def cut_text(tokenizer, text: str, num_tokens: int) -> str:
    """The longest start of `text` that the tokenizer reads as at most num_tokens tokens (no special tokens)."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) < num_tokens:
        raise ValueError(f"the corpus has only {len(offsets)} tokens, fewer than --tokens {num_tokens}")
    return text[: offsets[num_tokens - 1][1]]


def target_tokenizer(preset: str):
    """The preset's target tokenizer without its model: all this process needs to cut the text (the server process
    loads the models). The same tokenizer transfer/presets.py gives the target."""
    if preset == "tiny":
        from kvbridge.transfer.tiny_pair import build_tiny_tokenizer

        return build_tiny_tokenizer("sentencepiece")
    from kvbridge.transfer.models import prepare_gguf
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_gguf("smollm2-135m-instruct-q4_1"), local_files_only=True)


# ---------------------------------------------------------------------------------------------------- main


def run(argv: list[str] | None = None) -> dict:
    """The stream and wire benchmarks, as on the command line; returns their numbers (the printed lines' figures)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny random models, fewer tokens and rounds: a smoke run in seconds")
    parser.add_argument("--preset", choices=["small", "tiny"], help="model pair (default: small; tiny with --quick)")
    parser.add_argument("--tokens", type=int, help="context length in target tokens (default 2048; 512 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 9; 3 with --quick)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="KV dtype on the wire")
    parser.add_argument("--chunk-kb", type=int, default=1024, help="chunk size asked of the server (KiB)")
    parser.add_argument("--adapter", help="a trained adapter file (default: the pair's shipped adapter, else a ridge "
                                          "fit on 2048 corpus tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of this process and of the server process (default 1: they "
                             "share the machine's cores; see bench/store.md)")
    parser.add_argument("--shm-keep-s", type=float, default=None,
                        help="the server's --shm-keep-s (default: its default, 30): 0 makes every shm fetch gather "
                             "the KV into a new file; otherwise the timed fetches link the file the first one wrote")
    parser.add_argument("--stream-keep-mb", type=float, default=None,
                        help="the server's --stream-keep-mb (default: its default, 256): 0 makes every streamed fetch "
                             "gather and encode its chunks; otherwise the timed fetches send the messages kept from "
                             "the warm-up fetch")
    parser.add_argument("--in-process", action="store_true",
                        help="run the server (and the raw baseline's sender) as threads of this process instead of "
                             "separate processes: one GIL for both ends")
    args = parser.parse_args(argv)
    preset = args.preset or ("tiny" if args.quick else "small")
    # an option given is used as given (0 is refused below, not taken for the default)
    num_tokens = args.tokens if args.tokens is not None else 512 if args.quick else 2048
    rounds = args.rounds if args.rounds is not None else 3 if args.quick else 9
    for name, value, low in (("--tokens", num_tokens, 16), ("--rounds", rounds, 1), ("--chunk-kb", args.chunk_kb, 4),
                             ("--threads", args.threads, 1)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    torch.set_num_threads(args.threads)
    # The servicer logs an open (token-less) server and a missing adapter at WARNING; both are expected here.
    logging.getLogger("kvbridge.server").setLevel(logging.ERROR)

    started = time.perf_counter()
    mode = "quick" if args.quick else "full"
    corpus = str(data_path("pydoc_corpus_sample.txt"))
    chunk_bytes = args.chunk_kb * 1024
    message_mb = max(8.0, chunk_bytes / (1 << 20) + 1)  # a chunk and its message framing fit in one message
    common = dict(dtype=args.dtype, chunk_bytes=chunk_bytes, rounds=rounds, shm_keep_s=args.shm_keep_s)
    keep = {} if args.shm_keep_s is None else {"shm_keep_s": args.shm_keep_s}
    if args.stream_keep_mb is not None:
        keep["stream_keep_mb"] = args.stream_keep_mb
    common["stream_keep_mb"] = args.stream_keep_mb
    if args.in_process:
        source, target = load_pair(preset)
        machine = machine_line(target.device, mode)
        print(machine, flush=True)
        adapter, adapter_note = get_adapter(args.adapter, source, target)
        text = cut_text(target.tokenizer, Path(corpus).read_text(encoding="utf-8"), num_tokens)
        with tempfile.TemporaryDirectory(prefix="kvbridge-bench-grpc-") as folder:
            config = ServeConfig(preset=preset, listen="127.0.0.1:0", selfcheck=False, adapters=folder,
                                 store_capacity_mb=1024, chunk_kb=args.chunk_kb, max_message_mb=message_mb,
                                 correction="replace", **keep)
            service = build_service(config, source=source, targets=[target])
            service.adapters.add(ADAPTER_NAME, adapter, make_default=True)
            running = start_server(service, config)
            client = KVBridgeClient(running.address, timeout_s=600, max_message_mb=message_mb)
            try:
                result = bench_stream_and_wire(client, text, layout="server in this process", raw_sender=RawServer,
                                               note=adapter_note, **common)
            finally:
                client.close()
                running.stop(grace_s=1)
    else:
        # The server process runs the models on the CPU (--device cpu); this process loads models only to fit an
        # adapter, and frees them before the server starts.
        machine = machine_line(torch.device("cpu"), mode)
        print(machine, flush=True)
        with tempfile.TemporaryDirectory(prefix="kvbridge-bench-grpc-") as folder:
            folder = Path(folder)
            (folder / "adapters").mkdir()
            if args.adapter:
                adapter, adapter_note = get_adapter(args.adapter, None, None)
            else:
                source, target = load_pair(preset, device="cpu")
                adapter, adapter_note = get_adapter(None, source, target)
                del source, target
            save_adapter(adapter, folder / "adapters" / f"{ADAPTER_NAME}.safetensors")
            del adapter
            gc.collect()
            text = cut_text(target_tokenizer(preset), Path(corpus).read_text(encoding="utf-8"), num_tokens)
            server = ServerProcess(
                ["--preset", preset, "--adapters", str(folder / "adapters"), "--default-adapter", ADAPTER_NAME,
                 "--no-selfcheck", "--device", "cpu", "--correction", "replace", "--store-capacity-mb", "1024",
                 "--chunk-kb", str(args.chunk_kb), "--max-message-mb", str(message_mb),
                 *[arg for name, value in keep.items() for arg in (f"--{name.replace('_', '-')}", str(value))]],
                folder, args.threads)
            try:
                client = KVBridgeClient(server.address, timeout_s=600, max_message_mb=message_mb)
                try:
                    result = bench_stream_and_wire(
                        client, text, layout="server in its own process", raw_sender=RawSenderProcess,
                        note=f"{adapter_note}; server process ready in {server.start_s:.1f} s", **common)
                    result["server_start_s"] = server.start_s
                finally:
                    client.close()
            finally:
                rc = server.stop()
            if rc != 0:
                raise RuntimeError(f"the server process exited with {rc} after SIGTERM; its stderr:\n"
                                   f"{tail(server.stderr)}")
    wall_s = time.perf_counter() - started
    print(f"done in {wall_s:.0f} s", flush=True)
    return {"machine": machine, "preset": preset, **result, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def bench_stream_and_wire(client: KVBridgeClient, text: str, dtype: str, chunk_bytes: int, rounds: int,
                          layout: str, raw_sender: Callable[[list[bytes]], RawServer | RawSenderProcess],
                          note: str, shm_keep_s: float | None = None, stream_keep_mb: float | None = None) -> dict:
    """Prints the `stream` and `wire` lines and returns their numbers: warm projected fetch vs raw socket (medians
    of interleaved rounds), the cold first fetch and the Ingest before it, and the bytes on the wire."""
    t0 = time.perf_counter()
    entry = client.ingest(text=text).entries[0]
    ingest_s = time.perf_counter() - t0

    def fetch_projected():
        return client.fetch_projected(key=entry.key, dtype=dtype, chunk_bytes=chunk_bytes)

    t0 = time.perf_counter()
    cold = fetch_projected()  # projection, store put, stream
    cold_s = time.perf_counter() - t0
    kv = cold.segment.kv  # [L, 2, H, T, D] in the wire dtype
    if not torch.equal(fetch_projected().segment.kv, kv):  # also the warm-up of the timed path
        raise AssertionError("a warm projected fetch differs from the cold one")

    # the raw baseline moves the very blobs the server sent: same sizes, same order
    n_layers, _, h, t, d = kv.shape
    ranges = plan_chunks(n_layers, t, 2 * h * d * kv.element_size(), chunk_bytes)
    payloads = [encode(kv, r) for r in ranges]
    total = sum(len(p) for p in payloads)
    if (total, len(payloads)) != (cold.wire_bytes, cold.num_chunks):
        raise AssertionError(f"raw payloads ({len(payloads)} chunks, {total} B) do not match the gRPC fetch "
                             f"({cold.num_chunks} chunks, {cold.wire_bytes} B)")
    sender = raw_sender(payloads)
    try:
        raw = RawClient(sender.port, len(payloads), total)
        try:
            if bytes(raw.fetch()) != b"".join(payloads):
                raise AssertionError("the raw socket round trip changed the bytes")
            times = interleaved({"grpc": fetch_projected, "raw": raw.fetch}, rounds)
        finally:
            raw.close()
    finally:
        sender.close()

    mbs = {name: total / s / 1e6 for name, s in times.items()}
    ratio = mbs["grpc"] / mbs["raw"]
    biggest = max(len(p) for p in payloads)
    source_name, target_name = entry.model, cold.segment.model.name
    how = ("every fetch gathers and encodes its chunks (--stream-keep-mb 0)" if stream_keep_mb == 0 else
           "the fetches send the messages kept from the first warm one")
    print(f"stream  warm GetProjectedCache {source_name} -> {target_name}, {t} target tokens, {dtype} on the "
          f"wire ({total / 1e6:.1f} MB in {len(payloads)} chunks of <= {biggest / 1024:.0f} KiB; {how}), loopback, "
          f"{layout}: gRPC fetch to the assembled tensor {mbs['grpc']:,.0f} MB/s ({times['grpc'] * 1e3:.0f} ms), "
          f"raw TCP socket same chunks {mbs['raw']:,.0f} MB/s ({times['raw'] * 1e3:.0f} ms) -> ratio grpc/raw "
          f"{ratio:.2f} (goal >= 0.5, {verdict(ratio >= 0.5)}; medians of {rounds} interleaved rounds)", flush=True)
    print(f"stream  cold first fetch (projection + store put + stream) {cold_s * 1e3:,.0f} ms = "
          f"{cold_s / times['grpc']:.1f}x the warm fetch; before it, Ingest (source prefill of {entry.num_tokens} "
          f"tokens) {ingest_s * 1e3:,.0f} ms; {note} (information, no goal)", flush=True)

    shm = bench_shared_memory(client, entry.key, kv, dtype, rounds, fetch_projected, shm_keep_s)

    src = client.fetch_source(key=entry.key, dtype=dtype, chunk_bytes=chunk_bytes)
    t_s = src.segment.num_tokens
    per_t, per_s = cold.wire_bytes / t, src.wire_bytes / t_s
    print(f"wire    measured, {dtype}: projected fetch {cold.wire_bytes:,} B ({target_name}, {t} target tokens, "
          f"{per_t:,.0f} B/token) vs source fetch {src.wire_bytes:,} B ({src.segment.model.name}, {t_s} source "
          f"tokens, {per_s:,.0f} B/token) -> ratio projected/source {cold.wire_bytes / src.wire_bytes:.2f} "
          f"({per_t / per_s:.2f} per token; information, no goal)", flush=True)
    (ps, pb), (pt, pb_t) = PRODUCTION_PAIR
    (ss, sb), (st, sb_t) = SMALL_PAIR
    print(f"wire    computed from the models' KV bytes per token (bf16), not measured: production pair {pt} "
          f"{pb_t:,} B/token projected vs {ps} {pb:,} B/token source -> ratio projected/source {pb_t / pb:.1f}x "
          f"per token (fetching source KV and projecting locally moves that many times fewer bytes); small pair "
          f"{st} {sb_t:,} vs {ss} {sb:,} -> {sb_t / sb:.2f}x per token", flush=True)
    return {"pair": f"{source_name} -> {target_name}", "target_tokens": t, "dtype": dtype, "layout": layout,
            "rounds": rounds, "stream_bytes": total, "chunks": len(payloads), "grpc_s": times["grpc"],
            "raw_s": times["raw"], "grpc_mbs": mbs["grpc"], "raw_mbs": mbs["raw"], "ratio_grpc_over_raw": ratio,
            "cold_fetch_s": cold_s, "ingest_s": ingest_s, "projected_wire_bytes": cold.wire_bytes,
            "source_wire_bytes": src.wire_bytes,
            "ratio_projected_over_source_wire": cold.wire_bytes / src.wire_bytes, "stream_keep_mb": stream_keep_mb,
            **shm}


def bench_shared_memory(client: KVBridgeClient, key: str, kv: torch.Tensor, dtype: str, rounds: int,
                        fetch_stream: Callable[[], object], keep_s: float | None = None) -> dict:
    """Prints the `shm` line and returns its numbers: a warm same-host projected fetch through shared memory vs a
    numpy copy of the same bytes (fresh memory, as a memcpy into a new buffer) and vs the stream (medians of
    interleaved rounds); kv [L, 2, H, T, D] is the streamed fetch's KV, which the shared one must equal."""
    def fetch_shared():
        fetched = client.fetch_projected(key=key, dtype=dtype, transport="shared_memory")
        if fetched.transport != "shared_memory":
            raise AssertionError("the server streamed a fetch that asked for shared memory")
        return fetched

    if not torch.equal(fetch_shared().segment.kv, kv):  # also the warm-up
        raise AssertionError("the shared-memory fetch differs from the stream")
    source = kv.contiguous().view(torch.uint8).reshape(-1).numpy()  # the same bytes
    touched = np.empty_like(source)
    np.copyto(touched, source)
    times = interleaved({"shm": fetch_shared, "memcpy": source.copy, "memcpy_warm": lambda: np.copyto(touched, source),
                         "stream": fetch_stream}, rounds)
    nbytes = source.nbytes
    vs_copy, vs_warm, vs_stream = (times["memcpy"] / times["shm"], times["memcpy_warm"] / times["shm"],
                                   times["stream"] / times["shm"])
    how = ("every fetch gathers the KV into a new file (--shm-keep-s 0)" if keep_s == 0 else
           "the fetches link the file the first one wrote (kept files)")
    print(f"shm     warm GetProjectedCache through shared memory ({nbytes / 1e6:.1f} MB, {dtype}, same host; "
          f"{how}): fetch to the mapped, checked tensor {nbytes / times['shm'] / 1e6:,.0f} MB/s "
          f"({times['shm'] * 1e3:.1f} ms), "
          f"numpy copy of the same bytes into fresh memory {times['memcpy'] * 1e3:.1f} ms -> ratio memcpy/shm "
          f"{vs_copy:.2f} (goal >= 0.8, {verdict(vs_copy >= 0.8)}); the stream {times['stream'] * 1e3:.0f} ms -> "
          f"shm {vs_stream:.1f}x faster; copy into a touched buffer {times['memcpy_warm'] * 1e3:.1f} ms -> ratio "
          f"{vs_warm:.2f} (information; medians of {rounds} interleaved rounds)", flush=True)
    return {"shm_s": times["shm"], "memcpy_s": times["memcpy"], "memcpy_warm_s": times["memcpy_warm"],
            "ratio_memcpy_over_shm": vs_copy, "ratio_stream_over_shm": vs_stream, "shm_keep_s": keep_s}


if __name__ == "__main__":
    sys.exit(main())
