"""Helpers of the evaluation figures (``retrofit.evaluation.plots``, ``retrofit.evaluation.plots_compute``):
figures without pyplot state, levels and series, legends, number formats."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from retrofit.evaluation.metrics import loss_change_stats

_DPI = 120


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")


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


_FORCED_LABEL = re.compile(r"^\s*(?:d|depth|forced|D)?\s*[=:]?\s*(\d+)\s*$", re.IGNORECASE)


def _is_forced(label: Any) -> bool:
    if isinstance(label, (int, np.integer)) and not isinstance(label, bool):
        return True
    return isinstance(label, str) and bool(_FORCED_LABEL.match(label))


def _color_cycle() -> list[dict[str, Any]]:
    from matplotlib import rcParams

    return list(rcParams["axes.prop_cycle"])


def _as_loss_stats(obj: Any, tol: float) -> dict[str, Any]:
    if isinstance(obj, Mapping) and "counts" in obj and "bin_edges" in obj:
        return dict(obj)
    # Δ values: reuse loss_change_stats with loss_first = 0, loss_last = Δ.
    deltas = np.asarray(obj.detach().cpu().float() if hasattr(obj, "detach") else obj, dtype=np.float64)
    return loss_change_stats(np.zeros_like(deltas), deltas, tol=tol)


def _pct(x: Any) -> str:
    return f"{100 * float(x):.1f}%" if _finite(x) else "n/a"


def _fmt_num(v: Any, digits: int = 2) -> str:
    return f"{float(v):.{digits}f}" if _finite(v) else "n/a"
