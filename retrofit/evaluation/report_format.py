"""Formatting helpers of the Markdown report (``retrofit.evaluation.report``): numbers, intervals, p-values,
tables, and lookups into the results dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..hub.atomic_io import _is_numpy, _is_tensor


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    if _is_numpy(v) or _is_tensor(v):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(v, (int, float)) and math.isfinite(float(v)):
        return float(v)
    return None


def _pct(v: Any, digits: int = 1) -> str:
    x = _num(v)
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _fmt(v: Any, digits: int = 2) -> str:
    x = _num(v)
    return "–" if x is None else f"{x:.{digits}f}"


def _int(v: Any) -> str:
    x = _num(v)
    return "–" if x is None else f"{int(round(x)):,}"


def _mflops(v: Any) -> str:
    x = _num(v)
    return "–" if x is None else f"{x / 1e6:,.1f}"


def _interval(ci: Any, se: Any) -> str:
    """`` [lo–hi]`` of an interval in percent, else `` ± se`` (percentage points), else nothing."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_num(c) is not None for c in ci):
        return f" [{100 * _num(ci[0]):.1f}–{100 * _num(ci[1]):.1f}]"
    se = _num(se)
    return "" if se is None else f" ± {100 * se:.1f}"


def _pval(v: Any) -> str:
    x = _num(v)
    if x is None:
        return "–"
    return f"{x:.2g}" if x >= 1e-3 else f"{x:.1e}"


def _md(s: Any) -> str:
    """Escape a value for a Markdown table cell."""
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]], n_text: int = 1) -> list[str]:
    """Markdown table; the first ``n_text`` columns are left-aligned, the rest (numbers) right."""
    lines = ["| " + " | ".join(_md(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" if i < n_text else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _sort_keys(keys: list[Any]) -> list[Any]:
    """Union order of first appearance, deduplicated by string form (4 and "4" are one key,
    as after a JSON round trip); numeric (or numeric-string) keys sorted by value."""
    keys = list({str(k): k for k in reversed(keys)}.values())[::-1]
    values: list[float] = []
    for k in keys:
        if isinstance(k, bool):
            return keys
        try:
            values.append(float(k))
        except (TypeError, ValueError):
            return keys
    order = sorted(range(len(keys)), key=lambda i: values[i])
    return [keys[i] for i in order]


def _get(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, Mapping) else None


def _models(results: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    models = _get(results, "models")
    return {str(k): v for k, v in models.items() if isinstance(v, Mapping)} if isinstance(models, Mapping) else {}


def _tasks(models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    names: list[str] = []
    for m in models.values():
        tasks = _get(m, "tasks")
        if isinstance(tasks, Mapping):
            names += [str(t) for t in tasks]
    return list(dict.fromkeys(names))


def _task(model: Mapping[str, Any], task: str) -> Mapping[str, Any]:
    tasks = _get(model, "tasks")
    if not isinstance(tasks, Mapping):
        return {}
    for k, v in tasks.items():
        if str(k) == task and isinstance(v, Mapping):
            return v
    return {}


def _section(model_task: Mapping[str, Any], key: str) -> Mapping[Any, Any]:
    v = model_task.get(key)
    return v if isinstance(v, Mapping) and v else {}


def _lookup(mapping: Mapping[Any, Any], key: Any) -> Any:
    """``mapping[key]`` matching 3 == "3" (JSON round trips stringify keys)."""
    if key in mapping:
        return mapping[key]
    for k, v in mapping.items():
        if str(k) == str(key):
            return v
    return None
