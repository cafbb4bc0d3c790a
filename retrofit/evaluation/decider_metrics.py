"""Metrics of the decider's decisions: realized gain and continue probability per decision
(``decider_decisions``), mean gain per decile of the continue probability (``gain_by_decile``, TaH2's check
of the decider). Pure functions of arrays, as in ``retrofit.evaluation.metrics``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model.depth_cost import _to_numpy
from .stats import spearman


def decider_decisions(exit_depth: Any, depth_nll: Any, continue_prob: Any) -> dict[str, np.ndarray]:
    """Every decision the decider made at the given positions, with its realized gain (docs/evaluation.md).

    A token that exits at depth ``d*`` was asked "continue?" after depths ``d = 1 … min(d*, D − 1)``:
    it said yes for ``d < d*`` and no at ``d = d*``. The realized gain of decision ``d`` is
    ``δ = ℓ^(d) − ℓ^(d+1)``, the drop of the token's next-token loss from one more iteration (> 0: the
    next depth helps). ``ℓ^(d+1)`` is executed for ``d < d*`` and is the forward's gradient-free
    lookahead iteration for ``d = d*`` (TaH2 §3, ``output_depth_losses``), so every decision has its
    gain. Decisions whose two losses are not both finite (no label there, or no lookahead) are dropped.

    Args:
        exit_depth: ``[n]`` exit depths ``d*`` (1-based) of the positions.
        depth_nll: ``[n, D]`` per-depth next-token losses of the positions (NaN where not computed).
        continue_prob: ``[n, D − 1]`` the decider's probability to continue after depth ``d`` (column
            ``d − 1``): TaH2 ``c^(d)``, ANIRA-O ``1 − α^(d)``, ANIRA-E ``P(d* > d)``.

    Returns:
        ``{"gain", "continue_prob", "depth", "continued"}``: ``[k]`` arrays over the k decisions, in
        position order and, within a position, depth order.
    """
    d_star = _to_numpy(exit_depth, np.int64).reshape(-1)
    nll = _to_numpy(depth_nll, np.float64)
    prob = _to_numpy(continue_prob, np.float64)
    n = d_star.size
    nll = nll.reshape(n, -1)
    D = nll.shape[1]
    prob = prob.reshape(n, -1)
    if prob.shape[1] < D - 1:  # a loop that stopped early decided fewer depths: pad, those are never read
        prob = np.concatenate([prob, np.full((n, D - 1 - prob.shape[1]), np.nan)], axis=1)
    d = np.arange(1, D)  # decisions after depths 1 … D − 1
    made = d[None, :] <= d_star[:, None]  # [n, D − 1]
    gain = nll[:, :-1] - nll[:, 1:]
    keep = made & np.isfinite(gain) & np.isfinite(prob[:, : D - 1])
    return {
        "gain": gain[keep],
        "continue_prob": prob[:, : D - 1][keep],
        "depth": np.broadcast_to(d[None, :], keep.shape)[keep],
        "continued": (d[None, :] < d_star[:, None])[keep],
    }


def gain_by_decile(gain: Any, continue_prob: Any, n_bins: int = 10) -> dict[str, Any]:
    """Mean realized gain per equal-count bin of the decider's continue probability (TaH2's check).

    TaH2 reports that the gain from one more iteration rises with the decider's continue probability:
    a decider that knows where depth helps puts its high probabilities where the gain is. Decisions are
    sorted by probability (stable, so ties keep their order) and cut into ``n_bins`` groups of equal
    count (``numpy.array_split``: sizes differ by at most one; fewer bins when there are fewer
    decisions). ``spearman`` is the rank correlation of the bin index (1 = lowest probabilities) with
    the bin's mean gain: 1 when the mean gain rises from each bin to the next.

    Args:
        gain: ``[k]`` realized gains ``ℓ^(d) − ℓ^(d+1)`` (:func:`decider_decisions`).
        continue_prob: ``[k]`` the decider's continue probability of the same decisions.
        n_bins: bins (10: deciles).

    Returns:
        ``{"n_decisions", "n_bins", "bins": [{"bin", "n", "prob_mean", "prob_min", "prob_max", "gain_mean",
        "share_gain_positive"}], "spearman"}`` (``spearman`` nan with fewer than 2 bins or a constant mean
        gain); non-finite pairs are dropped.
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins!r}")
    g = _to_numpy(gain, np.float64).reshape(-1)
    p = _to_numpy(continue_prob, np.float64).reshape(-1)
    if g.shape != p.shape:
        raise ValueError(f"gain has {g.size} values but continue_prob has {p.size}")
    ok = np.isfinite(g) & np.isfinite(p)
    g, p = g[ok], p[ok]
    k = min(n_bins, int(g.size))
    bins = []
    if k:
        order = np.argsort(p, kind="stable")
        for i, idx in enumerate(np.array_split(order, k)):
            bins.append(
                {
                    "bin": i + 1,
                    "n": int(idx.size),
                    "prob_mean": float(p[idx].mean()),
                    "prob_min": float(p[idx].min()),
                    "prob_max": float(p[idx].max()),
                    "gain_mean": float(g[idx].mean()),
                    "share_gain_positive": float((g[idx] > 0).mean()),
                }
            )
    means = [b["gain_mean"] for b in bins]
    rho = float("nan")
    if len(bins) >= 2 and np.ptp(means) > 0:
        rho = spearman(np.arange(1, len(bins) + 1), means)
    return {"n_decisions": int(g.size), "n_bins": len(bins), "bins": bins, "spearman": rho}
