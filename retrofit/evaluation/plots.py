"""Plots for complexity-controlled evaluation (docs/tah2.md, docs/evaluation.md).

Each function writes one PNG and returns its path. Figures are built with
:class:`matplotlib.figure.Figure` and rendered by the Agg canvas directly, never through
``pyplot``: no global state, no GUI backend, no ``plt.show``, safe inside training jobs and
threads, and independent of the caller's ``matplotlib.use`` choice.

Series for several models are passed as ``dict[name -> series]``; one model is a dict with one
entry. Difficulty levels may be numbers (operator count L, node count N, input size n) or
labels ("MAIN", "P1", "P2"). Numeric-looking string keys (as they come back from JSON) are
treated as numbers so the x-axis keeps its spacing; otherwise levels are evenly spaced in the
order they first appear.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .plots_base import (
    _DPI,
    _as_loss_stats,
    _as_number,
    _finish_legend,
    _finite,
    _fmt_num,
    _level_series,
    _new_figure,
    _pct,
    _save,
)
from .plots_compute import (  # noqa: F401
    plot_accuracy_vs_compute,
    plot_accuracy_vs_flops,
)

__all__ = [
    "plot_accuracy_vs_compute",
    "plot_accuracy_vs_flops",
    "plot_depth_by_token_difficulty",
    "plot_accuracy_vs_difficulty",
    "plot_depth_vs_difficulty",
    "plot_loss_change_histogram",
]


# ----------------------------------------------------------------------------------------------
# difficulty plots
# ----------------------------------------------------------------------------------------------


def plot_depth_vs_difficulty(
    levels_by_model: Mapping[str, Mapping[Hashable, float]],
    path: str | os.PathLike,
    max_depth: int | None = None,
    title: str = "Mean exit depth vs difficulty",
    xlabel: str = "difficulty level",
) -> str:
    """Mean allocated depth d̄ per difficulty level, one line per model.

    Args:
        levels_by_model: ``{model name: {level: mean depth}}``; NaN/None values are skipped.
        path: output PNG path (parent directories are created).
        max_depth: D; if given, drawn as a dashed reference line and the y-axis spans 1..D.
        title: figure title.
        xlabel: x-axis label (e.g. "operators L", "nodes N").

    Returns:
        ``path`` as a string.
    """
    fig, ax = _new_figure()
    _level_series(ax, levels_by_model)
    if max_depth is not None:
        ax.axhline(max_depth, color="0.4", linestyle="--", linewidth=1, label=f"max depth D = {max_depth}")
        ax.set_ylim(0.8, max_depth + 0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean exit depth d̄")
    ax.set_title(title)
    _finish_legend(ax)
    return _save(fig, path)


def plot_accuracy_vs_difficulty(
    acc_by_model: Mapping[str, Mapping[Hashable, float]],
    path: str | os.PathLike,
    train_levels: Iterable[Hashable] = (),
    title: str = "Accuracy vs difficulty",
    xlabel: str = "difficulty level",
) -> str:
    """Accuracy per difficulty level, one line per model, training levels shaded.

    Levels in ``train_levels`` are shaded in grey (one band per run of adjacent training
    levels, with a "training levels" legend entry), so interpolation (unshaded levels between
    bands) and extrapolation (unshaded levels outside) are visible at a glance.

    Args:
        acc_by_model: ``{model name: {level: accuracy in [0, 1]}}``.
        path: output PNG path.
        train_levels: the levels seen in training (same keys as in ``acc_by_model``; numeric
            strings and numbers are matched by value).
        title: figure title.
        xlabel: x-axis label.

    Returns:
        ``path`` as a string.
    """
    fig, ax = _new_figure()
    pos = _level_series(ax, acc_by_model)
    train = list(train_levels)
    if train:
        # Match training levels to plotted positions by value (1 == "1" == 1.0).
        by_value: dict[Any, float] = {}
        for lvl, x in pos.items():
            by_value[lvl] = x
            num = _as_number(lvl)
            if num is not None:
                by_value[num] = x
        matched = (by_value.get(t, by_value.get(_as_number(t))) for t in train)
        xs_train = sorted({x for x in matched if x is not None})
        xs_all = sorted(set(pos.values()))
        if xs_train:
            gaps = np.diff(xs_all)
            half = float(gaps.min()) / 2 if gaps.size else 0.5
            labelled = False
            for x in xs_train:
                ax.axvspan(
                    x - half,
                    x + half,
                    color="0.55",
                    alpha=0.18,
                    linewidth=0,
                    label=None if labelled else "training levels",
                )
                labelled = True
            ax.set_xlim(min(xs_all + xs_train) - half, max(xs_all + xs_train) + half)
    values = [float(v) for s in acc_by_model.values() for v in s.values() if _finite(v)]
    if values and max(values) <= 1.0 and min(values) >= 0.0:
        ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    _finish_legend(ax)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# loss change
# ----------------------------------------------------------------------------------------------


def plot_loss_change_histogram(
    stats_or_deltas: Any,
    path: str | os.PathLike,
    tol: float = 1e-3,
    title: str = "First-vs-last depth loss change Δ = ℓ(D) − ℓ(1)",
    log_y: bool = False,
) -> str:
    """Histogram of the per-token loss change with the "unchanged" band marked (docs/tah2.md).

    Args:
        stats_or_deltas: one of
            * a dict from :func:`~retrofit.evaluation.metrics.loss_change_stats`;
            * an array/tensor of Δ values (stats computed here with ``tol``);
            * ``{model name: stats dict or Δ array}`` for several models (overlaid as step
              histograms; shares go into the legend instead of the title).
        path: output PNG path.
        tol: the |Δ| <= tol band (used when Δ values are given; a stats dict carries its own).
        title: figure title; for one model the shares are appended on a second line.
        log_y: logarithmic y-axis (the Δ = 0 spike often dwarfs the tails).

    Returns:
        ``path`` as a string.
    """
    single = not (isinstance(stats_or_deltas, Mapping) and "counts" not in stats_or_deltas)
    models = {"": stats_or_deltas} if single else dict(stats_or_deltas)
    stats = {name: _as_loss_stats(obj, tol) for name, obj in models.items()}
    fig, ax = _new_figure((6.8, 4.4))
    band_tol = max(float(s.get("tol", tol)) for s in stats.values()) if stats else tol
    for name, s in stats.items():
        edges = np.asarray(s["bin_edges"], dtype=np.float64)
        counts = np.asarray(s["counts"], dtype=np.float64)
        total = counts.sum()
        share = counts / total if total > 0 else counts
        if single:
            ax.bar(
                edges[:-1],
                share,
                width=np.diff(edges),
                align="edge",
                color="tab:blue",
                alpha=0.8,
                edgecolor="white",
                linewidth=0.3,
                label="tokens",
            )
        else:
            label = (
                f"{name}: unchanged {_pct(s['share_unchanged'])}, worse {_pct(s['share_worse'])}, "
                f"improved {_pct(s['share_improved'])}"
            )
            ax.stairs(share, edges, label=label, linewidth=1.5)
    # The band is far narrower than a bin; draw it at least a few pixels wide plus a centre line.
    ax.axvspan(-band_tol, band_tol, color="gold", alpha=0.5, linewidth=0)
    ax.axvline(
        0.0,
        color="0.2",
        linestyle="--",
        linewidth=1.0,
        label=f"unchanged band |Δ| ≤ {band_tol:g}",
    )
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("Δ loss (nats; > 0: worse after the extra iterations)")
    ax.set_ylabel("share of tokens")
    if single:
        s = next(iter(stats.values()))
        title = (
            f"{title}\nunchanged {_pct(s['share_unchanged'])} · worse {_pct(s['share_worse'])}"
            f" · improved {_pct(s['share_improved'])} (n = {s.get('n', int(sum(s['counts'])))})"
        )
    ax.set_title(title, fontsize=10)
    _finish_legend(ax)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# per-token depth vs difficulty
# ----------------------------------------------------------------------------------------------


def plot_depth_by_token_difficulty(
    stats_by_model: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike,
    title: str = "Exit depth of easy vs hard answer tokens",
) -> str:
    """Depth distribution of easy vs hard tokens, one panel per looped model.

    Args:
        stats_by_model: ``{model name: token_difficulty.depth_vs_token_difficulty output}`` (with
            ``"easy"`` / ``"hard"`` groups holding ``depth_share`` over depths 1..D, and optionally
            ``"reference"`` and ``"spearman"``).
        path: output PNG path.
        title: figure title.

    Returns:
        ``path`` as a string.
    """
    items = [(n, s) for n, s in stats_by_model.items() if s.get("easy") and s.get("hard")]
    k = max(1, len(items))
    fig = Figure(figsize=(4.6 * k + 1.0, 4.4), dpi=_DPI)
    FigureCanvasAgg(fig)
    for j, (name, st) in enumerate(items):
        ax = fig.add_subplot(1, k, j + 1)
        ax.grid(True, axis="y", alpha=0.3)
        D = max(len(st["easy"].get("depth_share") or []), len(st["hard"].get("depth_share") or []), 1)
        x = np.arange(1, D + 1)
        for off, group, color in ((-0.2, "easy", "tab:green"), (0.2, "hard", "tab:red")):
            g = st[group]
            share = [float(v) if _finite(v) else 0.0 for v in (g.get("depth_share") or [0.0] * D)]
            ax.bar(
                x + off,
                share,
                width=0.4,
                color=color,
                alpha=0.8,
                label=f"{group} (n = {g.get('n', 0)}, d̄ = {_fmt_num(g.get('mean_depth'))})",
            )
        ax.set_xticks(x)
        ax.set_xlabel("exit depth")
        ax.set_ylabel("share of tokens")
        ax.set_ylim(0, 1.05)
        ref = st.get("reference")
        rho = _fmt_num(st.get("spearman"), 3)
        ax.set_title(f"{name}: ρ = {rho}" + (f" (difficulty: {ref} loss)" if ref else ""), fontsize=9)
        _finish_legend(ax)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
