"""Exit policies at equal compute: the learned decider against the training-free exits.

Measured teacher-forced on the gold answers' producing positions: the learned ``decider`` (the
model's own adaptive forward) against ``kl``, ``state`` and ``confidence``, each with the
threshold whose mean depth is closest to the decider's d̄ (for a ``fixed`` model without a
decider: (1 + D) / 2). Thresholds are calibrated in the *full-context* frame (one depth-D forward;
:mod:`retrofit.evaluation.analysis`); where the engine implements a policy
(``retrofit.model.halting.training_free``: ``kl``, ``state``) its accuracy and d̄ are then re-measured
exactly with ``forward(exit_policy=..., exit_threshold=τ)`` and, with ``policy_generation``, it is
also generated with (``generation_accuracy``). ``frame`` says which. ``accuracy`` is
teacher-forced next-token accuracy on answer tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import analysis as A
from .models import ModelInfo
from .options import EvalOptions
from .rows import Example
from .teacher_forced import policy_pass

__all__ = ["cat", "engine_exit_policies", "exit_policies", "mean", "seq_acc"]


def engine_exit_policies() -> tuple[str, ...]:
    """Training-free exits the looped forward implements (``exit_policy=``)."""
    from retrofit.model.halting.training_free import EXIT_POLICIES

    return tuple(EXIT_POLICIES)


def cat(tf: Sequence[dict], key: str, examples: Sequence[Example], content_only: bool = True) -> np.ndarray:
    """Concatenate one per-token array over examples (content tokens only by default)."""
    parts = [t[key][e.content] if content_only else t[key] for t, e in zip(tf, examples)]
    return np.concatenate(parts) if parts else np.zeros(0)


def seq_acc(correct_per_example: Sequence[np.ndarray]) -> float:
    """Share of examples whose every token is correct."""
    return float(np.mean([bool(c.all()) for c in correct_per_example])) if correct_per_example else float("nan")


def mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if x.size else float("nan")


def exit_policies(
    model,
    info: ModelInfo,
    examples: list[Example],
    tf: list[dict],
    gen_accuracy: float,
    gen_mean_depth: float,
    pad: int,
    opts: EvalOptions,
    target: float | None,
    generate_accuracy: Callable[..., tuple[float, float]] | None,
    notes: list[str],
) -> dict[str, dict[str, Any]]:
    """The exit-policy comparison (module docstring).

    Args:
        gen_accuracy, gen_mean_depth: the decider's accuracy and d̄ as measured by the run's accuracy mode.
        target: d̄ to calibrate to; default the decider's (or (1 + D) / 2 without a decider).
        generate_accuracy: ``(exit_policy=, exit_threshold=) -> (accuracy, mean depth)`` or None.
        notes: run notes (appended to).
    """
    D = info.max_depth
    pred_depth = cat(tf, "pred_depth", examples).astype(np.int64)
    dec_correct = cat(tf, "correct", examples)
    per_depth = cat(tf, "correct_d", examples)
    ex_id = np.concatenate([np.full(int(e.content.sum()), i) for i, e in enumerate(examples)])

    def sacc(tok_correct: np.ndarray) -> float:
        return seq_acc([tok_correct[ex_id == i] for i in range(len(examples))])

    policies: dict[str, dict[str, Any]] = {}
    decider_depth = float(pred_depth.mean())
    if info.has_decider:
        policies["decider"] = {
            "accuracy": float(dec_correct.mean()),
            "sequence_accuracy": sacc(dec_correct),
            "mean_depth": decider_depth,
            "saving": decider_depth / D,
            "frame": "exact",
            "generation_accuracy": gen_accuracy,
            "generation_mean_depth": gen_mean_depth,
            "n_tokens": int(pred_depth.size),
        }
        # The decider's depths read in the same full-context frame as the training-free exits.
        c = A.policy_correct(per_depth, pred_depth)
        policies["decider (full-context)"] = {
            "accuracy": float(c.mean()),
            "sequence_accuracy": sacc(c),
            "mean_depth": decider_depth,
            "saving": decider_depth / D,
            "frame": "full-context",
        }
    goal = float(target) if target is not None else (decider_depth if info.has_decider else (1 + D) / 2)
    engine = engine_exit_policies()
    for pname, (first, rule) in A.POLICIES.items():
        if pname == "state" and any("state" not in t for t in tf):
            notes.append("state-change exit skipped: the core's per-depth states could not be captured")
            continue
        signal = cat(tf, pname, examples)
        tau, _ = A.calibrate_threshold(signal, first, goal, rule)
        depth = A.exit_depths(signal, tau, first, rule)
        c = A.policy_correct(per_depth, depth)
        entry = {
            "accuracy": float(c.mean()),
            "sequence_accuracy": sacc(c),
            "mean_depth": float(depth.mean()),
            "saving": float(depth.mean()) / D,
            "threshold": tau,
            "target_mean_depth": goal,
            "frame": "full-context",
            "n_tokens": int(depth.size),
        }
        if pname in engine and math.isfinite(tau) and tau > 0:
            entry["full_context"] = {"accuracy": entry["accuracy"], "mean_depth": entry["mean_depth"]}
            exact = policy_pass(model, info, examples, pad, opts, pname, tau, f"{pname} exit")
            d_ex = np.concatenate([d[e.content] for (d, _), e in zip(exact, examples)])
            c_ex = np.concatenate([k[e.content] for (_, k), e in zip(exact, examples)])
            entry.update(
                accuracy=float(c_ex.mean()),
                sequence_accuracy=sacc(c_ex),
                mean_depth=float(d_ex.mean()),
                saving=float(d_ex.mean()) / D,
                frame="exact",
            )
            if generate_accuracy is not None:
                acc, depth_mean = generate_accuracy(exit_policy=pname, exit_threshold=tau)
                entry["generation_accuracy"] = acc
                entry["generation_mean_depth"] = depth_mean
        elif pname in engine:
            notes.append(
                f"{pname} exit: the threshold matching d̄ = {goal:.3g} is {tau} (no token can exit early), which the "
                "engine does not take; the full-context numbers are reported"
            )
        policies[pname] = entry
    return policies
