"""The foundation's subcommands of `kvbridge`: `selfcheck` and `models prepare|info`."""

from __future__ import annotations

import argparse
import time

from kvbridge.transfer.devices import DTYPE_NAMES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", help="production preset: source model folder or HF repo id in the local HF cache")
    p.add_argument("--target", help="production preset: target model folder or HF repo id in the local HF cache")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="auto: bfloat16 on CUDA, float32 elsewhere")


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from kvbridge.transfer.models import model_from_config_file
    from kvbridge.transfer.presets import load_pair
    from kvbridge.transfer.selfcheck import run_selfcheck

    presets = args.preset or ([] if args.config else ["small"])
    if not presets and (args.source or args.target):  # they name the production preset's weights; --config alone
        raise ValueError("--source/--target apply to the production preset (--preset production), not to --config")
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
    if args.preset == "production":
        from kvbridge.transfer.shaped_pair import capacity_lines, kv_bytes_per_token, production_shapes

        for role, item in production_shapes().items():
            if role in ("source", "target"):
                print(f"{role} {item['name']} ({item['from']}): {kv_bytes_per_token(item['config']):,} KV bytes/token "
                      "in bf16")
        for gb in args.gpu_gb:
            print("\n".join(capacity_lines(gb)))
    try:
        source, target = load_pair(args.preset, args.source, args.target, dtype=args.dtype, device=args.device)
    except FileNotFoundError as exc:
        if args.preset != "production":
            raise
        print(f"weights: not on this machine: {exc}. Give --source/--target folders, set $KVBRIDGE_SOURCE/"
              "$KVBRIDGE_TARGET, or put the models in the local Hugging Face cache (nothing is downloaded)")
        return 1
    for lm in (source, target):
        print("\n".join(lm.spec.describe()))
        print(f"  loaded from {lm.origin}")
    return 0


def add_parsers(sub) -> None:
    from kvbridge.transfer.presets import PRESETS

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
    p = msub.add_parser("info", help="print the ModelSpec of a preset's models (production: also bytes per token and "
                                     "store capacity per GPU size, from the shipped shapes)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--gpu-gb", type=float, nargs="+", default=[80, 141], help="GPU sizes for the production pair's "
                                                                              "capacity lines (default 80 141)")
    _add_model_args(p)
    p.set_defaults(func=cmd_models_info)
