#!/usr/bin/env bash
# Second batch: the KL objective with the residual MLP, the MLP chain (attention 720 s -> KL 720 s) and KL alone
# for the same 1440 s.
cd /work/main
PY=".venv/bin/python /work/exp13/run_arm.py"
while kill -0 8622 2>/dev/null; do sleep 5; done
(
  $PY kl_mlp kl 720 --lr 3e-3 --eval-interval 25 --rank 128 --joint > /work/exp13/logs/kl_mlp.log 2>&1
  $PY chain_mlp_kl kl 720 --lr 3e-3 --eval-interval 25 --rank 128 --joint --init /work/exp13/runs/attn_mlp/best.safetensors > /work/exp13/logs/chain_mlp_kl.log 2>&1
) &
(
  $PY kl_mlp_long kl 1440 --lr 3e-3 --eval-interval 25 --rank 128 --joint > /work/exp13/logs/kl_mlp_long.log 2>&1
) &
wait
echo arms2 done
