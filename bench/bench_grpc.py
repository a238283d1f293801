"""gRPC streaming benchmarks: a real kvbridge server started in-process on loopback, a real KVBridgeClient, and a
baseline measured in the same run on the machine named in the header (STYLE rule 9). The two sides of a ratio are
interleaved over several rounds (the order alternates) and each reported time is a median.

    .venv/bin/python bench/bench_grpc.py [--quick] [--preset small|tiny] [--tokens 2048] [--dtype float32|bfloat16]
                                         [--chunk-kb 1024] [--adapter FILE] [--rounds 9] [--threads 1]

1. stream: a warm GetProjectedCache of a ~2048-target-token entry (projected entry already in the server's store),
   timed on the client from the call to the assembled tensor, vs a raw loopback TCP socket moving the same bytes in
   the same chunk sizes (MB/s; goal grpc/raw >= 0.7). The cold first fetch (projection included) as information.
2. wire: bytes on the wire of the projected fetch vs the source fetch (GetSourceCache) of the same entry, measured;
   and the production pair's ratio computed from DESIGN.md's model numbers (not measured).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.train import TrainConfig, train_adapter
from kvbridge.server.app import build_service, start_server
from kvbridge.server.chunks import encode, plan_chunks
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.config import ServeConfig
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.presets import load_pair

LENGTH = struct.Struct("!Q")  # the raw baseline's per-chunk length prefix
# DESIGN.md, "Numbers to keep in mind": KV bytes per token in bf16, (source, target) of each pair
PRODUCTION_PAIR = (("Qwen2-7B", 57_344), ("Phi-3-mini-4k", 393_216))
SMALL_PAIR = (("Gemma-3-270M", 18_432), ("SmolLM2-135M", 23_040))


# ---------------------------------------------------------------------------------------------------- helpers


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line(device: torch.device, mode: str) -> str:
    dev = str(device)
    if device.type == "cuda":
        dev += f" ({torch.cuda.get_device_name(device)})"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {platform.node()} | CPU {cpu_model()} x {os.cpu_count()} cores | torch {torch.__version__} "
            f"(intra-op threads: {torch.get_num_threads()}) | grpcio {grpc.__version__} | models on {dev} | "
            f"python {platform.python_version()} | load average {load} at start | {mode} run")


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


# ---------------------------------------------------------------------------------------------------- raw baseline


class RawServer:
    """A plain TCP server thread on loopback: for every request byte it sends the payloads, each after an 8-byte
    length. No encoding, no checks: what moving these bytes through the kernel costs from Python."""

    def __init__(self, payloads: list[bytes]):
        self.payloads = payloads
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="raw-tcp-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                for p in self.payloads:
                    conn.sendall(LENGTH.pack(len(p)))
                    conn.sendall(p)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


class RawClient:
    def __init__(self, port: int, num_chunks: int, total_bytes: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.num_chunks = num_chunks
        self.total_bytes = total_bytes

    def _read_into(self, view: memoryview) -> None:
        while view:
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionError("the raw server closed the connection mid-chunk")
            view = view[n:]

    def fetch(self) -> bytearray:
        """All chunks, back to back in one fresh buffer (as the client's assembler fills one fresh tensor)."""
        self.sock.sendall(b"g")
        out = bytearray(self.total_bytes)
        view, head, pos = memoryview(out), bytearray(LENGTH.size), 0
        for _ in range(self.num_chunks):
            self._read_into(memoryview(head))
            (size,) = LENGTH.unpack(head)
            self._read_into(view[pos:pos + size])
            pos += size
        if pos != self.total_bytes:
            raise AssertionError(f"raw fetch moved {pos} bytes, expected {self.total_bytes}")
        return out

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny random models, fewer tokens and rounds: a smoke run in seconds")
    parser.add_argument("--preset", choices=["small", "tiny"], help="model pair (default: small; tiny with --quick)")
    parser.add_argument("--tokens", type=int, help="context length in target tokens (default 2048; 512 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 9; 3 with --quick)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="KV dtype on the wire")
    parser.add_argument("--chunk-kb", type=int, default=1024, help="chunk size asked of the server (KiB)")
    parser.add_argument("--adapter", help="a trained adapter file (default: fit a ridge adapter on 2048 tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the server, the client and the raw baseline share "
                             "the machine's cores; see bench/README.md)")
    args = parser.parse_args(argv)
    preset = args.preset or ("tiny" if args.quick else "small")
    num_tokens = args.tokens or (512 if args.quick else 2048)
    rounds = args.rounds or (3 if args.quick else 9)
    for name, value, low in (("--tokens", num_tokens, 16), ("--rounds", rounds, 1), ("--chunk-kb", args.chunk_kb, 4),
                             ("--threads", args.threads, 1)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    torch.set_num_threads(args.threads)
    # The servicer logs an open (token-less) server and a missing adapter at WARNING; both are expected here.
    logging.getLogger("kvbridge.server").setLevel(logging.ERROR)

    started = time.perf_counter()
    source, target = load_pair(preset)
    print(machine_line(target.device, "quick" if args.quick else "full"), flush=True)

    # Throughput does not depend on the adapter's quality, only on its shapes; a real ridge fit on a small corpus
    # slice keeps the server's path the one users get, at about a second (tiny) to about 25 s (small).
    t0 = time.perf_counter()
    corpus = str(data_path("pydoc_corpus_sample.txt"))
    if args.adapter:
        adapter, how = load_adapter(args.adapter, target.device), f"loaded from {args.adapter}"
    else:
        adapter, _ = train_adapter(source, target, [corpus], TrainConfig(max_tokens=2048), progress=False)
        how = "ridge, fitted on 2048 corpus tokens"
    adapter_s = time.perf_counter() - t0
    text = cut_text(target.tokenizer, Path(corpus).read_text(encoding="utf-8"), num_tokens)
    chunk_bytes = args.chunk_kb * 1024
    message_mb = max(8.0, chunk_bytes / (1 << 20) + 1)  # a chunk and its message framing fit in one message

    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-grpc-") as folder:
        config = ServeConfig(preset=preset, listen="127.0.0.1:0", selfcheck=False, adapters=folder,
                             store_capacity_mb=1024, chunk_kb=args.chunk_kb, max_message_mb=message_mb)
        service = build_service(config, source=source, targets=[target])
        service.adapters.add("bench-adapter", adapter, make_default=True)
        running = start_server(service, config)
        client = KVBridgeClient(running.address, timeout_s=600, max_message_mb=message_mb)
        try:
            bench_stream_and_wire(client, source, target, text, args.dtype, chunk_bytes, rounds,
                                  f"adapter {how} in {adapter_s:.1f} s")
        finally:
            client.close()
            running.stop(grace_s=1)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def bench_stream_and_wire(client: KVBridgeClient, source: LoadedModel, target: LoadedModel, text: str, dtype: str,
                          chunk_bytes: int, rounds: int, adapter_note: str) -> None:
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
    raw_server = RawServer(payloads)
    raw = RawClient(raw_server.port, len(payloads), total)
    try:
        if bytes(raw.fetch()) != b"".join(payloads):
            raise AssertionError("the raw socket round trip changed the bytes")
        times = interleaved({"grpc": fetch_projected, "raw": raw.fetch}, rounds)
    finally:
        raw.close()
        raw_server.close()

    mbs = {name: total / s / 1e6 for name, s in times.items()}
    ratio = mbs["grpc"] / mbs["raw"]
    biggest = max(len(p) for p in payloads)
    print(f"stream  warm GetProjectedCache {source.name} -> {target.name}, {t} target tokens, {dtype} on the "
          f"wire ({total / 1e6:.1f} MB in {len(payloads)} chunks of <= {biggest / 1024:.0f} KiB), loopback: "
          f"gRPC fetch to the assembled tensor {mbs['grpc']:,.0f} MB/s ({times['grpc'] * 1e3:.0f} ms), raw TCP "
          f"socket same chunks {mbs['raw']:,.0f} MB/s ({times['raw'] * 1e3:.0f} ms) -> ratio grpc/raw {ratio:.2f} "
          f"(goal >= 0.7, {verdict(ratio >= 0.7)}; medians of {rounds} interleaved rounds)", flush=True)
    print(f"stream  cold first fetch (projection + store put + stream) {cold_s * 1e3:,.0f} ms = "
          f"{cold_s / times['grpc']:.1f}x the warm fetch; before it, Ingest (source prefill of {entry.num_tokens} "
          f"tokens) {ingest_s * 1e3:,.0f} ms; {adapter_note} (information, no goal)", flush=True)

    src = client.fetch_source(key=entry.key, dtype=dtype, chunk_bytes=chunk_bytes)
    t_s = src.segment.num_tokens
    per_t, per_s = cold.wire_bytes / t, src.wire_bytes / t_s
    print(f"wire    measured, {dtype}: projected fetch {cold.wire_bytes:,} B ({target.name}, {t} target tokens, "
          f"{per_t:,.0f} B/token) vs source fetch {src.wire_bytes:,} B ({source.name}, {t_s} source tokens, "
          f"{per_s:,.0f} B/token) -> ratio projected/source {cold.wire_bytes / src.wire_bytes:.2f} "
          f"({per_t / per_s:.2f} per token; information, no goal)", flush=True)
    (ps, pb), (pt, pb_t) = PRODUCTION_PAIR
    (ss, sb), (st, sb_t) = SMALL_PAIR
    print(f"wire    computed from DESIGN.md's KV bytes per token (bf16), not measured: production pair {pt} "
          f"{pb_t:,} B/token projected vs {ps} {pb:,} B/token source -> ratio projected/source {pb_t / pb:.1f}x "
          f"per token (fetching source KV and projecting locally moves that many times fewer bytes); small pair "
          f"{st} {sb_t:,} vs {ss} {sb:,} -> {sb_t / sb:.2f}x per token", flush=True)


if __name__ == "__main__":
    sys.exit(main())
