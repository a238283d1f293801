"""Issue 38, point 4: dev recovery against kl steps for each number of training windows, and held-out recovery and
fidelity against the number of windows (the runs of experiments/data-need/curve.sh).

    .venv/bin/python experiments/data-need/plot.py WORK docs/adapter-training/data_need.png [--none RUN] [--base RUN]

Held-out recovery needs the `none` mode's NLL: from each run, or from --none RUN (an eval rouge run of the same
documents with `none` and `full`: neither depends on the adapter, and `full` is checked equal). --base RUN: paired
differences of recovery against that run's `replace/noprior` (e.g. the shipped adapter's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("work", type=Path, help="the WORK folder of experiments/data-need/curve.sh")
parser.add_argument("out", type=Path, help="the figure (.png)")
parser.add_argument("--none", type=Path, help="an eval rouge run (folder) of the same documents with none and full")
parser.add_argument("--base", type=Path, help="an eval rouge run (folder) to pair replace/noprior against")
args = parser.parse_args()

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
from kvbridge.adapters.scoring import bootstrap_draws, bootstrap_recovery, interval95, recovery_ratio  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODE = "replace/noprior"


def documents(run: Path) -> list[dict]:
    return json.loads((run / "results.json").read_text())["documents"]


def nll(docs: list[dict], mode: str) -> np.ndarray:
    return np.array([d["modes"][mode]["nll"] for d in docs], dtype=np.float64)


reference = documents(args.none) if args.none else None
draws = None
runs = sorted((int(p.name[1:]), p) for p in args.work.glob("w[0-9]*") if p.is_dir())
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
points = []
for n, path in runs:
    run = args.work / f"eval-w{n}"
    if not (run / "results.json").exists():
        print(f"{run}: no eval run yet, left out")
        continue
    rows = json.loads((path / "stage-0-kl" / "record.json").read_text())
    a.plot([r["iter"] for r in rows], [r["dev_recovery"] for r in rows], label=f"{n} windows")
    docs = documents(run)
    ref = reference or docs
    assert [d["id"] for d in ref] == [d["id"] for d in docs], "the runs score other documents"
    assert np.array_equal(nll(ref, "full"), nll(docs, "full")), "full's NLL differs: not the same target or documents"
    none, full, mode = nll(ref, "none"), nll(ref, "full"), nll(docs, MODE)
    rec = bootstrap_recovery(none, full, mode)
    line = {"windows": n, "best dev recovery": round(max(r["dev_recovery"] for r in rows), 3),
            "recovery": [round(x, 3) for x in rec]}
    summary = json.loads((run / "results.json").read_text())["summary"]["modes"][MODE]
    for key in ("fidelity_rougeL", "top1_agreement", "greedy_agreement"):
        line[key] = [round(summary[key][k], 3) for k in ("mean", "low", "high")]
    if args.base:
        base = nll(documents(args.base), MODE)
        draws = bootstrap_draws(len(none)) if draws is None else draws
        diff = recovery_ratio(none, full, mode, draws) - recovery_ratio(none, full, base, draws)
        point = float(recovery_ratio(none, full, mode, np.arange(len(none))[None])[0]
                      - recovery_ratio(none, full, base, np.arange(len(none))[None])[0])
        line["recovery vs base"] = [round(point, 3), *[round(x, 3) for x in interval95(diff)]]
    points.append((n, line))
    print(json.dumps(line))
a.set_xlabel("kl steps (4 windows each)")
a.set_ylabel("dev recovery (22 held-out corpus windows)")
a.legend()
a.set_title("kl from one ridge fit (100 windows)")
ns = [p[0] for p in points]
for key, label in (("recovery", "held-out NLL recovery"), ("fidelity_rougeL", "fidelity ROUGE-L vs full"),
                   ("top1_agreement", "top-1 agreement")):
    b.errorbar(ns, [p[1][key][0] for p in points], yerr=np.array([[p[1][key][0] - p[1][key][1],
                                                                     p[1][key][2] - p[1][key][0]] for p in points]).T,
               marker="o", capsize=3, label=label)
b.plot(ns, [p[1]["best dev recovery"] for p in points], marker="x", linestyle="--", label="best dev recovery")
b.set_xscale("log")
b.set_xlabel("training windows (192 + 64 tokens)")
b.set_title(f"{MODE}, 100 held-out pydoc pages, 256 tokens")
b.legend(fontsize=8)
fig.tight_layout()
fig.savefig(args.out, dpi=110)
