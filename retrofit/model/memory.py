"""Memory estimates checked before a looped model allocates its depth-aware cache.

A looped model stores K/V per (core layer, depth), so its decoding memory grows with
``max_depth``; a request that cannot fit should fail at once with a clear message, not after
minutes of swapping. ``generation_bytes`` estimates what decoding one batch allocates and
``check_generation_memory`` compares it with the memory free on the device.

The estimate counts what must exist, not allocator slack: the K/V of every position at every
layer it may run (the core at up to ``max_depth`` depths, the coda per depth when the model
reads out every depth), plus one full-vocabulary logits tensor of the prompt (two with a
per-depth readout, which keeps the previous depth's distribution). Weights are already loaded and
not counted. It is a lower bound of the peak, so refusing above the free memory never refuses a
run that would have fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import registry
from .errors import RetrofitUserError


class MemoryEstimateError(RetrofitUserError, MemoryError):
    """The estimated memory of a request exceeds what the device has free."""


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def generation_bytes(
    config, batch: int, prompt_len: int, new_tokens: int, dtype_bytes: int = 4, readout: bool | None = None
) -> dict[str, int]:
    """Estimate the memory that generating ``new_tokens`` after a ``prompt_len`` prompt allocates.

    Args:
        config: a looped model's config (``config.loop`` holds the ``LoopConfig`` dict) or a base
            model's config (one depth).
        batch: sequences decoded together.
        prompt_len, new_tokens: lengths; the cache holds ``prompt_len + new_tokens`` positions.
        dtype_bytes: bytes per K/V element (4 for float32, 2 for bf16/fp16).
        readout: the run reads out every depth (TaH2, the KL exit); default: TaH2 models do.

    Returns:
        ``{"kv_cache": bytes, "logits": bytes, "total": bytes}``.
    """
    from .config import LoopConfig

    n_layers = config.num_hidden_layers
    loop = getattr(config, "loop", None)
    if loop:
        lc = loop if isinstance(loop, LoopConfig) else LoopConfig.from_dict(dict(loop))
        prelude, core, coda = (len(r) for r in lc.layer_ranges(n_layers))
        D = lc.max_depth
        if readout is None:
            readout = registry.method_class(lc.method).reads_every_depth(lc)
    else:
        prelude, core, coda, D, readout = n_layers, 0, 0, 1, False
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_pos_layer = 2 * kv_heads * head_dim * dtype_bytes  # K and V
    layer_slots = prelude + core * D + coda * (D if readout else 1)
    positions = prompt_len + new_tokens
    kv = batch * positions * per_pos_layer * layer_slots
    logits = batch * prompt_len * config.vocab_size * 4 * (2 if readout and D > 1 else 1)
    return {"kv_cache": kv, "logits": logits, "total": kv + logits}


def free_memory(device) -> int | None:
    """Bytes free on ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable``, capped by a cgroup
    limit), or None when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:  # a container's own limit (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            room = int(limit) - used
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def check_generation_memory(
    model, batch: int, prompt_len: int, new_tokens: int, *, readout: bool | None = None, free: int | None = None
) -> dict[str, int]:
    """Raise ``MemoryEstimateError`` when ``generation_bytes`` exceeds the free memory of the model's device.

    Args:
        model: the model about to generate.
        batch, prompt_len, new_tokens: the request.
        readout: see ``generation_bytes``.
        free: bytes free (default: ``free_memory`` of the model's device); None/unknown skips the check.

    Returns:
        The estimate.
    """
    p = next(model.parameters())
    est = generation_bytes(model.config, batch, prompt_len, new_tokens, p.element_size(), readout)
    free = free_memory(p.device) if free is None else free
    if os.environ.get("RETROFIT_SKIP_MEMORY_CHECK", "").strip() in ("1", "true", "yes"):
        return est
    if free is not None and est["total"] > free:
        D = getattr(getattr(model, "loop", None), "max_depth", 1)
        raise MemoryEstimateError(
            f"generating {new_tokens} tokens after a {prompt_len}-token prompt (batch {batch}, max_depth {D}) needs "
            f"about {_fmt(est['total'])} (K/V cache {_fmt(est['kv_cache'])}, logits {_fmt(est['logits'])}), more than "
            f"the {_fmt(free)} free on {p.device}; shorten the prompt, lower --max-new-tokens, or use a model with a "
            "smaller max_depth (RETROFIT_SKIP_MEMORY_CHECK=1 skips this check)"
        )
    return est
