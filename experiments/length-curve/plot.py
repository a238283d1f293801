"""Recovery and fidelity against document length: `kvbridge eval rouge` runs of the same documents cut at several
lengths, drawn as one figure (a panel per measure, a line per mode, bootstrap 95% intervals as bars) and printed as
the markdown table of docs/quality.md.

    .venv/bin/python experiments/length-curve/plot.py 256=eval-man-256 1024=eval-man-1024 2048=eval-man-2048 \
        --modes replace/noprior,replace,blend:0.1 --out docs/quality_vs_length.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MEASURES = (("nll_recovery", "NLL recovery"), ("fidelity_rougeL", "fidelity ROUGE-L vs full"),
            ("top1_agreement", "top-1 agreement"), ("greedy_agreement", "greedy agreement"))

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("runs", nargs="+", metavar="TOKENS=RUN", help="a document length and its eval rouge --out folder")
parser.add_argument("--modes", required=True, help="modes drawn, comma-separated")
parser.add_argument("--out", type=Path, required=True, help="the figure (.png)")
parser.add_argument("--title", default="")
args = parser.parse_args()

runs = []
for item in args.runs:
    tokens, _, path = item.partition("=")
    if not path:
        parser.error(f"{item!r}: give TOKENS=RUN")
    summary = json.loads((Path(path) / "results.json").read_text())["summary"]
    runs.append((int(tokens), summary))
runs.sort(key=lambda r: r[0])
modes = args.modes.split(",")
for tokens, summary in runs:
    missing = [m for m in modes if m not in summary["modes"]]
    if missing:
        parser.error(f"the {tokens}-token run has no mode {missing}")
docs = {summary["documents"] for _, summary in runs}
if len(docs) != 1:
    parser.error(f"the runs scored different numbers of documents: {sorted(docs)}")


def figure(summary: dict, mode: str, key: str) -> tuple[float, float, float] | None:
    e = summary["modes"][mode].get(key)
    return None if e is None else (e.get("value", e.get("mean")), e["low"], e["high"])  # recovery: value; means: mean


print("| document tokens | mode | " + " | ".join(label for _, label in MEASURES) + " |")
print("|---|---|" + "---|" * len(MEASURES))
for tokens, summary in runs:
    for mode in modes:
        cells = []
        for key, _ in MEASURES:
            f = figure(summary, mode, key)
            cells.append("–" if f is None else f"{f[0]:.3f} [{f[1]:.3f}, {f[2]:.3f}]")
        print(f"| {tokens:,} | `{mode}` | " + " | ".join(cells) + " |")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(1, len(MEASURES), figsize=(4.2 * len(MEASURES), 3.8))
lengths = [tokens for tokens, _ in runs]
for ax, (key, label) in zip(axes, MEASURES):
    for i, mode in enumerate(modes):
        points = [(t, figure(s, mode, key)) for t, s in runs]
        points = [(t, f) for t, f in points if f is not None]
        if not points:
            continue
        xs = [t * (1 + 0.03 * (i - (len(modes) - 1) / 2)) for t, _ in points]  # side by side, bars apart
        ys = [f[0] for _, f in points]
        err = [[f[0] - f[1] for _, f in points], [f[2] - f[0] for _, f in points]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{t:,}" for t in lengths])
    ax.set_xlabel("document tokens")
    ax.set_title(label)
    ax.grid(alpha=0.3)
axes[0].legend()
fig.suptitle(args.title or f"{docs.pop()} documents at each length, 95% bootstrap intervals")
fig.tight_layout()
args.out.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.out, dpi=100)
print("wrote", args.out)
