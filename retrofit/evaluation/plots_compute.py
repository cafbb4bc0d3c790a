"""Accuracy against compute: mean depth (``plot_accuracy_vs_compute``) and FLOPs per token (``plot_accuracy_vs_flops``,
the frontier). ``retrofit.evaluation.plots`` re-exports both."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .plots_base import (
    _DPI,
    _MARKERS,
    _color_cycle,
    _finish_legend,
    _finite,
    _is_forced,
    _new_figure,
    _save,
)


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
    (min–max accuracy and FLOPs over the draws) and a dotted link to the decider point it is matched to, the
    oracle at each decider point's d̄ as filled triangles (linked the same way), the accuracy ceiling as an X,
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
            orc = [p for p in mine if p["policy"] == "oracle"]
            for n, p in enumerate(orc):
                ax.scatter(
                    [x(p)],
                    [p["accuracy"]],
                    marker="^",
                    s=36,
                    color=color,
                    label=f"{m}: oracle at the same d̄" if n == 0 else None,
                )
                match = next((d for d in dec if d.get("threshold") == p.get("threshold")), None)
                if match is not None:
                    ax.plot([x(match), x(p)], [match["accuracy"], p["accuracy"]], ":", color=color, linewidth=0.8)
            for p in (p for p in mine if p["policy"] == "ceiling"):
                ax.scatter([x(p)], [p["accuracy"]], marker="X", s=60, color=color, label=f"{m}: accuracy ceiling")
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
