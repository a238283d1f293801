"""`kvbridge eval rouge`: load a preset's pair, serve it in-process on a loopback port (or use a running server),
make sure an adapter is loaded, fit fuse's gates when asked for, run every document under every mode with progress
bars, and write the report."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from kvbridge.eval.cost import PairCost
from kvbridge.eval.modes import DEFAULT_MODES, NEEDS_PROJECTION, Mode, parse_modes
from kvbridge.eval.records import read_records
from kvbridge.eval.report import check_out, summarise, write_report
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, SummaryEvaluator, prepare, run_documents
from kvbridge.transfer.models import LoadedModel

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
    force: bool = False  # write the report into an --out folder that already holds files

    def __post_init__(self):
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"engine must be transformers or vllm, got {self.engine!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.bootstrap < 1:
            raise ValueError(f"--bootstrap must be >= 1 (resamples for the 95% intervals), got {self.bootstrap}")
        if self.server is not None:  # a running server projects with its own default adapter, never one given here
            for given, flag in ((self.adapter, "--adapter"), (self.fit_adapter, "--fit-adapter")):
                if given:
                    raise ValueError(f"{flag} loads an adapter into the in-process server, and --server "
                                     f"{self.server} projects with its own default adapter for the pair: make the "
                                     "adapter that server's default (`kvbridge serve --default-adapter NAME`), or "
                                     "leave out --server")


def check_run(options: RunOptions, config: EvalConfig, modes: list[Mode]) -> None:
    """The run's mistakes in its options that would otherwise show only after models load or documents ran, named
    first (--out is checked once the data is read: report.check_out)."""
    served = [m.name for m in modes if m.kind == "served"]
    if options.prior and not config.induction_prior:
        raise ValueError("--prior names the induction prior the modes read with, and --no-induction-prior turns it "
                         "off: give one or the other")
    if options.server is not None and served and (options.prior or not config.induction_prior):
        flag = "--prior" if options.prior else "--no-induction-prior"
        raise ValueError(f"{flag} with --server and {served[0]}: the running server corrects served modes with its "
                         "own prior (`kvbridge serve --correction-prior-file FILE` or --no-correction-prior); "
                         f"start it so, and leave out {flag}, or leave out --server")
    if options.prior and not Path(options.prior).is_file():
        raise FileNotFoundError(f"--prior {options.prior}: no such file")
    if any(m.kind == "fuser" for m in modes):
        if options.server is not None or not options.fuser:
            raise ValueError("the fuser mode needs --fuser FILE and the source model here (not --server)")
        if not Path(options.fuser).is_file():
            raise FileNotFoundError(f"--fuser {options.fuser}: no such file")


def start_local_server(source: LoadedModel, target: LoadedModel, preset: str, adapter_file: str | None,
                       fit_adapter: bool, adapter=None, correction_prior: bool = True,
                       correction_prior_file: str | None = None, needs_adapter: bool = True):
    """An in-process kvbridge server on a free loopback port with the adapter (an Adapter object, a file, else the
    adapter folder's default for the pair, fitted there when asked) loaded as the pair's default; without one where
    `needs_adapter` is False (no mode projects). Its served corrections read with `correction_prior_file` (None: the
    prior that ships for the target), or with none where `correction_prior` is False."""
    from kvbridge.adapters.io import load_adapter
    from kvbridge.server.app import adapter_folder, build_service, fit_default_adapter, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset=preset, listen="127.0.0.1:0", selfcheck=False, store_capacity_mb=1024,
                         correction="replace", correction_prior=correction_prior,
                         correction_prior_file=correction_prior_file)
    service = build_service(config, source=source, targets=[target])
    if adapter is not None:
        service.adapters.add("given", adapter, make_default=True)
    elif adapter_file:
        path = Path(adapter_file)
        service.adapters.add(path.name.removesuffix(".safetensors"), load_adapter(path), make_default=True)
    elif service.adapters.default_for(target.spec) is None and (needs_adapter or fit_adapter):
        folder = adapter_folder(config)
        if not fit_adapter:
            raise FileNotFoundError(f"no adapter for {source.name} -> {target.name} in {folder}: pass --adapter "
                                    "FILE, or --fit-adapter to fit one there (about two minutes on the small pair)")
        fit_default_adapter(source, target, folder)
        service.adapters.autoload()
    return start_server(service, config)


def _local_adapter(running, source: LoadedModel, target: LoadedModel, adapter_file: str | None):
    """(digest, file or None, the Adapter) of the in-process server's default adapter for the pair; ("", None,
    None) where it has none."""
    from kvbridge.adapters.shipped import find_shipped

    name = running.service.adapters.default_for(target.spec)
    if name is None:
        return "", None, None
    _, adapter = running.service.adapters.resolve("", source.spec, target.spec)
    if adapter_file:
        return adapter.digest, str(Path(adapter_file).resolve()), adapter
    try:
        path = running.service.adapters.path(name)
    except ValueError:
        path = None
    if path is None or not path.is_file():
        shipped = find_shipped(source.spec, target.spec)
        path = shipped if shipped is not None and shipped.stem == name else None
    return adapter.digest, str(path.resolve()) if path is not None else None, adapter


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
    --engine vllm a running EngineProcess whose "default" server is `options.server` (tests share one engine).
    Mistakes in the options are named before anything loads; a document that fails stops the run, and the
    documents before it are written as a partial run (meta["partial"]) before the error is raised."""
    from kvbridge.server.client import KVBridgeClient

    config = config or EvalConfig()
    modes: list[Mode] = parse_modes(options.modes)
    if options.engine == "vllm":
        from kvbridge.eval.vllm_eval import check_vllm_modes
        from kvbridge.vllm.engine import vllm_available

        check_vllm_modes(modes)
        if options.prior:
            raise ValueError("--prior: vLLM reads loaded KV as it is, with no induction prior")
    check_run(options, config, modes)
    if options.engine == "vllm" and vllm_available():
        raise RuntimeError(f"--engine vllm: {vllm_available()}")
    records = read_records(options.data, options.exclude)
    if options.limit is not None:
        records = records[:options.limit]
    check_out(Path(options.out), options.force)
    started_with = _held(Path(options.out))
    torch.manual_seed(options.seed)
    if target is None or (source is None and options.server is None):
        from kvbridge.transfer.presets import load_pair

        # with --server the source runs there: here only its name and shapes (no weights)
        source, target = load_pair(options.preset, source_weights=options.server is None)
    running, cost, digest, adapter_path = None, None, "", None
    if options.server is None:
        projects = any(m.kind in NEEDS_PROJECTION for m in modes)
        running = start_local_server(source, target, options.preset, options.adapter, options.fit_adapter, adapter,
                                     correction_prior=config.induction_prior, correction_prior_file=options.prior,
                                     needs_adapter=projects)
        address = running.address
        digest, adapter_path, served = _local_adapter(running, source, target, options.adapter)
        if served is not None:
            cost = PairCost.of(source.model.config, target.model.config, served)
        served_prior = (options.prior or "the target's own (shipped, else probed)") if config.induction_prior \
            else None
    else:
        address, source = options.server, None  # the server's adapter is not known here: no system cost
        served_prior = "the server's own (its --correction-prior-file, or the target's shipped prior)"
    failure = None
    try:
        with KVBridgeClient(address, token=options.token, timeout_s=600) as client:
            adapters = client.list_adapters()  # a server that cannot be reached fails here, before any document
            adapter_label = next((f"{a.name}@{a.version}" for a in sorted(
                adapters, key=lambda a: a.target_model != target.name) if a.is_default), "")
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
                results, engine_meta, failure = run_vllm(target, address, modes, config, docs, client,
                                                         out.resolve() / "engine.log", options.vllm_dtype,
                                                         options.token or "", options.progress, engine)
                engine_meta["induction_prior"] = None  # vLLM reads loaded KV as it is
            else:
                results, engine_meta, failure, fetched = _run_in_process(options, config, modes, docs, client,
                                                                         target, source)
                digest = digest or fetched  # a running server's: what its fetches' headers named
            elapsed = time.perf_counter() - t0
    finally:
        if running is not None:
            running.stop(1)
    if failure is not None and not results:
        raise failure[1]  # nothing finished: nothing to write
    summary = summarise(results, options.bootstrap, options.seed, cost)
    meta = {"data": str(options.data), "exclude": options.exclude, "preset": options.preset,
            "source": source.name if source is not None else "(server)", "target": target.name,
            "adapter": adapter_label, "adapter_digest": digest, "adapter_path": adapter_path,
            "modes": [m.name for m in modes], "config": asdict(config),
            "skipped_short": skipped, "seconds": round(elapsed, 1), **engine_meta,
            "served_correction_prior": served_prior,
            "seed": options.seed, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if failure is not None:
        doc_id, exc = failure
        meta["partial"] = {"failed_document": doc_id, "error": f"{type(exc).__name__}: {exc}",
                           "documents_done": len(results), "documents_planned": len(docs)}
    paths = write_report(_report_folder(Path(options.out), options.force, started_with), summary, results, meta,
                         force=True)  # check_out looked at --out before the run; _report_folder since
    if failure is not None:
        doc_id, exc = failure
        if isinstance(exc, KeyboardInterrupt):
            log.warning("interrupted at document %s: the %d before it are written to %s as a partial run", doc_id,
                        len(results), options.out)
            raise exc
        raise RuntimeError(f"document {doc_id} failed ({type(exc).__name__}: {exc}); the {len(results)} of "
                           f"{len(docs)} documents before it are written to {options.out} as a partial run "
                           "(results.json meta.partial)") from exc
    return {"summary": summary, "paths": paths, "meta": meta, "results": results}


def _held(out: Path) -> dict[str, int]:
    """The files in `out` and their modification times (ns): what a run found there when it started."""
    held = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(out) as names:
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # removed or renamed meanwhile (an atomic writer's file)
                held[name.name] = name.stat().st_mtime_ns
    return held


def _report_folder(out: Path, force: bool, started_with: dict[str, int]) -> Path:
    """Where the report goes: --out, unless another run wrote a report there meanwhile (files added or changed
    since this run began, other than this run's engine.log): then a new folder beside it, said in the log, so neither
    run's report is written over nor mixed with the other's. --force writes over what was there at the start only."""
    changed = sorted(name for name, mtime in _held(out).items()
                     if name != "engine.log" and started_with.get(name) != mtime)
    if not changed:
        return out
    moved = out.with_name(f"{out.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    log.warning("--out %s: %s written there by another run while this one ran%s: this run's report goes to %s",
                out, ", ".join(changed[:3]), "" if not force else " (--force writes over what was there before)",
                moved)
    return moved


def _run_in_process(options: RunOptions, config: EvalConfig, modes: list[Mode], docs, client, target, source
                    ) -> tuple[list, dict, tuple | None, str]:
    """The in-process harness (eval.summaries) over `docs`, fitting fuse's gates and loading the fuser first when
    the modes ask for them; (results, meta: the gates and the priors the modes read with, the document that stopped
    the run and why or None, the digest of the adapter the fetches were projected by)."""
    projected = ProjectedSource(client, target)
    gates, gate_report = None, None
    if any(m.kind == "fuse" for m in modes):
        from kvbridge.eval.gates import fit_gates

        gates, gate_report = fit_gates(target, projected, steps=config.fuse_steps, progress=options.progress)
    fuser = None
    if any(m.kind == "fuser" for m in modes):  # check_run made sure of the file and the source here
        from kvbridge.adapters.fuser import Fuser

        fuser = Fuser.load(options.fuser, source, target)
    evaluator = SummaryEvaluator(target, modes, config, projected, gates, fuser, options.prior)
    results, failure = run_documents(evaluator.run, docs, f"{len(modes)} modes per document", options.progress)
    return results, {"engine": "transformers", "gates": gate_report,
                     "gate_values": gates.tolist() if gates is not None else None,
                     # what the modes without a suffix read with, checked against the adapter the fetches'
                     # headers name (a local or a remote server's)
                     "induction_prior": _prior_meta(evaluator.prior, projected.adapter_digest),
                     "induction_prior_probe": _prior_meta(evaluator.priors.get("probe"))  # what /probe modes read
                     }, failure, projected.adapter_digest
