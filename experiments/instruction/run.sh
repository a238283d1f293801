#!/usr/bin/env bash
# Which instruction gets an answer: `full`'s answers (the target's own prefill) under each wording, on records
# 100-159 of pydoc_summaries.jsonl (never the held-out records 0-99), then answers.py's table. ~80 s a wording.
#   bash experiments/instruction/run.sh [WORK [WORDING ...]]   (default experiments/out/instruction; the 6 wordings
#   the evaluation's instruction was chosen among; typed \n escapes are line breaks)
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  sed -n '2,6p' "$0" | cut -c3-
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-experiments/out/instruction}
shift || true
DATA=${KVBRIDGE_DATA:-data}
if [ $# -eq 0 ]; then
  set -- '\n\nOne-line summary of the text above:' '\n\nSummarize the text above in one sentence.\n' \
    '\n\nQuestion: What is the text above about? Answer in one sentence.\nAnswer:' '\n\nTL;DR:' \
    '\n\nIn one sentence, the text above explains' '\n\nSummary (one sentence):'
fi
mkdir -p "$WORK"
sed -n '101,160p' "$DATA/pydoc_summaries.jsonl" > "$WORK/pages-100-159.jsonl"
runs=()
i=0
for wording in "$@"; do
  .venv/bin/kvbridge eval rouge --data "$WORK/pages-100-159.jsonl" --max-doc-tokens 256 --modes full \
      --instruction "$wording" --out "$WORK/w$i" --force --no-progress > "$WORK/w$i.log" 2>&1
  runs+=("$WORK/w$i")
  i=$((i + 1))
done
.venv/bin/python experiments/instruction/answers.py "${runs[@]}"
