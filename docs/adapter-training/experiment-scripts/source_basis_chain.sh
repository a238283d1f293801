#!/bin/bash
# The small pair with a source basis of rank $1 over all source layers' K and V (adapter format 3), token features
# of rank 64; the teacher cache of /work/exp16 (2,000 training windows, no queries: no attention stage).
R=${1:-192}
cd /work/main
exec .venv/bin/train-adapter --preset small --trainer chain \
  --corpus ../shared/data/pydoc_corpus.txt ../shared/data/kernel_docs_corpus.txt \
  --stages kl:${2:-400} --train-windows 2000 --ridge-windows 400 --token-rank 64 --source-rank $R \
  --save-dtype bfloat16 --eval-docs 100 --work /work/exp17/work --out /work/exp17/basis$R.safetensors \
  --json /work/exp17/basis$R.json
