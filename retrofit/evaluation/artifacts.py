"""Artifacts of an evaluation: ``results.json``, ``report.md``, PNG plots and ``samples.html``.

Everything is drawn from the results dict alone, so a saved ``results.json`` can be re-rendered::

    import json
    from retrofit.evaluation import write_artifacts
    write_artifacts(json.load(open("eval/results.json")), "eval/")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["write_artifacts"]


def write_artifacts(results: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json``, the PNG plots, ``samples.html`` and ``report.md`` into ``out_dir``.

    Everything is drawn from ``results`` alone, so a saved ``results.json`` can be re-rendered.
    Per task: ``{task}_depth_vs_difficulty.png`` (looped models only), ``{task}_accuracy_vs_difficulty.png``
    (training levels shaded), ``{task}_accuracy_vs_compute.png`` (every model; x = matmul MFLOPs per
    generated token, error bars = accuracy intervals), ``{task}_loss_change.png`` (looped, D > 1) and
    ``{task}_depth_by_token_difficulty.png`` (looped models with a difficulty reference); with a frontier
    (``EvalOptions.frontier``), ``accuracy_vs_flops.png``: every model and policy, one panel per task.

    Returns:
        ``{artifact: path}``.
    """
    from ..hub.atomic_io import write_json_atomic
    from .html import write_depth_html
    from .plots import (
        plot_accuracy_vs_compute,
        plot_accuracy_vs_difficulty,
        plot_accuracy_vs_flops,
        plot_depth_by_token_difficulty,
        plot_depth_vs_difficulty,
        plot_loss_change_histogram,
    )
    from .report import write_markdown_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {"results": str(write_json_atomic(out / "results.json", results, strict=True))}
    plots: dict[str, str] = {}
    models = results.get("models", {})
    task_names = list(dict.fromkeys(t for m in models.values() for t in m.get("tasks", {})))
    all_samples = []
    max_d = 1
    for task in task_names:
        per = {mn: m["tasks"][task] for mn, m in models.items() if task in m.get("tasks", {})}
        any_t = next(iter(per.values()))
        knob = any_t.get("knob", "level")
        xlabel = f"{task} difficulty ({knob})"
        train = any_t.get("train_levels", [])
        looped = {mn: t for mn, t in per.items() if t.get("looped")}
        if looped:
            D = max(int(t.get("max_depth", 1)) for t in looped.values())
            max_d = max(max_d, D)
            p = plot_depth_vs_difficulty(
                {mn: {lvl: e.get("mean_depth") for lvl, e in t["levels"].items()} for mn, t in looped.items()},
                out / f"{task}_depth_vs_difficulty.png",
                max_depth=D,
                title=f"{task}: mean depth d̄ over answer tokens vs difficulty",
                xlabel=xlabel,
            )
            plots[f"{task}: d̄ vs difficulty"] = p
        p = plot_accuracy_vs_difficulty(
            {mn: {lvl: e.get("accuracy") for lvl, e in t["levels"].items()} for mn, t in per.items()},
            out / f"{task}_accuracy_vs_difficulty.png",
            train_levels=train,
            title=f"{task}: exact-match accuracy vs difficulty",
            xlabel=xlabel,
        )
        plots[f"{task}: accuracy vs difficulty"] = p
        points, unit = _compute_points(per)
        p = plot_accuracy_vs_compute(
            points,
            out / f"{task}_accuracy_vs_compute.png",
            title=f"{task}: accuracy vs compute\n(lines: forced depth; stars: each model's own exits; bars: intervals)",
            xlabel=unit,
        )
        plots[f"{task}: accuracy vs compute"] = p
        td = {mn: t["token_difficulty"] for mn, t in per.items() if t.get("token_difficulty")}
        if td:
            p = plot_depth_by_token_difficulty(
                td,
                out / f"{task}_depth_by_token_difficulty.png",
                title=f"{task}: exit depth of easy vs hard answer tokens\n(split at the median loss of the reference)",
            )
            plots[f"{task}: depth of easy vs hard tokens"] = p
        lc = {mn: t["loss_change"] for mn, t in per.items() if t.get("loss_change") and t["loss_change"].get("n")}
        if lc:
            p = plot_loss_change_histogram(
                next(iter(lc.values())) if len(lc) == 1 else lc,
                out / f"{task}_loss_change.png",
                title=f"{task}: loss change Δ = ℓ(D) − ℓ(1), teacher-forced answer tokens",
            )
            plots[f"{task}: first-vs-last depth loss change"] = p
        for t in per.values():
            all_samples += t.get("samples", [])
            max_d = max(max_d, int(t.get("max_depth", 1)))
    frontier = results.get("frontier") or {}
    if frontier:
        plots["accuracy vs FLOPs per answer token (the frontier)"] = plot_accuracy_vs_flops(
            {task: f.get("points", []) for task, f in frontier.items()}, out / "accuracy_vs_flops.png"
        )
    paths.update({f"plot:{k}": str(v) for k, v in plots.items()})
    if all_samples:
        paths["samples"] = write_depth_html(
            [{k: s[k] for k in ("title", "tokens", "depths")} for s in all_samples],
            out / "samples.html",
            max_depth=max_d,
            page_title="Sample generations, coloured by each token's exit depth (grey: prompt)",
        )
    paths["report"] = write_markdown_report(results, out / "report.md", plots=plots)
    return paths


def _compute_points(per: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list], str]:
    """Plot points ``{model: [(MFLOPs per token, accuracy, label, interval)]}`` and the x-axis label.

    Results written before compute points carried FLOPs hold ``[layers, accuracy, label]`` lists;
    those are drawn against layer passes.
    """
    points: dict[str, list] = {}
    flops = all(isinstance(p, Mapping) for t in per.values() for p in t.get("compute_points", []))
    for mn, t in per.items():
        pts = []
        for p in t.get("compute_points", []):
            if isinstance(p, Mapping):
                pts.append((p["flops_per_token"] / 1e6, p["accuracy"], p["label"], p.get("accuracy_ci")))
            elif not flops:
                pts.append(tuple(p))
        points[mn] = pts
    unit = "matmul MFLOPs per generated token" if flops else "decoder-layer passes per generated token"
    return points, unit
