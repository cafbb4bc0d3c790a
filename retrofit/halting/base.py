"""The contract every halting method fulfils.

A method owns its decider modules, its depth rule (inference and training) and its auxiliary loss
(STYLE.md: they change together). The looped forward calls, in order:

1. ``plan(e, ctx)`` once, with the core input ``e`` ``[B, T, H]``: a method that decides before the
   loop (ANIRA-E) returns the planned exit depth ``[B, T]``; online methods return ``None``.
2. ``step(d, e, h, probs, ctx)`` after each depth ``d < D`` on the (passthrough) state ``h``:
   returns ``continue`` ``[B, T]`` bool (meaningful for tokens still active) or ``None``.
   ``probs`` is the depth-``d`` next-token distribution when ``needs_depth_readout`` is set.
3. ``distribution(ctx, depths)`` after the loop: the halting distribution over depths
   ``[B, T, D]`` (or ``None`` for a method without one) and, for training, the straight-through
   weights used to combine per-depth states (``None`` when the hard exit state is used as is).

For training, the trainer (``retrofit.training``) asks the method for two more things:

- ``train_forward_kwargs(cfg)``: extra keyword arguments for the training forward (e.g. ``fixed``'s
  random depth per batch), and ``needs_depth_losses`` (forward with ``output_depth_losses=True``
  also in eval, so the auxiliary loss is defined there too);
- ``loss(outputs, labels, cfg, attention_mask=None)``: the method's auxiliary loss, already weighted
  (``α_D · L_D`` for TaH2, ``γ · L_C`` for ANIRA), added to the next-token loss ``outputs.loss``; plus
  the detached scalars to log. ``cfg`` is a ``LossConfig``.

``ctx`` is a ``HaltContext`` created per forward: all per-call state lives there, so a module can
serve concurrent forwards and checkpoint recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import LoopConfig


@dataclass
class LossConfig:
    """Weights and switches of the methods' training losses (METHODS.md §3–4).

    Args:
        alpha_d: TaH2's decider-loss weight ``α_D`` in ``L = L_NTP + α_D · L_D`` (§3: 0.05).
        rho: TaH2's cutoff mass ``ρ``: the kept positive gains cover this share of the batch's total
            positive gain (§3: 0.99). ``1.0`` keeps every positive gain (the seed's "ρ = 1" ablation).
        decider_weighting: TaH2's BCE weights: ``"distance"`` = ``|δ - κ|`` (cost-sensitive, §3) or
            ``"uniform"`` (the seed's ablation, −3.6 points).
        gamma: ANIRA's weight ``γ`` of the KL-to-prior term ``L_C`` (§4). The seed tunes it by grid
            search (ANIRA Appendix Table 5, values not in the seed); 0.01 is our default.
        prior_base: ANIRA's prior ``p(d) ∝ b^(-d)``; ``b = 1`` leaves only the entropy term (§4).
    """

    alpha_d: float = 0.05
    rho: float = 0.99
    decider_weighting: str = "distance"
    gamma: float = 0.01
    prior_base: float = 2.0

    def __post_init__(self):
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must lie in (0, 1], got {self.rho!r}")
        if self.decider_weighting not in ("distance", "uniform"):
            raise ValueError(f"decider_weighting must be 'distance' or 'uniform', got {self.decider_weighting!r}")
        if self.alpha_d < 0 or self.gamma < 0:
            raise ValueError(f"alpha_d and gamma must be >= 0, got alpha_d={self.alpha_d!r}, gamma={self.gamma!r}")
        if self.prior_base <= 0:
            raise ValueError(f"prior_base (b in p(d) ∝ b^(-d)) must be > 0, got {self.prior_base!r}")


@dataclass
class AuxLoss:
    """A method's auxiliary training loss.

    Attributes:
        loss: scalar, already weighted; the trainer adds it to the next-token loss.
        metrics: detached scalars to log (e.g. the unweighted decider loss, the cutoff κ).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HaltContext:
    """Per-forward state of a halting method."""

    training: bool
    max_depth: int
    signals: list[torch.Tensor] = field(default_factory=list)  # one [B, T] per decided depth
    extra: dict = field(default_factory=dict)


class HaltingMethod(nn.Module):
    """Base class; see the module docstring for the call order."""

    name: str = ""
    #: the method reads the next-token distribution of every executed depth (TaH2's decider input)
    needs_depth_readout: bool = False

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__()
        self.hidden_size = hidden_size
        self.loop = loop

    @property
    def mixture_output(self) -> bool:
        """Output = halting-weighted mixture of per-depth distributions (TaH2 only)."""
        return False

    def new_context(self, training: bool) -> HaltContext:
        return HaltContext(training=training, max_depth=self.loop.max_depth)

    def plan(self, e: torch.Tensor, ctx: HaltContext) -> torch.Tensor | None:
        return None

    def step(self, d: int, e: torch.Tensor, h: torch.Tensor, probs: torch.Tensor | None, ctx: HaltContext):
        return None

    def distribution(self, ctx: HaltContext, depths: torch.Tensor):
        """Returns ``(depth_probs [B, T, D] or None, straight_through [B, T, D] or None)``."""
        return None, None

    # -- training ------------------------------------------------------------------------------
    #: the loss reads ``outputs.depth_nll``: forward with ``output_depth_losses=True`` (TaH2)
    needs_depth_losses: bool = False

    def train_forward_kwargs(self, cfg) -> dict:
        """Extra forward keyword arguments for one training step (``cfg``: the trainer's config)."""
        return {}

    def loss(self, outputs, labels: torch.Tensor, cfg: LossConfig, attention_mask: torch.Tensor | None = None) -> AuxLoss | None:
        """The method's weighted auxiliary loss for one batch, or ``None`` (plain next-token loss).

        Args:
            outputs: the ``LoopedCausalLMOutput`` of the training forward.
            labels: ``[B, T]`` unshifted labels (-100 = ignored), as given to the forward.
            cfg: loss weights and switches.
            attention_mask: ``[B, T]`` 1 for real tokens; ``None`` = every token is real.
        """
        return None

    @property
    def decider_hidden(self) -> int:
        return self.loop.decider_hidden or max(1, self.hidden_size // 4)
