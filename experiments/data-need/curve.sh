#!/bin/bash
# Issue 38, point 4: how recovery and fidelity grow with the number of training windows. One teacher cache and one
# ridge fit (100 windows, token features of rank 64), then a kl stage from that fit on the first N windows of the
# chain's seeded shuffle (N = 100, 300, 1,000: 500 steps of 4 windows; 3,000: 1,000 steps), each scored on 100
# held-out pydoc pages at 256 tokens (replace/noprior: what vLLM serves). Windows past the ridge fit's are lean
# (no target KV). About 2 h on the 2-core VM; WORK holds ~20 GB.
#   bash experiments/data-need/curve.sh WORK    then    .venv/bin/python experiments/data-need/plot.py WORK PNG
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  sed -n '2,7p' "$0" | cut -c3-
  exit 0
fi
set -ex
WORK=${1:?usage: curve.sh WORK}
cd "$(dirname "$0")/../.."
cat transfer/data/pydoc_summaries_sample.jsonl transfer/data/pydoc_heldout.jsonl > "$WORK.exclude.jsonl"
run() {  # N STEPS
  mkdir -p "$WORK/w$1"
  if [ "$1" != 1000 ]; then
    ln -sfn "$WORK/w1000/teacher" "$WORK/w$1/teacher"
    ln -sfn "$WORK/w1000/ridge" "$WORK/w$1/ridge"
  fi
  .venv/bin/train-adapter --preset small --trainer chain --corpus data/pydoc_corpus.txt data/kernel_docs_corpus.txt \
    --stages "kl:$2" --train-windows "$1" --ridge-windows 100 --token-rank 64 --save-dtype bfloat16 --eval-docs 0 \
    --work "$WORK/w$1" --out "$WORK/w$1.safetensors" --json "$WORK/w$1.json" -q
}
run 1000 500
run 100 500
run 300 500
run 3000 1000
for n in 1000 100 300 3000; do
  .venv/bin/kvbridge eval rouge --data data/pydoc_summaries.jsonl --exclude "$WORK.exclude.jsonl" --limit 100 \
    --max-doc-tokens 256 --modes full,replace/noprior --adapter "$WORK/w$n.safetensors" --out "$WORK/eval-w$n" --force
done
