"""`kvbridge eval rouge`: load a preset's pair, serve it in-process on a loopback port (or use a running server),
make sure an adapter is loaded, fit fuse's gates when asked for, run every document under every mode with progress
bars, and write the report."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from kvbridge.eval.cost import PairCost
from kvbridge.eval.modes import DEFAULT_MODES, Mode, parse_modes
from kvbridge.eval.records import read_records
from kvbridge.eval.report import summarise, write_report
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, SummaryEvaluator, prepare
from kvbridge.transfer.models import LoadedModel
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    data: str
    preset: str = "small"
    modes: str = DEFAULT_MODES
    adapter: str | None = None  # adapter file; None: the adapter folder's default for the pair
    fit_adapter: bool = False  # fit one into the adapter folder when it has none
    fuser: str | None = None  # a trained fuser file (train-adapter --trainer fuser) for the fuser mode
    limit: int | None = None
    exclude: str | None = None  # a JSONL file whose ids are skipped (the shipped sample, for the full run)
    out: str = "eval-out"
    server: str | None = None  # host:port of a running server; None: serve in-process
    token: str | None = None
    seed: int = 0
    bootstrap: int = 1000
    progress: bool = True
    engine: str = "transformers"  # the target's engine: transformers in this process, or vllm (eval.vllm_eval)
    vllm_dtype: str = ""  # --engine vllm: the engine's dtype ("": bfloat16 where the CPU has it natively, else float32)
    prior: str | None = None  # a fitted induction prior file for the modes without a suffix; None: the shipped one

    def __post_init__(self):
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"engine must be transformers or vllm, got {self.engine!r}")


def start_local_server(source: LoadedModel, target: LoadedModel, preset: str, adapter_file: str | None,
                       fit_adapter: bool, adapter=None):
    """An in-process kvbridge server on a free loopback port with the adapter (an Adapter object, a file, else the
    adapter folder's default for the pair, fitted there when asked) loaded as the pair's default."""
    from kvbridge.adapters.io import load_adapter
    from kvbridge.server.app import adapter_folder, build_service, fit_default_adapter, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset=preset, listen="127.0.0.1:0", selfcheck=False, store_capacity_mb=1024,
                         correction="replace")
    service = build_service(config, source=source, targets=[target])
    if adapter is not None:
        service.adapters.add("given", adapter, make_default=True)
    elif adapter_file:
        path = Path(adapter_file)
        service.adapters.add(path.name.removesuffix(".safetensors"), load_adapter(path), make_default=True)
    elif service.adapters.default_for(target.spec) is None:
        folder = adapter_folder(config)
        if not fit_adapter:
            raise FileNotFoundError(f"no adapter for {source.name} -> {target.name} in {folder}: pass --adapter "
                                    "FILE, or --fit-adapter to fit one there (about two minutes on the small pair)")
        fit_default_adapter(source, target, folder)
        service.adapters.autoload()
    return start_server(service, config)


def _prior_meta(prior, adapter_digest: str = "") -> dict | None:
    """An induction prior as results.json records it: the heads it biases, what made it, the adapter it was fitted
    for and, where the run's adapter is known (`adapter_digest`), why it was not fitted for that one ("stale")."""
    if prior is None:
        return None
    stale = prior.stale_for(adapter_digest) if adapter_digest else None
    if stale:
        log.warning("%s", stale)
    return {"heads": {str(layer): heads for layer, heads in prior.heads.items()}, "origin": prior.origin,
            "adapter": prior.adapter, "stale": stale}


def evaluate(options: RunOptions, source: LoadedModel | None = None, target: LoadedModel | None = None,
             adapter=None, config: EvalConfig | None = None, engine=None) -> dict:
    """Run the evaluation and write the report; returns {"summary", "paths", "meta", "results"}. Models and an
    Adapter object may be passed in (tests: the tiny pair, or the identity adapter of a model to itself), and for
    --engine vllm a running EngineProcess whose "default" server is `options.server` (tests share one engine)."""
    from kvbridge.server.client import KVBridgeClient

    config = config or EvalConfig()
    modes: list[Mode] = parse_modes(options.modes)
    if options.engine == "vllm":
        from kvbridge.eval.vllm_eval import check_vllm_modes
        from kvbridge.vllm.engine import vllm_available

        check_vllm_modes(modes)
        if options.prior:
            raise ValueError("--prior: vLLM reads loaded KV as it is, with no induction prior")
        if vllm_available():
            raise RuntimeError(f"--engine vllm: {vllm_available()}")
    records = read_records(options.data, options.exclude)
    if options.limit is not None:
        if options.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {options.limit}")
        records = records[:options.limit]
    torch.manual_seed(options.seed)
    if target is None or (source is None and options.server is None):
        from kvbridge.transfer.presets import load_pair

        source, target = load_pair(options.preset)
    running, cost = None, None
    if options.server is None:
        running = start_local_server(source, target, options.preset, options.adapter, options.fit_adapter, adapter)
        address = running.address
        if source is not None:
            _, served = running.service.adapters.resolve("", source.spec, target.spec)
            cost = PairCost.of(source.model.config, target.model.config, served)
    else:
        address = options.server  # the server's adapter is not known here: no system cost
    try:
        with KVBridgeClient(address, token=options.token, timeout_s=600) as client:
            docs = [d for d in (prepare(r, target, config) for r in records) if d is not None]
            skipped = len(records) - len(docs)
            if len(docs) < 1:
                raise ValueError(f"none of the {len(records)} documents has {config.min_doc_tokens} target tokens "
                                 f"of context plus {config.continuation_tokens} held out")
            t0 = time.perf_counter()
            if options.engine == "vllm":
                from kvbridge.eval.vllm_eval import run_vllm

                out = Path(options.out)
                out.mkdir(parents=True, exist_ok=True)
                results, engine_meta = run_vllm(target, address, modes, config, docs, client,
                                                out.resolve() / "engine.log", options.vllm_dtype,
                                                options.token or "", options.progress, engine)
                engine_meta["induction_prior"] = None  # vLLM reads loaded KV as it is
            else:
                results, engine_meta = _run_in_process(options, config, modes, docs, client, target, source)
            elapsed = time.perf_counter() - t0
            adapters = client.list_adapters()
            adapter_label = next((f"{a.name}@{a.version}" for a in adapters if a.is_default), "") if adapters else ""
    finally:
        if running is not None:
            running.stop(1)
    summary = summarise(results, options.bootstrap, options.seed, cost)
    meta = {"data": str(options.data), "exclude": options.exclude, "preset": options.preset,
            "source": source.name if source is not None else "(server)", "target": target.name,
            "adapter": adapter_label, "modes": [m.name for m in modes], "config": asdict(config),
            "skipped_short": skipped, "seconds": round(elapsed, 1), **engine_meta,
            "seed": options.seed, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    paths = write_report(Path(options.out), summary, results, meta)
    return {"summary": summary, "paths": paths, "meta": meta, "results": results}


def _run_in_process(options: RunOptions, config: EvalConfig, modes: list[Mode], docs, client, target, source
                    ) -> tuple[list, dict]:
    """The in-process harness (eval.summaries) over `docs`, fitting fuse's gates and loading the fuser first when
    the modes ask for them; (results, meta: the gates and the priors the modes read with)."""
    projected = ProjectedSource(client, target)
    gates, gate_report = None, None
    if any(m.kind == "fuse" for m in modes):
        from kvbridge.eval.gates import fit_gates

        gates, gate_report = fit_gates(target, projected, steps=config.fuse_steps, progress=options.progress)
    fuser = None
    if any(m.kind == "fuser" for m in modes):
        if source is None or not options.fuser:
            raise ValueError("the fuser mode needs --fuser FILE and the source model here (not --server)")
        from kvbridge.adapters.fuser import Fuser

        fuser = Fuser.load(options.fuser, source, target)
    evaluator = SummaryEvaluator(target, modes, config, projected, gates, fuser, options.prior)
    results = [evaluator.run(doc) for doc in tqdm(docs, desc=f"{len(modes)} modes per document",
                                                   disable=not options.progress)]
    return results, {"engine": "transformers", "gates": gate_report,
                     "gate_values": gates.tolist() if gates is not None else None,
                     # what the modes without a suffix read with, checked against the adapter the fetches'
                     # headers name (a local or a remote server's)
                     "induction_prior": _prior_meta(evaluator.prior, projected.adapter_digest),
                     "induction_prior_probe": _prior_meta(evaluator.priors.get("probe"))}  # what /probe modes read
