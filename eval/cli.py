"""The `kvbridge eval rouge|compare|heldout` and `kvbridge demo` subcommands (assembled by kvbridge.cli)."""

from __future__ import annotations

import argparse
import re

from kvbridge.eval.modes import DEFAULT_MODES
from kvbridge.eval.summaries import EvalConfig


def add_parsers(sub) -> None:
    from kvbridge.transfer.presets import PRESETS

    ev = sub.add_parser("eval", help="evaluate transfer quality and cost end to end")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    from kvbridge.eval.heldout import add_parser as add_heldout

    add_heldout(esub)
    p = esub.add_parser("rouge", help="summaries under each transfer mode: ROUGE, NLL recovery, FLOPs, TTFT, bytes")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="records with id, document and summary")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--adapter", metavar="FILE", help="adapter file (default: the adapter folder's default)")
    p.add_argument("--fit-adapter", action="store_true", help="fit a ridge adapter into the folder if it has none")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated (default {DEFAULT_MODES})")
    p.add_argument("--fuser", metavar="FILE", help="a trained fuser (train-adapter --trainer fuser) for mode 'fuser'")
    p.add_argument("--limit", type=int, help="evaluate only the first N records")
    p.add_argument("--exclude", metavar="FILE.jsonl",
                   help="skip records whose id is in this file (records, or lines of an id alone: {\"id\": ...})")
    p.add_argument("--out", default="eval-out", metavar="DIR",
                   help="where results.json, table.md and the plot go: a new or empty folder (see --force)")
    p.add_argument("--force", action="store_true", help="write the report into an --out folder that holds files, "
                                                        "over the report there")
    p.add_argument("--server", metavar="HOST:PORT",
                   help="use a running kvbridge server (default: serve in-process); it projects with its own default "
                        "adapter and corrects served modes with its own prior (no --adapter, --fit-adapter, or, "
                        "with a served mode, --prior or --no-induction-prior)")
    p.add_argument("--token", help="bearer token for --server")
    p.add_argument("--max-doc-tokens", type=int, default=EvalConfig.max_doc_tokens,
                   help="cut documents to this many target tokens")
    p.add_argument("--continuation-tokens", type=int, default=EvalConfig.continuation_tokens,
                   help="held-out tokens after the cut, for NLL recovery")
    p.add_argument("--max-new-tokens", type=int, default=EvalConfig.max_new_tokens, help="summary length (greedy)")
    p.add_argument("--instruction", default=EvalConfig.instruction,
                   help="the text after the document that asks for the answer (default %(default)r; backslash "
                        "escapes such as \\n are read as such)")
    p.add_argument("--fuse-steps", type=int, default=EvalConfig.fuse_steps, help="Adam steps fitting fuse's gates")
    p.add_argument("--no-induction-prior", action="store_true",
                   help="read projected KV as it is in every mode (default: with the target's induction prior, "
                        "but in modes named with /noprior; /probe: the probe's prior)")
    p.add_argument("--prior", metavar="FILE",
                   help="the induction prior the modes without a suffix read (`kvbridge prior fit --adapter ADAPTER "
                        "--out FILE`; default: the one that ships for the target; the report says when it was "
                        "fitted for another adapter than the one evaluated)")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="the target's engine: transformers in this process (default), or a vLLM engine that gets "
                        "projected KV through the kvbridge connector, as vLLM deployments do (modes full, none, "
                        "tail:R, replace, recompute:R, served:C; needs the vLLM venv: KVBRIDGE_VLLM=1 ./setup.sh)")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"),
                   help="--engine vllm: the engine's dtype (default: bfloat16 where the CPU has it natively, else "
                        "float32)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval_rouge)

    p = esub.add_parser("compare", help="paired differences between two eval rouge runs on their shared documents "
                                        "(runs of the same settings: data file, document and continuation length, "
                                        "summary length, instruction)")
    p.add_argument("a", metavar="RUN_A", help="a results.json, or the --out folder of an eval rouge run")
    p.add_argument("b", metavar="RUN_B")
    p.add_argument("--pairs", required=True, metavar="MODE_A=MODE_B,...",
                   help="modes compared (a mode without '=' is compared with itself)")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_eval_compare)

    p = sub.add_parser("demo", help="the README's main job: a server, a projected document, summaries side by side")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--doc", metavar="ID", help="a record of the shipped sample (default pydoc:sndhdr)")
    p.add_argument("--max-doc-tokens", type=int, default=512, help="cut the document to this many target tokens")
    p.add_argument("--max-new-tokens", type=int, default=EvalConfig.max_new_tokens)
    p.add_argument("--adapters", metavar="DIR", help="adapter folder (default KVBRIDGE_HOME/adapters)")
    p.add_argument("--no-selfcheck", action="store_true", help="start the server without its self-checks")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="the target's engine: transformers in this process (default), or vLLM with the kvbridge "
                        "connector (needs the vLLM venv: KVBRIDGE_VLLM=1 ./setup.sh)")
    p.set_defaults(func=cmd_demo)


def cmd_eval_rouge(args: argparse.Namespace) -> int:
    from kvbridge.eval.run import RunOptions, evaluate

    config = EvalConfig(max_doc_tokens=args.max_doc_tokens, continuation_tokens=args.continuation_tokens,
                        max_new_tokens=args.max_new_tokens, fuse_steps=args.fuse_steps,
                        induction_prior=not args.no_induction_prior, instruction=_unescape(args.instruction))
    options = RunOptions(data=args.data, preset=args.preset, modes=args.modes, adapter=args.adapter,
                         fit_adapter=args.fit_adapter, fuser=args.fuser, limit=args.limit, exclude=args.exclude,
                         out=args.out, server=args.server, token=args.token, seed=args.seed, bootstrap=args.bootstrap,
                         progress=not args.no_progress, engine=args.engine, vllm_dtype=args.vllm_dtype or "",
                         prior=args.prior, force=args.force)
    result = evaluate(options, config=config)
    print(result["paths"]["markdown"].read_text())
    for name, path in result["paths"].items():
        print(f"{name}: {path}")
    return 0


def _unescape(text: str) -> str:
    r"""'\n\nSummary:' as typed in a shell -> two line breaks, then 'Summary:' (\n, \t and \\ only)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def cmd_eval_compare(args: argparse.Namespace) -> int:
    from kvbridge.eval.compare import compare, markdown, parse_pairs, read_run

    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap must be >= 1 (resamples for the 95% intervals), got {args.bootstrap}")
    a, b = read_run(args.a), read_run(args.b)
    print(markdown(compare(a, b, parse_pairs(args.pairs), args.bootstrap, args.seed), a, b))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvbridge.eval.demo import run_demo
    from kvbridge.eval.demo_vllm import run_demo_vllm

    run = run_demo_vllm if args.engine == "vllm" else run_demo
    return run(preset=args.preset, doc_id=args.doc, max_doc_tokens=args.max_doc_tokens,
                    max_new_tokens=args.max_new_tokens, adapters=args.adapters, selfcheck=not args.no_selfcheck)
