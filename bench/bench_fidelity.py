"""What users read, measured where the speed is: each mode's greedy answer against the target's own (`full`), in one
run on the machine named in the header (STYLE rule 9).

On the first N pages of the packaged held-out pydoc set (`transfer/data/pydoc_heldout.jsonl`: no adapter training
read them; earlier experiments compared checkpoints on them), cut to 512 target tokens with 32 held out, through a
kvbridge server in this process, as `kvbridge eval rouge` runs them (eval/run.py, the same code): the instruction
after the document, greedy decoding, no penalties, at most 24 new tokens. Per mode:

- fidelity: ROUGE-L of the mode's answer against `full`'s (with a 95% bootstrap interval);
- top-1 agreement: the share of the held-out continuation's positions where the mode's next-token argmax is `full`'s;
- greedy agreement: the share of the first 24 greedy tokens identical to `full`'s, position by position;
- NLL recovery: (NLL none - NLL mode) / (NLL none - NLL full) over the held-out continuations.

Modes: replace/noprior (the projection as vLLM serves it: no attention bias), replace (with the target's induction
prior, in-process), served:blend:0.1 (the server's stored correction, fetched as gRPC clients get it) and blend:0.1
(the same correction computed here). The goals are issue 38's (measured on >= 100 pages there; N here is a sample).

    .venv/bin/python bench/bench_fidelity.py [--quick] [--docs N] [--adapter FILE] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

PRESET = "small"
MODES = "full,none,replace/noprior,replace,served:blend:0.1,blend:0.1"
# issue 38's goals: (fidelity, NLL recovery)
GOALS = {"replace/noprior": (0.55, 0.85), "served:blend:0.1": (0.65, None), "blend:0.1": (0.65, None)}
QUICK_DOCS, FULL_DOCS = 3, 24


def measure(source, target, adapter, docs: int) -> dict:
    """Run the modes on the first `docs` held-out pages; {"documents", "modes": {name: {fidelity, top1, greedy,
    recovery}}}, each a {"mean", "low", "high"} (recovery: "value", "low", "high"), None where not defined."""
    from kvbridge.eval.run import RunOptions, evaluate
    from kvbridge.transfer.data import data_path

    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-fidelity-") as out:
        options = RunOptions(data=str(data_path("pydoc_heldout.jsonl")), preset=PRESET, modes=MODES, limit=docs,
                             out=out, progress=False)
        report = evaluate(options, source, target, adapter=adapter)
    table = report["summary"]["modes"]
    result = {"documents": report["summary"]["documents"], "modes": {}}
    for name, entry in table.items():
        if name in ("full", "none"):
            continue
        result["modes"][name] = {"fidelity": entry.get("fidelity_rougeL"), "top1": entry.get("top1_agreement"),
                                 "greedy": entry.get("greedy_agreement"), "recovery": entry.get("nll_recovery")}
    return result


def _interval(m: dict | None, key: str = "mean") -> str:
    return "-" if m is None else f"{m[key]:.3f} [{m['low']:.3f}, {m['high']:.3f}]"


def lines(result: dict) -> list[str]:
    out = []
    for name, m in result["modes"].items():
        goal_f, goal_r = GOALS.get(name, (None, None))
        verdict = "" if goal_f is None else (
            f" (goal fidelity >= {goal_f}" + (f", recovery >= {goal_r}" if goal_r else "") + ")")
        out.append(f"fidelity {name} on {result['documents']} held-out pydoc pages: ROUGE-L vs full "
                   f"{_interval(m['fidelity'])}, top-1 {_interval(m['top1'])}, greedy agreement "
                   f"{_interval(m['greedy'])}, NLL recovery {_interval(m['recovery'], 'value')}{verdict}; CPU "
                   f"capability {torch.backends.cpu.get_cpu_capability()}")
    return out


def run(argv: list[str] | None = None) -> dict:
    from machine import machine_line

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_DOCS} pages instead of {FULL_DOCS}")
    p.add_argument("--docs", type=int, help="pages (overrides --quick)")
    p.add_argument("--adapter", metavar="FILE", help="adapter file (default: the shipped one for the pair)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    for name, value in (("--docs", args.docs), ("--threads", args.threads)):
        if value is not None and value < 1:  # --docs 0 would otherwise run the default count
            p.error(f"{name} must be >= 1, got {value}")
    if args.adapter and not Path(args.adapter).is_file():
        p.error(f"--adapter {args.adapter}: no such file")
    torch.set_num_threads(args.threads)
    print(machine_line("quick" if args.quick else "full"), flush=True)
    from bench_suffix import get_adapter
    from kvbridge.transfer.presets import load_pair

    source, target = load_pair(PRESET, device="cpu")
    adapter, note = get_adapter(args.adapter, source, target)
    print(f"setup   {source.name} -> {target.name}; {note}", flush=True)
    docs = args.docs if args.docs is not None else QUICK_DOCS if args.quick else FULL_DOCS
    result = measure(source, target, adapter, docs)
    for line in lines(result):
        print(line, flush=True)
    return result


if __name__ == "__main__":
    run(sys.argv[1:])
    sys.exit(0)
