"""Halting methods: one file each, one explicit table (STYLE.md habit 6)."""

from __future__ import annotations

from ..config import LoopConfig
from .anira import AniraEarly, AniraOnline
from .base import HaltContext, HaltingMethod
from .fixed import FixedDepth
from .tah2 import TaH2

HALTING_METHODS: dict[str, type[HaltingMethod]] = {
    "tah2": TaH2,
    "anira-e": AniraEarly,
    "anira-o": AniraOnline,
    "fixed": FixedDepth,
}


def build_halting(hidden_size: int, loop: LoopConfig) -> HaltingMethod:
    try:
        cls = HALTING_METHODS[loop.method]
    except KeyError:
        raise ValueError(f"unknown method {loop.method!r}; allowed: {', '.join(HALTING_METHODS)}") from None
    return cls(hidden_size, loop)


__all__ = ["HALTING_METHODS", "HaltContext", "HaltingMethod", "build_halting"]
