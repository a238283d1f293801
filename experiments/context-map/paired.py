"""Held-out recovery of `replace/noprior` in several `eval rouge` runs of the same documents, and each run's paired
difference from the first, with `none` and `full` taken from the run that has them (`--reference`; the data-need
runs scored `full` and `replace/noprior` only). scoring.py's recovery and document bootstrap (95%).

    .venv/bin/python experiments/context-map/paired.py --reference WORK/eval-ctx-w4r64 \
        WORK/eval-w3000 WORK/eval-ctx-w4r64 WORK/eval-ctx-lag1-w8r64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="eval rouge --out folders; the first is the base")
    parser.add_argument("--reference", type=Path, required=True, help="a run of the same documents with none, full")
    parser.add_argument("--mode", default="replace/noprior")
    args = parser.parse_args(argv)

    import numpy as np
    from kvbridge.adapters.scoring import bootstrap_draws, interval95, recovery_ratio

    def documents(run: Path) -> dict[str, dict]:
        return {d["id"]: d["modes"] for d in json.loads((run / "results.json").read_text())["documents"]}

    ref = documents(args.reference)
    ids = sorted(ref)
    none = np.array([ref[i]["none"]["nll"] for i in ids])
    full = np.array([ref[i]["full"]["nll"] for i in ids])
    draws = bootstrap_draws(len(ids))
    every = np.arange(len(ids))[None]
    base = None
    for run in args.runs:
        modes = documents(run)
        if sorted(modes) != ids:
            raise SystemExit(f"{run} scored other documents than {args.reference}")
        if any(abs(modes[i]["full"]["nll"] - ref[i]["full"]["nll"]) > 1e-3 for i in ids if "full" in modes[i]):
            raise SystemExit(f"{run}: full's NLLs differ from {args.reference}'s: not the same documents and cut")
        mode = np.array([modes[i][args.mode]["nll"] for i in ids])
        value = recovery_ratio(none, full, mode, every)[0]
        lo, hi = interval95(recovery_ratio(none, full, mode, draws))
        line = f"{run.name}: {args.mode} recovery {value:.3f} [{lo:.3f}, {hi:.3f}]"
        if base is None:
            base = mode
        else:
            diff = recovery_ratio(none, full, mode, draws) - recovery_ratio(none, full, base, draws)
            d_lo, d_hi = interval95(diff)
            line += (f", paired vs {args.runs[0].name}: {value - recovery_ratio(none, full, base, every)[0]:+.3f} "
                     f"[{d_lo:+.3f}, {d_hi:+.3f}]")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
