"""How often an answer repeats the request instead of answering it: for each `kvbridge eval rouge` run (its --out
folder), its instruction, and per mode the answers that name a summary or end with a colon (the request said back,
"The one-line summary of the text above is:", with the content on a next line that a one-line answer never reaches),
empty answers, and ROUGE-L against the reference.

    .venv/bin/python experiments/instruction/answers.py RUN [RUN ...]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPEATED = re.compile(r"summar|:\s*$", re.IGNORECASE)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="an eval rouge --out folder")
args = parser.parse_args()

print("| instruction | mode | documents | request repeated | empty | ROUGE-L vs reference |")
print("|---|---|---|---|---|---|")
for run in args.runs:
    data = json.loads((run / "results.json").read_text())
    docs = data["documents"]
    for mode in data["meta"]["modes"]:
        answers = [d["modes"][mode]["summary"].strip() for d in docs]
        rouge_l = sum(d["modes"][mode]["rouge"]["rougeL"] for d in docs) / len(docs)
        print(f"| {data['meta']['config']['instruction']!r} | {mode} | {len(docs)} | "
              f"{sum(bool(REPEATED.search(a)) for a in answers)} | {sum(not a for a in answers)} | {rouge_l:.3f} |")
