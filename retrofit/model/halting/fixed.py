"""``fixed``: every token runs all ``max_depth`` iterations (Huginn / Ouro / retrofitted
recurrence). No decider; the baseline every adaptive method is compared against. Training-free
exits (``retrofit.model.halting.training_free``) can still be applied at inference.

Training is plain looped SFT (next-token loss only), with two options of the looped-pretraining
literature, both trainer switches (``retrofit.training.RetrofitSFTConfig``):

- **random depth per batch** (``random_depth=True``): each optimizer micro-step runs every token at
  one depth ``r`` drawn from the Poisson-lognormal of Huginn (Geiping et al. 2025, §3.3), also used
  by retrofitted recurrence (McLeish et al. 2025); see ``sample_poisson_lognormal_depth``;
- **truncated backprop** (``truncate_backprop=k``): gradients flow through the last ``k`` core
  iterations only (Huginn uses k = 8); earlier iterations run without autograd. Implemented by
  the model's ``backprop_depth=`` forward argument.
"""

from __future__ import annotations

import math

import torch

from .base import HaltingMethod


def sample_poisson_lognormal_depth(
    mean: float, sigma: float, max_depth: int, generator: torch.Generator | None = None
) -> int:
    """One depth from Huginn's Poisson-lognormal, clipped to ``1 … max_depth``::

        τ ~ N(log(r̄ - 1) - σ²/2, σ),      r = 1 + Poisson(e^τ)

    so that ``E[r] = r̄`` before clipping (Huginn writes ``log r̄`` and ``r ~ Poisson(e^τ) + 1``,
    whose mean is ``r̄ + 1``; we shift by one so ``mean`` is the mean depth). Huginn trains with
    r̄ = 32, σ = 1/2; the heavy right tail is what lets a model extrapolate to more iterations at
    test time. Uses the global torch RNG unless ``generator`` is given, so a resumed run (whose
    RNG state the trainer restores) draws the same depths.

    Args:
        mean: r̄, the mean depth (≥ 1; ``1`` always returns 1).
        sigma: σ of the log-normal rate (Huginn: 0.5).
        max_depth: D; samples above it are clipped to D.
        generator: optional RNG.

    Returns:
        An int in ``1 … max_depth``.
    """
    if mean < 1:
        raise ValueError(f"random depth mean must be >= 1, got {mean!r}")
    if sigma < 0:
        raise ValueError(f"random depth sigma must be >= 0, got {sigma!r}")
    if mean <= 1.0:
        return 1
    mu = math.log(mean - 1.0) - 0.5 * sigma**2
    tau = mu + sigma * torch.randn((), generator=generator, dtype=torch.float64)
    r = 1 + int(torch.poisson(tau.exp().reshape(1), generator=generator).item())
    return max(1, min(max_depth, r))


class FixedDepth(HaltingMethod):
    name = "fixed"
    description = "fixed depth: every token runs all max_depth iterations"
    vllm_supported = True

    def train_forward_kwargs(self, cfg, step: int = 0) -> dict:
        """``{"depth": r}`` with a Poisson-lognormal ``r`` when ``cfg.random_depth`` is set.

        ``cfg.random_depth_mean`` (``None`` = ``(D + 1) / 2``) and ``cfg.random_depth_sigma`` are the
        distribution's parameters.
        """
        if not cfg.random_depth:
            return {}
        D = self.loop.max_depth
        mean = cfg.random_depth_mean if cfg.random_depth_mean is not None else (D + 1) / 2
        return {"depth": sample_poisson_lognormal_depth(mean, cfg.random_depth_sigma, D)}
