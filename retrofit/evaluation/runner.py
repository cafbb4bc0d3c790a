"""``evaluate``: complexity-controlled evaluation of one or more models on the same rows.

One call evaluates models on task generators (``data_prep.tasks``: MANO, BREVO, LANO, CLRS, GSM,
reasoning-gym tasks) at chosen difficulty levels and writes ``results.json`` (the schema of
:mod:`retrofit.evaluation.report`), ``report.md``, PNG plots and ``samples.html``.

Example::

    from retrofit.evaluation import evaluate
    results = evaluate(looped, tok, ["mano"], levels=[3, 5, 8], n=50, compare=(base, tok),
                       name="looped", compare_name="base", out_dir="eval/")

The package, by idea: :mod:`.options` (``EvalOptions``), :mod:`.rows` (rows and tokenization),
:mod:`.decoding` (greedy generation), :mod:`.teacher_forced` (teacher-forced passes),
:mod:`.policies` (exit policies at equal compute), :mod:`.task_eval` (one model, one task),
:mod:`.artifacts` (files), :mod:`.cli` (``retrofit eval``); pure functions in :mod:`.analysis`
and :mod:`.metrics`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .artifacts import write_artifacts
from .decoding import greedy_generate
from .models import model_info
from .options import DEFAULT_N, EvalOptions, resolve_options
from .rows import levels_for, task_rows
from .task_eval import evaluate_task

__all__ = [
    "add_arguments",
    "as_list",
    "evaluate",
    "evaluate_task",
    "greedy_generate",
    "run",
    "task_rows",
    "write_artifacts",
]


def as_list(tasks) -> list:
    """Task keys from a key, a comma-separated string, a Task or a list of them."""
    if isinstance(tasks, str):
        return [t for t in (s.strip() for s in tasks.split(",")) if t]
    if not isinstance(tasks, (list, tuple)):
        return [tasks]
    return list(tasks)


def evaluate(
    model,
    tokenizer,
    tasks="mano",
    levels=None,
    n: int = DEFAULT_N,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    *,
    name: str = "model",
    compare=None,
    compare_name: str = "compare",
    rows: Mapping[str, Any] | None = None,
    limit: int | None = None,
    train_levels=None,
    options: EvalOptions | None = None,
    print_summary: bool = False,
    config: Mapping[str, Any] | None = None,
    **option_overrides,
) -> dict[str, Any]:
    """Evaluate a model (and optionally a second one on the same rows) on several tasks.

    Args:
        model: looped or plain causal LM.
        tokenizer: its tokenizer.
        tasks: a task key, a comma-separated string or a list of keys / Tasks.
        levels: ``None`` (each task's defaults), a list (all tasks) or ``{task: levels}``.
        n: examples per level.
        seed: data seed.
        out_dir: when given, write every artifact there (:func:`write_artifacts`).
        name: the model's name in the results.
        compare: a second model evaluated the same way (e.g. the base): a model (same
            tokenizer) or ``(model, tokenizer)``. A looped model made by ``retrofit.convert``
            shares its modules with the base object, so pass a separate copy of the base.
        compare_name: its name.
        rows: ``{task: rows}`` to evaluate given rows instead of generated ones.
        limit: at most this many rows per task (:func:`task_rows`).
        train_levels: levels marked as training levels: a list or ``{task: levels}``.
        options: an :class:`EvalOptions` (default ``EvalOptions()``).
        print_summary: print the rich summary table.
        config: extra entries for ``results["config"]``.
        **option_overrides: fields of ``EvalOptions`` to override (e.g. ``batch_size=4``).

    Returns:
        The results dict (schema: :mod:`retrofit.evaluation.report`).
    """
    from data_prep.tasks import get_task

    opts = resolve_options(options, option_overrides)
    task_objs = [get_task(t) for t in as_list(tasks)]
    if not task_objs:
        raise ValueError("no task given")
    models = [(name, model, tokenizer)]
    if compare is not None:
        c_model, c_tok = compare if isinstance(compare, tuple) else (compare, tokenizer)
        if compare_name == name:
            compare_name = f"{compare_name} (compare)"
        models.append((compare_name, c_model, c_tok))
    results: dict[str, Any] = {
        "config": {
            "tasks": [t.name for t in task_objs],
            "models": [m[0] for m in models],
            "n_per_level": n,
            "seed": seed,
            "limit": limit,
            "batch_size": opts.batch_size,
            "max_new_tokens": opts.max_new_tokens if opts.max_new_tokens is not None else "auto (longest answer + 2)",
            "input_format": "chat template" if opts.chat else f"raw continuation, answer separator {opts.answer_sep!r}",
            "depth_alignment": opts.alignment,
            "accuracy": "exact match (task scorer) of greedy generation, stop at EOS or newline",
            "depth_statistics": "teacher-forced on the gold answer's content tokens",
            "exit_policies": "teacher-forced next-token accuracy on answer tokens; thresholds calibrated to "
            "the decider's mean depth (full-context frame, re-measured exactly where the engine implements the exit)",
            **dict(config or {}),
        },
        "models": {},
    }
    # one row set per task, shared by every model (side-by-side comparisons see the same instances)
    task_data = {}
    for t in task_objs:
        t_rows = rows.get(t.name) if rows is not None else None
        task_data[t.name] = task_rows(t, levels_for(t, levels), n, seed, limit) if t_rows is None else t_rows
    for mname, m, tok in models:
        entry: dict[str, Any] = {"tasks": {}}
        for t in task_objs:
            entry["tasks"][t.name] = evaluate_task(
                m, tok, t, rows=task_data[t.name], train_levels=levels_for(t, train_levels), name=mname, options=opts
            )
        info = model_info(m)
        entry["max_depth"] = info.max_depth
        entry["method"] = info.method
        entry["looped"] = info.looped
        results["models"][mname] = entry
    if out_dir is not None:
        write_artifacts(results, out_dir)
    if print_summary:
        from rich.console import Console

        from .report import summary_table

        Console().print(summary_table(results))
    return results


def add_arguments(parser) -> None:
    """Flags of ``retrofit eval`` (:mod:`.cli`)."""
    from .cli import add_arguments as _add

    _add(parser)


def run(args) -> int:
    """Entry point of ``retrofit eval`` (:mod:`.cli`)."""
    from .cli import run as _run

    return _run(args)
