"""ANIRA: early (E) and online (O) depth decisions with a KL-to-geometric-prior loss (docs/anira.md).

- ANIRA-E: ``q_i = softmax(FFN(h_i^(0)))`` over depths ``1 … D``, one decision before the loop.
  Training: straight-through Gumbel-softmax sample; inference: ``argmax_d q_i(d)``, or with a call-time
  threshold ``u`` (``forward(decider_threshold=u)``) the first depth whose cumulative mass reaches ``u``.
- ANIRA-O: after each depth, ``α_i^(d) = σ(FFN(h_i^(d)))`` is the halting probability;
  ``q_i(d) = α^(d) Π_{j<d} (1 - α^(j))``, the remaining mass at ``D``. Training: inverse-CDF
  sampling with ``u ~ U(0, 1)``; inference: ``u = halt_threshold`` (0.5 = the median depth; a call may
  pass its own, ``forward(decider_threshold=u)``).

In both, the straight-through weights ``z = hard + q_soft - q_soft.detach()`` combine the per-depth
(passthrough) states for the coda, ``Σ_d z_d h^(d)``: the forward value is the exit state, the
backward reaches the decider.

The deciders are two-layer FFNs of width ``LoopConfig.decider_hidden`` (ANIRA uses an FFN shaped
like the model's own, ~8% of a 13.7M model; that would break our 3% budget at LLM scale).

For ANIRA-O, a token that exited keeps its state (passthrough), so its later halting
probabilities equal the one at its exit depth; ``distribution`` fills them in that way instead
of running the decider on copies.

Training loss (§4, ANIRA §3.2.1)::

    L = L_CE + γ · L_C,    L_C = mean_i KL(q_i ‖ p),    p(d) ∝ b^(-d), d = 1 … D

``L_CE`` is the model's own ``outputs.loss``; it covers answer tokens only because the SFT labels
mask the prompt (TRL's completion-only loss). ``L_C`` averages over *all* non-padding tokens, the
prompt included. The decider gets gradient from both: directly from ``L_C`` and, through the
straight-through weights, from ``L_CE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import LoopConfig, _is_number
from ..heads import DeciderFFN
from .base import AuxLoss, HaltContext, HaltingMethod


@dataclass
class AniraOptions:
    """The options both ANIRA methods have (docs/anira.md): their prior loss. ``LoopConfig.options`` holds
    ``AniraOnlineOptions`` for ``method="anira-o"`` and ``AniraEarlyOptions`` for ``"anira-e"``.

    Args:
        gamma: the weight ``γ`` of the KL-to-prior term ``L_C`` (§4). The seed tunes it by grid search (ANIRA
            Appendix Table 5, values not in the seed); 0.01 is our default.
        prior_base: the prior ``p(d) ∝ b^(-d)``; ``b = 1`` leaves only the entropy term (§4).
    """

    gamma: float = field(default=0.01, metadata={"help": "Weight γ of the KL-to-prior loss L_C."})
    prior_base: float = field(
        default=2.0, metadata={"help": "Base b of the depth prior p(d) ∝ b^(-d); 1 = entropy term only."}
    )

    def __post_init__(self):
        if not _is_number(self.gamma) or self.gamma < 0:
            raise ValueError(f"gamma must be a number >= 0, got {self.gamma!r}")
        if not _is_number(self.prior_base) or not self.prior_base > 0:
            raise ValueError(f"prior_base (b in p(d) ∝ b^(-d)) must be a number > 0, got {self.prior_base!r}")


@dataclass
class AniraOnlineOptions(AniraOptions):
    """ANIRA-O's options: the prior loss's plus its inference threshold.

    Args:
        halt_threshold: inference: a token stops at the first depth where its cumulative halting mass reaches this
            value (0.5 = the median depth, §4); lower = shallower. The frontier and calibration move it.
    """

    halt_threshold: float = field(
        default=0.5,
        metadata={"help": "Inference: stop once the cumulative halting mass reaches it (0.5 = the median depth)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if not _is_number(self.halt_threshold) or not 0.0 < self.halt_threshold < 1.0:
            raise ValueError(f"halt_threshold must be a number strictly between 0 and 1, got {self.halt_threshold!r}")


@dataclass
class AniraEarlyOptions(AniraOptions):
    """ANIRA-E's options: the prior loss's plus the temperature of its straight-through Gumbel-softmax.

    Args:
        gumbel_tau: the temperature of the training-time Gumbel-softmax sample of the depth.
    """

    gumbel_tau: float = field(default=1.0, metadata={"help": "Training: Gumbel-softmax temperature."})

    def __post_init__(self):
        super().__post_init__()
        if not _is_number(self.gumbel_tau) or not self.gumbel_tau > 0:
            raise ValueError(f"gumbel_tau must be a number > 0, got {self.gumbel_tau!r}")


def log_prior(max_depth: int, base: float, device=None) -> torch.Tensor:
    """``log p(d)`` for ``p(d) ∝ b^(-d)``, ``d = 1 … D``: ``[D]`` float32 (uniform when ``b = 1``)."""
    d = torch.arange(1, max_depth + 1, dtype=torch.float64, device=device)
    logits = -d * math.log(base)
    return (logits - logits.logsumexp(0)).float()


def kl_to_prior(q: torch.Tensor, base: float, log_q: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``KL(q ‖ p)`` with ``p(d) ∝ b^(-d)`` (§4).

    Equals ``-H(q) + log(b) · E_q[d] + log Z`` with ``Z = Σ_d b^(-d)``.

    Args:
        q: ``[..., D]`` depth distributions (rows sum to 1).
        base: the prior's base ``b > 0``.
        log_q: ``log q`` when known stably (ANIRA-E's log-softmax); else ``log`` of ``q`` clamped at
            1e-30, so ``q = 0`` contributes 0 with a finite gradient.

    Returns:
        ``[...]`` float32.
    """
    q = q.float()
    log_q = q.clamp_min(1e-30).log() if log_q is None else log_q.float()
    lp = log_prior(q.shape[-1], base, q.device)
    return (q * (log_q - lp)).sum(-1)


def _prior_loss(q, log_q, attention_mask, cfg: AniraOptions) -> AuxLoss:
    kl = kl_to_prior(q, cfg.prior_base, log_q)  # [B, T]
    mask = torch.ones_like(kl, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    n = mask.sum().clamp_min(1)
    l_c = torch.where(mask, kl, torch.zeros_like(kl)).sum() / n
    with torch.no_grad():
        d = torch.arange(1, q.shape[-1] + 1, device=q.device, dtype=torch.float32)
        exp_d = (q.float() * d).sum(-1)
        metrics = {
            "kl_prior": l_c.detach(),
            "expected_depth_q": torch.where(mask, exp_d, torch.zeros_like(exp_d)).sum() / n,
        }
    return AuxLoss(cfg.gamma * l_c, metrics)


class AniraEarly(HaltingMethod):
    name = "anira-e"
    description = "ANIRA-E, which decides each token's depth once, before the loop"
    threshold_meaning = "allocation quantile of q"
    threshold_rule = "halt_mass"
    Options = AniraEarlyOptions
    decider_runs = "once"
    vllm_supported = True
    paper_claims = ("depth_follows_level",)

    @classmethod
    def continue_probabilities(cls, out, max_depth: int) -> torch.Tensor:
        """``P(d* > d) = 1 - Σ_{j<=d} q_j`` from the planned distribution (``depth_probs``)."""
        return 1.0 - out.depth_probs.float().cumsum(-1)[..., : max_depth - 1]

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        D = loop.max_depth
        bias = [0.0] * D
        bias[-1] = loop.deep_init_logit  # starts deep: argmax = D
        self.decider = DeciderFFN(hidden_size, self.decider_hidden, D, bias)

    def plan(self, e, ctx: HaltContext):
        logits = self.decider(e).float()  # [B, T, D]
        q = logits.softmax(-1)
        ctx.extra["q"] = q
        ctx.extra["q_logits"] = logits
        if ctx.training:
            g = -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-10, 1.0 - 1e-7)))
            y = ((logits + g) / self.loop.method_options.gumbel_tau).softmax(-1)
            depth = y.argmax(-1) + 1
            ctx.extra["soft"] = y
        elif ctx.threshold is not None:
            # allocation quantile u: the first depth whose cumulative mass under q reaches u (a compute knob
            # for the accuracy-compute frontier; u -> 0 is shallow, u -> 1 deep)
            depth = (q.cumsum(-1) < ctx.threshold).sum(-1).clamp_max(q.shape[-1] - 1) + 1
        else:
            depth = q.argmax(-1) + 1
        return depth

    def distribution(self, ctx: HaltContext, depths):
        q = ctx.extra["q"]
        st = None
        if ctx.training:
            soft = ctx.extra["soft"]
            hard = F.one_hot(depths - 1, q.shape[-1]).to(soft.dtype)
            st = hard + soft - soft.detach()
        return q, st

    def loss(self, outputs, labels, cfg: AniraOptions, attention_mask=None, num_items_in_batch=None) -> AuxLoss | None:
        """``γ · L_C`` over all non-padding tokens; ``log q`` from the raw depth logits (stable)."""
        if outputs.depth_probs is None:  # a forced depth: no decision was made
            return None
        return _prior_loss(outputs.depth_probs, outputs.depth_logits_q.float().log_softmax(-1), attention_mask, cfg)


class AniraOnline(HaltingMethod):
    name = "anira-o"
    description = "ANIRA-O, which decides after each iteration whether the token halts"
    threshold_field = "halt_threshold"
    threshold_meaning = "cumulative halting mass u"
    threshold_rule = "halt_mass"
    Options = AniraOnlineOptions
    decider_runs = "per_depth"
    vllm_supported = True
    paper_claims = ("depth_follows_level",)

    @classmethod
    def card_rows(cls, loop) -> list[tuple[str, str]]:
        return [("halt threshold", str(loop.method_options.halt_threshold))]

    @classmethod
    def continue_probabilities(cls, out, max_depth: int) -> torch.Tensor:
        """``1 - α^(d)``: the complement of the halting probability (``halt_signals``)."""
        return 1.0 - out.halt_signals.float()

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        # starts deep: halting logit = -deep_init_logit
        self.decider = DeciderFFN(hidden_size, self.decider_hidden, 1, -loop.deep_init_logit)

    def plan(self, e, ctx: HaltContext):
        B, T = e.shape[:2]
        if ctx.training:
            ctx.extra["u"] = torch.rand(B, T, device=e.device)
        else:
            u = self.loop.method_options.halt_threshold if ctx.threshold is None else ctx.threshold
            ctx.extra["u"] = torch.full((B, T), u, device=e.device)
        ctx.extra["cdf"] = torch.zeros(B, T, device=e.device)
        ctx.extra["remain"] = torch.ones(B, T, device=e.device)
        return None

    def halt_prob(self, h):
        return torch.sigmoid(self.decider(h).squeeze(-1).float())

    def step(self, d, e, h, probs, ctx: HaltContext):
        a = self.halt_prob(h)
        ctx.signals.append(a)
        with torch.no_grad():
            ctx.extra["cdf"] = ctx.extra["cdf"] + a * ctx.extra["remain"]
            ctx.extra["remain"] = ctx.extra["remain"] * (1 - a)
        # inverse CDF: stop at the first depth whose cumulative mass reaches u
        return ctx.extra["cdf"] < ctx.extra["u"]

    def distribution(self, ctx: HaltContext, depths):
        q = online_distribution(ctx.signals, depths, ctx.max_depth)
        st = None
        if ctx.training:
            hard = F.one_hot(depths - 1, q.shape[-1]).to(q.dtype)
            st = hard + q - q.detach()
        return q, st

    def loss(self, outputs, labels, cfg: AniraOptions, attention_mask=None, num_items_in_batch=None) -> AuxLoss | None:
        """``γ · L_C`` over all non-padding tokens."""
        if outputs.depth_probs is None:  # a forced depth: no decision was made
            return None
        return _prior_loss(outputs.depth_probs, None, attention_mask, cfg)


def online_distribution(alphas: list[torch.Tensor], depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """ANIRA-O's depth distribution ``[B, T, D]`` from halting probabilities ``α^(1) … α^(k)``.

    A missing ``α^(d)`` (the loop stopped before depth ``d``, or the token had exited) equals the
    token's halting probability at its exit depth, because passthrough freezes the state the
    decider reads.
    """
    B, T = depths.shape
    remain = torch.ones(B, T, device=depths.device)
    out = []
    last = None
    for d in range(1, max_depth):
        if d <= len(alphas):
            a = alphas[d - 1]
            # an exited token's state is frozen at its exit depth d*: reuse α^(d*)
            if last is not None:
                a = torch.where(depths < d, last, a)
        else:
            a = last
        last = a
        out.append(a * remain)
        remain = remain * (1 - a)
    out.append(remain)
    return torch.stack(out, -1)
