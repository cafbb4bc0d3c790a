"""The accuracy–compute frontier: does adaptive depth earn its compute? (issue 24, docs/evaluation.md)

Every model is placed on one plane, accuracy against matmul FLOPs per answer token, measured the same way
on the same rows (``EvalOptions.frontier``; greedy exact match from one teacher-forced forward per batch,
``accuracy="teacher_forced_argmax"``):

* a looped model with a decider: its own decisions (``"decider"``, the model's threshold), a sweep of the
  decider's threshold (``frontier_thresholds``: TaH2's τ_exit, ANIRA-O's cumulative halting mass, ANIRA-E's
  allocation quantile; ``forward(decider_threshold=)``), **random allocation at the same d̄** at each of
  those thresholds (``"random"``), and every forced depth ``1 … D`` (``"forced"``);
* a looped model without a decider (the ``fixed`` control): its forced depths ``1 … M``;
* a plain model (the SFT control, the base): one point (``"plain"``).

Depth statistics are over the **answer steps**, the forward positions that produce the gold answer tokens
and then the stop token (``step_depths`` of :func:`~.teacher_forced.argmax_pass`): what greedy decoding of
the answer computes. FLOPs per answer token are :func:`~.models.flops_per_token` at those depths (TaH2's
per-depth readouts and the decider included; a forced depth runs neither).

**Random allocation at the same d̄.** For a threshold whose decider spends ``d̄`` iterations per answer
step, each answer step instead continues after every depth with probability ``q``
(``continue_rate_for_mean_depth(d̄, D)``: geometric depths with mean ``d̄``) — ``RandomContinue`` with
``where`` = the answer steps, so prompt tokens keep the decider's own decisions at that threshold and the
two runs differ only where the decider's judgement is tested. Draw ``s`` seeds batch ``b`` with
``batch_seed(s, b)``; the same seeds serve every threshold (common random numbers). When every answer
step of the decider is at depth 1 (``q = 0``) or at ``D`` (``q = 1``) random allocation is that same
allocation, and the decider's pass is reused instead of run again. The paired test of decider vs random
(:func:`~.stats.paired_vs_draws`) compares, row by row, the decider's outcome with the mean outcome over
the draws.

**Gain per decile** (TaH2's check of the decider): one adaptive forward with the gold answers as labels and
``output_depth_losses=True`` gives, at every answer token's producing position, the loss at each executed
depth and at the lookahead depth ``d* + 1``; every decision the decider made there gets its realized gain
``ℓ^(d) − ℓ^(d+1)`` and its continue probability (:func:`~.decider_metrics.decider_decisions`,
:func:`~.decider_metrics.gain_by_decile`). The stop step is left out: it has no single gold token to score.

**The oracle at equal compute and the accuracy ceiling** (``frontier_oracle``, :mod:`~.oracle`): at every
decider point, the same number of continues spent on the answer steps with the largest realized gains (from the
forced-depth pass), and every answer step run to its first right depth; decider vs oracle paired on the rows.

**Cost.** With ``R`` frontier rows (``frontier_rows_per_level`` per level), ``t`` thresholds (the model's
own, reused from the adaptive pass, plus the sweep) and ``k`` draws, a decider model runs about
``(t − 1) + t·k + 1`` teacher-forced passes over ``R`` rows (fewer where ``q`` is 0 or 1), plus ``t + 1`` for the
oracle and the ceiling; forced depths come from the depth-``D`` forward the forced-depth curve already ran, and
plain models add nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrofit.model import registry
from retrofit.model.backends import share_first_depth

from .calibrate import (  # noqa: F401  (answer_steps_mask, continue_probabilities: imported from here too)
    answer_steps_mask,
    continue_probabilities,
    first_decisions,
    threshold_for_stop_share,
    threshold_kind,
)
from .decider_metrics import gain_by_decile
from .decisions import batch_seed, decision_gains, random_allocation, random_rate
from .models import ModelInfo, device, flops_per_token
from .options import EvalOptions
from .rows import Example
from .stats import paired_comparison, paired_vs_draws, wilson_interval
from .teacher_forced import argmax_pass, forced_depths_argmax

__all__ = [
    "FLOPS_RATIO_MAX",
    "NOT_WORSE_MARGIN",
    "FrontierArrays",
    "answer_steps_mask",
    "batch_seed",
    "continue_probabilities",
    "fixed_control_comparison",
    "frontier_rows",
    "model_frontier",
    "own_threshold",
    "random_allocation",
    "random_rate",
]

#: the issue's "not worse than the fixed-depth control": bootstrap lower bound of adaptive − fixed above −3 points
NOT_WORSE_MARGIN = 0.03
#: ... at no more than this share of the fixed control's FLOPs per answer token
FLOPS_RATIO_MAX = 0.85


@dataclass
class FrontierArrays:
    """Per-row outcomes of one model's frontier points, for paired comparisons across models.

    Attributes:
        rows: ``[n]`` indices of the frontier rows in the task's row order.
        correct: point key (``"decider:own"``, ``"decider:0.3"``, ``"random:own"``, ``"oracle:own"``,
            ``"ceiling"``, ``"forced:2"``, ``"plain"``) -> ``[n]`` bool (random: ``[k, n]``, one row per draw).
        points: the JSON points (``model_frontier``), in the same order as their keys were added.
    """

    rows: np.ndarray
    correct: dict[str, np.ndarray] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)


def frontier_rows(examples: Sequence[Example], per_level: int | None) -> np.ndarray:
    """Indices of the frontier rows: the first ``per_level`` rows of every level in row order (all when None).

    A prefix per level, not a random sample, so every model of a run (they share the rows) gets the same
    frontier rows and a larger cap only adds rows."""
    if per_level is None:
        return np.arange(len(examples))
    seen: dict[Any, int] = {}
    keep = []
    for i, e in enumerate(examples):
        if seen.get(e.level, 0) < per_level:
            seen[e.level] = seen.get(e.level, 0) + 1
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def own_threshold(model, info: ModelInfo) -> float | None:
    """The decider threshold the model runs with when a call passes none (its method's ``threshold_field``: TaH2's
    ``exit_threshold``, ANIRA-O's ``halt_threshold``, Ouro's ``exit_q``); None for a method without one (ANIRA-E:
    its own rule is the argmax of q, not a quantile)."""
    if info.method is None:
        return None
    return registry.method_class(info.method).get_threshold(model.loop)


def _tkey(tau: float) -> str:
    """A threshold's key in the points (``decider:<key>``): 10 significant digits, so thresholds placed by
    stop share in a narrow band of probabilities stay distinct."""
    return f"{float(tau):.10g}"


def _cat(steps: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in steps]) if steps else np.zeros(0, np.int64)


def _point(name: str, policy: str, key: str, label: str, correct: np.ndarray, confidence: float, **kw) -> dict:
    """A frontier point: accuracy (mean over draws for random allocation) with its Wilson interval."""
    c = np.asarray(correct, dtype=np.float64)
    n = int(c.shape[-1])
    acc = float(c.mean()) if c.size else float("nan")
    # random allocation: the interval of the draws' mean accuracy, taken as a proportion over the n rows
    k = int(round(acc * n)) if n else 0
    return {
        "model": name,
        "policy": policy,
        "key": key,
        "label": label,
        "threshold": kw.pop("threshold", None),
        "accuracy": acc,
        "accuracy_ci": list(wilson_interval(k, n, confidence)) if n else [float("nan")] * 2,
        "n": n,
        **kw,
    }


def model_frontier(
    model,
    info: ModelInfo,
    examples: list[Example],
    pad: int,
    opts: EvalOptions,
    is_stop,
    max_new_tokens: int,
    tag: str,
    name: str,
    own: list[dict[str, Any]],
    forced: dict[int, list[dict[str, Any]]] | None,
    stop_token_ids: Sequence[int] = (),
) -> tuple[dict[str, Any], FrontierArrays]:
    """One model's frontier points on the frontier rows (module docstring).

    Args:
        examples: the task's rows (all of them; the frontier rows are chosen here).
        is_stop, max_new_tokens: the greedy exact-match rule (:func:`~.teacher_forced.argmax_pass`).
        tag: progress-bar prefix.
        name: the model's name in the points.
        own: the adaptive (or plain) pass already run on every row: per row ``{"row_correct", "step_depths"}``.
        forced: ``{d: per row forced_depths_argmax dict}`` of every forced depth on every row, if already run.
        stop_token_ids: the stop step's tokens the oracle's gains score (``decoding.stop_ids``).

    Returns:
        ``(entry, arrays)``: the task entry's ``frontier`` section (``rows``, ``points``, ``passes``,
        ``wall_s``; with a decider also ``threshold_kind``, ``decider_vs_random``, ``decider_vs_oracle``,
        ``ceiling``, ``gain_by_decile``, ``break_even_mean_depth``) and the per-row outcomes.
    """
    # a looped model's passes share their first depth (every policy computes it alike, and every pass runs the
    # same batches of the frontier rows: EvalOptions.share_first_depth)
    with share_first_depth(model, enabled=info.looped and opts.share_first_depth):
        return _model_frontier(
            model, info, examples, pad, opts, is_stop, max_new_tokens, tag, name, own, forced, stop_token_ids
        )


def _model_frontier(
    model, info, examples, pad, opts, is_stop, max_new_tokens, tag, name, own, forced, stop_token_ids
) -> tuple[dict[str, Any], FrontierArrays]:
    t0 = time.time()
    rows = frontier_rows(examples, opts.frontier_rows_per_level)
    exs = [examples[i] for i in rows]
    arr = FrontierArrays(rows=rows)
    D = info.max_depth
    passes = 0

    def add(policy: str, key: str, label: str, correct, depths, flops: float, **kw) -> dict:
        arr.correct[key] = np.asarray(correct, dtype=bool)
        d = _cat(depths)
        p = _point(
            name,
            policy,
            key,
            label,
            arr.correct[key],
            opts.confidence,
            mean_depth=float(d.mean()) if (info.looped and d.size) else None,
            flops_per_token=flops,
            **kw,
        )
        arr.points.append(p)
        return p

    def outcome(res: list[dict]) -> tuple[np.ndarray, list[np.ndarray]]:
        return np.array([r["row_correct"] for r in res], dtype=bool), [r["step_depths"] for r in res]

    entry: dict[str, Any] = {"rows": int(rows.size), "rows_per_level": opts.frontier_rows_per_level}
    if not info.looped:
        c, _ = outcome([own[i] for i in rows])
        add("plain", "plain", name, c, [], flops_per_token(model, info, []))
        entry.update(points=arr.points, passes=0, wall_s=round(time.time() - t0, 2))
        return entry, arr

    # --- forced depths 1 … D (from the depth-D forward the forced-depth curve already ran) ----------------
    if forced is None:
        if D > 1:
            sub = forced_depths_argmax(
                model, info, exs, pad, opts, is_stop, max_new_tokens, f"{tag} frontier depths", stop_token_ids
            )
            passes += 1
        else:
            sub = {1: [own[i] for i in rows]}
    else:
        sub = {d: [res[i] for i in rows] for d, res in forced.items()}
    for d in range(1, D + 1):
        c, s = outcome(sub[d])
        add("forced", f"forced:{d}", f"depth {d}", c, s, flops_per_token(model, info, [d], decider=False), depth=d)

    if not info.has_decider:  # the fixed control: its own pass is forced depth D
        entry.update(points=arr.points, passes=passes, wall_s=round(time.time() - t0, 2))
        return entry, arr

    # --- the decider's threshold sweep ------------------------------------------------------------------
    from retrofit.model.flops import break_even_mean_depth

    own_tau = own_threshold(model, info)
    runs: dict[str, tuple[float | None, np.ndarray, list[np.ndarray]]] = {}
    runs["own"] = (own_tau, *outcome([own[i] for i in rows]))
    thresholds, shares = list(opts.frontier_thresholds), {}
    if opts.frontier_stop_shares is not None:  # placed by compute on these rows (evaluation/calibrate.py)
        c1 = first_decisions(model, exs, pad, batch_size=opts.batch_size)
        passes += 1
        thresholds = []
        for s in opts.frontier_stop_shares:
            tau = round(threshold_for_stop_share(c1, s, info.method), 12)
            shares[_tkey(tau)] = s
            thresholds.append(tau)
    for tau in dict.fromkeys(thresholds):
        if own_tau is not None and abs(float(tau) - own_tau) < 1e-12:
            continue  # the model's own threshold: the adaptive pass
        res = argmax_pass(
            model, info, exs, pad, opts, is_stop, max_new_tokens, f"{tag} frontier τ={tau:g}", decider_threshold=tau
        )
        passes += 1
        runs[_tkey(tau)] = (float(tau), *outcome(res))
    keys = sorted(runs, key=lambda k: (runs[k][0] is None, runs[k][0] if runs[k][0] is not None else 0.0))
    decider_flops: dict[str, float] = {}
    for k in keys:
        tau, c, s = runs[k]
        decider_flops[k] = flops_per_token(model, info, _cat(s))
        label = "decider (own)" if k == "own" else f"decider {tau:g}"
        extra = {"stop_share": shares[k]} if k in shares else {}
        add("decider", f"decider:{k}", label, c, s, decider_flops[k], threshold=tau, own=k == "own", **extra)

    # --- random allocation at each threshold's d̄ ----------------------------------------------------------
    vs_random: dict[str, Any] = {}
    n_draws = opts.frontier_random_draws
    for k in keys if n_draws else []:
        tau, c, s = runs[k]
        d_bar = float(_cat(s).mean())
        q = random_rate(d_bar, D)
        draws_c, draws_s = [], []
        reused = q in (0.0, 1.0)
        for draw in range(n_draws):
            if reused:  # every answer step already at depth 1 (or D): random allocation is this allocation
                draws_c.append(c)
                draws_s.append(s)
                continue

            res = argmax_pass(
                model,
                info,
                exs,
                pad,
                opts,
                is_stop,
                max_new_tokens,
                f"{tag} frontier random {k} #{draw}",
                decider_threshold=tau,
                policy_for_batch=random_allocation(q, draw, device(model)),
            )
            passes += 1
            rc, rs = outcome(res)
            draws_c.append(rc)
            draws_s.append(rs)
        b = np.stack(draws_c)
        per_draw_depth = [float(_cat(x).mean()) for x in draws_s]
        p = add(
            "random",
            f"random:{k}",
            f"random {'(own)' if k == 'own' else k}",
            b,
            [x for ds in draws_s for x in ds],
            flops_per_token(model, info, np.concatenate([_cat(x) for x in draws_s])),
            threshold=tau,
            own=k == "own",
            seeds=list(range(n_draws)),
            rate=q,
            target_mean_depth=d_bar,
            reused_decider_pass=reused,
            accuracy_draws=[float(x.mean()) for x in b],
            mean_depth_draws=per_draw_depth,
        )
        test = paired_vs_draws(c, b, n_boot=opts.bootstrap_samples, seed=opts.stats_seed, confidence=opts.confidence)
        for i, dd in enumerate(test["per_draw"]):
            dd.update(seed=i, mean_depth=per_draw_depth[i])
        vs_random[k] = {
            "threshold": tau,
            "own": k == "own",
            "decider_mean_depth": d_bar,
            "random_rate": q,
            "random_mean_depth": p["mean_depth"],
            "decider_flops_per_token": decider_flops[k],
            "random_flops_per_token": p["flops_per_token"],
            "reused_decider_pass": reused,
            **test,
        }

    vs_oracle = ceiling = None
    if opts.frontier_oracle and D > 1:  # --- the oracle at equal compute and the accuracy ceiling (oracle.py) ---
        from .oracle import oracle_frontier

        rnd = {k: float(arr.correct[f"random:{k}"].mean()) for k in keys if f"random:{k}" in arr.correct}
        args = (model, info, exs, pad, opts, is_stop, max_new_tokens, tag, {k: runs[k] for k in keys}, sub, rnd, add)
        vs_oracle, ceiling, n = oracle_frontier(*args)
        passes += n

    # --- TaH2's check of the decider: realized gain per decile of the continue probability ----------------
    gains = decision_gains(model, info, exs, pad, opts, f"{tag} frontier gains")
    passes += 1
    entry.update(
        stop_shares=shares or None,
        threshold_kind=threshold_kind(info.method),
        own_threshold=own_tau,
        points=arr.points,
        decider_vs_random=vs_random,
        decider_vs_oracle=vs_oracle,
        ceiling=ceiling,
        gain_by_decile=gain_by_decile(gains["gain"], gains["continue_prob"]),
        break_even_mean_depth=break_even_mean_depth(model),
        passes=passes,
        wall_s=round(time.time() - t0, 2),
    )
    return entry, arr


def fixed_control_comparison(
    adaptive: str,
    fixed: str,
    a_correct: np.ndarray,
    f_correct: np.ndarray,
    a_flops: float,
    f_flops: float,
    by_split: dict[str, Any],
    a_frontier: FrontierArrays | None,
    f_frontier: FrontierArrays | None,
    f_depth: int,
    opts: EvalOptions,
) -> dict[str, Any]:
    """The adaptive model (its own decider) against the ``fixed`` control (every token at its depth ``M``).

    On all rows: the paired test (``by_split``: :func:`~.task_entries.paired_by_split` of the two), the
    FLOPs-per-answer-token ratio adaptive / fixed, and whether the issue's target holds — bootstrap 95%
    lower bound of adaptive − fixed above ``−NOT_WORSE_MARGIN`` at no more than ``FLOPS_RATIO_MAX`` of the
    fixed control's FLOPs. On the frontier rows: the same check for every point of the decider's threshold
    sweep against the fixed control's depth ``M`` (thresholds compared on test rows: a description of the
    frontier, not a choice of threshold).
    """
    all_rows = by_split["all"]
    lo = all_rows["bootstrap"]["ci"][0]
    ratio = a_flops / f_flops if f_flops else float("nan")
    out: dict[str, Any] = {
        "adaptive": adaptive,
        "fixed": fixed,
        "fixed_depth": f_depth,
        "n": all_rows["n"],
        "accuracy_adaptive": all_rows["accuracy_a"],
        "accuracy_fixed": all_rows["accuracy_b"],
        "difference": all_rows["difference"],
        "ci": all_rows["bootstrap"]["ci"],
        "lower_bound": lo,
        "mcnemar_p": all_rows["mcnemar_p"],
        "flops_per_token_adaptive": a_flops,
        "flops_per_token_fixed": f_flops,
        "flops_ratio": ratio,
        "margin": NOT_WORSE_MARGIN,
        "max_flops_ratio": FLOPS_RATIO_MAX,
        "meets": bool(lo > -NOT_WORSE_MARGIN and ratio <= FLOPS_RATIO_MAX),
        **{k: by_split[k] for k in ("all", "train", "held_out") if k in by_split},
    }
    points = []
    fkey = f"forced:{f_depth}"
    if a_frontier is not None and f_frontier is not None and fkey in f_frontier.correct:
        if not np.array_equal(a_frontier.rows, f_frontier.rows):
            raise ValueError("the adaptive model and the fixed control have different frontier rows")
        f_pt = next(p for p in f_frontier.points if p["key"] == fkey)
        for p in a_frontier.points:
            if p["policy"] != "decider":
                continue
            cmp = paired_comparison(
                a_frontier.correct[p["key"]],
                f_frontier.correct[fkey],
                n_boot=opts.bootstrap_samples,
                seed=opts.stats_seed,
                confidence=opts.confidence,
            )
            r = p["flops_per_token"] / f_pt["flops_per_token"]
            lb = cmp["bootstrap"]["ci"][0]
            points.append(
                {
                    "key": p["key"],
                    "threshold": p["threshold"],
                    "own": p.get("own", False),
                    "mean_depth": p["mean_depth"],
                    "n": cmp["n"],
                    "difference": cmp["difference"],
                    "ci": cmp["bootstrap"]["ci"],
                    "mcnemar_p": cmp["mcnemar_p"],
                    "flops_ratio": r,
                    "meets": bool(lb > -NOT_WORSE_MARGIN and r <= FLOPS_RATIO_MAX),
                }
            )
    out["frontier_points"] = points
    out["frontier_points_meeting"] = [p["key"] for p in points if p["meets"]]
    return out
