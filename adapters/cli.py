"""`train-adapter`: fit a projection adapter between two models, print its per-layer table and its recovery.

--trainer ridge (default): the closed-form fit on a corpus sample, optionally refined end to end.
--trainer chain: the trained recipe (adapters/chain.py): teacher cache, ridge, then stages such as attention
                 matching and KL (--stages), folded into a format-1 adapter; resumable from --work.
--trainer fuser: the learned fuser on the same recipe (stages "ce"): the target keeps its own prefill and the
                 source adds to it; written as a format-2 fuser file.

chain and fuser also run under torchrun (adapters/distributed.py): the teacher cache, the ridge statistics and every
step's batch are split by rank, the statistics and gradients summed; the result is one process's, rank 0 writes it."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.adapters.layer_map import LAYER_MAPS
from kvbridge.transfer.data import data_path
from kvbridge.transfer.devices import DTYPE_NAMES
from kvbridge.transfer.tensor_files import write_text

if TYPE_CHECKING:
    from kvbridge.adapters.distributed import Launch

TORCHRUN = ("under torchrun (chain, fuser; gloo on CPUs, NCCL on GPUs), e.g. two processes on one machine:\n"
            "  torchrun --standalone --nproc-per-node 2 -m kvbridge.adapters.cli --trainer chain --corpus FILE... "
            "--work W")


def build_parser(prog: str = "train-adapter") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=TORCHRUN,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", "small", "production"], default=None,
                   help="model pair (default small, unless --source/--target are given)")
    p.add_argument("--source", help="source model folder or HF repo id in the local cache (production pair)")
    p.add_argument("--target", help="target model folder or HF repo id in the local cache (production pair)")
    p.add_argument("--corpus", nargs="+", metavar="FILE",
                   help="fitting corpus: .txt or .jsonl ('text' field) files (default: the packaged "
                        "pydoc_corpus_sample.txt, 400 KB of Python documentation)")
    p.add_argument("--out", help="adapter file (.safetensors); default KVBRIDGE_HOME/adapters/<pair>--<layer map or "
                                 "trainer>.safetensors (a model given by a path or a repo id is named there by its "
                                 "last part and a short hash of the whole)")
    p.add_argument("--trainer", choices=["ridge", "chain", "fuser"], default="ridge",
                   help="ridge: closed form (+ --refine-steps); chain: teacher cache, ridge, trained stages; "
                        "fuser: a learned fuser over the target's own prefill")
    p.add_argument("--stages", default=None,
                   help="chain/fuser: OBJECTIVE:STEPS,... (default attention:300,kl:600; fuser: ce:600)")
    p.add_argument("--stage-lr", default="", help="chain/fuser: OBJECTIVE=LR,... (default 3e-3 each; 1e-3 for the "
                                                  "answer stages); an OBJECTIVE that is no stage is refused")
    p.add_argument("--train-windows", type=int, default=1400, help="chain/fuser: training windows in the cache")
    p.add_argument("--ridge-windows", type=int, default=200, help="chain/fuser: of them, for the ridge fit")
    p.add_argument("--dev-per-corpus", type=int, default=12, help="chain/fuser: held-out dev windows per file")
    p.add_argument("--batch-windows", type=int, default=4,
                   help="chain/fuser: windows per optimiser step (under torchrun the ranks split them)")
    p.add_argument("--fuser-rank", type=int, default=64, help="fuser: rank of the residual per layer and map")
    p.add_argument("--token-rank", type=int, default=64,
                   help="chain: the maps also read the target's own token features of this rank (adapter format 2; "
                        "0: source features only)")
    p.add_argument("--source-rank", type=int, default=0,
                   help="chain: the maps read a basis of this rank over the K and V of all source layers, fitted by "
                        "reduced-rank regression (adapter format 3; the small pair: 192), instead of a mix of --k "
                        "layers of one kind (0)")
    p.add_argument("--context-window", type=int, default=0, metavar="W",
                   help="chain: the maps also read the W target tokens before each token through a small MLP (adapter "
                        "format 4; the small pair: 8; 0: none)")
    p.add_argument("--context-rank", type=int, default=32, help="chain: the hidden width of that MLP per layer")
    p.add_argument("--context-no-norm", action="store_true",
                   help="chain: that MLP without the norm of its filtered inputs (adapter format 5): the projection "
                        "then runs the filter as one GEMM per lag with the maps, not as elementwise passes")
    p.add_argument("--init", metavar="ADAPTER",
                   help="chain: start from this trained adapter of the pair (no ridge fit; its token rank and its "
                        "context branch, formats 4-5, are kept and trained on), e.g. to fine-tune it with --exact-tail "
                        "or on longer windows (--context-tokens)")
    p.add_argument("--exact-tail", type=float, default=0.0, metavar="F",
                   help="chain/fuser: in half the kl/ce steps the context's last k tokens (k up to F of it) are "
                        "prefilled exactly after the projected rest, as selective recompute does (0: never)")
    p.add_argument("--answer-windows", type=int, default=0, metavar="N",
                   help="chain: N answer windows (a document of --answer-lengths tokens, an instruction after it, the "
                        "target's own answer) for stages 'answer' (teacher-forced KL over the answer), 'decision' "
                        "(that KL and a hinge on the answer's greedy decisions) and 'onpolicy' "
                        "(KL over the student's own greedy answer, scored by the target's own prefill), which keep "
                        "the checkpoint of best dev fidelity; with any, every stage reports dev fidelity")
    p.add_argument("--decision-weight", type=float, default=1.0, metavar="W",
                   help="chain: a 'decision' stage's hinge on the answer's greedy decisions, W times beside its "
                        "answer KL (default 1)")
    p.add_argument("--keep", choices=("best", "last"), default="best",
                   help="chain: each stage's checkpoint: the best by its dev score (recovery; fidelity for "
                        "answer stages), or the last step (docs/answers.md: a small dev set picks answer "
                        "checkpoints by chance)")
    p.add_argument("--answer-dev", type=int, default=0, metavar="N",
                   help="chain: dev answer windows per file, from held-out dev documents, asked in a wording no "
                        "training window uses; their fidelity picks an answer stage's checkpoint (default: "
                        "--dev-per-corpus; 50 a file makes the choice steadier, at ~0.4 s a window every probe)")
    p.add_argument("--answer-lengths", default="256,512,1024,2048",
                   help="chain: document tokens an answer window may hold, drawn per window")
    p.add_argument("--work", help="chain/fuser: folder of the teacher cache and checkpoints (a rerun of the same "
                                  "command resumes; one that asks other options, another corpus or another --init is "
                                  "refused by name); default KVBRIDGE_HOME/train/<pair>")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written maps, every trainer (a shipped adapter is bfloat16); the recorded "
                        "recovery is that of the written maps")
    p.add_argument("--layer-map", default="proportional", choices=LAYER_MAPS)
    p.add_argument("--k", type=int, default=3, help="source layers mixed per target layer with --layer-map mix")
    p.add_argument("--max-tokens", type=int, default=16_384, help="target tokens of corpus to read (train + held-out)")
    p.add_argument("--window-tokens", type=int, default=256)
    p.add_argument("--refine-steps", type=int, default=0,
                   help="end-to-end refinement steps through the frozen target after the ridge fit (0: none)")
    p.add_argument("--refine-lr", type=float, default=1e-5, help="Adam learning rate of the refinement")
    p.add_argument("--refine-docs", type=int, default=64, help="corpus pieces the refinement samples from")
    p.add_argument("--stats", help="ridge: file to keep the accumulated statistics in, written when they are all in "
                                   "and at most every 10 minutes before; a rerun resumes from it")
    p.add_argument("--eval", metavar="FILE", help="held-out documents (.jsonl with 'document' or 'text'); default: "
                                                  "the packaged pydoc_heldout.jsonl")
    p.add_argument("--eval-docs", type=int, default=20, help="documents for the recovery figure (0: skip it)")
    p.add_argument("--context-tokens", type=int, default=192,
                   help="projected context tokens of the evaluation documents and, for chain/fuser, of every teacher "
                        "window (default 192; past Gemma's 512-token sliding window, e.g. 1024, to train for long "
                        "documents: a new --work folder)")
    p.add_argument("--continuation-tokens", type=int, default=64,
                   help="tokens after the context that are scored (default 64)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="auto: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def model_component(name: str) -> str:
    """A model's name as one component of a default path: the name itself when it is one ("tiny-qwen2"), else its
    last part and a short hash of the whole, so that no two models share one ("/models/Qwen2-7B" and "Qwen/Qwen2-7B"
    -> "Qwen2-7B-" and two different 8-digit hashes)."""
    if re.fullmatch(r"[\w+-][\w.+-]*", name):
        return name
    parts = [p for p in re.split(r"[\\/]+", name) if p not in ("", ".", "..")]
    base = re.sub(r"[^\w.+-]", "_", parts[-1] if parts else "").lstrip(".") or "model"
    return f"{base}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def default_out(home: Path, source: str, target: str, kind: str) -> Path:
    """--out's default: home/adapters/<source>--<target>--<kind>.safetensors, one file name whatever the models'."""
    return home / "adapters" / f"{model_component(source)}--{model_component(target)}--{kind}.safetensors"


def default_work(home: Path, source: str, target: str) -> Path:
    """--work's default: home/train/<source>--<target>, one folder name whatever the models'."""
    return home / "train" / f"{model_component(source)}--{model_component(target)}"


# options only some trainers read (the sizes of the chain's windows, --work and the ridge's corpus sizes are left
# out: runs and scripts share them across trainers)
OTHER_TRAINERS_OPTIONS = {
    "--init": ("chain", "fuser"), "--stages": ("chain", "fuser"), "--stage-lr": ("chain", "fuser"),
    "--exact-tail": ("chain", "fuser"), "--answer-windows": ("chain", "fuser"), "--token-rank": ("chain",),
    "--source-rank": ("chain",), "--context-window": ("chain",), "--refine-steps": ("ridge",), "--stats": ("ridge",)}


def check_options(args: argparse.Namespace) -> None:
    """Refuse, by the option's name, what is wrong before any model loads (chain.ChainConfig names the rest of the
    chain's options when it is made, still before any model loads)."""
    if args.out and Path(args.out).suffix != ".safetensors":
        raise ValueError(f"--out {args.out}: adapter files end in .safetensors")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    if args.eval_docs < 0 or args.eval_docs == 1:
        raise ValueError(f"--eval-docs {args.eval_docs}: the recovery figure needs 2 documents or more (0 skips it)")
    if args.init and not Path(args.init).is_file():
        raise FileNotFoundError(f"--init {args.init}: no such adapter file")
    if args.trainer == "fuser" and args.fuser_rank < 1:
        raise ValueError(f"--fuser-rank must be >= 1 for --trainer fuser, got {args.fuser_rank}")
    # what the other trainer would have done: ignored, it gave another adapter than the one asked for (--trainer
    # ridge --init X fitted a fresh ridge and recorded no training at all)
    defaults = build_parser()
    for option, trainers in OTHER_TRAINERS_OPTIONS.items():
        name = option[2:].replace("-", "_")
        if args.trainer not in trainers and getattr(args, name) != defaults.get_default(name):
            raise ValueError(f"{option} is an option of --trainer {' or '.join(trainers)}; --trainer {args.trainer} "
                             "does not read it")


def eval_documents(args: argparse.Namespace, source, target) -> list:
    """The held-out documents of the recovery figure (--eval, --eval-docs), prepared before any training: fewer than
    two long enough for --context-tokens + --continuation-tokens are refused then, not after the training."""
    if not args.eval_docs:
        return []
    from kvbridge.adapters.evaluate import prepare_documents
    from kvbridge.adapters.train import read_corpus

    path = args.eval or str(data_path("pydoc_heldout.jsonl"))
    texts, _ = read_corpus([path])
    docs = prepare_documents(texts, source, target, args.context_tokens, args.continuation_tokens,
                             limit=args.eval_docs)
    if len(docs) < 2:
        raise ValueError(f"--eval-docs {args.eval_docs}: {path} holds {len(docs)} document(s) of at least "
                         f"{args.context_tokens} + {args.continuation_tokens} target tokens (--context-tokens, "
                         "--continuation-tokens); the recovery figure needs 2 or more (--eval-docs 0 skips it)")
    return docs


def run(args: argparse.Namespace) -> int:
    import torch
    from kvbridge.adapters.distributed import Launch
    from kvbridge.adapters.evaluate import evaluate_recovery
    from kvbridge.adapters.io import save_adapter
    from kvbridge.adapters.refine import refine_adapter
    from kvbridge.adapters.train import TrainConfig, read_corpus, train_adapter
    from kvbridge.transfer.models import kvbridge_home
    from kvbridge.transfer.presets import load_pair

    check_options(args)
    torch.manual_seed(args.seed)
    launch = Launch.from_env()
    if args.trainer != "ridge":
        return run_chain(args, launch)
    if launch is not None and launch.world_size > 1:
        raise ValueError("--trainer ridge runs in one process; under torchrun use --trainer chain (its ridge fit, "
                         "teacher cache and stages are split over the ranks)")
    preset = args.preset or ("production" if (args.source or args.target) else "small")
    config = TrainConfig(layer_map=args.layer_map, k=args.k, window_tokens=args.window_tokens,
                         max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    source, target = load_pair(preset, args.source, args.target, dtype=args.dtype, device=args.device)
    print(f"{source.name} -> {target.name} on {target.device} ({time.perf_counter() - t0:.1f} s to load)", flush=True)
    docs = eval_documents(args, source, target)
    corpus = args.corpus or [str(data_path("pydoc_corpus_sample.txt"))]
    t0 = time.perf_counter()
    adapter, report = train_adapter(source, target, corpus, config, stats_path=args.stats, progress=not args.quiet)
    fit_s = time.perf_counter() - t0
    print(f"ridge fit: {report.windows} windows, layer map {args.layer_map}, {fit_s:.1f} s: {report.split()}")
    print(report.table())
    result_json: dict = {"layers": report.layers, "fit_seconds": fit_s, "layer_map": args.layer_map,
                         "split": {"documents": report.documents, "train_tokens": report.train_tokens,
                                   "select_tokens": report.select_tokens, "heldout_tokens": report.heldout_tokens}}
    if args.refine_steps:
        t0 = time.perf_counter()
        before = None
        if docs:
            before = evaluate_recovery(source, target, adapter, docs, seed=args.seed, progress=not args.quiet,
                                       wrong=False)
            print(f"before refinement: recovery {before.recovery['projected']:.3f}")
        texts, _ = read_corpus(corpus)
        adapter, losses = refine_adapter(source, target, adapter, texts, steps=args.refine_steps, seed=args.seed,
                                         lr=args.refine_lr, max_documents=args.refine_docs,
                                         context_tokens=args.context_tokens,
                                         continuation_tokens=args.continuation_tokens, progress=not args.quiet)
        print(f"refinement: {args.refine_steps} steps, KL {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"({time.perf_counter() - t0:.1f} s)")
        result_json["refine"] = {"steps": args.refine_steps, "kl_first": losses[0], "kl_last": losses[-1],
                                 "recovery_before": before.recovery["projected"] if before else None}
    if args.save_dtype != "float32":  # the file's figures are of the file's maps: rounded before they are evaluated
        adapter = adapter.with_maps_dtype(getattr(torch, args.save_dtype))
    if docs:
        t0 = time.perf_counter()
        result = evaluate_recovery(source, target, adapter, docs, seed=args.seed, progress=not args.quiet)
        for line in result.lines():
            print(line)
        print(f"(evaluation {time.perf_counter() - t0:.1f} s)")
        adapter.meta.metrics["recovery"] = result.recovery
        adapter.meta.metrics["recovery_ci95"] = result.interval
        adapter.meta.metrics["nll"] = result.nll
        adapter.meta.metrics["eval_documents"] = result.documents
        result_json["recovery"] = {"nll": result.nll, "recovery": result.recovery, "interval": result.interval,
                                   "documents": result.documents, "scored_tokens": result.scored_tokens}
    heldout_mean = {key: sum(r[key] for r in report.layers) / len(report.layers)
                    for key in ("r2_k", "cos_k", "r2_v", "cos_v")}
    if args.refine_steps:  # the report's figures are of the ridge maps, which refinement changed: said so by name
        adapter.meta.metrics["ridge_fit_heldout_layers"] = adapter.meta.metrics.pop("heldout_layers", report.layers)
        adapter.meta.metrics["ridge_fit_heldout_mean"] = heldout_mean
    else:
        adapter.meta.metrics["heldout_mean"] = heldout_mean
    out = Path(args.out) if args.out else default_out(kvbridge_home(), source.name, target.name, args.layer_map)
    save_adapter(adapter, out)
    print(f"adapter written to {out}")
    _prior_hint(preset, out)
    if args.json:
        write_text(args.json, json.dumps(result_json, indent=2, default=float))
    return 0


def _stage_lr(text: str) -> dict:
    """"kl=1e-2,attention=3e-3" -> {"kl": 0.01, "attention": 0.003} (names and values: chain.ChainConfig checks)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--stage-lr takes OBJECTIVE=LR,..., got {part!r}") from None
    return out


def run_chain(args: argparse.Namespace, launch: Launch | None = None) -> int:
    """--trainer chain|fuser: adapters.chain.train_chain, then the held-out recovery on --eval documents. launch
    (distributed.Launch): torchrun's; every rank trains, rank 0 evaluates and writes."""
    import dataclasses
    import platform
    import shlex

    import torch
    from kvbridge.adapters.answer_windows import AnswerConfig
    from kvbridge.adapters.chain import DEFAULT_LR, ChainConfig, parse_stages, train_chain
    from kvbridge.adapters.distributed import process_group
    from kvbridge.adapters.evaluate import evaluate_recovery
    from kvbridge.adapters.fuser import as_saved, save_fuser
    from kvbridge.adapters.io import save_adapter
    from kvbridge.adapters.pairs import start_token_id
    from kvbridge.adapters.recovery_probe import RecoveryProbe
    from kvbridge.adapters.teacher import TeacherConfig
    from kvbridge.transfer.models import kvbridge_home
    from kvbridge.transfer.presets import load_pair

    if not args.corpus:
        raise ValueError(f"--trainer {args.trainer} needs --corpus FILE... (e.g. data/pydoc_corpus.txt "
                         "data/kernel_docs_corpus.txt, made by `kvbridge data build --out data`)")
    fuser = args.trainer == "fuser"
    stages = parse_stages(args.stages or ("ce:600" if fuser else "attention:300,kl:600"))
    # the queries (45% of a teacher window) only for attention matching
    teacher = TeacherConfig(context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
                            queries=any(name == "attention" for name, _ in stages))
    config = ChainConfig(stages=stages, teacher=teacher, fuser_rank=args.fuser_rank if fuser else 0,
                         token_rank=0 if fuser else args.token_rank, source_rank=0 if fuser else args.source_rank,
                         context_window=0 if fuser else args.context_window, context_rank=args.context_rank,
                         context_norm=not args.context_no_norm,
                         train_windows=args.train_windows, ridge_windows=args.ridge_windows,
                         dev_per_corpus=args.dev_per_corpus, layer_map="mix" if args.layer_map == "proportional"
                         else args.layer_map, k=args.k, lr=DEFAULT_LR | _stage_lr(args.stage_lr), seed=args.seed,
                         init=args.init or "", exact_tail=args.exact_tail,
                         decision_weight=args.decision_weight, batch_windows=args.batch_windows,
                         answer_windows=args.answer_windows, answer_dev=args.answer_dev, keep=args.keep,
                         answer=AnswerConfig(lengths=tuple(int(n) for n in args.answer_lengths.split(","))))
    preset = args.preset or ("production" if (args.source or args.target) else "small")
    main_rank = launch is None or launch.rank == 0
    device = args.device if launch is None else launch.device(args.device)
    with process_group(launch, device):
        source, target = load_pair(preset, args.source, args.target, dtype=args.dtype, device=device)
        docs = eval_documents(args, source, target)  # (every rank: each refuses too few before any work)
        work = Path(args.work) if args.work else default_work(kvbridge_home(), source.name, target.name)
        if main_rank:
            ranks = f", {launch.world_size} ranks" if launch else ""
            print(f"{source.name} -> {target.name}: {args.trainer}, stages {stages}, work folder {work}{ranks}",
                  flush=True)
        maps, record = train_chain(source, target, args.corpus, config, work,
                                   progress=not args.quiet and main_rank)
    if not main_rank:
        return 0
    for st in record["stages"]:
        fidelity = (f", fidelity {st['dev_fidelity']:.3f} (ROUGE-L {st['dev_rougeL']:.3f}, top-1 {st['dev_top1']:.3f}, "
                    f"greedy {st['dev_greedy']:.3f})" if "dev_fidelity" in st else "")
        print(f"stage {st['objective']}: {st['steps']} steps ({st['seconds']} s, {st['tokens_per_s']} tok/s), best "
              f"step {st['best_step']} by {st['select']}: dev recovery {st['dev_recovery']:.3f}{fidelity}")
    corpus = {"files": [Path(f).name for f in args.corpus],
              "sha256": {Path(f).name: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in args.corpus},
              "windows": record["teacher_windows"], "heldout_fraction": config.heldout_fraction,
              "doc_chars": config.doc_chars,  # (eval.heldout.training_split reads it; older files: the sentence)
              "documents": f"runs of ~{config.doc_chars} characters of consecutive paragraphs; held out when "
                           f"blake2b(id) < {config.heldout_fraction} (dev windows come from those only)"}
    argv = args.argv if hasattr(args, "argv") else sys.argv[1:]  # (main's; a Namespace made elsewhere: the process's)
    training = {"command": "train-adapter " + shlex.join(argv),
                "trainer": args.trainer, "record": record, "machine": f"{platform.machine()}, "
                f"{torch.get_num_threads()} torch threads", "seed": args.seed}
    if args.init:  # what this run started from, so the chain of commands reproduces it from scratch
        from kvbridge.adapters.io import read_adapter_meta

        init_meta = read_adapter_meta(args.init) or {}
        training["init"] = {"file": Path(args.init).name,
                            "sha256": hashlib.sha256(Path(args.init).read_bytes()).hexdigest(),
                            "training": init_meta.get("training", {}), "metrics": init_meta.get("metrics", {})}
    metrics: dict = {}
    out = Path(args.out) if args.out else default_out(kvbridge_home(), source.name, target.name, args.trainer)
    dtype = getattr(torch, args.save_dtype)
    if fuser:
        maps = as_saved(maps, dtype)  # the file's figures are of the file's weights: folded, rounded to --save-dtype
        if docs:
            # start_kv None: a fuser keeps the start token's own KV
            probe = RecoveryProbe.from_documents(source, target, None, docs, start_token_id(target.tokenizer),
                                                 own=True)
            r = probe.recovery(maps, seed=args.seed, wrong=True)
            metrics["recovery_fused"] = [r["recovery"], *r["interval"]]
            metrics["recovery_wrong_document"] = [r["wrong"], *r["wrong_interval"]]
            metrics["own_minus_wrong"] = [r["own_minus_wrong"], *r["own_minus_wrong_interval"]]
            metrics["nll"] = r["nll"]
            metrics["eval_documents"] = r["documents"]
            print(f"fused: recovery {r['recovery']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}] on "
                  f"{r['documents']} documents; NLL own prefill {r['nll']['full']:.4f}, fused "
                  f"{r['nll']['projected']:.4f}, none {r['nll']['none']:.4f}")
            print(f"wrong-document control (another document's source read into this one's own cache): "
                  f"{r['wrong']:.3f} [{r['wrong_interval'][0]:.3f}, {r['wrong_interval'][1]:.3f}]; own minus wrong "
                  f"{r['own_minus_wrong']:.3f} [{r['own_minus_wrong_interval'][0]:.3f}, "
                  f"{r['own_minus_wrong_interval'][1]:.3f}]")
        meta = dataclasses.replace(_ridge_meta(work), corpus=corpus, training=training, metrics=metrics)
        save_fuser(maps, meta, out, dtype=dtype)
    else:
        # the file's figures are of the file's weights: evaluated after the maps are rounded to --save-dtype
        adapter = maps.with_maps_dtype(dtype) if dtype != torch.float32 else maps
        if docs:
            result = evaluate_recovery(source, target, adapter, docs, seed=args.seed, progress=not args.quiet)
            for line in result.lines():
                print(line)
            metrics |= {"recovery": result.recovery, "recovery_ci95": result.interval, "nll": result.nll,
                        "eval_documents": result.documents}
        adapter = dataclasses.replace(adapter, meta=dataclasses.replace(adapter.meta, corpus=corpus,
                                                                       training=training, metrics=metrics))
        save_adapter(adapter, out)
    print(f"{args.trainer} written to {out} ({out.stat().st_size / 1e6:.1f} MB)")
    if args.trainer == "chain":
        _prior_hint(preset, out)
    if args.json:
        write_text(args.json, json.dumps({"record": record, "metrics": metrics}, indent=2, default=float))
    return 0


def _ridge_meta(work: Path):
    from kvbridge.adapters.io import load_adapter

    return load_adapter(work / "ridge" / "ridge.safetensors").meta


def add_parsers(sub) -> None:
    """`kvbridge train-adapter ARGS`: the same as the train-adapter command."""
    # prefix_chars="+": no options of its own, so "--corpus" or "--help" land in `rest` (with "-" as a prefix,
    # argparse refuses a REMAINDER that starts with an option, bpo-17050)
    p = sub.add_parser("train-adapter", help="fit a projection adapter (same as the train-adapter command)",
                       add_help=False, prefix_chars="+")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.rest, prog="kvbridge train-adapter"))


def main(argv: list[str] | None = None, prog: str = "train-adapter") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv  # the command the adapter records (training.command)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _prior_hint(preset: str, out: Path) -> None:
    """The command that fits the target's induction prior for this adapter (corrections and `eval rouge` read the
    shipped one otherwise, fitted for the shipped adapter, and say so)."""
    print(f"its induction prior: kvbridge prior fit --preset {preset} --data DATA --adapter {out} --out PRIOR "
          "(then `serve --correction-prior-file PRIOR`, `eval rouge --prior PRIOR`)")


if __name__ == "__main__":
    sys.exit(main())
