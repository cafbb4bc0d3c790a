"""The oracle at equal compute and the accuracy ceiling: what the decider's compute could buy (docs/evaluation.md).

Random allocation at the same d̄ (``frontier.py``) is the floor a decider must beat; the oracle is the roof it is
measured against. Both run on the frontier rows, in the same frame as the decider: the decider still runs (TaH2's
mixture weights stay its own), prompt tokens keep its decisions at the point's threshold, and only who continues
at the **answer steps** (the positions producing the answer tokens, then the stop token) changes.

**Realized gains.** From the forced-depth teacher-forced pass (every token at depth ``D``, every depth read out at
the answer steps: :func:`~.teacher_forced.forced_depths_argmax`'s ``step_nll``), answer step ``t`` has the loss
``ℓ_t^(d)`` of its gold token at each depth ``d`` (at the stop step: ``−log`` of the stop tokens' total
probability), and one more iteration after depth ``d`` gains ``g_t^(d) = ℓ_t^(d) − ℓ_t^(d+1)`` — the quantity
TaH2's lookahead labels are built from (docs/tah2.md), here for every answer step and every depth.

**The oracle at a decider point** with answer-step depths ``d_t`` spends the same number of continues,
``K = Σ_t (d_t − 1)``, on the answer steps with the largest gains: one continue at a time, to the answer step
whose next iteration gains most (a step's continue after depth ``d + 1`` becomes available once it has
continued after ``d``); ties go to the earlier step in row order. At ``D = 2`` that is exactly the ``K`` steps
of largest ``g^(1)``; at ``D > 2`` it is this greedy rule (:func:`oracle_depths`), not a search over every
allocation. Its d̄ equals the decider's exactly. It is measured by a real forward (:class:`OracleContinue`),
greedy exact match as every frontier point.

**The accuracy ceiling** continues exactly where more depth turns a wrong argmax right: each answer step runs to
the first depth whose argmax is right (depth 1 when none is; :func:`ceiling_depths`), whatever that costs. Two
figures: ``token_accuracy_bound``, the teacher-forced token accuracy over the answer tokens in the forced frame
(the share of answer tokens right at some depth), and ``exact_match_bound``, the share of rows whose every answer
step is right at its ceiling depth in that frame (greedy exact match, as the frontier scores it). The ceiling
point's ``accuracy`` is the real forward at the ceiling depths: in the mixed-depth context of that forward an
argmax may differ from the forced frame's, so it can fall short of the bounds.

**Reported** per decider point (``decider_vs_oracle[key]``): the decider, random allocation (mean of its draws)
and the oracle on the same rows, the share of the random → oracle gap the decider closes
(``(acc_decider − acc_random) / (acc_oracle − acc_random)``, None when the gap is 0 or there is no random
allocation) and the paired test of decider vs oracle (:func:`~.stats.paired_comparison`: exact McNemar and the
paired bootstrap).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from retrofit.model.halting.training_free import ExitPolicy

from .calibrate import answer_steps_mask
from .models import ModelInfo, device, flops_per_token
from .options import EvalOptions
from .rows import Example
from .stats import paired_comparison
from .teacher_forced import argmax_pass, batch_chunks

__all__ = [
    "OracleContinue",
    "ceiling_depths",
    "forced_frame_outcomes",
    "gap_closed",
    "oracle_depths",
    "oracle_frontier",
    "selection_policy",
]


class OracleContinue(ExitPolicy):
    """Given exit depths at given positions; every other position keeps the model's own decision.

    A position in ``where`` continues after depth ``d`` iff ``d < target`` there; the decider still runs, so
    TaH2's mixture weights are its own (as for ``RandomContinue``). Without a mixture (a ``fixed`` model, or
    TaH2 with ``mixture_output=False``) the forward equals ``forward(depth=<the realized depths>)``
    (``tests/evaluation/test_oracle.py``).

    Args:
        target: ``[B, T]`` long, the exit depth of each position in ``where``.
        where: ``[B, T]`` bool, the positions whose depth is given.
    """

    name = "oracle"
    defers_to_decider = True

    def __init__(self, target: torch.Tensor, where: torch.Tensor):
        if target.shape != where.shape:
            raise ValueError(f"target {tuple(target.shape)} and where {tuple(where.shape)} must have one shape")
        self.threshold = 1.0
        self.target, self.where = target.long(), where.bool()

    def check(self, d, h, log_probs, state, idx):
        cont = self.target.reshape(-1).to(h.device)[idx] > d
        own = state.get("decider_continue")
        own = torch.ones_like(cont) if own is None else own.to(h.device)
        return ~torch.where(self.where.reshape(-1).to(h.device)[idx], cont, own)


def oracle_depths(step_nll: Sequence[np.ndarray], n_continues: int) -> list[np.ndarray]:
    """The oracle's answer-step depths (module docstring): ``n_continues`` continues, greedily to the largest gain.

    Args:
        step_nll: per row ``[m_r + 1, D]`` the loss at every depth of each answer step (NaN gains rank last).
        n_continues: ``K``, in ``0 … Σ_r (m_r + 1)(D − 1)``.

    Returns:
        per row ``[m_r + 1]`` int depths in ``1 … D`` with ``Σ (depth − 1) = K``.
    """
    nll = [np.asarray(x, dtype=np.float64).reshape(len(x), -1) for x in step_nll]
    D = nll[0].shape[1] if nll else 1
    depths = [np.ones(x.shape[0], dtype=np.int64) for x in nll]
    total = sum(x.shape[0] for x in nll) * (D - 1)
    if not 0 <= n_continues <= total:
        raise ValueError(f"n_continues must lie in 0..{total} (every answer step at depth {D}), got {n_continues}")

    def key(r: int, t: int, d: int):
        g = nll[r][t, d - 1] - nll[r][t, d]
        return (-g if np.isfinite(g) else np.inf, r, t)

    heap = [(*key(r, t, 1), 1) for r, x in enumerate(nll) for t in range(x.shape[0]) if D > 1]
    heapq.heapify(heap)
    for _ in range(n_continues):
        _, r, t, d = heapq.heappop(heap)
        depths[r][t] = d + 1
        if d + 1 < D:
            heapq.heappush(heap, (*key(r, t, d + 1), d + 1))
    return depths


def ceiling_depths(step_correct: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per row ``[m_r + 1]``: the first depth whose argmax is right at each answer step (1 when none is).

    Args:
        step_correct: per row ``[m_r + 1, D]`` bool, the argmax is right at each depth (the forced frame).
    """
    out = []
    for c in step_correct:
        c = np.asarray(c, dtype=bool).reshape(len(c), -1)
        out.append(np.where(c.any(1), c.argmax(1) + 1, 1).astype(np.int64))
    return out


def forced_frame_outcomes(step_correct: Sequence[np.ndarray], depths: Sequence[np.ndarray]) -> tuple[float, float]:
    """``(token accuracy over the answer tokens, exact match over rows)`` of an allocation in the forced frame: step
    ``t`` is right iff its argmax at depth ``depths[t]`` is (the stop step counts for exact match only)."""
    tokens, rows = [], []
    for c, d in zip(step_correct, depths):
        c = np.asarray(c, dtype=bool).reshape(len(c), -1)
        right = c[np.arange(len(d)), np.asarray(d, dtype=np.int64) - 1]
        tokens.append(right[:-1])
        rows.append(bool(right.all()))
    t = np.concatenate(tokens) if tokens else np.zeros(0, dtype=bool)
    return (float(t.mean()) if t.size else float("nan")), (float(np.mean(rows)) if rows else float("nan"))


def gap_closed(decider: float, random: float | None, oracle: float) -> float | None:
    """The share of the random → oracle accuracy gap the decider closes; None without random or without a gap."""
    if random is None or not np.isfinite(random) or abs(oracle - random) < 1e-12:
        return None
    return float((decider - random) / (oracle - random))


def selection_policy(examples: Sequence[Example], depths: Sequence[np.ndarray], batch_size: int, dev=None):
    """The ``policy_for_batch`` hook of :func:`~.teacher_forced.argmax_pass` that runs answer step ``t`` of
    example ``i`` to ``depths[i][t]`` (:class:`OracleContinue` on the batch's answer steps)."""
    chunks = batch_chunks(examples, batch_size)

    def policy_for_batch(b: int, starts, lengths, T: int):
        target = torch.ones(len(starts), T, dtype=torch.long, device=dev)
        for r, (i, s) in enumerate(zip(chunks[b], starts)):
            target[r, s - 1 : s + lengths[r]] = torch.as_tensor(depths[i], dtype=torch.long, device=dev)
        return OracleContinue(target, answer_steps_mask(starts, lengths, T, dev))

    return policy_for_batch


def oracle_frontier(
    model,
    info: ModelInfo,
    examples: list[Example],
    pad: int,
    opts: EvalOptions,
    is_stop,
    max_new_tokens: int,
    tag: str,
    runs: dict[str, tuple[float | None, np.ndarray, list[np.ndarray]]],
    forced: dict[int, list[dict[str, Any]]],
    random_accuracy: dict[str, float],
    add: Callable[..., dict],
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The oracle at every decider point and the accuracy ceiling, on the frontier rows (module docstring).

    Args:
        examples: the frontier rows.
        runs: the decider points, ``key -> (threshold, row_correct [n], step_depths per row)``.
        forced: ``{d: per row forced_depths_argmax dict}`` on the frontier rows (``step_nll``, ``step_correct``).
        random_accuracy: ``key -> random allocation's accuracy`` (mean of its draws) where it ran.
        add: the frontier's point builder, ``add(policy, key, label, correct, depths, flops, **extra)``.

    Returns:
        ``(decider_vs_oracle, ceiling, passes)``.
    """
    D = info.max_depth
    step_nll = [np.stack([forced[d][i]["step_nll"] for d in range(1, D + 1)], 1) for i in range(len(examples))]
    step_ok = [np.stack([forced[d][i]["step_correct"] for d in range(1, D + 1)], 1) for i in range(len(examples))]
    dev = device(model)
    passes = 0

    def measure(desc: str, tau, depths) -> tuple[np.ndarray, list[np.ndarray]]:
        nonlocal passes
        res = argmax_pass(
            model,
            info,
            examples,
            pad,
            opts,
            is_stop,
            max_new_tokens,
            desc,
            decider_threshold=tau,
            policy_for_batch=selection_policy(examples, depths, opts.batch_size, dev),
        )
        passes += 1
        return np.array([r["row_correct"] for r in res], dtype=bool), [r["step_depths"] for r in res]

    vs: dict[str, Any] = {}
    for k, (tau, c, s) in runs.items():
        K = int(sum(int((np.asarray(x) - 1).sum()) for x in s))
        depths = oracle_depths(step_nll, K)
        reused = all(np.array_equal(a, b) for a, b in zip(depths, s))
        oc, os_ = (c, s) if reused else measure(f"{tag} frontier oracle {k}", tau, depths)
        tok_acc, em = forced_frame_outcomes(step_ok, depths)
        flops = flops_per_token(model, info, np.concatenate(os_))
        p = add(
            "oracle",
            f"oracle:{k}",
            f"oracle {'(own)' if k == 'own' else k}",
            oc,
            os_,
            flops,
            threshold=tau,
            own=k == "own",
            n_continues=K,
            reused_decider_pass=reused,
            forced_frame_token_accuracy=tok_acc,
            forced_frame_exact_match=em,
        )
        cmp = paired_comparison(c, oc, n_boot=opts.bootstrap_samples, seed=opts.stats_seed, confidence=opts.confidence)
        rnd = random_accuracy.get(k)
        vs[k] = {
            "threshold": tau,
            "own": k == "own",
            "n_continues": K,
            "decider_mean_depth": float(np.concatenate(s).mean()),
            "oracle_mean_depth": p["mean_depth"],
            "accuracy_decider": float(c.mean()),
            "accuracy_random": rnd,
            "accuracy_oracle": p["accuracy"],
            "gap_closed": gap_closed(float(c.mean()), rnd, p["accuracy"]),
            "decider_vs_oracle": cmp,
        }

    # --- the accuracy ceiling, prompt tokens at the model's own threshold -------------------------------
    own_tau = runs["own"][0] if "own" in runs else None
    depths = ceiling_depths(step_ok)
    cc, cs = measure(f"{tag} frontier ceiling", own_tau, depths)
    tok_acc, em = forced_frame_outcomes(step_ok, depths)
    p = add(
        "ceiling",
        "ceiling",
        "accuracy ceiling",
        cc,
        cs,
        flops_per_token(model, info, np.concatenate(cs)),
        threshold=own_tau,
        token_accuracy_bound=tok_acc,
        exact_match_bound=em,
    )
    ceiling = {
        "rule": "each answer step runs to the first depth whose argmax is right (1 if none)",
        "token_accuracy_bound": tok_acc,
        "exact_match_bound": em,
        "accuracy": p["accuracy"],
        "mean_depth": p["mean_depth"],
        "flops_per_token": p["flops_per_token"],
        "frame": "bounds: the forced-depth teacher-forced pass (every token at depth D); accuracy: a real forward "
        "at the ceiling depths, greedy exact match",
    }
    return vs, ceiling, passes
