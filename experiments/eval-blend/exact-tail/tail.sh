#!/usr/bin/env bash
# Fine-tune the shipped adapter with exact tails (`--exact-tail 0.25`) on 2,000 training windows; the work folder
# WORK/tail (its teacher cache is the one prev_kl.py, ind_att.py, source_keys.py and
# ../../adapter-training/source_features_r2.py read), the adapter WORK/tail.safetensors. As run: first with
# --train-windows 600 in the same work folder, before its cache grew (the dev rows of both are in
# docs/eval-blend/README.md); stopped at step 100, ckpt_eval.py read WORK/tail/stage-0-kl/last.safetensors.
#   experiments/eval-blend/exact-tail/tail.sh [WORK=experiments/out/exact-tail]
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
  --stages kl:300 --stage-lr kl=1e-3 --exact-tail 0.25 --train-windows 2000 \
  --save-dtype bfloat16 --eval-docs 100 --work "$WORK/tail" --out "$WORK/tail.safetensors" \
  --json "$WORK/tail.json"
