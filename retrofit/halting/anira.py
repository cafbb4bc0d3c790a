"""ANIRA: early (E) and online (O) depth decisions with a KL-to-geometric-prior loss (METHODS.md §4).

- ANIRA-E: ``q_i = softmax(FFN(h_i^(0)))`` over depths ``1 … D``, one decision before the loop.
  Training: straight-through Gumbel-softmax sample; inference: ``argmax_d q_i(d)``.
- ANIRA-O: after each depth, ``α_i^(d) = σ(FFN(h_i^(d)))`` is the halting probability;
  ``q_i(d) = α^(d) Π_{j<d} (1 - α^(j))``, the remaining mass at ``D``. Training: inverse-CDF
  sampling with ``u ~ U(0, 1)``; inference: ``u = halt_threshold`` (0.5 = the median depth).

In both, the straight-through weights ``z = hard + q_soft - q_soft.detach()`` combine the per-depth
(passthrough) states for the coda, ``Σ_d z_d h^(d)``: the forward value is the exit state, the
backward reaches the decider.

The deciders are two-layer FFNs of width ``LoopConfig.decider_hidden`` (ANIRA uses an FFN shaped
like the model's own, ~8% of a 13.7M model; that would break our 3% budget at LLM scale).

For ANIRA-O, a token that exited keeps its state (passthrough), so its later halting
probabilities equal the one at its exit depth; ``distribution`` fills them in that way instead
of running the decider on copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import LoopConfig
from ..heads import DeciderFFN
from .base import HaltContext, HaltingMethod


class AniraEarly(HaltingMethod):
    name = "anira-e"

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
            y = ((logits + g) / self.loop.gumbel_tau).softmax(-1)
            depth = y.argmax(-1) + 1
            ctx.extra["soft"] = y
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


class AniraOnline(HaltingMethod):
    name = "anira-o"

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        # starts deep: halting logit = -deep_init_logit
        self.decider = DeciderFFN(hidden_size, self.decider_hidden, 1, -loop.deep_init_logit)

    def plan(self, e, ctx: HaltContext):
        B, T = e.shape[:2]
        if ctx.training:
            ctx.extra["u"] = torch.rand(B, T, device=e.device)
        else:
            ctx.extra["u"] = torch.full((B, T), self.loop.halt_threshold, device=e.device)
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
