"""The `kvbridge` command: subcommands for every part of the product (each imports its part lazily)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", help="production preset: source model folder or HF repo id in the local HF cache")
    p.add_argument("--target", help="production preset: target model folder or HF repo id in the local HF cache")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when present)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from kvbridge.transfer.models import model_from_config_file
    from kvbridge.transfer.presets import load_pair
    from kvbridge.transfer.selfcheck import run_selfcheck

    presets = args.preset or ([] if args.config else ["small"])
    failed = 0
    total = 0

    def report(lm) -> None:
        nonlocal failed, total
        t0 = time.perf_counter()
        for result in run_selfcheck(lm):
            print(result.line(), flush=True)
            total += 1
            failed += not result.passed
        print(f"      {lm.name}: checks took {time.perf_counter() - t0:.1f} s", flush=True)

    for preset in presets:
        t0 = time.perf_counter()
        source, target = load_pair(preset, args.source, args.target, dtype=args.dtype, device=args.device)
        print(f"preset {preset}: loaded {source.name} and {target.name} in {time.perf_counter() - t0:.1f} s "
              f"on {source.device}", flush=True)
        report(source)
        report(target)
    for path in args.config or []:
        report(model_from_config_file(path, seed=args.seed, dtype=args.dtype, device=args.device))
    print(f"selfcheck: {total - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from kvbridge.transfer.models import PACKAGED, kvbridge_home, prepare_gguf

    for name in args.names or sorted(PACKAGED):
        t0 = time.perf_counter()
        folder = prepare_gguf(name, force=args.force)
        print(f"{name}: {folder} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"KVBRIDGE_HOME={kvbridge_home()}")
    return 0


def cmd_models_info(args: argparse.Namespace) -> int:
    from kvbridge.transfer.presets import PRESETS, load_pair

    preset = PRESETS[args.preset]
    print(f"preset {preset.name}: {preset.source} -> {preset.target} ({preset.note})")
    source, target = load_pair(args.preset, args.source, args.target, dtype=args.dtype, device=args.device)
    for lm in (source, target):
        print("\n".join(lm.spec.describe()))
        print(f"  loaded from {lm.origin}")
    return 0


def cmd_train_adapter(args: argparse.Namespace) -> int:
    from kvbridge.adapters.cli import main as train_main

    return train_main(args.rest, prog="kvbridge train-adapter")


def bench_folder() -> Path:
    """The repository's bench/ folder: benchmarks live beside the package sources, not in the installed package."""
    import kvbridge.server

    return Path(kvbridge.server.__file__).resolve().parents[1] / "bench"


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    folder = bench_folder()
    script = folder / "bench_all.py"
    if not script.is_file():
        raise FileNotFoundError(f"no {script}: `kvbridge bench` runs bench/bench_all.py of a kvbridge source checkout "
                                "(installed with pip install -e), and this kvbridge was installed without the "
                                "repository's bench folder")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # bench/ is not a package: its modules import each other by name
    return importlib.import_module("bench_all").main(args.rest, prog="kvbridge bench")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbridge.server.app import serve, setup_logging
    from kvbridge.server.config import ServeConfig

    setup_logging(verbose=True, as_json=args.log_json)
    overrides = {k: getattr(args, k) for k in (
        "preset", "source", "target", "device", "dtype", "adapters", "default_adapter", "store_device",
        "store_capacity_mb", "cpu_tier_mb", "block_size", "redis_url", "default_ttl_s", "listen", "tls_cert", "tls_key",
        "token_file", "max_message_mb", "chunk_kb", "workers", "metrics_listen", "grace_s", "detector_layers")}
    for flag in ("fit_adapter", "allow_remote_without_tokens", "log_json", "detector_strict"):
        overrides[flag] = True if getattr(args, flag) else None
    overrides["selfcheck"] = False if args.no_selfcheck else None
    config = ServeConfig.load(args.config, **overrides)
    return serve(config, ready_file=args.ready_file)


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.transfer.presets import PRESETS

    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("selfcheck", help="check RoPE identities and exact inject-and-continue on models")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS),
                   help="model pair to check (repeatable; default small unless --config is given)")
    p.add_argument("--config", action="append", metavar="CONFIG_JSON",
                   help="a transformers config.json: checked as a random-init model (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of random-init models built from --config")
    _add_model_args(p)
    p.set_defaults(func=cmd_selfcheck)

    models = sub.add_parser("models", help="prepare and inspect models")
    msub = models.add_subparsers(dest="models_command", required=True)
    p = msub.add_parser("prepare", help="convert the packaged GGUF models to safetensors under KVBRIDGE_HOME once")
    p.add_argument("names", nargs="*", help="packaged model names (default: all)")
    p.add_argument("--force", action="store_true", help="convert again even if a converted copy exists")
    p.set_defaults(func=cmd_models_prepare)
    p = msub.add_parser("info", help="print the ModelSpec of a preset's models")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    _add_model_args(p)
    p.set_defaults(func=cmd_models_info)
    p = sub.add_parser("serve", help="run the gRPC service (kvbridge.v1) until SIGINT/SIGTERM")
    p.add_argument("--config", metavar="TOML", help="a TOML file of ServeConfig fields; flags override it")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model pair (default small)")
    p.add_argument("--source", help="production preset: source model folder or cached repo id")
    p.add_argument("--target", help="production preset: target model folder or cached repo id")
    p.add_argument("--device", default=None, help="where models run: cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--adapters", metavar="DIR", help="adapter folder (default KVBRIDGE_HOME/adapters)")
    p.add_argument("--default-adapter", metavar="NAME", help="adapter to load at start (default: newest matching)")
    p.add_argument("--fit-adapter", action="store_true",
                   help="fit a ridge adapter at start if the folder has none for the pair (about a minute)")
    p.add_argument("--store-device", default=None, help="device of the block pool (default: cuda when present)")
    p.add_argument("--store-capacity-mb", type=float, default=None, help="block pool size (default: half the free "
                                                                          "memory)")
    p.add_argument("--cpu-tier-mb", type=float, default=None, help="CPU tier under the pool (default 0: none)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default 16)")
    p.add_argument("--redis-url", help="Redis/Valkey tier shared by replicas, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--default-ttl-s", type=float, default=None, help="TTL of entries stored without one")
    p.add_argument("--listen", default=None, help="host:port (default 127.0.0.1:50051; port 0 picks a free one)")
    p.add_argument("--allow-remote-without-tokens", action="store_true",
                   help="let a server without --token-file listen on a non-loopback address")
    p.add_argument("--tls-cert", help="PEM certificate chain (TLS only, with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--token-file", help="'tenant token' lines: bearer tokens and their tenants")
    p.add_argument("--max-message-mb", type=float, default=None, help="largest gRPC message (default 8)")
    p.add_argument("--chunk-kb", type=int, default=None, help="KV chunk size on the wire (default 1024)")
    p.add_argument("--workers", type=int, default=None, help="gRPC worker threads (default 8)")
    p.add_argument("--metrics-listen", help="host:port of a Prometheus /metrics endpoint (default: off)")
    p.add_argument("--grace-s", type=float, default=None, help="shutdown drain time (default 10)")
    p.add_argument("--detector-layers", type=int, nargs="+", default=None,
                   help="layers whose attention entropy Ingest's DETECT_SEGMENTS uses (default: all)")
    p.add_argument("--detector-strict", action="store_true", help="5 positions below 0.75 nats (default 3 below 0.8)")
    p.add_argument("--no-selfcheck", action="store_true", help="skip the start-up self-checks (not for production)")
    p.add_argument("--log-json", action="store_true", help="structured logs: one JSON object per line")
    p.add_argument("--ready-file", help="write the bound address as JSON here once serving (for scripts)")
    p.set_defaults(func=cmd_serve)

    # prefix_chars="+" here and for bench: these parsers have no options of their own, so "--corpus" or "--help"
    # land in `rest` (with "-" as a prefix, argparse refuses a REMAINDER that starts with an option, bpo-17050)
    p = sub.add_parser("train-adapter", help="fit a projection adapter (same as the train-adapter command)",
                       add_help=False, prefix_chars="+")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_train_adapter)

    p = sub.add_parser("bench", help="run every benchmark of a source checkout and print one table of ratios "
                                     "(bench/bench_all.py)", add_help=False, prefix_chars="+")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    from kvbridge.eval.cli import add_parsers

    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
