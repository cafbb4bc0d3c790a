"""Metrics for complexity-controlled evaluation of looped models (docs/tah2.md, docs/evaluation.md).

Everything here is a pure function of arrays: no model, no I/O. Inputs may be Python
sequences, NumPy arrays or torch tensors (detached and moved to CPU internally); outputs are
Python floats/ints, lists and dicts so that they serialize to JSON directly (see
:func:`retrofit.hub.atomic_io.write_json_atomic`, ``strict=True``). Only NumPy is needed; SciPy is used in
the tests as an independent reference, never here.

Conventions:
    * Depths are **1-based**: a token that exits after the first core iteration has depth 1,
      ``D`` (``max_depth``) is the maximum.
    * ``mask`` is a boolean array of the same shape as the data; ``True`` marks a valid token
      (e.g. an answer token that is not padding). ``None`` means every entry is valid.

Functions:
    spearman                Rank correlation (defined in :mod:`retrofit.evaluation.stats`, re-exported).
    linear_regression       OLS of per-token depth on features.
    regression_with_control OLS with categorical fixed effects (BREVO: node count N controlled).
    loss_change_stats       First-vs-last-depth per-token loss change (TaH2 §3 statistic).
    cost_exec               Active tokens per depth, Cost_exec = Σ_d |A_d|, mean depth, d̄/D.
    flops_ratio             Executed layer passes per token vs the fixed-depth and base models.
    accuracy_by_level       Accuracy (± binomial s.e.) and mean depth per difficulty level.
    expected_depth          E[d] under a per-token depth distribution.

The decider's metrics (``decider_decisions``, ``gain_by_decile``) are in :mod:`retrofit.evaluation.decider_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..model.depth_cost import _to_numpy, _valid_mask, cost_exec, flops_ratio
from .stats import spearman  # noqa: F401  (one Spearman, in stats; imported from here too)

__all__ = [
    "LOSS_CHANGE_BIN_EDGES",
    "accuracy_by_level",
    "cost_exec",
    "expected_depth",
    "flops_ratio",
    "linear_regression",
    "loss_change_stats",
    "regression_with_control",
    "spearman",
]

#: Fixed histogram bin edges for :func:`loss_change_stats`: 81 bins of width 0.1 nats centred
#: on -4.0, -3.9, …, 0.0, …, 4.0 (edges -4.05 … 4.05). The centre bin [-0.05, 0.05) contains
#: the "unchanged" tokens (|Δ| <= tol for any tol < 0.05). Values outside the range are clipped
#: into the outermost bins so that the counts always sum to the number of valid tokens; the
#: number clipped on each side is reported separately. Fixed edges make histograms from
#: different models and runs directly comparable.
LOSS_CHANGE_BIN_EDGES: np.ndarray = np.round(np.linspace(-4.05, 4.05, 82), 10)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _r2(y: np.ndarray, y_hat: np.ndarray) -> float:
    """Coefficient of determination; nan when y is constant."""
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0.0:
        return float("nan")
    ss_res = float(np.sum((y - y_hat) ** 2))
    return 1.0 - ss_res / ss_tot


def _design(X: Any, feature_names: Sequence[str], y: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate and return ``X [n x k]`` and ``y [n]`` as float64."""
    Xa = _to_numpy(X, np.float64)
    if Xa.ndim == 1:
        Xa = Xa[:, None]
    if Xa.ndim != 2:
        raise ValueError(f"X must be [n x k] (or [n] for one feature), got shape {Xa.shape}")
    ya = _to_numpy(y, np.float64).reshape(-1)
    if Xa.shape[0] != ya.shape[0]:
        raise ValueError(f"X has {Xa.shape[0]} rows but y has {ya.shape[0]} values")
    names = list(feature_names)
    if len(names) != Xa.shape[1]:
        raise ValueError(f"got {len(names)} feature names for {Xa.shape[1]} columns of X")
    if len(set(names)) != len(names):
        raise ValueError(f"feature names must be unique, got {names}")
    if not (np.all(np.isfinite(Xa)) and np.all(np.isfinite(ya))):
        raise ValueError("X and y must be finite (drop or impute NaN/inf rows first)")
    return Xa, ya


def _ols(design: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Least squares; returns (beta, fitted values, rank of the design matrix)."""
    beta, _, rank, _ = np.linalg.lstsq(design, y, rcond=None)
    return beta, design @ beta, int(rank)


# ----------------------------------------------------------------------------------------------
# correlation and regression (ANIRA §5: LANO Spearman, BREVO regression)
# ----------------------------------------------------------------------------------------------


def linear_regression(X: Any, y: Any, feature_names: Sequence[str]) -> dict[str, Any]:
    """Ordinary least squares with an intercept: ``y ≈ intercept + X @ coefficients``.

    Args:
        X: features ``[n x k]`` (or ``[n]`` for a single feature).
        y: targets ``[n]`` (e.g. per-token exit depth).
        feature_names: ``k`` unique names, one per column of ``X``.

    Returns:
        ``{"coefficients": {name: float}, "standardized_coefficients": {name: float},
        "intercept": float, "r2": float, "n": int, "rank": int}``.
        ``standardized_coefficients`` are ``coef * std(x) / std(y)`` (comparable across
        features with different scales; nan when y is constant). ``r2`` is nan when y is
        constant. ``rank`` is the rank of the design matrix (``k + 1`` unless features are
        collinear, in which case the minimum-norm solution is returned).

    Raises:
        ValueError: on shape mismatches, non-finite values, or fewer than ``k + 1`` rows.
    """
    Xa, ya = _design(X, feature_names, y)
    n, k = Xa.shape
    if n < k + 1:
        raise ValueError(f"linear_regression needs at least k + 1 = {k + 1} rows, got {n}")
    design = np.column_stack([np.ones(n), Xa])
    beta, fitted, rank = _ols(design, ya)
    sy = float(ya.std())
    sx = Xa.std(axis=0)
    names = list(feature_names)
    return {
        "coefficients": {name: float(b) for name, b in zip(names, beta[1:])},
        "standardized_coefficients": {
            name: (float(b * s / sy) if sy > 0 else float("nan")) for name, b, s in zip(names, beta[1:], sx)
        },
        "intercept": float(beta[0]),
        "r2": _r2(ya, fitted),
        "n": int(n),
        "rank": rank,
    }


def _sorted_levels(values: Iterable[Hashable]) -> list[Hashable]:
    levels = list(dict.fromkeys(values))
    try:
        return sorted(levels)
    except TypeError:  # mixed types: deterministic order by string form
        return sorted(levels, key=str)


def regression_with_control(X: Any, y: Any, feature_names: Sequence[str], groups: Any) -> dict[str, Any]:
    """OLS with categorical fixed effects: ``y ≈ a + X @ b + Σ_g γ_g · 1[group = g]``.

    Controls for a categorical variable (BREVO: node count N) by one-hot dummies for every
    level except the reference (the smallest level), so that the feature coefficients are
    estimated *within* groups. The controls-only model ``y ≈ a + Σ_g γ_g 1[group = g]`` is
    fitted too: ``r2 - r2_controls`` is what the features explain beyond the control.

    Args:
        X: features ``[n x k]`` (or ``[n]``).
        y: targets ``[n]``.
        feature_names: ``k`` unique names.
        groups: ``[n]`` hashable group labels (ints, strings, …).

    Returns:
        ``{"coefficients": {name: float}, "intercept": float (reference group),
        "group_effects": {level: float} (offset of each non-reference level vs the
        reference), "reference_group": level, "r2": float (full model),
        "r2_controls": float (controls only), "r2_gain": float, "n": int,
        "n_groups": int, "rank": int}``.

    Raises:
        ValueError: on shape mismatches or fewer rows than parameters.
    """
    Xa, ya = _design(X, feature_names, y)
    n, k = Xa.shape
    g = _to_numpy(groups).reshape(-1).tolist()
    if len(g) != n:
        raise ValueError(f"groups has {len(g)} entries but X has {n} rows")
    levels = _sorted_levels(g)
    index = {lvl: i for i, lvl in enumerate(levels)}
    codes = np.array([index[v] for v in g])
    dummies = np.zeros((n, max(len(levels) - 1, 0)))
    for j in range(1, len(levels)):
        dummies[codes == j, j - 1] = 1.0
    n_params = 1 + k + dummies.shape[1]
    if n < n_params:
        raise ValueError(
            f"regression_with_control needs at least {n_params} rows "
            f"(1 + {k} features + {dummies.shape[1]} group dummies), got {n}"
        )
    ones = np.ones((n, 1))
    full = np.hstack([ones, Xa, dummies])
    beta, fitted, rank = _ols(full, ya)
    _, fitted_c, _ = _ols(np.hstack([ones, dummies]), ya)
    r2 = _r2(ya, fitted)
    r2_c = _r2(ya, fitted_c)
    return {
        "coefficients": {name: float(b) for name, b in zip(feature_names, beta[1 : 1 + k])},
        "intercept": float(beta[0]),
        "group_effects": {lvl: float(b) for lvl, b in zip(levels[1:], beta[1 + k :])},
        "reference_group": levels[0],
        "r2": r2,
        "r2_controls": r2_c,
        "r2_gain": r2 - r2_c,
        "n": int(n),
        "n_groups": len(levels),
        "rank": rank,
    }


# ----------------------------------------------------------------------------------------------
# loss change and compute
# ----------------------------------------------------------------------------------------------


def loss_change_stats(
    loss_first: Any,
    loss_last: Any,
    tol: float = 1e-3,
    mask: Any = None,
    bin_edges: Any = None,
) -> dict[str, Any]:
    """First-vs-last-depth per-token loss change (TaH2's motivating statistic, docs/tah2.md).

    ``Δ = loss_last - loss_first`` per valid token (next-token NLL at depth D minus at depth 1;
    positive = the extra iterations made the token *worse*). TaH2 reports for fixed-depth Ouro
    52.3% unchanged (|Δ| <= 1e-3) and 21.7% worse; Huginn 33.5% / 15.9%.

    Args:
        loss_first: per-token loss at the first depth, any shape ``[...]``.
        loss_last: per-token loss at the last depth, same shape.
        tol: half-width of the "unchanged" band, in nats.
        mask: optional boolean ``[...]``; ``True`` = valid token. Non-finite Δ are also dropped
            (counted in ``n_nonfinite``).
        bin_edges: histogram edges; default :data:`LOSS_CHANGE_BIN_EDGES` (fixed, 0.1-nat bins
            on [-4.05, 4.05], out-of-range values clipped into the end bins).

    Returns:
        ``{"n", "tol", "share_unchanged" (|Δ| <= tol), "share_worse" (Δ > tol),
        "share_improved" (Δ < -tol), "mean_delta", "median_delta", "n_nonfinite",
        "bin_edges" (list), "counts" (list of ints), "n_clipped_low", "n_clipped_high"}``.
        Shares and means are nan when no valid token remains. The three shares sum to 1.
    """
    first = _to_numpy(loss_first, np.float64)
    last = _to_numpy(loss_last, np.float64)
    if first.shape != last.shape:
        raise ValueError(f"loss_first has shape {first.shape} but loss_last has {last.shape}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    valid = _valid_mask(first.shape, mask)
    delta = (last - first)[valid]
    finite = np.isfinite(delta)
    n_nonfinite = int((~finite).sum())
    delta = delta[finite]
    edges = LOSS_CHANGE_BIN_EDGES if bin_edges is None else _to_numpy(bin_edges, np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError("bin_edges must be a strictly increasing 1-D array of >= 2 edges")
    n = int(delta.size)
    lo, hi = float(edges[0]), float(edges[-1])
    n_low, n_high = int((delta < lo).sum()), int((delta > hi).sum())
    counts, _ = np.histogram(np.clip(delta, lo, hi), bins=edges)
    nan = float("nan")
    if n:
        unchanged = int((np.abs(delta) <= tol).sum())
        worse = int((delta > tol).sum())
        improved = n - unchanged - worse
        shares = (unchanged / n, worse / n, improved / n)
        mean, median = float(delta.mean()), float(np.median(delta))
    else:
        shares, mean, median = (nan, nan, nan), nan, nan
    return {
        "n": n,
        "tol": float(tol),
        "share_unchanged": shares[0],
        "share_worse": shares[1],
        "share_improved": shares[2],
        "mean_delta": mean,
        "median_delta": median,
        "n_nonfinite": n_nonfinite,
        "bin_edges": [float(e) for e in edges],
        "counts": [int(c) for c in counts],
        "n_clipped_low": n_low,
        "n_clipped_high": n_high,
    }


# ----------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------


def accuracy_by_level(records: Iterable[Mapping[str, Any]]) -> dict[Hashable, dict[str, Any]]:
    """Aggregate per-example results by difficulty level.

    Args:
        records: dicts with ``"level"`` (hashable: L, N, n, "P1", …), ``"correct"`` (bool) and
            optionally ``"mean_depth"`` (the example's mean exit depth; ``None``/NaN = unknown).

    Returns:
        ``{level: {"n", "accuracy", "accuracy_se", "mean_depth", "mean_depth_se",
        "n_depth"}}`` with levels in sorted order. ``accuracy_se = sqrt(p(1-p)/n)`` (binomial
        standard error); ``mean_depth_se`` = sample std (ddof 1) / sqrt(n_depth), nan when
        fewer than 2 depths are known; ``mean_depth`` is nan when none is known.
    """
    correct: dict[Hashable, list[bool]] = {}
    depth: dict[Hashable, list[float]] = {}
    for i, r in enumerate(records):
        if "level" not in r or "correct" not in r:
            raise ValueError(f"record {i} needs 'level' and 'correct' keys, got {sorted(r)}")
        lvl = r["level"]
        lvl = lvl.item() if hasattr(lvl, "item") else lvl
        correct.setdefault(lvl, []).append(bool(r["correct"]))
        md = r.get("mean_depth")
        if md is not None:
            md = float(_to_numpy(md))
            if math.isfinite(md):
                depth.setdefault(lvl, []).append(md)
    out: dict[Hashable, dict[str, Any]] = {}
    nan = float("nan")
    for lvl in _sorted_levels(correct):
        c = np.asarray(correct[lvl], dtype=np.float64)
        n = int(c.size)
        p = float(c.mean())
        ds = np.asarray(depth.get(lvl, []), dtype=np.float64)
        out[lvl] = {
            "n": n,
            "accuracy": p,
            "accuracy_se": math.sqrt(p * (1.0 - p) / n),
            "mean_depth": float(ds.mean()) if ds.size else nan,
            "mean_depth_se": float(ds.std(ddof=1) / math.sqrt(ds.size)) if ds.size > 1 else nan,
            "n_depth": int(ds.size),
        }
    return out


def expected_depth(depth_probs: Any) -> Any:
    """Expected exit depth ``E[d] = Σ_{d=1..D} d · q(d)`` (ANIRA's E_q[d]).

    Args:
        depth_probs: ``[..., D]`` probabilities over depths 1..D (last axis; expected to sum to
            1, not renormalized here). A torch tensor stays a torch tensor (differentiable,
            same device and dtype); anything else is computed with NumPy.

    Returns:
        ``[...]``: a torch tensor for torch input, else a NumPy array (a 0-d array for ``[D]``
        input; use ``float()`` for a scalar).
    """
    if hasattr(depth_probs, "detach") and hasattr(depth_probs, "new_tensor"):
        D = depth_probs.shape[-1]
        steps = depth_probs.new_tensor(list(range(1, D + 1)))
        return (depth_probs * steps).sum(dim=-1)
    q = _to_numpy(depth_probs, np.float64)
    if q.ndim == 0:
        raise ValueError("depth_probs must have a last axis of size D")
    return q @ np.arange(1, q.shape[-1] + 1, dtype=np.float64)
