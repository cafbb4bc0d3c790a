"""``evaluate``: complexity-controlled evaluation of one or more models on the same rows.

One call evaluates models on task generators (``data_prep.tasks``: MANO, BREVO, LANO, CLRS, GSM,
reasoning-gym tasks) at chosen difficulty levels and writes ``results.json`` (the schema of
:mod:`retrofit.evaluation.report`), ``report.md``, PNG plots and ``samples.html``.

Example::

    from retrofit.evaluation import evaluate
    results = evaluate(looped, tok, ["mano"], levels=[3, 5, 8], n=50, name="looped",
                       compare=[("sft", sft, tok), ("base", base, tok)], out_dir="eval/",
                       accuracy="teacher_forced_argmax")

The package, by idea: :mod:`.options` (``EvalOptions``), :mod:`.models` (model facts, batching,
FLOPs per token), :mod:`.rows` (rows and tokenization), :mod:`.decoding` (greedy generation),
:mod:`.teacher_forced` (teacher-forced passes, greedy exact match from one forward),
:mod:`.policies` (exit policies at equal compute), :mod:`.frontier` (the accuracy–compute frontier:
threshold sweep, random allocation at the same d̄, gain per decile, break-even d̄), :mod:`.oracle` (the oracle at
equal compute and the accuracy ceiling), :mod:`.structure`
(LANO/BREVO on the model's own strings), :mod:`.task_eval` (one model, one task), this module (several models, paired
comparisons), :mod:`.artifacts` (files), :mod:`.cli` (``retrofit eval``); pure functions in
:mod:`.analysis`, :mod:`.metrics`, :mod:`.stats` (intervals, paired tests, rows needed) and
:mod:`.token_difficulty`; output in :mod:`.report`, :mod:`.jsonio`, :mod:`.plots`, :mod:`.html`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from retrofit.model import registry

from .artifacts import write_artifacts
from .decoding import greedy_generate
from .models import model_info
from .options import DEFAULT_N, EvalOptions, resolve_options
from .rows import levels_for, split_of, task_rows
from .stats import rows_needed
from .task_entries import paired_by_split
from .task_eval import TaskArrays, evaluate_task, evaluate_task_arrays
from .token_difficulty import depth_vs_token_difficulty

__all__ = [
    "as_list",
    "compare_list",
    "evaluate",
    "evaluate_task",
    "greedy_generate",
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


def compare_list(compare, compare_name: str, name: str, tokenizer) -> list[tuple[str, Any, Any]]:
    """Normalise ``compare`` to ``[(name, model, tokenizer), ...]``.

    Accepted: None; a model (the primary's tokenizer); ``(model, tokenizer)`` (named
    ``compare_name``); or a list of ``(name, model, tokenizer)`` / ``(name, model)`` entries.

    Raises:
        ValueError: a malformed entry, or a name used twice (the primary's name included).
    """
    if compare is None:
        return []
    if isinstance(compare, list):
        out = []
        for i, item in enumerate(compare):
            if not isinstance(item, tuple) or len(item) not in (2, 3) or not isinstance(item[0], str):
                raise ValueError(
                    f"compare[{i}] must be (name, model, tokenizer) or (name, model), got {type(item).__name__}"
                )
            out.append((item[0], item[1], item[2] if len(item) == 3 else tokenizer))
    else:
        model, tok = compare if isinstance(compare, tuple) else (compare, tokenizer)
        if compare_name == name:
            compare_name = f"{compare_name} (compare)"
        out = [(compare_name, model, tok)]
    names = [name] + [n for n, _, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"model names must be unique; used more than once: {', '.join(dup)}")
    return out


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
    """Evaluate a model and any number of compared models on the same rows of several tasks.

    Besides each model's own results, the first model (``name``) is compared with every other one
    on the same rows (``results["comparisons"]``: exact McNemar and a paired bootstrap per level,
    over training levels, held-out levels and all rows; :mod:`.stats`); with ``frontier=True`` every
    model's frontier points are gathered in ``results["frontier"]`` (with the fixed-control comparison
    when a ``fixed`` looped model is compared with an adaptive first one; :mod:`.frontier`); and each looped model's
    per-token exit depth is set against a non-looped reference model's per-token loss
    (``token_difficulty`` in its task entry; :mod:`.token_difficulty`).

    Args:
        model: looped or plain causal LM.
        tokenizer: its tokenizer.
        tasks: a task key, a comma-separated string or a list of keys / Tasks.
        levels: ``None`` (each task's defaults), a list (all tasks) or ``{task: levels}``.
        n: examples per level.
        seed: data seed.
        out_dir: when given, write every artifact there (:func:`write_artifacts`).
        name: the model's name in the results.
        compare: models evaluated the same way, side by side: ``[(name, model, tokenizer), ...]``
            (or ``(name, model)`` with this tokenizer); the older single forms ``model`` or
            ``(model, tokenizer)``, named ``compare_name``, still work. A looped model made by
            ``retrofit.convert`` shares its modules with the base object, so pass a separate copy
            of the base.
        compare_name: the name of a single ``compare`` model.
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
    models = [(name, model, tokenizer)] + compare_list(compare, compare_name, name, tokenizer)
    reference = _difficulty_reference(models, opts.difficulty_reference)
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
            "accuracy": (
                "greedy output == gold answer + stop token, from one teacher-forced forward (exact for causal exits)"
                if opts.accuracy == "teacher_forced_argmax"
                else "task scorer on greedy generation, stop at EOS or newline"
            ),
            "accuracy_interval": f"Wilson score interval, {opts.confidence:.0%}",
            "paired_tests": f"{name} vs each other model on the same rows: exact McNemar (two-sided) and a paired "
            f"bootstrap of the accuracy difference ({opts.bootstrap_samples} resamples, seed {opts.stats_seed})",
            "rows_needed_for_10_points": f"{rows_needed(0.10)} per level (paired test, 80% power, two-sided 5%, "
            "independent errors at 50% accuracy: the worst case; retrofit.evaluation.stats.rows_needed)",
            "depth_statistics": "teacher-forced on the gold answer's content tokens",
            "lano_brevo_strings": opts.structure_strings,
            "exit_policies": "teacher-forced next-token accuracy on answer tokens; thresholds calibrated to "
            "the decider's mean depth (full-context frame, re-measured exactly where the engine implements the exit)",
            "token_difficulty_reference": reference,
            **dict(config or {}),
        },
        "models": {},
    }
    # one row set per task, shared by every model (side-by-side comparisons see the same instances)
    task_data = {}
    for t in task_objs:
        t_rows = rows.get(t.name) if rows is not None else None
        task_data[t.name] = task_rows(t, levels_for(t, levels), n, seed, limit) if t_rows is None else t_rows
    # every report states which levels trained and which were held out
    trained, held_out = {}, {}
    for t in task_objs:
        evaluated = sorted({int(r["difficulty"]) for r in task_data[t.name]})
        train = levels_for(t, train_levels)
        trained[t.name] = list(t.default_train_levels if train is None else train)
        held_out[t.name] = [lv for lv in evaluated if lv not in trained[t.name]]
    results["config"].update(train_levels=trained, held_out_levels=held_out)
    arrays: dict[str, dict[str, TaskArrays]] = {t.name: {} for t in task_objs}
    for mname, m, tok in models:
        entry: dict[str, Any] = {"tasks": {}}
        for t in task_objs:
            entry["tasks"][t.name], arrays[t.name][mname] = evaluate_task_arrays(
                m, tok, t, rows=task_data[t.name], train_levels=levels_for(t, train_levels), name=mname, options=opts
            )
        info = model_info(m)
        entry["max_depth"] = info.max_depth
        entry["method"] = info.method
        entry["looped"] = info.looped
        results["models"][mname] = entry
    if len(models) > 1:
        results["comparisons"] = {
            t.name: _comparisons(name, arrays[t.name], results["models"], t.name, opts) for t in task_objs
        }
    if opts.frontier:
        results["frontier"] = {
            t.name: _frontier(name, [m[0] for m in models], arrays[t.name], results["models"], t.name, opts)
            for t in task_objs
        }
    if reference is not None:
        for t in task_objs:
            for mname, _, _ in models:
                task_entry = results["models"][mname]["tasks"][t.name]
                if mname != reference and task_entry["looped"] and task_entry["max_depth"] > 1:
                    _token_difficulty(task_entry, arrays[t.name][mname], arrays[t.name][reference], reference)
    if out_dir is not None:
        write_artifacts(results, out_dir)
    if print_summary:
        from rich.console import Console

        from .report import summary_table

        Console().print(summary_table(results))
    return results


def _difficulty_reference(models, wanted: str | None) -> str | None:
    from .models import model_info as info_of

    names = [m[0] for m in models]
    if wanted is not None:
        if wanted not in names:
            raise ValueError(f"difficulty_reference {wanted!r} is not a model of this run; models: {', '.join(names)}")
        return wanted
    return next((n for n, m, _ in models if not info_of(m).looped), None)


def _comparisons(primary: str, arrays: dict[str, TaskArrays], models: dict, task: str, opts: EvalOptions) -> dict:
    """``{other: {"levels": {level: cmp}, "train": cmp, "held_out": cmp, "all": cmp}}`` (primary = a)."""
    entry = models[primary]["tasks"][task]
    levels = list(entry["levels"])
    train = entry.get("train_levels", [])
    row_level = np.asarray(arrays[primary].levels, dtype=object)
    a = arrays[primary].correct
    is_train = np.array([split_of(lv, train) == "train" for lv in arrays[primary].levels], dtype=bool)
    return {
        other: {"a": primary, "b": other, **paired_by_split(a, arr.correct, row_level, levels, is_train, opts)}
        for other, arr in arrays.items()
        if other != primary
    }


def _frontier(primary: str, names: list[str], arrays: dict[str, TaskArrays], models: dict, task: str, opts) -> dict:
    """``results["frontier"][task]``: every model's frontier points on the same rows, and — when the run has a
    looped model without a decider (the ``fixed`` control) next to a primary model with one — the
    fixed-control comparison (:func:`.frontier.fixed_control_comparison`)."""
    from .frontier import fixed_control_comparison

    entries = {n: models[n]["tasks"][task] for n in names}
    out: dict[str, Any] = {
        "rows": entries[primary]["frontier"]["rows"],
        "rows_per_level": opts.frontier_rows_per_level,
        "points": [p for n in names for p in entries[n]["frontier"]["points"]],
    }
    prim = entries[primary]

    def decides(entry) -> bool:  # a looped model whose method decides depths (not the fixed loop)
        return entry["looped"] and registry.method_class(entry["method"]).has_decider()

    fixed = next((n for n in names if n != primary and entries[n]["looped"] and not decides(entries[n])), None)
    if decides(prim) and fixed is not None:
        levels = list(prim["levels"])
        row_level = np.asarray(arrays[primary].levels, dtype=object)
        is_train = np.array([split_of(lv, prim.get("train_levels", [])) == "train" for lv in row_level], dtype=bool)
        a, f = arrays[primary].correct, arrays[fixed].correct
        out["fixed_control"] = fixed_control_comparison(
            primary,
            fixed,
            a,
            f,
            prim["overall"]["gen_flops_per_token"],
            entries[fixed]["overall"]["gen_flops_per_token"],
            paired_by_split(a, f, row_level, levels, is_train, opts),
            arrays[primary].frontier,
            arrays[fixed].frontier,
            entries[fixed]["max_depth"],
            opts,
        )
    return out


def _token_difficulty(entry: dict, looped: TaskArrays, ref: TaskArrays, ref_name: str) -> None:
    if looped.answer_ids != ref.answer_ids:
        entry.setdefault("notes", []).append(
            f"token difficulty: {ref_name} tokenizes the answers differently; per-token analysis skipped"
        )
        return
    depths = np.concatenate([d[c] for d, c in zip(looped.pred_depth, looped.content)])
    losses = np.concatenate([x[c] for x, c in zip(ref.nll, ref.content)])
    entry["token_difficulty"] = {"reference": ref_name, **depth_vs_token_difficulty(depths, losses, looped.max_depth)}
