"""The `kvbridge` command, assembled at the top from the subcommands each layer offers (`add_parsers` of
kvbridge.transfer.cli and .corpus, .adapters.cli, .server.cli and .eval.cli), plus `bench` (the repository's bench/
folder). Subcommands import their part lazily."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def bench_folder() -> Path:
    """The repository's bench/ folder: benchmarks live beside the package sources, not in the installed package."""
    return Path(__file__).resolve().parents[1] / "bench"


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


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.adapters.average import add_parsers as average_parsers
    from kvbridge.adapters.cli import add_parsers as adapters_parsers
    from kvbridge.eval.cli import add_parsers as eval_parsers
    from kvbridge.eval.prior_cli import add_parsers as prior_parsers
    from kvbridge.server.cli import add_parsers as server_parsers
    from kvbridge.transfer.cli import add_parsers as transfer_parsers
    from kvbridge.transfer.corpus import add_parsers as corpus_parsers

    parser = argparse.ArgumentParser(prog="kvbridge", description="kvbridge: a small causal LM generates from the "
                                     "projected KV cache of a large one.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    transfer_parsers(sub)
    server_parsers(sub)
    adapters_parsers(sub)
    average_parsers(sub)
    # prefix_chars="+": this parser has no options of its own, so "--quick" or "--help" land in `rest` (with "-"
    # as a prefix, argparse refuses a REMAINDER that starts with an option, bpo-17050)
    p = sub.add_parser("bench", help="run every benchmark of a source checkout and print one table of ratios "
                                     "(bench/bench_all.py)", add_help=False, prefix_chars="+")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    eval_parsers(sub)
    prior_parsers(sub)
    corpus_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except Exception as exc:
        if not isinstance(exc, (ValueError, FileNotFoundError, RuntimeError, OSError, *_server_errors())):
            raise
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _server_errors() -> tuple[type, ...]:
    """KVBridgeError (a server's reply: unreachable, refused, failed), where the command imported the client: a
    message, not a traceback (importing it here would load gRPC for every command)."""
    replies = sys.modules.get("kvbridge.server.replies")
    return (replies.KVBridgeError,) if replies is not None else ()


if __name__ == "__main__":
    sys.exit(main())
