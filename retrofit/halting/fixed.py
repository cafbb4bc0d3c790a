"""``fixed``: every token runs all ``max_depth`` iterations (Huginn / Ouro / retrofitted
recurrence). No decider; the baseline every adaptive method is compared against. Training-free
exits (``retrofit.halting.training_free``) can still be applied at inference."""

from __future__ import annotations

from .base import HaltingMethod


class FixedDepth(HaltingMethod):
    name = "fixed"
