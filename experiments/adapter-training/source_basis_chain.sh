#!/usr/bin/env bash
# The small pair with a source basis of rank R over all source layers' K and V (adapter format 3), token features
# of rank 64, `kl` for STEPS steps (2,000 training windows, no attention stage). As run, WORK/train/teacher was the
# teacher cache of ../eval-blend/exact-tail/tail.sh with its queries dropped; link it there to reuse it, else
# train-adapter builds the cache.
#   experiments/adapter-training/source_basis_chain.sh [R=192] [STEPS=400] [WORK=experiments/out/source-basis]
# Needs KVBRIDGE_DATA: the folder of pydoc_corpus.txt and kernel_docs_corpus.txt.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
: "${KVBRIDGE_DATA:?set KVBRIDGE_DATA to the folder of pydoc_corpus.txt and kernel_docs_corpus.txt}"
cd "$(dirname "$0")/../.."
R=${1:-192}
WORK=$(realpath -m "${3:-experiments/out/source-basis}")
mkdir -p "$WORK"
exec "${TRAIN_ADAPTER:-.venv/bin/train-adapter}" --preset small --trainer chain \
  --corpus "$KVBRIDGE_DATA/pydoc_corpus.txt" "$KVBRIDGE_DATA/kernel_docs_corpus.txt" \
  --stages "kl:${2:-400}" --train-windows 2000 --ridge-windows 400 --token-rank 64 --source-rank "$R" \
  --save-dtype bfloat16 --eval-docs 100 --work "$WORK/train" --out "$WORK/basis$R.safetensors" \
  --json "$WORK/basis$R.json"
