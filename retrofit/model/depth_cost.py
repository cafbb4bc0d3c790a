"""Executed depth and layer passes of an adaptive-depth run: the cost metrics the model's own compute
accounting (``retrofit.model.flops``) and the evaluation (``retrofit.evaluation.metrics``, which
re-exports them) share. Pure functions of arrays (NumPy; torch tensors are detached and moved to CPU).

Depths are **1-based** (``D`` = ``max_depth``); ``mask`` is a boolean array of the data's shape,
``True`` = valid token, ``None`` = all valid.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _to_numpy(x: Any, dtype: Any = None) -> np.ndarray:
    """Convert a torch tensor, NumPy array, scalar or (nested) sequence to a NumPy array."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    arr = np.asarray(x)
    if dtype is not None:
        arr = arr.astype(dtype, copy=False)
    return arr


def _valid_mask(shape: tuple[int, ...], mask: Any) -> np.ndarray:
    """Boolean validity mask of ``shape``; ``None`` means all valid."""
    if mask is None:
        return np.ones(shape, dtype=bool)
    m = _to_numpy(mask).astype(bool)
    if m.shape != shape:
        raise ValueError(f"mask has shape {m.shape}, expected the data shape {shape}")
    return m


def cost_exec(depths: Any, mask: Any = None, max_depth: int | None = None) -> dict[str, Any]:
    """Executed core work of an adaptive-depth run (ANIRA §3.2.5 / §5, docs/evaluation.md).

    With ``A_d`` the set of valid tokens still active at depth d (exit depth >= d),
    ``Cost_exec = Σ_{d=1..D} |A_d|``, which equals the sum of exit depths. A fixed-depth model
    costs ``n · D``; the ratio ``saving = d̄ / D`` is the fraction of that compute actually
    executed (lower is cheaper).

    Args:
        depths: integer exit depths, 1-based, any shape ``[...]`` (e.g. ``[B x T]``).
            Entries outside the mask may hold anything (0, -1, …).
        mask: optional boolean ``[...]``; ``True`` = valid token.
        max_depth: ``D``. Default: the largest valid depth (pass it explicitly whenever the
            model's D is known, otherwise ``saving`` is relative to the observed maximum).

    Returns:
        ``{"n_tokens", "max_depth", "active_per_depth" (list of |A_d|, d = 1..D),
        "cost_exec" (int), "cost_fixed" (n · D), "mean_depth" (d̄), "saving" (d̄ / D),
        "depth_histogram" (list of token counts per depth 1..D)}``. ``mean_depth`` and
        ``saving`` are nan when there is no valid token.

    Raises:
        ValueError: if a valid depth is not an integer in 1..D.
    """
    d_all = _to_numpy(depths)
    valid = _valid_mask(d_all.shape, mask)
    d = d_all[valid].astype(np.float64)
    if d.size and not np.all(np.isfinite(d) & (d == np.round(d))):
        raise ValueError("depths must be integers (1-based) on valid tokens")
    d = d.astype(np.int64)
    if max_depth is None:
        if d.size == 0:
            raise ValueError("max_depth is required when there is no valid token")
        max_depth = int(d.max())
    D = int(max_depth)
    if D < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if d.size and (d.min() < 1 or d.max() > D):
        raise ValueError(f"valid depths must lie in 1..{D} (1-based), got min {d.min()} max {d.max()}")
    hist = np.bincount(d, minlength=D + 1)[1 : D + 1]
    # |A_d| = number of tokens with depth >= d: reverse cumulative sum of the histogram.
    active = np.cumsum(hist[::-1])[::-1]
    n = int(d.size)
    total = int(active.sum())
    mean = total / n if n else float("nan")
    return {
        "n_tokens": n,
        "max_depth": D,
        "active_per_depth": [int(a) for a in active],
        "cost_exec": total,
        "cost_fixed": n * D,
        "mean_depth": float(mean),
        "saving": float(mean / D) if n else float("nan"),
        "depth_histogram": [int(h) for h in hist],
    }


def flops_ratio(
    mean_depth: float,
    max_depth: int,
    n_layers: int,
    prelude: int,
    core: int,
    coda: int,
) -> dict[str, float]:
    """Decoder-layer passes per token of the adaptive model vs the fixed-depth and base models.

    Per token: base (non-looped) model = ``n_layers`` layer passes; looped model at fixed depth
    D = ``prelude + core·D + coda``; adaptive = ``prelude + core·d̄ + coda``. The small heads
    (updater, decider) and the per-depth LM-head projections some methods evaluate are
    ignored (they are < 3% of the parameters; count them separately if a method applies the
    LM head at every depth). Attention cost that grows with context length is also ignored:
    this is a per-token layer count, the quantity the "d̄ / D" saving refers to.

    ``prelude + core + coda`` normally equals ``n_layers`` (docs/looped-model.md); this is not
    enforced because a retrofit may drop layers.

    Args:
        mean_depth: d̄, mean executed core depth (1 <= d̄ <= D).
        max_depth: D.
        n_layers: decoder layers of the base model.
        prelude, core, coda: layer counts of the three ranges.

    Returns:
        ``{"layers_base", "layers_fixed", "layers_adaptive", "adaptive_vs_fixed",
        "adaptive_vs_base", "fixed_vs_base"}`` (the first three are layer passes per token,
        the rest ratios).
    """
    D = int(max_depth)
    if D < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if not (math.isfinite(mean_depth) and 1.0 - 1e-9 <= mean_depth <= D + 1e-9):
        raise ValueError(f"mean_depth must lie in [1, {D}], got {mean_depth}")
    if min(n_layers, prelude, core, coda) < 0 or n_layers == 0 or core == 0:
        raise ValueError(
            f"need n_layers > 0, core > 0, prelude/coda >= 0; got n_layers={n_layers}, "
            f"prelude={prelude}, core={core}, coda={coda}"
        )
    base = float(n_layers)
    fixed = float(prelude + core * D + coda)
    adaptive = float(prelude + core * mean_depth + coda)
    return {
        "layers_base": base,
        "layers_fixed": fixed,
        "layers_adaptive": adaptive,
        "adaptive_vs_fixed": adaptive / fixed,
        "adaptive_vs_base": adaptive / base,
        "fixed_vs_base": fixed / base,
    }
