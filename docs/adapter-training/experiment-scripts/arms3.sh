#!/usr/bin/env bash
# Third batch: the MLP chain's KL stage at a 10x lower rate, and attention matching with the MLP for longer.
cd /work/main
PY=".venv/bin/python /work/exp13/run_arm.py"
while kill -0 12877 2>/dev/null; do sleep 5; done
$PY chain_mlp_kl_lo kl 600 --lr 3e-4 --eval-interval 25 --rank 128 --joint --init /work/exp13/runs/attn_mlp/best.safetensors > /work/exp13/logs/chain_mlp_kl_lo.log 2>&1 &
$PY attn_mlp_long attention 1200 --lr 3e-3 --eval-interval 40 --rank 128 --joint > /work/exp13/logs/attn_mlp_long.log 2>&1 &
wait
echo arms3 done
