#!/usr/bin/env bash
# Which instruction `eval rouge` asks with: `full`'s answers (the target's own prefill) under 6 wordings, on records
# 100-159 of pydoc_summaries.jsonl (never the held-out records 0-99), then answers.py's table. ~8 minutes.
#   bash experiments/instruction/run.sh [WORK]      (default experiments/out/instruction)
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  sed -n '2,4p' "$0" | cut -c3-
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-experiments/out/instruction}
DATA=${KVBRIDGE_DATA:-data}
mkdir -p "$WORK"
sed -n '101,160p' "$DATA/pydoc_summaries.jsonl" > "$WORK/pages-100-159.jsonl"
i=0
for wording in '\n\nOne-line summary of the text above:' '\n\nSummarize the text above in one sentence.\n' \
    '\n\nQuestion: What is the text above about? Answer in one sentence.\nAnswer:' '\n\nTL;DR:' \
    '\n\nIn one sentence, the text above explains' '\n\nSummary (one sentence):'; do
  .venv/bin/kvbridge eval rouge --data "$WORK/pages-100-159.jsonl" --max-doc-tokens 256 --modes full \
      --instruction "$wording" --out "$WORK/w$i" --no-progress > "$WORK/w$i.log" 2>&1
  i=$((i + 1))
done
.venv/bin/python experiments/instruction/answers.py "$WORK"/w?
