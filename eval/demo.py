"""`kvbridge demo`: what transfer buys, on one document, end to end on this machine.

Fit an adapter if none is cached (progress bars), start `kvbridge serve` in the background on a free loopback
port, ingest one document of the shipped sample (the source model reads it once), fetch its projected cache over
gRPC, and print side by side what the target does with its own prefill, with the projected cache (replace), with
the server's stored corrections of it (served blend:0.1 and recompute:0.1: the target recomputes 10% of the
document over the projection once, on the server; every later fetch reads it from the store) and with no document:
the summaries, ROUGE-L against the reference and fidelity to `full`'s summary, TTFT cold (the first fetch of the
document: the server projects, and corrects) and warm (a user's next question: a store hit), prefill FLOPs and KV
bytes. The server is stopped with SIGTERM (it drains) and must exit cleanly.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.eval.modes import parse_modes
from kvbridge.eval.records import read_records
from kvbridge.eval.report import greedy_agreement, repeated_ngram_share, rouge, top1_agreement
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, SummaryEvaluator, prepare

# served: the server's stored corrections (server/corrections.py): blend:0.1 is the server's default (the best
# fidelity measured on 100 held-out pages, docs/eval-blend), recompute:0.1 the other rule at the same share
DEMO_MODES = "full,replace,served:blend:0.1,served:recompute:0.1,none"
DEMO_DOC = "pydoc:sndhdr"  # one where SmolLM2's own summary is on topic, so the modes' differences show
SAMPLE = "pydoc_summaries_sample.jsonl"


def _say(text: str) -> None:
    print(text, flush=True)


class BackgroundServer:
    """`kvbridge serve` as a child process, found through its ready file; output to a log file."""

    def __init__(self, args: list[str], workdir: Path, start_timeout_s: float = 900.0):
        self.workdir, self.log = workdir, workdir / "serve.log"
        ready = workdir / "ready.json"
        setpriv = shutil.which("setpriv")  # the server dies with the demo, however the demo ends
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        cmd = [*prefix, sys.executable, "-m", "kvbridge.cli", "serve", *args, "--listen", "127.0.0.1:0",
               "--ready-file", str(ready)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"kvbridge serve did not start (exit {self.proc.returncode}); its log:\n"
                                   + self.tail())
            time.sleep(0.2)
        self.address = json.loads(ready.read_text())["address"]

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait for the drain; the exit code (SIGKILL after timeout_s gives -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _ensure_adapter(source, target, folder: Path) -> str:
    from kvbridge.adapters.shipped import find_shipped
    from kvbridge.server.adapter_registry import AdapterRegistry
    from kvbridge.server.app import fit_default_adapter

    registry = AdapterRegistry(folder, source.spec, [target.spec])
    if registry.autoload():
        name = registry.default_for(target.spec)
        _say(f"adapter: {name} (cached in {folder})")
        return name
    shipped = find_shipped(source.spec, target.spec)
    if shipped is not None:  # the server takes it when the folder has none
        _say(f"adapter: {shipped.stem}, shipped with kvbridge ({folder} has none for this pair)")
        return shipped.stem
    _say(f"adapter: none cached in {folder} for {source.name} -> {target.name}; fitting a ridge adapter "
         "(a couple of minutes on the small pair)")
    t0 = time.perf_counter()
    path = fit_default_adapter(source, target, folder)
    _say(f"adapter: fitted {path.name} in {time.perf_counter() - t0:.0f} s")
    return path.name.removesuffix(".safetensors")


def _format_table(doc, result, reference: str) -> str:
    rows = [("mode", "TTFT cold", "TTFT warm", "target prefill", "FLOPs saved", "KV bytes in", "ROUGE-L vs ref",
             "fidelity vs full", "top-1 = full", "greedy = full", "repeated 3-grams")]
    full = result.modes.get("full")
    for name, m in result.modes.items():
        saved = f"{1 - m.prefill_flops / full.prefill_flops:.0%}" if full else "-"
        kv = f"{m.kv_bytes / 1e6:.1f} MB" if m.kv_bytes else "0"
        fidelity = f"{rouge(full.summary, m.summary)['rougeL']:.3f}" if full else "-"
        agree = top1_agreement(m.continuation_top1, full.continuation_top1) if full else None
        greedy = greedy_agreement(m.summary_ids, full.summary_ids) if full else None
        rows.append((name, f"{m.ttft_s:.2f} s", f"{m.ttft_warm_s:.2f} s", f"{m.prefill_tokens} tok", saved, kv,
                     f"{rouge(reference, m.summary)['rougeL']:.3f}", fidelity,
                     f"{agree:.0%}" if agree is not None else "-", f"{greedy:.0%}" if greedy is not None else "-",
                     f"{repeated_ngram_share(m.summary_ids):.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_demo(preset: str = "small", doc_id: str | None = None, max_doc_tokens: int = 512,
             max_new_tokens: int = EvalConfig.max_new_tokens, adapters: str | None = None,
             selfcheck: bool = True) -> int:
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.models import kvbridge_home
    from kvbridge.transfer.presets import load_pair

    t_start = time.perf_counter()
    records = read_records(data_path(SAMPLE))
    doc_id = doc_id or DEMO_DOC
    record = next((r for r in records if r.id == doc_id), None)
    if record is None:
        raise ValueError(f"no record {doc_id!r} in the shipped sample; ids: {', '.join(r.id for r in records)}")
    _say(f"kvbridge demo: preset {preset}, document {record.id} of the shipped sample ({SAMPLE})")
    source, target = load_pair(preset)
    _say(f"models: {source.name} (source) -> {target.name} (target)")
    folder = Path(adapters).expanduser() if adapters else kvbridge_home() / "adapters"
    _ensure_adapter(source, target, folder)
    del source  # the server loads its own; this process needs only the target from here on
    args = ["--preset", preset, "--adapters", str(folder), "--store-capacity-mb", "512"]
    if not selfcheck:
        args.append("--no-selfcheck")
    config = EvalConfig(max_doc_tokens=max_doc_tokens, max_new_tokens=max_new_tokens)
    doc = prepare(record, target, config)
    if doc is None:
        raise ValueError(f"document {record.id} is too short for the demo")
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as tmp:
        _say("server: starting kvbridge serve in the background" + (" (self-checks first)" if selfcheck else ""))
        t0 = time.perf_counter()
        server = BackgroundServer(args, Path(tmp))
        code = None
        try:
            _say(f"server: listening on {server.address} after {time.perf_counter() - t0:.0f} s")
            with KVBridgeClient(server.address, timeout_s=600) as client:
                projected = ProjectedSource(client, target)
                evaluator = SummaryEvaluator(target, parse_modes(DEMO_MODES), config, projected)
                _say(f"document: {doc.doc_tokens} target tokens of {record.id}; ingesting it, fetching its projected "
                     "cache (cold, then warm), two served corrections (cold, then warm), then five requests")
                result = evaluator.run(doc)
                stats = client.stats()
                stale = evaluator.prior.stale_for(projected.adapter_digest) if evaluator.prior else None
                if stale:  # an adapter of the user's own in the folder, read with the shipped prior
                    _say(f"note: {stale}")
        finally:
            code = server.stop()
        _say("")
        _say(_format_table(doc, result, record.summary))
        _say("")
        width = max(len("reference"), *map(len, result.modes))
        _say(f"{'reference':>{width}}: {record.summary}")
        for name, m in result.modes.items():
            _say(f"{name:>{width}}: {m.summary}")
        _say("")
        _say(f"projected cache: {doc.doc_tokens + 1} target tokens, {result.modes['replace'].kv_bytes / 1e6:.1f} MB "
             f"over gRPC in {result.fetch_s:.2f} s cold, {result.warm_fetch_s:.2f} s warm (exact token coverage "
             f"{result.exact_coverage:.2f}); the server held {stats.tenant_entries} entries, {stats.tenant_tokens} "
             "tokens")
        _say("TTFT cold: the document's first request (the server projects it; served: and corrects it once, with "
             "the projection counted though replace's fetch stored it first). TTFT warm: the next request on it (the "
             "server's store has it). Fidelity: ROUGE-L against full's answer; greedy = full: the share of full's "
             "answer tokens the mode has in place.")
        if code != 0:
            _say(f"server: exited with {code}; its log:\n{server.tail()}")
            return 1
        _say(f"server: stopped cleanly (exit 0). Demo took {time.perf_counter() - t_start:.0f} s.")
    return 0
