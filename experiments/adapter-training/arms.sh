#!/usr/bin/env bash
# The arms of the first comparison (docs/adapter-training/README.md), one thread each, two at a time, in three
# batches (as run: three scripts, each started when the one before ended).
#   1. the equal-wall-time comparison: attention, KL, the linear chain (attention -> KL), attention with the MLP;
#   2. KL with the MLP, the MLP chain (attention 720 s -> KL 720 s), KL with the MLP for the same 1,440 s;
#   3. the MLP chain's KL stage at a 10x lower rate, attention with the MLP for longer.
# Needs WORK/cache and WORK/split.json of build_cache.py; logs in WORK/logs. Then eval_arms.py and plot.py.
#   experiments/adapter-training/arms.sh [WORK]     (WORK default experiments/out/arms; SECONDS_PER_ARM=720)
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
WORK=$(realpath -m "${1:-experiments/out/arms}")
PYTHON=${PYTHON:-.venv/bin/python}
LOGS="$WORK/logs"
mkdir -p "$LOGS"
arm() {  # arm NAME ARGS...: one arm, its output in WORK/logs/NAME.log
  local name=$1; shift
  "$PYTHON" "$HERE/run_arm.py" "$name" "$@" --work "$WORK" > "$LOGS/$name.log" 2>&1
}
S=${SECONDS_PER_ARM:-720}
H=$((S / 2))
RUNS="$WORK/runs"
(
  arm attn_linear attention "$S" --lr 3e-3 --eval-interval 40
  arm chain_attn attention "$H" --lr 3e-3 --eval-interval 40
  arm chain_kl kl "$H" --lr 3e-3 --eval-interval 25 --init "$RUNS/chain_attn/best.safetensors"
) &
(
  arm kl_linear kl "$S" --lr 3e-3 --eval-interval 25
  arm attn_mlp attention "$S" --lr 3e-3 --eval-interval 40 --rank 128 --joint
) &
wait
echo arms done
(
  arm kl_mlp kl 720 --lr 3e-3 --eval-interval 25 --rank 128 --joint
  arm chain_mlp_kl kl 720 --lr 3e-3 --eval-interval 25 --rank 128 --joint --init "$RUNS/attn_mlp/best.safetensors"
) &
arm kl_mlp_long kl 1440 --lr 3e-3 --eval-interval 25 --rank 128 --joint &
wait
echo arms2 done
arm chain_mlp_kl_lo kl 600 --lr 3e-4 --eval-interval 25 --rank 128 --joint --init "$RUNS/attn_mlp/best.safetensors" &
arm attn_mlp_long attention 1200 --lr 3e-3 --eval-interval 40 --rank 128 --joint &
wait
echo arms3 done
