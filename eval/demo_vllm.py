"""`kvbridge demo --engine vllm`: the demo's side-by-side table with vLLM as the target's engine.

As `kvbridge demo` (eval.demo): an adapter cached or shipped, `kvbridge serve` in the background, one document of
the shipped sample ingested once by the source. Then a vLLM engine (the vLLM venv; `kvbridge.vllm`) serves the target
with the kvbridge connector and answers every mode's request, `[start] + document + instruction`, greedy, one line:
  full           vLLM prefills the whole prompt itself
  replace        the connector loads the document's projected KV (whole vLLM blocks); vLLM prefills the rest
  served:blend:0.1  the server's stored correction (blend:0.1, computed once by the server over the projection)
  recompute:0.1  the same, leaving the document's last 10% (rounded up to whole blocks) to vLLM's own prefill
  none           start + instruction only: no document
TTFT cold is a one-token request made first (the server projects the document, and computes the served correction
from it); TTFT warm one made after the summary (the server's store has the KV: a user's next question). The modes
after replace find its projection stored: their cold counts replace's first fetch as a new user's first request would
(vllm_eval.FirstFetches).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from kvbridge.eval.demo import DEMO_DOC, SAMPLE, BackgroundServer, _ensure_adapter, _say
from kvbridge.eval.flops import FlopModel
from kvbridge.eval.records import read_records
from kvbridge.eval.report import repeated_ngram_share, rouge
from kvbridge.eval.summaries import EvalConfig, instruction_ids, prepare, stop_ids
from kvbridge.eval.vllm_eval import FirstFetches, one_line

BLOCK_SIZE = 32  # vLLM's block size here (CPU: multiples of 32); small, so little of the document is left over
RECOMPUTE = 0.1
SERVED = "blend:0.1"  # the server's default correction


def run_demo_vllm(preset: str = "small", doc_id: str | None = None, max_doc_tokens: int = 512,
                  max_new_tokens: int = EvalConfig.max_new_tokens, adapters: str | None = None,
                  selfcheck: bool = True, dtype: str | None = None) -> int:
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.models import kvbridge_home, prepare_gguf
    from kvbridge.transfer.presets import load_pair
    from kvbridge.vllm.engine import EngineOptions, EngineProcess, engine_dtype, kv_transfer_config, vllm_available

    missing = vllm_available()
    if missing:
        raise SystemExit(f"kvbridge demo --engine vllm: {missing}")
    if preset != "small":
        raise ValueError("--engine vllm serves the small preset's target (a packaged checkpoint vLLM can load)")
    t_start = time.perf_counter()
    record = next((r for r in read_records(data_path(SAMPLE)) if r.id == (doc_id or DEMO_DOC)), None)
    if record is None:
        raise ValueError(f"no record {doc_id!r} in the shipped sample")
    _say(f"kvbridge demo --engine vllm: preset {preset}, document {record.id} of the shipped sample ({SAMPLE})")
    source, target = load_pair(preset)
    folder = Path(adapters).expanduser() if adapters else kvbridge_home() / "adapters"
    _ensure_adapter(source, target, folder)
    del source
    config = EvalConfig(max_doc_tokens=max_doc_tokens, max_new_tokens=max_new_tokens)
    doc = prepare(record, target, config)
    if doc is None:
        raise ValueError(f"document {record.id} is too short for the demo")
    context = doc.target_ids.tolist()
    instruction = instruction_ids(target, config.instruction).tolist()
    stop = stop_ids(target)
    flops = FlopModel.from_config(target.model.config)
    recompute_tokens = math.ceil(RECOMPUTE * doc.doc_tokens)
    requests = {"full": (context + instruction, None),
                "replace": (context + instruction, {"text": doc.text, "mode": "replace"}),
                f"served:{SERVED}": (context + instruction, {"text": doc.text, "mode": SERVED}),
                f"recompute:{RECOMPUTE:g}": (context + instruction,
                                             {"text": doc.text, "mode": "replace",
                                              "recompute_tokens": recompute_tokens}),
                "none": (context[:1] + instruction, None)}
    args = ["--preset", preset, "--adapters", str(folder), "--store-capacity-mb", "512"]
    if not selfcheck:
        args.append("--no-selfcheck")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-vllm-") as tmp:
        _say("server: starting kvbridge serve in the background" + (" (self-checks first)" if selfcheck else ""))
        server = BackgroundServer(args, Path(tmp))
        try:
            _say(f"server: listening on {server.address}")
            with KVBridgeClient(server.address, timeout_s=600) as client:
                client.ingest(text=doc.text)  # the source reads the document once
            dtype = dtype or engine_dtype()  # bfloat16 where the CPU multiplies it natively, else float32
            options = EngineOptions(model=str(prepare_gguf(target.name)), dtype=dtype,
                                    max_model_len=len(context) + len(instruction) + max_new_tokens + 64,
                                    block_size=BLOCK_SIZE,
                                    kv_transfer_config=kv_transfer_config(address=server.address, timeout_s=600))
            t0 = time.perf_counter()
            _say(f"vLLM: starting an engine for {target.name} in {dtype} with the kvbridge connector")
            with EngineProcess(options, Path(tmp) / "engine.log") as engine:
                _say(f"vLLM: ready after {time.perf_counter() - t0:.0f} s; document: {doc.doc_tokens} target "
                     f"tokens; {len(requests)} modes, three requests each")
                for name, (prompt, kvbridge) in requests.items():
                    cold = engine.generate(prompt, max_tokens=1, kvbridge=kvbridge)
                    out = engine.generate(prompt, max_tokens=max_new_tokens, kvbridge=kvbridge)
                    warm = engine.generate(prompt, max_tokens=1, kvbridge=kvbridge)
                    results[name] = (prompt, out, cold, warm)
        finally:
            code = server.stop()
            log_tail = server.tail() if code != 0 else ""  # read while its folder is there
    rows = [("mode", "TTFT cold", "TTFT warm", "KV loaded", "vLLM prefill", "FLOPs saved", "ROUGE-L vs ref",
             "fidelity vs full", "repeated 3-grams")]
    summaries = {}
    full_flops = flops.prefill(len(results["full"][0]))
    first = FirstFetches()
    for name, (prompt, out, cold, warm) in results.items():
        ids = one_line(target.tokenizer, out["token_ids"], stop)
        summaries[name] = target.tokenizer.decode(ids, skip_special_tokens=True).strip()
        loaded = out["loaded_tokens"]
        prefilled = len(prompt) - loaded
        cold_s = first.cold_seconds(requests[name][1], cold, warm)
        rows.append((name, f"{cold_s:.2f} s", f"{warm['seconds']:.2f} s", f"{loaded} tok", f"{prefilled} tok",
                     f"{1 - flops.prefill(prefilled, loaded) / full_flops:.0%}",
                     f"{rouge(record.summary, summaries[name])['rougeL']:.3f}",
                     f"{rouge(summaries['full'], summaries[name])['rougeL']:.3f}", f"{repeated_ngram_share(ids):.0%}"))
        if out["kvbridge_error"]:
            _say(f"{name}: kvbridge: {out['kvbridge_error']}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    _say("")
    _say("\n".join(lines))
    _say("")
    width = max(len("reference"), *map(len, summaries))
    _say(f"{'reference':>{width}}: {record.summary}")
    for name, summary in summaries.items():
        _say(f"{name:>{width}}: {summary}")
    _say("")
    if code != 0:
        _say(f"server: exited with {code}; its log:\n{log_tail}")
        return 1
    _say(f"server: stopped cleanly (exit 0). Demo took {time.perf_counter() - t_start:.0f} s.")
    return 0
