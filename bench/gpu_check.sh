#!/usr/bin/env bash
# The device check for a lent GPU, in one prepared run (< 8 minutes on one H200, no network): bench/gpu_check.py
# prints one PASS / FAIL / SKIP line per check with its figure. It checks the production-shaped preset in bf16 with
# flash-attn (a FAIL naming why when flash-attn is missing) end to end through a real `kvbridge serve` process
# (ingest, project + fetch, generate, served `recompute` and `blend` with the induction prior), a decode step under
# the prior, the store's pool on the GPU with its pinned CPU tier, projection time against the target's own
# prefill, and the vLLM connector's CUDA tests only where a CUDA vLLM imports (else SKIP); then the CUDA tests.
# Run from the repository root with .venv present:   bash bench/gpu_check.sh
# Dry run on a CPU (about 3 minutes):                 bash bench/gpu_check.sh --device cpu --quick
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
status=0
timeout 360 "$PY" bench/gpu_check.py "$@" 2>"${TMPDIR:-/tmp}/gpu_check.stderr.log" || status=1
if [[ " $* " != *" --device cpu "* ]]; then
    timeout 100 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_models.py || status=1
fi
echo "gpu_check: exit $status (tracebacks in ${TMPDIR:-/tmp}/gpu_check.stderr.log)"
exit $status
