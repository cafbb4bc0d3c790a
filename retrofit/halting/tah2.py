"""TaH2: a token-level iteration decider trained with lookahead depth supervision (METHODS.md §3).

Decider (after each depth ``d < D``)::

    c_t^(d) = σ(FFN([e_t ; h_t^(d) ; top-K of softmax(z_t^(d))]))      continue probability

A token stops at the first ``d`` with ``c < τ_exit`` (0.5), else runs to ``D``. The rule is the same
in training (on-policy); the seed's "sampled decisions" ablation draws Bernoulli(c) instead.

Output mixture: ``π_1 = 1 - c^(1)``, ``π_2 = c^(1)(1 - c^(2))``, …; the last executed depth absorbs
the remaining mass ``Π_{j<d*} c^(j)``; ``p_t = Σ_d π_d softmax(z^(d))``.

The top-K probabilities enter the decider detached: they are features of the current prediction,
and letting the decider's loss reshape the LM distribution through them is not what the seed
describes.
"""

from __future__ import annotations

import torch

from ..config import LoopConfig
from ..heads import DeciderFFN
from .base import HaltContext, HaltingMethod


class TaH2(HaltingMethod):
    name = "tah2"
    needs_depth_readout = True

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        self.top_k = loop.decider_top_k
        # starts deep: continue logit = +deep_init_logit for every token
        self.decider = DeciderFFN(2 * hidden_size + self.top_k, self.decider_hidden, 1, loop.deep_init_logit)

    @property
    def mixture_output(self) -> bool:
        return self.loop.mixture_output

    def continue_prob(self, e: torch.Tensor, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[B, T, H]``; ``probs``: ``[B, T, V]`` -> continue probability ``[B, T]``."""
        k = min(self.top_k, probs.shape[-1])
        top = probs.detach().topk(k, dim=-1).values
        if k < self.top_k:
            top = torch.nn.functional.pad(top, (0, self.top_k - k))
        x = torch.cat([e, h, top.to(h.dtype)], dim=-1)
        return torch.sigmoid(self.decider(x).squeeze(-1).float())

    def step(self, d, e, h, probs, ctx: HaltContext):
        c = self.continue_prob(e, h, probs)
        ctx.signals.append(c)
        if ctx.training and self.loop.train_decisions == "sample":
            return torch.bernoulli(c.detach()).bool()
        return c >= self.loop.exit_threshold

    def distribution(self, ctx: HaltContext, depths: torch.Tensor):
        """π ``[B, T, D]`` from the continue probabilities, given exit depths ``[B, T]``."""
        return mixture_weights(ctx.signals, depths, ctx.max_depth), None


def mixture_weights(cont: list[torch.Tensor], depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Halting weights of the output mixture.

    Args:
        cont: continue probabilities ``c^(1) … c^(k)``, each ``[B, T]`` (k may be < D - 1 when the
            loop stopped early; depths never exceed ``k + 1`` then).
        depths: exit depths ``[B, T]`` (1-based).
        max_depth: ``D``.

    Returns:
        ``[B, T, D]``: ``π_d = (1 - c^(d)) Π_{j<d} c^(j)`` for ``d < d*``, ``Π_{j<d*} c^(j)`` at ``d*``
        (the last executed depth absorbs the remaining mass), 0 beyond. Rows sum to 1.
    """
    B, T = depths.shape
    out = []
    survive = torch.ones(B, T, dtype=torch.float32, device=depths.device)
    for d in range(1, max_depth + 1):
        is_last = depths == d
        if d <= len(cont):
            c = cont[d - 1].float()
            w = torch.where(is_last, survive, survive * (1 - c))
            next_survive = survive * c
        else:
            w = torch.where(is_last, survive, torch.zeros_like(survive))
            next_survive = survive
        w = torch.where(depths >= d, w, torch.zeros_like(w))
        out.append(w)
        survive = next_survive
    return torch.stack(out, dim=-1)
