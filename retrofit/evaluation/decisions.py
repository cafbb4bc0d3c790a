"""The decider's decisions at the answer steps, for the frontier (``retrofit.evaluation.frontier``): their
realized gains (``decision_gains``), and random allocation at a matched continue rate (``random_allocation``,
``random_rate``, seeded per batch by ``batch_seed``: the same seeds serve every threshold, common random
numbers). ``retrofit.evaluation.frontier`` re-exports these names.
"""

from __future__ import annotations

import numpy as np
import torch

from .calibrate import answer_steps_mask, continue_probabilities
from .decider_metrics import decider_decisions
from .models import ModelInfo, device, forward
from .options import EvalOptions
from .rows import Example
from .teacher_forced import tf_passes


def batch_seed(draw: int, batch: int) -> int:
    """Seed of random-allocation draw ``draw`` on batch ``batch`` (distinct for every batch under 1,000,003)."""
    return 1_000_003 * int(draw) + int(batch)


def random_allocation(rate: float, draw: int, dev=None):
    """The ``policy_for_batch`` hook of :func:`~.teacher_forced.argmax_pass` for random allocation: batch ``b``
    gets ``RandomContinue(rate, seed=batch_seed(draw, b), where=<its answer steps>)``, so every answer step
    continues after each depth with probability ``rate`` and every other position keeps the decider's
    decision."""
    from retrofit.model.halting.training_free import RandomContinue

    def policy_for_batch(b: int, starts, lengths, T: int):
        return RandomContinue(rate, seed=batch_seed(draw, b), where=answer_steps_mask(starts, lengths, T, dev))

    return policy_for_batch


def random_rate(mean_depth: float, max_depth: int) -> float:
    """The continue rate whose geometric depths have mean ``mean_depth`` (0 at d̄ = 1, 1 at d̄ = D)."""
    from retrofit.model.halting.training_free import continue_rate_for_mean_depth

    if mean_depth <= 1.0:
        return 0.0
    if mean_depth >= max_depth:
        return 1.0
    return continue_rate_for_mean_depth(float(mean_depth), max_depth)


@torch.no_grad()
def decision_gains(model, info: ModelInfo, examples: list[Example], pad: int, opts: EvalOptions, desc: str) -> dict:
    """Every decision of the model's own decider at the answer tokens' producing positions, with its realized
    gain (:func:`~.decider_metrics.decider_decisions`), from one adaptive forward per batch with the gold answers as
    labels, ``output_depth_losses=True`` (the lookahead iteration gives ``ℓ^(d*+1)``) and
    ``labelled_logits_only`` (the LM head at the labelled positions only; the decider still reads every
    position's distribution, so the depths are the adaptive pass's).

    Returns:
        ``decider_decisions``' arrays, concatenated over rows.
    """
    dev = device(model)
    parts: list[dict[str, np.ndarray]] = []
    for _, _, exs, ids, mask, starts, _ in tf_passes(
        examples, pad, dev, opts.batch_size, progress=opts.progress, desc=desc
    ):
        labels = torch.full_like(ids, -100)
        for r, (e, s) in enumerate(zip(exs, starts)):
            labels[r, s : s + len(e.answer_ids)] = torch.as_tensor(e.answer_ids, device=dev)
        out = forward(
            model,
            info,
            ids,
            mask,
            labels=labels,
            output_depth_losses=True,
            labelled_logits_only=True,
            output_router_logits=False,
        )
        cont = continue_probabilities(out, info)  # [B, T, k]
        for r, (e, s) in enumerate(zip(exs, starts)):
            pred = torch.arange(len(e.answer_ids), device=dev) + s - 1  # producing positions
            parts.append(
                decider_decisions(
                    out.depths[r, pred].cpu().numpy(),
                    out.depth_nll[r, pred].float().cpu().numpy(),
                    cont[r, pred].cpu().numpy(),
                )
            )
    keys = ("gain", "continue_prob", "depth", "continued")
    return {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in keys}
