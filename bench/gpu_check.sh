#!/usr/bin/env bash
# The device check for a lent GPU, in one short run (< 8 minutes): the CUDA tests, then projection vs the target's
# prefill and store get vs copy on the GPU. Run from the repository root after ./setup.sh (or with .venv present):
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
"$PY" -c "import torch, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'flash_attn', \
u.find_spec('flash_attn') is not None)"
status=0
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_models.py || status=1
(cd bench && timeout 120 "../$PY" bench_projection.py --preset small --tokens 2048 --dtype bfloat16 --device cuda) \
    || status=1
(cd bench && timeout 120 "../$PY" bench_store.py --quick) || status=1
echo "gpu_check: exit $status"
exit $status
