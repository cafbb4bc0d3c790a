"""Planning a comparison: rows needed for the paired test to see a difference, and the exact test's power.

Pure functions (Python + ``math``), re-exported by :mod:`retrofit.evaluation.stats`:

    rows_needed     Rows per level to detect a given accuracy difference (assumptions stated there).
    mcnemar_power   Exact power of the exact McNemar test (enumeration), to check ``rows_needed``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["mcnemar_power", "rows_needed"]


def _discordance(delta: float, base_accuracy: float, discordant: float | None) -> float:
    if discordant is not None:
        return float(discordant)
    p1, p2 = base_accuracy - delta / 2, base_accuracy + delta / 2
    if not (0.0 <= p1 and p2 <= 1.0):
        raise ValueError(f"base_accuracy ± delta/2 must lie in [0, 1], got {p1:.3f}..{p2:.3f}")
    # independent errors: a row is discordant when exactly one model is right
    return p1 * (1 - p2) + p2 * (1 - p1)


def rows_needed(
    delta: float = 0.10,
    base_accuracy: float = 0.5,
    discordant: float | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
) -> int:
    """Rows per level for the paired (McNemar) test to detect an accuracy difference ``delta``.

    Assumptions: a two-sided test at level ``alpha`` with the given ``power``, and Connor's (1987)
    normal approximation for McNemar's test,
    ``n = ((z_{1−α/2}·√ψ + z_{power}·√(ψ − δ²)) / δ)²``, where ψ is the share of rows on which
    the two models disagree. ψ is unknown before the run; by default it is taken for
    *independent* errors at accuracies ``base_accuracy ∓ δ/2``: ``ψ = p1(1−p2) + p2(1−p1)``. At
    50% accuracy that is the worst case (ψ ≈ 0.5, about 390 rows for δ = 0.10); two fine-tunes
    of the same base usually err on the same rows (smaller ψ), which needs fewer rows (ψ = 0.2:
    about 155). Pass the observed ψ (``a_only + b_only`` over n) as ``discordant`` to plan a
    rerun. The exact McNemar test is slightly conservative: :func:`mcnemar_power` gives its exact
    power at the returned n (0.78 at n = 395 for the default, 0.76 at ψ = 0.2).

    Returns:
        The smallest integer n given by the formula.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    psi = _discordance(delta, base_accuracy, discordant)
    if not delta <= psi <= 1.0:
        raise ValueError(f"the discordant share must lie in [delta, 1] = [{delta}, 1], got {psi!r}")
    z_a = NormalDist().inv_cdf(1 - alpha / 2)
    z_b = NormalDist().inv_cdf(power)
    n = ((z_a * math.sqrt(psi) + z_b * math.sqrt(max(psi - delta * delta, 0.0))) / delta) ** 2
    return int(math.ceil(n - 1e-9))


def mcnemar_power(n: int, delta: float, discordant: float, alpha: float = 0.05) -> float:
    """Exact power of :func:`mcnemar_exact` at level ``alpha`` with ``n`` rows.

    Model: each row is discordant with probability ψ = ``discordant``, independently; a
    discordant row favours A with probability ``(ψ + δ) / (2ψ)``. Enumerates every
    (discordant count, A-favouring count) and sums the probability of a rejection.
    """
    if not 0 < delta <= discordant <= 1:
        raise ValueError(f"need 0 < delta <= discordant <= 1, got delta={delta}, discordant={discordant}")
    q = (discordant + delta) / (2 * discordant)

    def log_binom(k: int, m: int, p: float) -> float:
        if p in (0.0, 1.0):
            return 0.0 if (k == 0 and p == 0.0) or (k == m and p == 1.0) else -math.inf
        return (
            math.lgamma(m + 1)
            - math.lgamma(k + 1)
            - math.lgamma(m - k + 1)
            + k * math.log(p)
            + (m - k) * math.log1p(-p)
        )

    total = 0.0
    for m in range(n + 1):
        p_m = math.exp(log_binom(m, n, discordant))
        if p_m < 1e-15:
            continue
        # rejection region {a <= k} ∪ {a >= m − k}: the largest k with 2·P(Bin(m, ½) <= k) <= alpha
        k, tail = -1, 0
        while k + 1 <= m // 2 and 2 * (tail + math.comb(m, k + 1)) / 2**m <= alpha:
            k += 1
            tail += math.comb(m, k)
        for a in list(range(k + 1)) + list(range(m - k, m + 1)) if k >= 0 else []:
            total += p_m * math.exp(log_binom(a, m, q))
    return total
