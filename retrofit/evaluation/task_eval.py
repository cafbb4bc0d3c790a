"""Evaluate one model on one task: accuracy, depth and compute per difficulty level.

What is measured (options: :class:`~retrofit.evaluation.options.EvalOptions`):

* **Accuracy** per level, with ``accuracy="generate"``: the task's scorer (``Task.score``) on
  greedy generation (:mod:`~retrofit.evaluation.decoding`: stop at EOS or a newline token, budget
  the longest gold answer + 2 tokens); with ``"teacher_forced_argmax"``: whether greedy decoding
  would emit exactly the gold answer and a stop token, read from the teacher-forced forward
  (:func:`~retrofit.evaluation.teacher_forced.argmax_pass`; no generation). The same at every
  forced depth ``1 … D`` (the test-time scaling curve, ``forced_depth_accuracy``).
  ``gen_mean_depth`` is the mean depth of the decoding steps (the generated tokens' producing
  steps; teacher-forced: the steps that produce the gold answer and its stop token).
* **Depth** (teacher-forced, :mod:`~retrofit.evaluation.teacher_forced`): the level ``mean_depth``
  d̄, ``cost_exec`` (Σ_d |A_d|) and ``saving`` (d̄ / D) over the gold answer's content tokens
  (whitespace-only tokens excluded), E[d], next-token ``token_accuracy``, the LANO Spearman and
  BREVO regression, and — from the depth-D forward — per-depth token accuracy, the
  first-vs-last depth loss change and the exit-policy comparison (:mod:`~retrofit.evaluation.policies`).

* **The accuracy–compute frontier** (``frontier=True``, :mod:`~retrofit.evaluation.frontier`): on the
  frontier rows, (FLOPs per answer token, accuracy) of the decider's threshold sweep, random allocation
  at each threshold's d̄, every forced depth (or the plain model's one point), the decider-vs-random
  paired tests, the realized gain per decile of the continue probability and the break-even d̄. The
  adaptive pass and the forced-depth curve are reused, subset to the frontier rows.

A plain (non-looped) model is evaluated at its only depth (D = 1): accuracy, token accuracy and
layer counts, no depth statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from retrofit.model.backends import share_first_depth

from .decoding import greedy_generate, stop_ids, stop_rule
from .frontier import FrontierArrays, model_frontier
from .length_cutoffs import length_cutoff_curve
from .metrics import loss_change_stats
from .models import flops_per_token, model_info, pad_id
from .options import DEFAULT_N, EvalOptions, resolve_options
from .policies import cat, exit_policies, mean
from .rows import prepare, split_of, task_rows
from .structure import generated_examples
from .task_entries import (
    ci,
    gen_depths,
    html_samples,
    level_table,
    overall_entry,
    paired_by_split,
    split_table,
    structure_analysis,
)
from .teacher_forced import argmax_pass, forced_depths_argmax, teacher_forced

__all__ = ["TaskArrays", "evaluate_task", "evaluate_task_arrays"]


@dataclass
class TaskArrays:
    """Per-example arrays of one model on one task, for comparisons across models (same row order).

    Attributes:
        levels: ``[N]`` each row's difficulty level.
        correct: ``[N]`` bool, the row's accuracy outcome.
        answer_ids: per example, the gold answer tokens ``[m]``.
        content: per example, ``[m]`` bool (non-whitespace answer tokens).
        nll: per example, ``[m]`` teacher-forced loss of each answer token (producing position).
        pred_depth: per example, ``[m]`` exit depth of the producing position (looped models) or None.
        max_depth: D.
        step_depths: per example, the depths of its decoding steps (``[m + 1]`` teacher-forced).
        frontier: the per-row outcomes of the model's frontier points (``EvalOptions.frontier``) or None.
    """

    levels: list
    correct: np.ndarray
    answer_ids: list[list[int]]
    content: list[np.ndarray]
    nll: list[np.ndarray]
    pred_depth: list[np.ndarray] | None
    max_depth: int
    step_depths: list[np.ndarray] | None = None
    frontier: FrontierArrays | None = None


def evaluate_task(
    model,
    tokenizer,
    task,
    levels=None,
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    rows=None,
    limit: int | None = None,
    train_levels=None,
    exit_target_depth: float | None = None,
    name: str = "model",
    options: EvalOptions | None = None,
    **option_overrides,
) -> dict[str, Any]:
    """Evaluate one model on one task (what is measured: module docstring).

    Args:
        model: looped or plain causal LM (put in eval mode here, its mode restored after).
        tokenizer: its tokenizer.
        task: registry key (``data_prep.tasks.TASKS``) or Task.
        levels: difficulty levels; default the task's default levels.
        n: examples per level.
        seed: data seed.
        rows: evaluate these rows instead of generating (a ``datasets.Dataset`` or dicts with
            ``prompt``, ``answer``, ``difficulty`` and, for BREVO/LANO, ``token_features``).
        limit: cap on the rows (quick looks; :func:`~retrofit.evaluation.rows.task_rows`).
        train_levels: levels marked as training levels; default ``task.default_train_levels``.
        exit_target_depth: d̄ the exit policies are calibrated to; default the decider's d̄.
        name: model name used in sample titles.
        options: an :class:`EvalOptions` (default ``EvalOptions()``).
        **option_overrides: fields of ``EvalOptions`` to override (e.g. ``batch_size=4``).

    Returns:
        The per-task entry of the results schema (:mod:`retrofit.evaluation.report`) plus
        ``knob``, ``method``, ``train_levels``, ``overall``, ``forced_depth_token_accuracy``,
        ``samples`` (for ``samples.html``) and ``notes``.
    """
    return evaluate_task_arrays(
        model,
        tokenizer,
        task,
        levels,
        n,
        seed,
        rows=rows,
        limit=limit,
        train_levels=train_levels,
        exit_target_depth=exit_target_depth,
        name=name,
        options=options,
        **option_overrides,
    )[0]


def evaluate_task_arrays(
    model,
    tokenizer,
    task,
    levels=None,
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    rows=None,
    limit=None,
    train_levels=None,
    exit_target_depth=None,
    name: str = "model",
    options: EvalOptions | None = None,
    **option_overrides,
) -> tuple[dict[str, Any], TaskArrays]:
    """:func:`evaluate_task` that also returns the per-example :class:`TaskArrays`."""
    from data_prep.tasks import get_task

    opts = resolve_options(options, option_overrides)
    task = get_task(task)
    train = list(task.default_train_levels if train_levels is None else train_levels)
    if rows is None:
        rows = task_rows(task, levels, n, seed, limit)
    else:
        import datasets

        rows = rows.to_list() if isinstance(rows, datasets.Dataset) else list(rows)
    if not rows:
        raise ValueError(f"{task.name}: no rows to evaluate")
    was_training = model.training
    model.eval()
    try:
        return _evaluate_task(model, tokenizer, task, rows, train, opts, exit_target_depth, name)
    finally:
        model.train(was_training)


def _evaluate_task(
    model, tokenizer, task, rows, train, opts: EvalOptions, exit_target_depth, name
) -> tuple[dict[str, Any], TaskArrays]:
    info = model_info(model)
    D = info.max_depth
    pad = pad_id(tokenizer)
    examples = prepare(rows, tokenizer, opts)
    notes: list[str] = []
    max_new = opts.max_new_tokens or max(len(e.answer_ids) for e in examples) + 2
    if opts.length_cutoffs and max(opts.length_cutoffs) > max_new:
        raise ValueError(
            f"length_cutoffs go up to {max(opts.length_cutoffs)} tokens but the generation budget of "
            f"{name}/{task.name} is {max_new}: set max_new_tokens >= {max(opts.length_cutoffs)}"
        )
    prompts = [e.prompt_ids for e in examples]
    tag = f"{name}/{task.name}"
    levels_sorted = sorted({e.level for e in examples})

    is_stop = stop_rule(model, tokenizer)
    tf_mode = opts.accuracy == "teacher_forced_argmax"

    def generate(desc, **kw):
        # producing-step depths ("predict"): what decoding computes, for compute and samples.html
        return greedy_generate(
            model,
            tokenizer,
            prompts,
            max_new,
            batch_size=opts.batch_size,
            alignment="predict",
            backend=opts.backend,
            progress=opts.progress,
            desc=f"{tag} {desc}",
            **kw,
        )

    def score(gens) -> np.ndarray:
        return np.array(
            [task.score(g["text"], e.row["answer"], prompt=e.row["prompt"]) for g, e in zip(gens, examples)], dtype=bool
        )

    def outcomes(desc, **kw) -> tuple[np.ndarray, list[np.ndarray], list[dict] | None]:
        """Per row: correct, and the depths of the decoding steps; plus the generations ('generate' mode)."""
        if tf_mode:
            res = (
                tf if not kw else argmax_pass(model, info, examples, pad, opts, is_stop, max_new, f"{tag} {desc}", **kw)
            )
            return np.array([r["row_correct"] for r in res], dtype=bool), [r["step_depths"] for r in res], None
        gens = generate(desc, **kw)
        return score(gens), [np.asarray(g["depths"], dtype=np.int64) for g in gens], gens

    compute_points: list[dict[str, Any]] = []

    def point(label, c: np.ndarray, depths, decider: bool = True) -> None:
        """A point of the accuracy-vs-compute plot: compute per generated token at these depths (``decider``:
        the method's decider ran; a forced depth runs none)."""
        depths = np.asarray(depths, dtype=np.int64)
        if info.looped and depths.size == 0:
            return
        d_mean = float(depths.mean()) if info.looped else 1.0
        compute_points.append(
            {
                "label": label,
                "accuracy": float(c.mean()),
                "accuracy_ci": ci(c, opts.confidence),
                "mean_depth": d_mean if info.looped else None,
                "layers_per_token": info.layers(d_mean),
                "flops_per_token": flops_per_token(model, info, depths, decider=decider),
            }
        )

    # --- accuracy with the model's own exits, and the teacher-forced pass -------------------------
    # (and, in greedy-exact-match mode, every forced depth from one depth-D forward, exact), the two sharing
    # their first depth (EvalOptions.share_first_depth)
    with share_first_depth(model, enabled=opts.share_first_depth):
        tf = teacher_forced(
            model,
            info,
            examples,
            pad,
            opts,
            f"{tag} teacher-forced",
            per_depth=opts.exit_policies,
            is_stop=is_stop if tf_mode else None,
            max_new_tokens=max_new,
        )
        by_depth = (
            forced_depths_argmax(
                model, info, examples, pad, opts, is_stop, max_new, f"{tag} depths 1-{D}", stop_ids(model, tokenizer)
            )
            if info.looped and opts.forced_depths and tf_mode and D > 1
            else None
        )
    correct, steps, gens = outcomes("generate")

    # --- per level, training vs held-out levels, overall ------------------------------------------
    level_entries = level_table(model, info, examples, tf, correct, steps, train, opts.confidence)
    result: dict[str, Any] = {
        "knob": task.knob,
        "description": task.description,
        "max_depth": D,
        "method": info.method,
        "looped": info.looped,
        "alignment": opts.alignment,
        "train_levels": train,
        "levels": level_entries,
    }
    is_train = np.array([split_of(e.level, train) == "train" for e in examples], dtype=bool)
    result["splits"] = split_table(examples, correct, is_train, train, opts.confidence)
    overall = result["overall"] = overall_entry(model, info, examples, tf, correct, steps, opts.confidence)
    if opts.length_cutoffs:
        per_step = {d: flops_per_token(model, info, [d]) for d in range(1, D + 1)} if info.looped else None
        result["length_cutoffs"] = length_cutoff_curve(
            gens,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            lambda i, text: task.score(text, examples[i].row["answer"], prompt=examples[i].row["prompt"]),
            opts.length_cutoffs,
            per_step or {1: flops_per_token(model, info, [])},
            opts.confidence,
        )

    # --- forced depths (test-time scaling) -------------------------------------------------------
    if info.looped:
        if opts.forced_depths:
            forced_acc: dict[int, float] = {}
            forced_by_level: dict[int, dict[Any, float]] = {}
            forced_correct: dict[int, np.ndarray] = {}
            # greedy exact match: by_depth, above; generation: one run per depth
            for d in range(1, D + 1):
                if by_depth is not None:
                    c_d = np.array([r["row_correct"] for r in by_depth[d]], dtype=bool)
                else:
                    c_d, _, _ = outcomes(f"depth {d}", depth=d)
                forced_acc[d] = float(c_d.mean())
                forced_by_level[d] = {
                    lvl: float(np.mean([c for c, e in zip(c_d, examples) if e.level == lvl])) for lvl in levels_sorted
                }
                forced_correct[d] = c_d
                point(d, c_d, [d], decider=False)
            result["forced_depth_accuracy"] = forced_acc
            result["forced_depth_accuracy_by_level"] = forced_by_level
            # does depth at inference matter? the adaptive exits vs every forced depth, paired on the same rows
            result["adaptive_vs_forced"] = {
                d: paired_by_split(correct, c, [e.level for e in examples], levels_sorted, is_train, opts)
                for d, c in forced_correct.items()
            }
            for lvl in levels_sorted:
                level_entries[lvl]["forced_accuracy"] = {d: forced_by_level[d][lvl] for d in forced_by_level}
        point("adaptive", correct, gen_depths(steps))
    else:
        point("plain", correct, [])

    if info.looped and D > 1 and opts.exit_policies:
        result["forced_depth_token_accuracy"] = {
            d: mean(cat(tf, "correct_d", examples)[:, d - 1]) for d in range(1, D + 1)
        }
        # --- loss change, first vs last depth (TaH2 §3) ------------------------------------------
        nll = cat(tf, "nll_d", examples)
        result["loss_change"] = loss_change_stats(nll[:, 0], nll[:, D - 1])

        def generate_accuracy(**kw):
            c_g, s_g, _ = outcomes(f"{kw['exit_policy']} exit", **kw)
            point(kw["exit_policy"], c_g, gen_depths(s_g))
            return float(c_g.mean()), mean(gen_depths(s_g))

        result["exit_policies"] = exit_policies(
            model,
            info,
            examples,
            tf,
            float(correct.mean()),
            overall["gen_mean_depth"],
            pad,
            opts,
            exit_target_depth,
            generate_accuracy if opts.policy_generation else None,
            notes,
        )
    elif info.looped and D == 1:
        notes.append("max_depth = 1: no forced-depth sweep, loss change or exit policies")

    # --- depth vs difficulty features ----------------------------------------------------------
    if info.looped and task.name in ("lano", "brevo"):
        if opts.structure_strings == "generated":
            if gens is None:  # teacher-forced accuracy: these analyses still need the model's own strings
                gens = generate("generate (own strings)")
            s_examples, stats = generated_examples(task.name, examples, gens, tokenizer, is_stop)
            s_tf = teacher_forced(model, info, s_examples, pad, opts, f"{tag} own strings", per_depth=False)
            result["structure_strings"] = {"strings": "generated", **stats}
        else:
            s_examples, s_tf = examples, tf
            result["structure_strings"] = {"strings": "gold", "rows": len(examples)}
        structure_analysis(task, s_examples, s_tf, result, notes)

    result["compute_points"] = compute_points

    # --- the accuracy-compute frontier -----------------------------------------------------------
    frontier = None
    if opts.frontier:
        # the adaptive pass (tf) and the forced-depth curve (by_depth) are reused, subset to the frontier rows
        result["frontier"], frontier = model_frontier(
            model, info, examples, pad, opts, is_stop, max_new, tag, name, tf, by_depth, stop_ids(model, tokenizer)
        )

    result["samples"] = html_samples(name, task, tokenizer, examples, gens, correct, steps, D, opts.html_samples)
    result["notes"] = notes
    arrays = TaskArrays(
        levels=[e.level for e in examples],
        correct=correct,
        answer_ids=[list(e.answer_ids) for e in examples],
        content=[e.content for e in examples],
        nll=[t["nll"] for t in tf],
        pred_depth=[t["pred_depth"] for t in tf] if info.looped else None,
        max_depth=D,
        step_depths=[np.asarray(x, dtype=np.int64) for x in steps],
        frontier=frontier,
    )
    return result, arrays
