#!/usr/bin/env bash
# Fine-tune the shipped adapter without exact tails (the control) on 2,000 training windows, 100 `kl` steps; the
# work folder WORK/plain, the adapter WORK/plain.safetensors.
#   experiments/eval-blend/exact-tail/plain.sh [WORK=experiments/out/exact-tail]
# Needs KVBRIDGE_DATA: the folder of pydoc_corpus.txt and kernel_docs_corpus.txt.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
: "${KVBRIDGE_DATA:?set KVBRIDGE_DATA to the folder of pydoc_corpus.txt and kernel_docs_corpus.txt}"
cd "$(dirname "$0")/../../.."
WORK=$(realpath -m "${1:-experiments/out/exact-tail}")
mkdir -p "$WORK"
exec "${TRAIN_ADAPTER:-.venv/bin/train-adapter}" --preset small --trainer chain \
  --corpus "$KVBRIDGE_DATA/pydoc_corpus.txt" "$KVBRIDGE_DATA/kernel_docs_corpus.txt" \
  --init adapters/shipped/gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors \
  --stages kl:100 --stage-lr kl=1e-3 --train-windows 2000 \
  --save-dtype bfloat16 --eval-docs 0 --work "$WORK/plain" --out "$WORK/plain.safetensors" \
  --json "$WORK/plain.json"
