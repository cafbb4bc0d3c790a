"""Ouro: an exit gate trained by an entropy-regularized expected loss, then on realized improvements (docs/ouro.md).

Ouro (Zhu et al. 2025, arXiv 2510.25741, §3) loops the whole stack ``T_max`` times (4 in the paper) and reads out
every step through the shared final norm and LM head. After step ``t`` an exit gate gives::

    λ_t = σ(w · h_t + b)            h_t = the step's state after the final norm (what the LM head reads)

    p(t) = λ_t Π_{j<t} (1 − λ_j)    t < D,      p(D) = Π_{j<D} (1 − λ_j)   (the last step takes the rest)

**Stage I** (everything trains; every token runs every step)::

    L = Σ_t p(t) · L^(t)  −  β · H(p)          L^(t) = the next-token loss of step t's own readout

per labelled token, summed and divided by the labelled tokens (``num_items_in_batch`` when the trainer passes
it). ``−β·H(p)`` is ``β·KL(p ‖ uniform)`` up to a constant: the paper's ELBO with a uniform prior (a geometric
prior undertrained the deeper steps, its Appendix A). The paper uses β = 0.1 early and 0.05 later (its
Table 1); 0.05 is our default (``OuroOptions.entropy_beta``). This is the model's *main* loss: the method's
``main_loss`` hook receives every step's per-token loss with gradient.

**Stage II** (the decider-only phase, ``RetrofitSFTConfig.decider_phase_from``: the LM frozen, the gate
trains). The realized improvement of one more step and its soft target::

    I^(t+1) = max(0, L^(t) − L^(t+1))   (detached),      w_t = σ(k · (I^(t+1) − γ)),   k = 50, γ = 0.005

and a binary cross-entropy between the probability to continue after step ``t``, ``1 − λ_t``, and ``w_t``,
averaged over the labelled tokens and the ``D − 1`` decisions. The paper's Eq. 6 indexes the gate and the
improvement by the same ``t`` (and divides the sum over ``t = 2 … T_max`` by ``T_max``); we pair the decision
after step ``t`` with the improvement it would buy, ``I^(t+1)``, and average over the decisions.

**Inference ("Q-exit")**: a token exits at the first step whose cumulative exit probability
``CDF(t) = 1 − Π_{j<=t} (1 − λ_j)`` reaches ``q`` (``OuroOptions.exit_q``; ``q = 1`` runs every step). The output
is the exit step's readout.

Retrofitting a pretrained model, the gate starts at λ = 0.5 for every token (zero weights and bias: the paper
does not state an init); with D = 2 that is p = (0.5, 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LoopConfig
from ..heads import tag_init
from .anira import online_distribution
from .base import AuxLoss, HaltContext, HaltingMethod
from .tah2 import next_token_mask


@dataclass
class OuroOptions:
    """Ouro's options (``LoopConfig.options`` when ``method="ouro"``; docs/ouro.md).

    Args:
        exit_q: inference's Q-exit: stop at the first step whose cumulative exit probability reaches ``q``, in
            ``(0, 1]`` (1 = every step; the paper sweeps it to trade accuracy for compute).
        entropy_beta: Stage I's entropy weight ``β`` in ``Σ_t p(t) L^(t) − β H(p)`` (paper: 0.1, then 0.05).
        gate_k: Stage II's target sharpness ``k`` in ``w = σ(k (I − γ))`` (paper: 50).
        gate_gamma: Stage II's improvement margin ``γ`` (paper: 0.005).
    """

    exit_q: float = field(
        default=0.5, metadata={"help": "Q-exit: stop at the first step whose cumulative exit probability >= q."}
    )
    entropy_beta: float = field(default=0.05, metadata={"help": "Stage I: entropy weight β of the exit distribution."})
    gate_k: float = field(default=50.0, metadata={"help": "Stage II: sharpness k of the target σ(k (I − γ))."})
    gate_gamma: float = field(default=0.005, metadata={"help": "Stage II: improvement margin γ of the target."})

    def __post_init__(self):
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not number(self.exit_q) or not 0.0 < self.exit_q <= 1.0:
            raise ValueError(f"exit_q must be a number in (0, 1] (1 = every step), got {self.exit_q!r}")
        if not number(self.entropy_beta) or self.entropy_beta < 0:
            raise ValueError(f"entropy_beta must be a number >= 0, got {self.entropy_beta!r}")
        if not number(self.gate_k) or not self.gate_k > 0:
            raise ValueError(f"gate_k must be a number > 0, got {self.gate_k!r}")
        if not number(self.gate_gamma) or self.gate_gamma < 0:
            raise ValueError(f"gate_gamma must be a number >= 0, got {self.gate_gamma!r}")


class Ouro(HaltingMethod):
    name = "ouro"
    description = (
        "Ouro, an exit gate trained by the expected loss over its exit distribution with an entropy bonus, "
        "then on realized loss improvements; tokens exit once the cumulative exit probability reaches q"
    )
    default_attention = "same-depth"
    Options = OuroOptions
    threshold_field = "exit_q"
    threshold_meaning = "cumulative exit probability q"
    threshold_rule = "halt_mass"
    decider_runs = "per_depth"
    vllm_supported = False
    needs_depth_ce = True
    #: the gate (and the updater) read the step's state after the final norm, what the LM head reads
    loop_defaults = {"decider_state": "final_norm"}

    @classmethod
    def card_rows(cls, loop) -> list[tuple[str, str]]:
        o = loop.method_options
        return [("exit q", str(o.exit_q)), ("entropy β (Stage I)", str(o.entropy_beta))]

    @classmethod
    def continue_probabilities(cls, out, max_depth: int) -> torch.Tensor:
        """``Π_{j<=d} (1 − λ_j)``: the survival after step ``d``, so that "continue iff it is > 1 − q" is the
        Q-exit at every depth (``threshold_rule = "halt_mass"``)."""
        return (1.0 - out.halt_signals.float()).cumprod(-1)

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        self.gate = tag_init(nn.Linear(hidden_size, 1), "bias", 0.0)  # λ = 0.5 at init (module docstring)

    @property
    def options(self) -> OuroOptions:
        return self.loop.method_options

    def exit_prob(self, h: torch.Tensor) -> torch.Tensor:
        """``λ``: ``[..., H]`` final-normed states -> ``[...]`` exit probabilities (float32)."""
        return torch.sigmoid(self.gate(h).squeeze(-1).float())

    def plan(self, e, ctx: HaltContext):
        B, T = e.shape[:2]
        q = self.options.exit_q if ctx.threshold is None else ctx.threshold
        ctx.extra["q"] = torch.full((B, T), float(q), device=e.device)  # per token (a serving engine's rows)
        ctx.extra["survive"] = torch.ones(B, T, device=e.device)
        return None

    def step(self, d, e, h, probs, ctx: HaltContext):
        lam = self.exit_prob(h)
        ctx.signals.append(lam)
        if ctx.training:  # Stage I and II: every token runs every step (each step's loss is needed)
            return torch.ones_like(lam, dtype=torch.bool)
        with torch.no_grad():
            ctx.extra["survive"] = ctx.extra["survive"] * (1 - lam)
        return (1.0 - ctx.extra["survive"]) < ctx.extra["q"]  # continue while CDF(d) < q

    def distribution(self, ctx: HaltContext, depths):
        """``p`` ``[B, T, D]`` (the last step takes the rest); no straight-through weights: the exit state is used."""
        return online_distribution(ctx.signals, depths, ctx.max_depth), None

    # -- training --------------------------------------------------------------------------------
    def main_loss(self, outputs, labels, num_items_in_batch=None):
        """Stage I: ``Σ_t p(t) L^(t) − β H(p)`` per labelled token, summed and divided by the labelled tokens."""
        ce, p = outputs.depth_ce_tokens, outputs.depth_probs
        if ce is None or p is None:
            return None
        mask = next_token_mask(labels).to(ce.device)
        D = ce.shape[-1]
        p = p[..., :D].float()
        expected = (p * ce).sum(-1)  # [B, T]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        per_token = expected - self.options.entropy_beta * entropy
        denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp_min(1)
        return torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / torch.as_tensor(
            denom, device=ce.device
        )

    def decider_phase_loss(self, outputs, labels, cfg, num_items_in_batch=None) -> AuxLoss | None:
        """Stage II: BCE of ``1 − λ_t`` against ``σ(k (max(0, L^(t) − L^(t+1)) − γ))``, mean over labelled
        tokens and decisions."""
        if outputs.halt_signals is None or outputs.depth_nll is None:
            return None
        lam = outputs.halt_signals.float()  # [B, T, k]
        nll = outputs.depth_nll.detach().float()  # [B, T, D]
        K = min(lam.shape[-1], nll.shape[-1] - 1)
        gain = (nll[..., :K] - nll[..., 1 : K + 1]).clamp_min(0.0)
        o = self.options
        target = torch.sigmoid(o.gate_k * (gain - o.gate_gamma))
        mask = next_token_mask(labels).to(lam.device)[..., None] & torch.isfinite(gain)
        target = torch.where(mask, target, torch.zeros_like(target))
        cont = (1.0 - lam[..., :K]).clamp(1e-7, 1 - 1e-7)
        bce = F.binary_cross_entropy(cont, target, reduction="none")
        n = mask.sum().clamp_min(1)
        loss = torch.where(mask, bce, torch.zeros_like(bce)).sum() / n
        with torch.no_grad():
            metrics = {
                "gate_loss": loss.detach(),
                "gate_target_mean": (target * mask).sum() / n,
                "continue_prob_mean": (cont * mask).sum() / n,
            }
        return AuxLoss(loss, metrics)
