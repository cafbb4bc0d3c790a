"""Per-token evidence: does a looped model spend more iterations on the tokens that are hard?

TaH's claim is that hard tokens get more iterations. A token's difficulty is measured by a
*reference* model that does not loop (the SFT control, or the untrained base): its teacher-forced
loss ``−log p_ref(token | gold prefix)``. For every gold answer token (content tokens, as d̄) the
looped model's exit depth at the *producing* position — the position whose next-token prediction
that loss scores, whatever the report's ``alignment`` — is paired with the reference's loss on the
same token. Both models must tokenize the answer identically (the same tokenizer).

Reported: Spearman ρ(depth, reference loss) over all pooled tokens, and the depth distribution of
*easy* tokens (reference loss at or below the median) against *hard* ones (above the median).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .stats import spearman

__all__ = ["depth_vs_token_difficulty"]


def _group(depths: np.ndarray, max_depth: int) -> dict[str, Any]:
    n = int(depths.size)
    counts = np.bincount(depths, minlength=max_depth + 1)[1 : max_depth + 1]
    return {
        "n": n,
        "mean_depth": float(depths.mean()) if n else float("nan"),
        "depth_counts": [int(c) for c in counts],
        "depth_share": [float(c / n) if n else float("nan") for c in counts],
    }


def depth_vs_token_difficulty(depths: Any, losses: Any, max_depth: int) -> dict[str, Any]:
    """Rank correlation of per-token exit depth with per-token reference loss, and the easy/hard split.

    Args:
        depths: ``[n]`` exit depths (1-based) of the looped model's producing positions.
        losses: ``[n]`` the reference model's loss on the same tokens (nats); non-finite pairs dropped.
        max_depth: D of the looped model.

    Returns:
        ``{"n_tokens", "spearman" (nan when depth or loss is constant), "median_loss",
        "easy": group, "hard": group}`` with group = ``{"n", "mean_depth", "depth_counts" [D],
        "depth_share" [D]}``; easy = loss <= median, hard = loss > median.
    """
    d = np.asarray(depths).reshape(-1)
    x = np.asarray(losses, dtype=np.float64).reshape(-1)
    if d.shape != x.shape:
        raise ValueError(f"depths has {d.size} tokens but losses has {x.size}")
    ok = np.isfinite(x)
    d, x = d[ok].astype(np.int64), x[ok]
    if d.size and (d.min() < 1 or d.max() > max_depth):
        raise ValueError(f"depths must lie in 1..{max_depth}, got {d.min()}..{d.max()}")
    nan = float("nan")
    median = float(np.median(x)) if x.size else nan
    hard = x > median
    return {
        "n_tokens": int(d.size),
        "spearman": spearman(d, x) if d.size >= 2 else nan,
        "median_loss": median,
        "easy": _group(d[~hard], max_depth),
        "hard": _group(d[hard], max_depth),
    }
