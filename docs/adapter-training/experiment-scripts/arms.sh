#!/usr/bin/env bash
# The equal-wall-time comparison: two sequences of arms, one thread each, run side by side.
cd /work/main
PY=".venv/bin/python /work/exp13/run_arm.py"
S=${SECONDS_PER_ARM:-720}
H=$((S / 2))
(
  $PY attn_linear attention $S --lr 3e-3 --eval-interval 40 > /work/exp13/logs/attn_linear.log 2>&1
  $PY chain_attn attention $H --lr 3e-3 --eval-interval 40 > /work/exp13/logs/chain_attn.log 2>&1
  $PY chain_kl kl $H --lr 3e-3 --eval-interval 25 --init /work/exp13/runs/chain_attn/best.safetensors > /work/exp13/logs/chain_kl.log 2>&1
) &
(
  $PY kl_linear kl $S --lr 3e-3 --eval-interval 25 > /work/exp13/logs/kl_linear.log 2>&1
  $PY attn_mlp attention $S --lr 3e-3 --eval-interval 40 --rank 128 --joint > /work/exp13/logs/attn_mlp.log 2>&1
) &
wait
echo arms done
