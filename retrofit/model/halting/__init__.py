"""Halting methods: one module each, one registry entry each (``retrofit.model.registry``; STYLE.md habit 6).

Adding a method: write its module here (a ``HaltingMethod`` subclass with its declarations, its options
dataclass and its loss), add one ``register(...)`` line below, its docs page and its tests
(docs/architecture.md, "adding a method").
"""

from __future__ import annotations

from ..config import LoopConfig
from ..registry import method_class, names, register
from .anira import AniraEarly, AniraOnline
from .base import HaltContext, HaltingMethod
from .fixed import FixedDepth
from .ouro import Ouro
from .tah2 import TaH2

register(TaH2)
register(AniraEarly)
register(AniraOnline)
register(FixedDepth)
register(Ouro)


def build_halting(hidden_size: int, loop: LoopConfig) -> HaltingMethod:
    """The halting module of ``loop.method`` for a model of width ``hidden_size``."""
    return method_class(loop.method)(hidden_size, loop)


def __getattr__(name):
    if name == "HALTING_METHODS":  # ``{name: class}`` of every registered method, in registration order
        return {n: method_class(n) for n in names()}
    raise AttributeError(name)


__all__ = ["HaltContext", "HaltingMethod", "build_halting", "method_class", "register"]
