"""Settings for the vLLM tests, which run in the vLLM venv only (scripts/vllm_env.sh).

The default test run of the main environment does not collect this folder (setup.cfg
``norecursedirs``); CI runs it explicitly. vLLM runs in-process here (no engine subprocess), which
starts faster and needs no ``if __name__ == "__main__":`` guard.
"""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
