"""What a study's numbers depend on besides its config: the CPU, the library versions, the thread count, the
determinism flags and the commit. Each trial records its own (``trial_env``, in its result JSON: a study resumed
on another machine or at another commit says so), and study.json lists what its trials ran on."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any


def trial_env(threads: int) -> dict[str, Any]:
    """A trial's environment, in its result JSON."""
    import torch

    return {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": threads,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "git": git_commit(),
    }


def environment(results: dict) -> dict[str, Any]:
    """What the numbers depend on besides the config: the CPU, the library versions, threads, determinism, the
    commit (the trials record theirs; see ``trial._result``)."""
    import torch
    import transformers

    envs = [r.get("env") or {} for r in results.values()]
    return {
        "cpus": sorted({e.get("cpu") for e in envs if e.get("cpu")}),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads_per_trial": sorted({e.get("threads") for e in envs if e.get("threads") is not None}),
        "deterministic_algorithms": "torch.use_deterministic_algorithms(True, warn_only=True) in every trial",
        "git_commits": sorted({e.get("git") for e in envs if e.get("git")}),
    }


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    """The repository's commit (``-dirty`` with uncommitted changes to tracked files), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True, timeout=30)
        return head.stdout.strip() + ("-dirty" if dirty.returncode else "")
    except (OSError, subprocess.SubprocessError):
        return None
