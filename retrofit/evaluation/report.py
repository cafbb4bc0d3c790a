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
                "decider_vs_oracle": {"own" | "<threshold>": {"threshold", "own", "n_continues",
                    "decider_mean_depth", "oracle_mean_depth", "accuracy_decider", "accuracy_random",
                    "accuracy_oracle", "gap_closed", "decider_vs_oracle": stats.paired_comparison output}},
                "ceiling": {"rule", "token_accuracy_bound", "exact_match_bound", "accuracy", "mean_depth",
                    "flops_per_token", "frame"},              # EvalOptions.frontier_oracle (oracle.py)
                "gain_by_decile": decider_metrics.gain_by_decile output,
                "break_even_mean_depth": flops.break_even_mean_depth output,
              },
                # point = {"model", "policy" ("decider" | "random" | "oracle" | "ceiling" | "forced" | "plain"),
                #          "key", "label", "threshold", "own", "depth" (forced), "seeds", "rate",
                #          "target_mean_depth", "accuracy_draws", "mean_depth_draws" (random), "n_continues",
                #          "forced_frame_token_accuracy", "forced_frame_exact_match" (oracle),
                #          "token_accuracy_bound", "exact_match_bound" (ceiling), "mean_depth", "flops_per_token",
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
    write_json              ``write_json(obj, path)``: the old name of
                            ``retrofit.hub.atomic_io.write_json_atomic(path, obj, strict=True)``.
    write_markdown_report   The human-readable report with tables and embedded plots.
    summary_table           A ``rich`` table of accuracy and depth per model, task and level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..hub.atomic_io import write_text_atomic
from .jsonio import to_jsonable, write_json
from .report_format import (
    _fmt,
    _get,
    _int,
    _interval,
    _lookup,
    _mflops,
    _models,
    _num,
    _pct,
    _section,
    _sort_keys,
    _task,
    _tasks,
)
from .report_sections import (
    _comparisons_section,
    _correlation_section,
    _frontier_section,
    _length_section,
    _levels_table,
    _loss_change_section,
    _policies_table,
    _scaling_table,
    _token_difficulty_section,
)

__all__ = ["summary_table", "to_jsonable", "write_json", "write_markdown_report"]


# ----------------------------------------------------------------------------------------------
# Markdown report
# ----------------------------------------------------------------------------------------------


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
            + _length_section(task, models)
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
    return str(write_text_atomic(path, "\n".join(lines).rstrip() + "\n"))


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
