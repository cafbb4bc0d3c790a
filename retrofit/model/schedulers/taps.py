"""Step sizes of the core update: the unit step and TAPS (docs/taps.md).

The looped core is an iteration ``h_d = F(h_{d-1})`` with ``F(h) = core(U(e, s(h)))`` (the updater
re-injects the core input ``e``; ``s`` is ``retrofit.model.loop.loop_state``, the final norm or the identity).
A step schedule relaxes it::

    h_d = h_{d-1} + η_d · (F(h_{d-1}) - h_{d-1})          (d ≥ 2; h_1 = core(e) always)

``unit`` is ``η ≡ 1`` (the trained model's own update). ``TAPS`` (trajectory-adaptive progress–
fluctuation scheduler) sets ``η_d`` per token from its own trajectory of updates
``Δ_d = F(h_{d-1}) - h_{d-1}``, ``n = d - 1`` of them so far (exact formula; the seed gives the idea,
not the equations, so these choices are ours)::

    S_d  = β S_{d-1} + (1-β) ‖Δ_d - m̂_{d-1}‖²        centered fluctuation (against the previous mean)
    m_d  = β m_{d-1} + (1-β) Δ_d                      EMA mean of the updates
    m̂_d = m_d / (1 - βⁿ),   Ŝ_d = S_d / (1 - βⁿ)      bias-corrected (m_1 = S_1 = 0 before, m̂_1 := 0)
    P̂_d = ‖m̂_d‖²                                     persistent progress: energy of the EMA mean
    ρ_d  = P̂_d / (P̂_d + Ŝ_d + ε)                     ∈ [0, 1]
    η_d  = clip(1 + γ (2ρ_d - 1), η_min, η_max)

Why this shape: when successive updates keep pointing the same way, ``Δ_d ≈ m̂_{d-1}`` so ``Ŝ`` decays
while ``P̂`` stays, ``ρ → 1`` and the step grows to ``1 + γ``; when they oscillate, the mean cancels
(``P̂`` small) and the deviations are large, ``ρ → 0`` and the step shrinks to ``1 - γ``. The first
update (``n = 1``) carries no trajectory information: by construction ``P̂ = Ŝ = ‖Δ‖²`` there, so
``ρ = ½`` and ``η = 1`` (set exactly). Depth 1 is never relaxed: it maps the embeddings to the first
state (the pretrained function), not an iteration of ``F``. Hence TAPS only acts from depth 3 on and
is the unit step for ``max_depth ≤ 2``. Defaults: ``β = 0.5`` (trajectories are a handful of steps
long), ``γ = 0.5``, ``η ∈ [0.5, 1.5]``, ``ε = 1e-12``. Norms are over the hidden size, per token, in
float32.

``η ≡ 1`` (e.g. ``TAPS(gain=0)``) reproduces the unit step exactly: the update is
``torch.lerp(h, F(h), η)``, which returns ``F(h)`` bit for bit at weight 1.

A schedule composes with any exit: exits read the relaxed state. Tokens that exited keep their
state and their statistics frozen.
"""

from __future__ import annotations

import torch


class StepSchedule:
    """Base class. ``state = init(n_tokens)``; per depth ``h_new = step(d, h_prev, raw, state, idx)``."""

    name: str = ""

    def init(self, n_tokens: int) -> dict:
        """Per-call state for ``n_tokens`` flat tokens (``B * T``)."""
        return {"n": n_tokens}

    def step(
        self, d: int, h_prev: torch.Tensor | None, raw: torch.Tensor, state: dict, idx: torch.Tensor | None
    ) -> torch.Tensor:
        """The new state of ``n`` running tokens.

        Args:
            d: depth just computed (1-based).
            h_prev: ``[n, H]`` their states at depth ``d - 1`` (None at ``d = 1``).
            raw: ``[n, H]`` the core output ``F(h_prev)``.
            state: the dict from ``init``.
            idx: ``[n]`` flat token indices (stable across depths), or None for all tokens in order.

        Returns:
            ``[n, H]`` the state at depth ``d``.
        """
        raise NotImplementedError


class UnitStep(StepSchedule):
    """``η ≡ 1``: the trained update ``h_d = F(h_{d-1})``."""

    name = "unit"

    def step(self, d, h_prev, raw, state, idx):
        return raw


class TAPS(StepSchedule):
    """Trajectory-adaptive step size (see the module docstring for the formula).

    Args:
        beta: EMA factor ``β`` in [0, 1).
        gain: ``γ ≥ 0``; 0 gives ``η ≡ 1``.
        eta_min, eta_max: clip range of ``η`` (``0 < η_min ≤ 1 ≤ η_max``).
        eps: ``ε`` in the ratio.
    """

    name = "taps"

    def __init__(
        self, beta: float = 0.5, gain: float = 0.5, eta_min: float = 0.5, eta_max: float = 1.5, eps: float = 1e-12
    ):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must lie in [0, 1), got {beta!r}")
        if gain < 0:
            raise ValueError(f"gain must be >= 0, got {gain!r}")
        if not 0.0 < eta_min <= 1.0 <= eta_max:
            raise ValueError(f"need 0 < eta_min <= 1 <= eta_max, got eta_min={eta_min!r}, eta_max={eta_max!r}")
        self.beta, self.gain, self.eta_min, self.eta_max, self.eps = beta, gain, eta_min, eta_max, eps

    def __repr__(self):
        return f"TAPS(beta={self.beta}, gain={self.gain}, eta_min={self.eta_min}, eta_max={self.eta_max})"

    def eta(self, d: int, delta: torch.Tensor, state: dict, idx: torch.Tensor | None) -> torch.Tensor:
        """Update the statistics with ``Δ_d`` (``[n, H]``) and return ``η_d`` ``[n]`` (float32)."""
        n_tok = state["n"]
        dlt = delta.float()
        if "m" not in state:
            state["m"] = dlt.new_zeros(n_tok, dlt.shape[-1])
            state["S"] = dlt.new_zeros(n_tok)
        sel = slice(None) if idx is None else idx
        m, S = state["m"][sel], state["S"][sel]
        n = d - 1  # updates seen, this one included (depth 1 makes none)
        b = self.beta
        m_hat_prev = m / (1 - b ** (n - 1)) if n > 1 else torch.zeros_like(m)
        S = b * S + (1 - b) * (dlt - m_hat_prev).square().sum(-1)
        m = b * m + (1 - b) * dlt
        state["m"][sel] = m
        state["S"][sel] = S
        corr = 1 - b**n
        P_hat = (m / corr).square().sum(-1)
        S_hat = S / corr
        rho = P_hat / (P_hat + S_hat + self.eps)
        eta = (1 + self.gain * (2 * rho - 1)).clamp(self.eta_min, self.eta_max)
        if n == 1:
            eta = torch.ones_like(eta)
        state.setdefault("etas", {})[d] = eta
        return eta

    def step(self, d, h_prev, raw, state, idx):
        if d == 1 or h_prev is None:
            return raw
        eta = self.eta(d, raw - h_prev, state, idx)
        return torch.lerp(h_prev, raw, eta[:, None].to(raw.dtype))


#: step schedules by name (``step_schedule=`` at forward/generate time)
STEP_SCHEDULES: dict[str, type[StepSchedule]] = {
    "unit": UnitStep,
    "taps": TAPS,
}


def build_step_schedule(spec) -> StepSchedule:
    """``None``/``"unit"`` -> ``UnitStep``; ``"taps"`` -> ``TAPS()``; a ``StepSchedule`` passes through."""
    if spec is None:
        return UnitStep()
    if isinstance(spec, StepSchedule):
        return spec
    if isinstance(spec, str) and spec in STEP_SCHEDULES:
        return STEP_SCHEDULES[spec]()
    raise ValueError(f"unknown step_schedule {spec!r}; allowed: {', '.join(STEP_SCHEDULES)} or a StepSchedule instance")
