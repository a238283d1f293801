"""Dev recovery against wall time and against steps for every arm (WORK/runs/*/record.json) -> WORK/recovery.png
(docs/adapter-training/recovery_vs_steps.png).

  python experiments/adapter-training/plot.py
"""

import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of the arms (default: experiments/out/arms)")
parser.add_argument("--out", type=Path, help="the figure (default: WORK/recovery.png)")
args = parser.parse_args()

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

runs = args.work / "runs"
out = args.out or args.work / "recovery.png"
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
for d in sorted(runs.iterdir()):
    rec = d / "record.json"
    if not rec.exists():
        continue
    r = json.loads(rec.read_text())
    t0 = 0.0
    first = {"chain_kl": "chain_attn", "chain_mlp_kl": "attn_mlp", "chain_mlp_kl_lo": "attn_mlp"}.get(d.name)
    if first and (runs / first / "record.json").exists():  # a chain's second stage starts where its first ended
        t0 = json.loads((runs / first / "record.json").read_text())[-1]["elapsed_s"]
    axes[0].plot([t0 + x["elapsed_s"] for x in r], [x["dev_recovery"] for x in r], marker="o", ms=3, label=d.name)
    axes[1].plot([x["iter"] for x in r], [x["dev_recovery"] for x in r], marker="o", ms=3, label=d.name)
axes[0].set_xlabel("wall time (s, 1 CPU thread, shared machine)")
axes[1].set_xlabel("steps (4 windows each)")
for ax in axes:
    ax.set_ylabel("dev recovery (22 held-out dev windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.suptitle("Gemma-3-270M -> SmolLM2-135M: held-out recovery during training")
fig.tight_layout()
fig.savefig(out, dpi=110)
print("wrote", out)
