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

import math
import os
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from retrofit.evaluation.metrics import loss_change_stats

__all__ = [
    "plot_accuracy_vs_compute",
    "plot_accuracy_vs_flops",
    "plot_depth_by_token_difficulty",
    "plot_accuracy_vs_difficulty",
    "plot_depth_vs_difficulty",
    "plot_loss_change_histogram",
]

_DPI = 120
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _new_figure(figsize: tuple[float, float] = (6.4, 4.2)) -> tuple[Figure, Any]:
    fig = Figure(figsize=figsize, dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=_DPI)
    return path


def _as_number(v: Any) -> float | None:
    """Level as a float if it is numeric (or a numeric string), else None."""
    if isinstance(v, bool):
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


def _level_positions(levels: Iterable[Hashable]) -> tuple[dict[Hashable, float], bool]:
    """Map each level to an x position; numeric levels keep their value."""
    levels = list(dict.fromkeys(levels))
    nums = [_as_number(v) for v in levels]
    if levels and all(x is not None for x in nums):
        return {lvl: x for lvl, x in zip(levels, nums)}, True
    return {lvl: float(i) for i, lvl in enumerate(levels)}, False


def _finite(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float, np.number)) and math.isfinite(float(v))


def _level_series(ax: Any, series_by_model: Mapping[str, Mapping[Hashable, Any]]) -> dict[Hashable, float]:
    """Draw one line per model over difficulty levels; return the level -> x mapping."""
    all_levels = [lvl for series in series_by_model.values() for lvl in series]
    pos, numeric = _level_positions(all_levels)
    for i, (name, series) in enumerate(series_by_model.items()):
        pts = sorted(
            ((pos[lvl], float(v)) for lvl, v in series.items() if _finite(v)),
            key=lambda p: p[0],
        )
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], label=str(name), linewidth=1.6)
    if not numeric:
        ax.set_xticks(list(pos.values()))
        ax.set_xticklabels([str(lvl) for lvl in pos], rotation=0)
    elif len(pos) <= 20:
        ax.set_xticks(sorted(set(pos.values())))
        ax.set_xticklabels([_fmt_level(x) for x in sorted(set(pos.values()))])
    return pos


def _fmt_level(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _finish_legend(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8, loc="best", framealpha=0.85)


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
# test-time scaling
# ----------------------------------------------------------------------------------------------

_FORCED_LABEL = re.compile(r"^\s*(?:d|depth|forced|D)?\s*[=:]?\s*(\d+)\s*$", re.IGNORECASE)


def _is_forced(label: Any) -> bool:
    if isinstance(label, (int, np.integer)) and not isinstance(label, bool):
        return True
    return isinstance(label, str) and bool(_FORCED_LABEL.match(label))


def plot_accuracy_vs_compute(
    points_by_model: Mapping[str, Sequence[tuple[float, float, Any]]],
    path: str | os.PathLike,
    title: str = "Test-time scaling: accuracy vs compute",
    xlabel: str = "compute (mean core depth per token)",
    logx: bool = False,
) -> str:
    """Test-time scaling curve: accuracy vs compute, forced depths joined, adaptive points starred.

    Each point is ``(compute, accuracy, label)`` or ``(compute, accuracy, label, (low, high))``
    with an accuracy interval, drawn as a vertical error bar. A point whose label is an integer
    or a string like ``"3"``, ``"d=3"``, ``"depth 3"`` is a *forced-depth* point; those of one
    model are joined by a line in order of compute. Any other label (``"adaptive"``,
    ``"tah2 τ=0.5"``, ``"kl<1e-3"``) is drawn as a star in the model's colour. Every point is
    annotated with its label.

    Args:
        points_by_model: ``{model name: [(compute, accuracy, label[, (low, high)]), ...]}``.
            Compute may be mean depth, layer passes or FLOPs per token; say which in ``xlabel``.
        path: output PNG path.
        title: figure title.
        xlabel: x-axis label.
        logx: log2 x-axis (TaH2 reports gains per doubling of decode FLOPs).

    Returns:
        ``path`` as a string.
    """
    fig, ax = _new_figure((6.8, 4.4))
    prop_colors = [c["color"] for c in _color_cycle()]
    for i, (name, points) in enumerate(points_by_model.items()):
        color = prop_colors[i % len(prop_colors)]
        intervals = [(float(p[0]), float(p[1]), p[3]) for p in points if len(p) > 3 and p[3] is not None]
        points = [tuple(p[:3]) for p in points]
        for c, a, (lo, hi) in intervals:
            if _finite(c) and _finite(a) and _finite(lo) and _finite(hi):
                ax.errorbar(
                    [c], [a], yerr=[[a - float(lo)], [float(hi) - a]], color=color, alpha=0.5, capsize=3, linewidth=1
                )
        forced = sorted(
            ((float(c), float(a), lab) for c, a, lab in points if _finite(c) and _finite(a) and _is_forced(lab)),
            key=lambda p: p[0],
        )
        other = [(float(c), float(a), lab) for c, a, lab in points if _finite(c) and _finite(a) and not _is_forced(lab)]
        if forced:
            xs, ys, _ = zip(*forced)
            ax.plot(
                xs,
                ys,
                marker=_MARKERS[i % len(_MARKERS)],
                color=color,
                label=f"{name} (forced depth)",
            )
        if other:
            xs, ys, _ = zip(*other)
            ax.scatter(
                xs,
                ys,
                marker="*",
                s=160,
                color=color,
                edgecolor="black",
                linewidth=0.6,
                zorder=3,
                label=f"{name} (adaptive)" if forced else str(name),
            )
        for c, a, lab in forced + other:
            ax.annotate(str(lab), (c, a), textcoords="offset points", xytext=(4, 5), fontsize=7, color=color)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    _finish_legend(ax)
    return _save(fig, path)


def plot_accuracy_vs_flops(
    points_by_task: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike,
    title: str = "Accuracy vs compute: every model and policy on the same rows",
) -> str:
    """The accuracy–compute frontier (docs/evaluation.md): one panel per task, x = matmul MFLOPs per answer
    token, y = greedy exact-match accuracy.

    Per model (one colour each): the decider's threshold sweep as a connected line (its own threshold
    starred), random allocation at each threshold's d̄ as open diamonds with the spread of its draws
    (min–max accuracy and FLOPs over the draws) and a dotted link to the decider point it is matched to,
    forced depths as a dashed line of squares (the ``fixed`` control's are its only points), a plain
    model as one large marker. Vertical bars on decider and plain points are their Wilson intervals.

    Args:
        points_by_task: ``{task: [frontier point, ...]}`` (``results["frontier"][task]["points"]``: ``model``,
            ``policy``, ``threshold``, ``flops_per_token``, ``accuracy``, ``accuracy_ci`` and for random
            allocation ``accuracy_draws`` / ``mean_depth_draws``; ``label`` annotates forced points).
        path: output PNG path.
        title: figure title.

    Returns:
        ``path`` as a string.
    """
    tasks = [t for t, pts in points_by_task.items() if pts]
    k = max(1, len(tasks))
    fig = Figure(figsize=(6.8 * k, 4.8), dpi=_DPI)
    FigureCanvasAgg(fig)
    colors = [c["color"] for c in _color_cycle()]
    for j, task in enumerate(tasks):
        ax = fig.add_subplot(1, k, j + 1)
        ax.grid(True, alpha=0.3)
        pts = [p for p in points_by_task[task] if _finite(p.get("flops_per_token")) and _finite(p.get("accuracy"))]
        models = list(dict.fromkeys(p["model"] for p in pts))
        for i, m in enumerate(models):
            color = colors[i % len(colors)]
            mine = [p for p in pts if p["model"] == m]

            def x(p):
                return float(p["flops_per_token"]) / 1e6

            def bars(ps):
                for p in ps:
                    ci = p.get("accuracy_ci") or [None, None]
                    if _finite(ci[0]) and _finite(ci[1]):
                        a = float(p["accuracy"])
                        yerr = [[max(0.0, a - float(ci[0]))], [max(0.0, float(ci[1]) - a)]]
                        ax.errorbar([x(p)], [a], yerr=yerr, color=color, alpha=0.35, capsize=2, linewidth=1)

            dec = sorted((p for p in mine if p["policy"] == "decider"), key=x)
            if dec:
                ax.plot(
                    [x(p) for p in dec], [p["accuracy"] for p in dec], "-o", color=color, ms=4, label=f"{m}: decider"
                )
                bars(dec)
                for p in dec:
                    if p.get("own"):
                        ax.scatter([x(p)], [p["accuracy"]], marker="*", s=170, color=color, edgecolor="black", zorder=4)
                    if p.get("threshold") is not None:
                        ax.annotate(
                            f"{p['threshold']:g}",
                            (x(p), p["accuracy"]),
                            textcoords="offset points",
                            xytext=(3, 5),
                            fontsize=6,
                            color=color,
                        )
            rnd = [p for p in mine if p["policy"] == "random"]
            for n, p in enumerate(rnd):
                accs = [float(a) for a in p.get("accuracy_draws") or [] if _finite(a)]
                yerr = [[p["accuracy"] - min(accs)], [max(accs) - p["accuracy"]]] if accs else None
                ax.errorbar(
                    [x(p)],
                    [p["accuracy"]],
                    yerr=yerr,
                    fmt="D",
                    mfc="none",
                    color=color,
                    ms=5,
                    capsize=2,
                    linewidth=0.8,
                    label=f"{m}: random at the same d̄" if n == 0 else None,
                )
                match = next((d for d in dec if d.get("threshold") == p.get("threshold")), None)
                if match is not None:
                    ax.plot([x(match), x(p)], [match["accuracy"], p["accuracy"]], ":", color=color, linewidth=0.8)
            forced = sorted((p for p in mine if p["policy"] == "forced"), key=x)
            if forced:
                ax.plot(
                    [x(p) for p in forced],
                    [p["accuracy"] for p in forced],
                    "--s",
                    color=color,
                    ms=4,
                    mfc="white",
                    label=f"{m}: forced depth",
                )
                for p in forced:
                    ax.annotate(
                        f"d={p.get('depth', p.get('label'))}",
                        (x(p), p["accuracy"]),
                        textcoords="offset points",
                        xytext=(3, -9),
                        fontsize=6,
                        color=color,
                    )
            plain = [p for p in mine if p["policy"] == "plain"]
            for p in plain:
                ax.scatter([x(p)], [p["accuracy"]], marker="P", s=90, color=color, edgecolor="black", zorder=4, label=m)
            bars(plain)
        ax.set_xlabel("matmul MFLOPs per answer token")
        ax.set_ylabel("greedy exact-match accuracy")
        ax.set_title(f"{task} (star: the decider's own threshold; numbers: thresholds)", fontsize=9)
        _finish_legend(ax)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _color_cycle() -> list[dict[str, Any]]:
    from matplotlib import rcParams

    return list(rcParams["axes.prop_cycle"])


# ----------------------------------------------------------------------------------------------
# loss change
# ----------------------------------------------------------------------------------------------


def _as_loss_stats(obj: Any, tol: float) -> dict[str, Any]:
    if isinstance(obj, Mapping) and "counts" in obj and "bin_edges" in obj:
        return dict(obj)
    # Δ values: reuse loss_change_stats with loss_first = 0, loss_last = Δ.
    deltas = np.asarray(obj.detach().cpu().float() if hasattr(obj, "detach") else obj, dtype=np.float64)
    return loss_change_stats(np.zeros_like(deltas), deltas, tol=tol)


def _pct(x: Any) -> str:
    return f"{100 * float(x):.1f}%" if _finite(x) else "n/a"


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


def _fmt_num(v: Any, digits: int = 2) -> str:
    return f"{float(v):.{digits}f}" if _finite(v) else "n/a"
