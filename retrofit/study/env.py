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
        "cpu_id": cpu_id(),
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
    ids = sorted({e.get("cpu_id") for e in envs if e.get("cpu_id")})  # trials before 2026-12-06 have none
    return {
        "cpus": sorted({e.get("cpu") for e in envs if e.get("cpu")}),
        **({"cpu_ids": ids} if ids else {}),
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


def cpu_id(cpuinfo: str | None = None) -> str | None:
    """Vendor, family, model and stepping, and the widest vector ISA (``"GenuineIntel family 6 model 207 stepping 2,
    AVX-512"``): the cloud machines here all call themselves "Intel(R) Xeon(R) Processor" or "AMD EPYC", and two of
    one name can train different models (docs/study.md, "Threads, `--jobs` and determinism"). ``cpuinfo``: the text
    of /proc/cpuinfo (default: read it). None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return None
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    if "cpu family" not in info:
        return None
    flags = set(info.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (
        f"{info.get('vendor_id', '?')} family {info['cpu family']} model {info.get('model', '?')} "
        f"stepping {info.get('stepping', '?')}, {isa}"
    )


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
