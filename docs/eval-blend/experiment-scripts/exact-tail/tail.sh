#!/bin/bash
# Fine-tune the shipped adapter with exact tails on 2,000 training windows (the first run: --train-windows 600 in the same
# work folder, before its cache grew; the dev rows of both are in ../../README.md). Stopped at step 100; ckpt_eval.py read last.safetensors.
cd /work/main
exec .venv/bin/train-adapter --preset small --trainer chain \
  --corpus ../shared/data/pydoc_corpus.txt ../shared/data/kernel_docs_corpus.txt \
  --init adapters/shipped/gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors \
  --stages kl:300 --stage-lr kl=1e-3 --exact-tail 0.25 --train-windows 2000 \
  --save-dtype bfloat16 --eval-docs 100 --work /work/exp16/work --out /work/exp16/tail.safetensors \
  --json /work/exp16/tail.json
