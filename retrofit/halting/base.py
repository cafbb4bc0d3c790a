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

``ctx`` is a ``HaltContext`` created per forward: all per-call state lives there, so a module can
serve concurrent forwards and checkpoint recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import LoopConfig


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

    @property
    def decider_hidden(self) -> int:
        return self.loop.decider_hidden or max(1, self.hidden_size // 4)
