"""MANO: prefix-notation modular arithmetic (ANIRA §5.1; docs/evaluation.md).

An instance is an expression tree over operators ``+ - *`` and operands ``0..22`` written in
prefix (Polish) notation; the answer is its value mod 23.  The knob ``L`` is the number of
operators, so evaluation costs Θ(L).

Example row (L = 2)::

    {"prompt": "+ * 3 4 5 =", "answer": "17", "difficulty": 2, "task": "mano"}

ANIRA trains on L ∈ {3, …, 16} and reports collapse for L > 16; the defaults follow that: every
level 3..16 trains, and 18, 20, 24 are evaluated as extrapolation. Holding interior levels out
(interpolation) is opt-in: ``build_splits("mano", ..., interp_levels=mano.INTERP_HOLDOUT)``
(``--interp_levels 7,11,15`` in the recipes) removes them from the default training levels.
"""

from __future__ import annotations

import random

from data_prep.common import Task, level_rng

MOD = 23
OPERATORS = ("+", "-", "*")
#: Interior levels to hold out for an interpolation test (opt-in; ANIRA trains on all of 3..16).
INTERP_HOLDOUT = (7, 11, 15)


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return (a + b) % MOD
    if op == "-":
        return (a - b) % MOD
    return (a * b) % MOD


def _build(rng: random.Random, n_ops: int, out: list[str]) -> int:
    """Appends the prefix tokens of a random tree with ``n_ops`` operators; returns its value."""
    if n_ops == 0:
        value = rng.randrange(MOD)
        out.append(str(value))
        return value
    op = rng.choice(OPERATORS)
    out.append(op)
    # A uniform split of the remaining operators gives a mix of deep chains and bushy trees.
    n_left = rng.randint(0, n_ops - 1)
    left = _build(rng, n_left, out)
    right = _build(rng, n_ops - 1 - n_left, out)
    return _apply(op, left, right)


def make_expression(rng: random.Random, n_ops: int) -> tuple[list[str], int]:
    """Samples one expression.

    Args:
        rng: Source of randomness.
        n_ops: Number of operators L (>= 0).

    Returns:
        ``(prefix_tokens, value_mod_23)``.
    """
    tokens: list[str] = []
    value = _build(rng, n_ops, tokens)
    return tokens, value


def generate(level: int, n: int, seed: int) -> list[dict]:
    """Generates ``n`` MANO rows with exactly ``level`` operators each."""
    rng = level_rng("mano", level, seed)
    rows = []
    for _ in range(n):
        tokens, value = make_expression(rng, level)
        rows.append({"prompt": " ".join(tokens) + " =", "answer": str(value), "difficulty": level, "task": "mano"})
    return rows


TASK = Task(
    name="mano",
    knob="L",
    default_train_levels=list(range(3, 17)),
    interp_levels=[],
    extrap_levels=[18, 20, 24],
    generate_fn=generate,
    min_level=1,
    description="prefix arithmetic mod 23 over + - *; L = number of operators",
)
