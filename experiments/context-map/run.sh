#!/bin/bash
# Issue 38: does a map that reads the neighbouring tokens' source features beat the per-token map at the same data?
# On the data-need run's teacher cache and ridge fit (experiments/data-need/curve.sh WORK, its w3000 folder), the
# kl stage of that run (1,000 steps, the same batches) trains a context map (context_maps.py) instead of the linear
# residual; each is scored by `eval rouge` on the same 100 held-out pydoc pages at 256 tokens (replace/noprior).
# About 35 min a map on the 2-core VM.
#   bash experiments/context-map/run.sh WORK    (WORK: curve.sh's; its eval-w3000 is the paired baseline)
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  sed -n '2,7p' "$0" | cut -c3-
  exit 0
fi
set -ex
WORK=${1:?usage: run.sh WORK}
cd "$(dirname "$0")/../.."
cat transfer/data/pydoc_summaries_sample.jsonl transfer/data/pydoc_heldout.jsonl > "$WORK.exclude.jsonl"
map() {  # NAME ARGS...
  name=$1
  shift
  .venv/bin/python experiments/context-map/train.py --work "$WORK/w3000" --out "$WORK/$name" "$@"
  .venv/bin/python experiments/context-map/eval.py --work "$WORK/w3000" --maps "$WORK/$name" -- \
    --data data/pydoc_summaries.jsonl --exclude "$WORK.exclude.jsonl" --limit 100 --max-doc-tokens 256 \
    --modes full,none,replace/noprior --out "$WORK/eval-$name" --force
  .venv/bin/kvbridge eval compare "$WORK/eval-w3000" "$WORK/eval-$name" --pairs replace/noprior
}
map ctx-w4r64 --window 4 --rank 64 --steps 1000          # the token and the 3 before it (stopped at step 375 in docs)
map ctx-lag1-w8r64 --window 8 --first-lag 1 --rank 64 --steps 1000   # the 8 tokens before, not the token itself
map ctx-lag1-w16r64 --window 16 --first-lag 1 --rank 64 --steps 1000
