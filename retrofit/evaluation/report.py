"""Evaluation reports: atomic JSON, a Markdown report and a terminal summary table.

Results schema
--------------
One nested dict, produced by the evaluation driver and consumed here. Every key is optional:
a missing section (or a section whose values are all missing) is skipped, never an error.
Levels, depths and policies may be ints or strings (JSON turns keys into strings; numeric
strings are sorted numerically). Accuracies are fractions in [0, 1] (shown as percentages).

.. code-block:: text

    results = {
      "config": {key: value, ...},                  # shown as a bullet list (run settings)
      "models": {
        model_name: {                               # e.g. "base", "looped-fixed", "tah2"
          "max_depth": D,                           # optional, default for its tasks
          "tasks": {
            task_name: {                            # e.g. "mano", "brevo", "gsm-symbolic"
              "max_depth": D,                       # optional
              "levels": {                           # per difficulty level (§7)
                level: {
                  "accuracy": float,                # in [0, 1]
                  "accuracy_se": float,             # optional binomial standard error
                  "accuracy_ci": [low, high],       # optional Wilson interval (stats.wilson_interval)
                  "mean_depth": float,              # d̄ (absent for non-looped models)
                  "cost_exec": int,                 # Σ_d |A_d| (metrics.cost_exec)
                  "saving": float,                  # d̄ / D
                  "layers_per_token": float,        # decoder-layer passes per answer token
                  "flops_per_token": float,         # matmul FLOPs per answer token (models.flops_per_token)
                  "n": int,                         # examples at this level
                  "split": "train"|"interp"|"extrap",  # optional
                },
              },
              "splits": {"train" | "held_out": {"levels": [...], "n", "accuracy", "accuracy_ci"}},
                  # rows of the training levels vs the other levels, pooled (Wilson interval)
              "forced_depth_accuracy": {d: accuracy},          # test-time scaling, d = 1..D
              "exit_policies": {                               # learned vs training-free exits
                policy: {"accuracy": float, "mean_depth": float, "saving": float (optional)},
              },
              "spearman": {proxy: rho | {"rho": float, "n": int}},
              "regression": regression_dict | {name: regression_dict},
                  # regression_dict = metrics.linear_regression / regression_with_control output:
                  # {"coefficients": {feature: b}, "intercept", "r2", "r2_controls"?, "n"}
              "loss_change": metrics.loss_change_stats output,
              "token_difficulty": {"reference": name, **token_difficulty.depth_vs_token_difficulty output},
              "compute_points": [{"label", "accuracy", "accuracy_ci", "mean_depth", "layers_per_token",
                                  "flops_per_token"}],      # the accuracy-vs-compute plot
              "frontier": {                                    # EvalOptions.frontier (frontier.model_frontier)
                "rows", "rows_per_level", "passes", "wall_s", "points": [point, ...],
                # looped models with a decider:
                "threshold_kind", "own_threshold",
                "decider_vs_random": {"own" | "<threshold>": {"threshold", "own", "decider_mean_depth",
                    "random_rate", "random_mean_depth", "decider_flops_per_token", "random_flops_per_token",
                    "reused_decider_pass", **stats.paired_vs_draws output}},
                "gain_by_decile": metrics.gain_by_decile output,
                "break_even_mean_depth": flops.break_even_mean_depth output,
              },
                # point = {"model", "policy" ("decider" | "random" | "forced" | "plain"), "key", "label",
                #          "threshold", "own", "depth" (forced), "seeds", "rate", "target_mean_depth",
                #          "accuracy_draws", "mean_depth_draws" (random), "mean_depth", "flops_per_token",
                #          "accuracy", "accuracy_ci" (Wilson), "n"}
            },
          },
        },
      },
      "comparisons": {                              # first model vs each other one, same rows
        task_name: {other: {"a": first, "b": other, "levels": {level: cmp}, "train": cmp,
                            "held_out": cmp, "all": cmp}},
            # cmp = stats.paired_comparison output (counts, McNemar p, paired bootstrap)
      },
      "frontier": {                                 # EvalOptions.frontier: every model's points, same rows
        task_name: {"rows", "rows_per_level", "points": [point, ...],
                    "fixed_control": frontier.fixed_control_comparison output},  # with a `fixed` model
      },
    }

Functions:
    write_json              Atomic JSON writer that understands NumPy / torch values (:mod:`.jsonio`).
    write_markdown_report   The human-readable report with tables and embedded plots.
    summary_table           A ``rich`` table of accuracy and depth per model, task and level.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .jsonio import _is_numpy, _is_tensor, atomic_write_text, to_jsonable, write_json

__all__ = ["summary_table", "to_jsonable", "write_json", "write_markdown_report"]


# ----------------------------------------------------------------------------------------------
# formatting helpers
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Markdown report
# ----------------------------------------------------------------------------------------------


def _levels_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    per_model = {name: _section(_task(m, task), "levels") for name, m in models.items()}
    per_model = {k: v for k, v in per_model.items() if v}
    if not per_model:
        return []
    levels = _sort_keys([lvl for lv in per_model.values() for lvl in lv])

    def has(name: str, key: str) -> bool:
        return any(_num(_get(_lookup(per_model[name], lvl), key)) is not None for lvl in levels)

    has_split = any(_get(_lookup(lv, lvl), "split") for lv in per_model.values() for lvl in levels)
    # (header, model, key, formatter): accuracies of all models side by side, then depth columns.
    cols: list[tuple[str, str, str, Any]] = [(f"acc ({name})", name, "accuracy", _pct) for name in per_model]
    for name in per_model:
        if has(name, "mean_depth"):
            cols.append((f"d̄ ({name})", name, "mean_depth", _fmt))
        if has(name, "saving"):
            cols.append((f"d̄/D ({name})", name, "saving", _fmt))
        if has(name, "cost_exec"):
            cols.append((f"Cost_exec ({name})", name, "cost_exec", _int))
    # compute per answer token, comparable across looped and plain models
    for name in per_model:
        if has(name, "layers_per_token"):
            cols.append((f"layers/token ({name})", name, "layers_per_token", _fmt))
        if has(name, "flops_per_token"):
            cols.append((f"MFLOPs/token ({name})", name, "flops_per_token", _mflops))
    header = ["level"] + (["split"] if has_split else []) + ["n"] + [c[0] for c in cols]
    n_text = 2 if has_split else 1
    rows = []
    for lvl in levels:
        entries = {name: _lookup(lv, lvl) for name, lv in per_model.items()}
        row = [str(lvl)]
        if has_split:
            row.append(str(next((e["split"] for e in entries.values() if _get(e, "split")), "")))
        n = next((_get(e, "n") for e in entries.values() if _num(_get(e, "n")) is not None), None)
        row.append(_int(n))
        for _, name, key, fmt in cols:
            cell = fmt(_get(entries[name], key))
            if key == "accuracy" and cell != "–":
                cell += _interval(_get(entries[name], "accuracy_ci"), _get(entries[name], "accuracy_se"))
            row.append(cell)
        rows.append(row)
    return ["### Accuracy and depth by difficulty level", ""] + _table(header, rows, n_text)


def _scaling_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    per_model = {n: _section(_task(m, task), "forced_depth_accuracy") for n, m in models.items()}
    per_model = {k: v for k, v in per_model.items() if v}
    if not per_model:
        return []
    depths = _sort_keys([d for v in per_model.values() for d in v])
    rows = [[str(d)] + [_pct(_lookup(v, d)) for v in per_model.values()] for d in depths]
    return ["### Test-time scaling (forced depth)", ""] + _table(
        ["forced depth"] + [f"acc ({n})" for n in per_model], rows
    )


def _policies_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        for policy, p in _section(_task(m, task), "exit_policies").items():
            p = p if isinstance(p, Mapping) else {"accuracy": p}
            rows.append(
                [
                    name,
                    str(policy),
                    _pct(p.get("accuracy")),
                    _fmt(p.get("mean_depth")),
                    _fmt(p.get("saving")),
                ]
            )
    if not rows:
        return []
    return ["### Exit policies", ""] + _table(["model", "policy", "accuracy", "d̄", "d̄/D"], rows, n_text=2)


def _regressions(reg: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    if "coefficients" in reg:
        return {"": reg}
    return {str(k): v for k, v in reg.items() if isinstance(v, Mapping) and "coefficients" in v}


def _correlation_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    rows = []
    for name, m in models.items():
        for proxy, v in _section(_task(m, task), "spearman").items():
            rho = _get(v, "rho") if isinstance(v, Mapping) else v
            n = _get(v, "n") if isinstance(v, Mapping) else None
            rows.append([name, str(proxy), _fmt(rho, 3), _int(n)])
    if rows:
        out += ["**Spearman correlation of per-token depth with difficulty proxies**", ""]
        out += _table(["model", "proxy", "ρ", "n"], rows, n_text=2)
    reg_rows = []
    fit_rows = []
    for name, m in models.items():
        for reg_name, reg in _regressions(_section(_task(m, task), "regression")).items():
            label = f"{name} {reg_name}".strip()
            coefs = reg.get("coefficients") or {}
            for feat, b in coefs.items():
                reg_rows.append([label, str(feat), _fmt(b, 3)])
            fit_rows.append([label, _fmt(reg.get("r2"), 3), _fmt(reg.get("r2_controls"), 3), _int(reg.get("n"))])
    if reg_rows or fit_rows:
        out += ["**Linear regression of per-token depth on features**", ""]
        out += _table(["model", "feature", "coefficient"], reg_rows, n_text=2) if reg_rows else []
        out += _table(["model", "R²", "R² (controls only)", "n"], fit_rows)
    return (["### Depth–difficulty correlation and regression", ""] + out) if out else []


def _loss_change_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        s = _section(_task(m, task), "loss_change")
        if s:
            tol = _num(s.get("tol"))
            rows.append(
                [
                    name,
                    "–" if tol is None else f"{tol:g}",
                    _pct(s.get("share_unchanged")),
                    _pct(s.get("share_worse")),
                    _pct(s.get("share_improved")),
                    _fmt(s.get("mean_delta"), 4),
                    _int(s.get("n")),
                ]
            )
    if not rows:
        return []
    return ["### First-vs-last depth loss change", ""] + _table(
        ["model", "tol", "unchanged", "worse", "improved", "mean Δ", "tokens"], rows
    )


def _comparison_rows(label: str, c: Mapping[str, Any]) -> list[str]:
    boot = c.get("bootstrap") if isinstance(c.get("bootstrap"), Mapping) else {}
    ci = boot.get("ci") or [None, None]
    diff = _num(c.get("difference"))
    return [
        label,
        _int(c.get("n")),
        _pct(c.get("accuracy_a")),
        _pct(c.get("accuracy_b")),
        "–" if diff is None else f"{100 * diff:+.1f}",
        _int(c.get("a_only")),
        _int(c.get("b_only")),
        _pval(c.get("mcnemar_p")),
        "–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]",
        _pval(boot.get("p_value")),
    ]


def _comparisons_section(task: str, results: Mapping[str, Any]) -> list[str]:
    comps = _get(_get(results, "comparisons"), task)
    if not isinstance(comps, Mapping) or not comps:
        return []
    out = ["### Paired comparisons (same rows)", ""]
    for other, comp in comps.items():
        a, b = comp.get("a", "a"), comp.get("b", other)
        rows = [_comparison_rows(str(lvl), c) for lvl, c in _sort_keys_items(_section(comp, "levels"))]
        for key, label in (("train", "training levels"), ("held_out", "held-out levels"), ("all", "all rows")):
            if isinstance(comp.get(key), Mapping):
                rows.append(_comparison_rows(f"**{label}**", comp[key]))
        out += [f"**{a} vs {b}** (difference = {a} − {b}, percentage points)", ""]
        out += _table(
            [
                "level",
                "n",
                f"acc ({a})",
                f"acc ({b})",
                "difference",
                f"only {a} right",
                f"only {b} right",
                "McNemar p",
                "bootstrap 95% CI",
                "bootstrap p",
            ],
            rows,
        )
    return out


def _sort_keys_items(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return [(k, _lookup(mapping, k)) for k in _sort_keys(list(mapping))]


def _token_difficulty_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        s = _section(_task(m, task), "token_difficulty")
        if not s:
            continue
        easy, hard = s.get("easy") or {}, s.get("hard") or {}
        share = " / ".join(_pct(x, 0) for x in (hard.get("depth_share") or []))
        rows.append(
            [
                name,
                str(s.get("reference", "")),
                _int(s.get("n_tokens")),
                _fmt(s.get("spearman"), 3),
                _fmt(s.get("median_loss"), 3),
                _fmt(easy.get("mean_depth")),
                _fmt(hard.get("mean_depth")),
                share,
            ]
        )
    if not rows:
        return []
    return [
        "### Per-token depth vs difficulty",
        "",
        "Difficulty of an answer token = the reference model's teacher-forced loss on it; depth = the looped "
        "model's exit depth at the position that predicts it. Easy: loss at or below the median; hard: above.",
        "",
    ] + _table(
        ["model", "reference", "tokens", "Spearman ρ", "median loss", "d̄ easy", "d̄ hard", "hard tokens per depth"],
        rows,
        n_text=2,
    )


def _frontier_section(task: str, results: Mapping[str, Any]) -> list[str]:
    """The accuracy–compute frontier: every point, decider vs random, gain per decile, break-even, fixed control."""
    fr = _get(_get(results, "frontier"), task)
    if not isinstance(fr, Mapping) or not fr.get("points"):
        return []
    out = [
        "### Accuracy–compute frontier",
        "",
        f"Frontier rows: {fr.get('rows')} (at most {fr.get('rows_per_level') or 'every'} per level). d̄ and FLOPs "
        "per answer token over the answer steps (the positions producing the answer tokens and the stop token).",
        "",
    ]
    rows = []
    for p in fr["points"]:
        thr = p.get("threshold")
        rows.append(
            [
                str(p.get("model")),
                str(p.get("policy")) + (" (own)" if p.get("own") else ""),
                "–" if thr is None else f"{thr:g}",
                str(p.get("depth", "")) if p.get("policy") == "forced" else "",
                _fmt(p.get("mean_depth")),
                _mflops(p.get("flops_per_token")),
                _pct(p.get("accuracy")) + _interval(p.get("accuracy_ci"), None),
                _int(p.get("n")),
            ]
        )
    out += _table(["model", "policy", "threshold", "depth", "d̄", "MFLOPs/token", "accuracy", "n"], rows, n_text=2)
    for name, m in _models(results).items():
        f = _section(_task(m, task), "frontier")
        vs = f.get("decider_vs_random") if f else None
        if vs:
            rows = []
            for key, t in vs.items():
                boot = t.get("bootstrap") or {}
                ci = boot.get("ci") or [None, None]
                diff = _num(t.get("difference"))
                rows.append(
                    [
                        str(key),
                        _fmt(t.get("decider_mean_depth")),
                        _fmt(t.get("random_mean_depth")),
                        _fmt(t.get("random_rate"), 3),
                        _pct(t.get("accuracy_a")),
                        _pct(t.get("accuracy_b")),
                        "–" if diff is None else f"{100 * diff:+.1f}",
                        "–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]",
                        _pval(t.get("sign_flip_p")),
                        ", ".join(_pval(d.get("mcnemar_p")) for d in t.get("per_draw") or []),
                    ]
                )
            out += [f"**{name}: decider vs random allocation at the same d̄** (same rows; difference in points)", ""]
            out += _table(
                [
                    "threshold",
                    "d̄ decider",
                    "d̄ random",
                    "continue rate",
                    "acc decider",
                    "acc random (mean of draws)",
                    "difference",
                    "bootstrap 95% CI",
                    "sign-flip p",
                    "McNemar p per draw",
                ],
                rows,
            )
        g = f.get("gain_by_decile") if f else None
        if g and g.get("bins"):
            rows = [
                [
                    str(b["bin"]),
                    _int(b["n"]),
                    _fmt(b["prob_mean"], 3),
                    _fmt(b["gain_mean"], 4),
                    _pct(b["share_gain_positive"], 0),
                ]
                for b in g["bins"]
            ]
            out += [
                f"**{name}: realized gain ℓ(d) − ℓ(d+1) per decile of the continue probability** "
                f"({g['n_decisions']} decisions; Spearman over the deciles {_fmt(g.get('spearman'), 3)})",
                "",
            ]
            out += _table(["decile", "decisions", "mean continue prob", "mean gain (nats)", "gain > 0"], rows)
        be = f.get("break_even_mean_depth") if f else None
        if be:
            x = _num(be.get("mean_depth"))
            out += [
                f"**{name}: break-even d̄** (FLOPs per token equal to the loop at fixed depth {be.get('max_depth')} "
                f"without decider or per-depth readout): "
                + (_fmt(x, 3) if x is not None else f"none — {be.get('reason')}"),
                "",
            ]
    fc = fr.get("fixed_control")
    if isinstance(fc, Mapping):
        ci = fc.get("ci") or [None, None]
        out += [
            f"**{fc.get('adaptive')} vs the fixed-depth control {fc.get('fixed')} (depth {fc.get('fixed_depth')})**, "
            f"all {fc.get('n')} rows: {_pct(fc.get('accuracy_adaptive'))} vs {_pct(fc.get('accuracy_fixed'))}, "
            f"difference {100 * (_num(fc.get('difference')) or 0):+.1f} points, bootstrap 95% CI "
            + ("–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]")
            + f", McNemar p {_pval(fc.get('mcnemar_p'))}, FLOPs per answer token ratio {_fmt(fc.get('flops_ratio'), 3)}"
            f" — target (lower bound > −{100 * fc.get('margin', 0):.0f} points at ≤ {fc.get('max_flops_ratio')}× "
            f"FLOPs) {'met' if fc.get('meets') else 'not met'}.",
            "",
        ]
    return out


def write_markdown_report(
    results: Mapping[str, Any],
    path: str | os.PathLike,
    plots: Mapping[str, str | os.PathLike] | None = None,
    title: str = "Retrofit evaluation report",
) -> str:
    """Write a readable Markdown report of ``results`` (schema in the module docstring).

    Sections (each skipped when its data is missing): run configuration; per task: accuracy
    (with its interval), d̄, d̄/D, Cost_exec and compute per answer token per level (one column per
    model); paired comparisons; per-token depth vs difficulty; test-time scaling by forced depth;
    exit-policy comparison; Spearman correlations and regressions; first-vs-last loss change; the
    accuracy–compute frontier (``results["frontier"]``); finally the plots, embedded as images.

    Args:
        results: the results dict.
        path: output ``.md`` path; written atomically.
        plots: ``{caption: image path}``; absolute paths (or paths relative to the current
            directory that exist) are rewritten relative to the report's directory so the
            links work wherever the report folder is moved.
        title: top heading.

    Returns:
        ``path`` as a string.
    """
    path = os.fspath(path)
    report_dir = os.path.dirname(os.path.abspath(path))
    lines = [f"# {title}", ""]
    config = _get(results, "config")
    if isinstance(config, Mapping) and config:
        lines += ["## Configuration", ""]
        for k, v in config.items():
            val = v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(to_jsonable(v))
            lines.append(f"- **{k}**: {val}")
        lines.append("")
    models = _models(results)
    tasks = _tasks(models)
    if not tasks:
        lines += ["_No task results._", ""]
    for task in tasks:
        body = (
            _levels_table(task, models)
            + _comparisons_section(task, results)
            + _token_difficulty_section(task, models)
            + _scaling_table(task, models)
            + _policies_table(task, models)
            + _correlation_section(task, models)
            + _loss_change_section(task, models)
            + _frontier_section(task, results)
        )
        lines += [f"## Task: {task}", ""] + (body or ["_No results for this task._", ""])
    if plots:
        lines += ["## Plots", ""]
        for caption, p in plots.items():
            p = os.fspath(p)
            if os.path.isabs(p):
                p = os.path.relpath(p, report_dir)
            elif os.path.exists(p) and not os.path.exists(os.path.join(report_dir, p)):
                p = os.path.relpath(os.path.abspath(p), report_dir)
            p = p.replace(os.sep, "/")
            lines += [f"### {caption}", "", f"![{caption}]({p.replace(' ', '%20')})", ""]
    return atomic_write_text("\n".join(lines).rstrip() + "\n", path)


# ----------------------------------------------------------------------------------------------
# terminal
# ----------------------------------------------------------------------------------------------


def summary_table(results: Mapping[str, Any], title: str = "Evaluation summary") -> Any:
    """A ``rich.table.Table`` with one row per (model, task, level).

    Columns: model, task, level, n, accuracy (with its interval when present), d̄, d̄/D,
    MFLOPs per answer token. Print it with ``rich.console.Console().print(summary_table(results))``.
    """
    from rich.table import Table

    table = Table(title=title)
    for col, kw in (
        ("model", {}),
        ("task", {}),
        ("level", {"justify": "right"}),
        ("n", {"justify": "right"}),
        ("accuracy", {"justify": "right"}),
        ("d̄", {"justify": "right"}),
        ("d̄/D", {"justify": "right"}),
        ("MFLOPs/token", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    models = _models(results)
    for task in _tasks(models):
        for name, m in models.items():
            levels = _section(_task(m, task), "levels")
            for lvl in _sort_keys(list(levels)):
                e = _lookup(levels, lvl)
                table.add_row(
                    name,
                    task,
                    str(lvl),
                    _int(_get(e, "n")),
                    _pct(_get(e, "accuracy"))
                    + (_interval(_get(e, "accuracy_ci"), None) if _num(_get(e, "accuracy")) is not None else ""),
                    _fmt(_get(e, "mean_depth")),
                    _fmt(_get(e, "saving")),
                    _mflops(_get(e, "flops_per_token")),
                )
    return table
