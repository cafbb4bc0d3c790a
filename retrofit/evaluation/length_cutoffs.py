"""Accuracy at several output-length cutoffs against decode FLOPs (``EvalOptions.length_cutoffs``; docs/evaluation.md
"Accuracy by output length").

TaH2's headline measure for long-answer tasks (GSM-style reasoning): how accuracy grows with the decode budget,
and how much compute each step of budget costs. Greedy decoding is prefix-consistent — the first ``L`` tokens of a
generation under a budget of ``N >= L`` tokens are exactly the generation under a budget of ``L`` (every exit rule
is causal: a step's depth never depends on later steps) — so every cutoff is scored from the one generation the
evaluation already ran: a row's answer at cutoff ``L`` is the text of its first ``L`` generated tokens, and its
decode FLOPs are the sum over those steps of the FLOPs of each step at its exit depth. The test checks both against
separate generations at each budget.

The slope is the least-squares slope of accuracy on ``log2`` of the mean decode FLOPs per row over the cutoffs:
accuracy points gained per doubling of decode compute (``None`` with fewer than two distinct FLOPs values).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .stats import wilson_interval

__all__ = ["length_cutoff_curve", "slope_per_doubling"]


def slope_per_doubling(flops: Sequence[float], accuracy: Sequence[float]) -> float | None:
    """Least-squares slope of ``accuracy`` on ``log2(flops)`` (accuracy per doubling); None if undefined."""
    x = np.log2(np.asarray(flops, dtype=np.float64))
    y = np.asarray(accuracy, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0.0:
        return None
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def length_cutoff_curve(
    generations: Sequence[Mapping[str, Any]],
    decode: Callable[[Sequence[int]], str],
    score: Callable[[int, str], bool],
    cutoffs: Sequence[int],
    flops_of_depth: Mapping[int, float],
    confidence: float = 0.95,
) -> dict[str, Any]:
    """The accuracy-vs-decode-budget curve from one set of generations.

    Args:
        generations: per row ``{"ids": generated ids (stop token included), "depths": each step's exit depth}``,
            generated with a budget of at least ``max(cutoffs)`` tokens.
        decode: generated ids -> text (the tokenizer's decode, special tokens skipped).
        score: ``(row index, text) -> correct`` (the task's scorer).
        cutoffs: output-length budgets in generated tokens, increasing.
        flops_of_depth: FLOPs of one decoding step that exits at depth d (the method's decider included).
        confidence: level of the Wilson intervals.

    Returns:
        ``{"points": [{"cutoff", "accuracy", "accuracy_ci", "decode_flops_per_row", "mean_tokens",
        "mean_depth", "stopped"}], "slope_per_doubling", "n"}``: ``mean_tokens`` is the mean number of steps run
        within the cutoff, ``stopped`` the share of rows whose generation ended (a stop token or the end of its
        generation) within it.
    """
    points = []
    for cut in cutoffs:
        correct, flops, tokens, depth_sum, stopped = [], [], [], 0, 0
        for i, g in enumerate(generations):
            ids, depths = list(g["ids"]), [int(d) for d in g["depths"]]
            if len(depths) != len(ids):
                raise ValueError(f"row {i}: {len(ids)} generated ids but {len(depths)} depths")
            head = ids[:cut]
            correct.append(bool(score(i, decode(head))))
            flops.append(sum(flops_of_depth[d] for d in depths[:cut]))
            tokens.append(len(head))
            depth_sum += sum(depths[:cut])
            stopped += len(ids) <= cut
        c = np.asarray(correct, dtype=bool)
        n_steps = int(sum(tokens))
        points.append(
            {
                "cutoff": int(cut),
                "accuracy": float(c.mean()) if c.size else float("nan"),
                "accuracy_ci": list(wilson_interval(int(c.sum()), int(c.size), confidence)),
                "decode_flops_per_row": float(np.mean(flops)) if flops else float("nan"),
                "mean_tokens": float(np.mean(tokens)) if tokens else float("nan"),
                "mean_depth": depth_sum / n_steps if n_steps else None,
                "stopped": stopped / len(generations) if generations else float("nan"),
            }
        )
    usable = [p for p in points if p["decode_flops_per_row"] > 0]
    slope = slope_per_doubling([p["decode_flops_per_row"] for p in usable], [p["accuracy"] for p in usable])
    return {"points": points, "slope_per_doubling": slope, "n": len(generations)}
