#!/bin/bash
# Fine-tune the shipped adapter without exact tails (control) on 2,000 training windows.
cd /work/main
exec .venv/bin/train-adapter --preset small --trainer chain \
  --corpus ../shared/data/pydoc_corpus.txt ../shared/data/kernel_docs_corpus.txt \
  --init adapters/shipped/gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors \
  --stages kl:100 --stage-lr kl=1e-3 --train-windows 2000 \
  --save-dtype bfloat16 --eval-docs 0 --work /work/exp16/work-b --out /work/exp16/plain.safetensors \
  --json /work/exp16/plain.json
