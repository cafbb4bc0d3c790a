"""Statistics for accuracy comparisons: Wilson intervals, paired tests, rows needed.

Pure functions (Python + NumPy). Two models evaluated on the *same* rows are compared pairwise:
each row gives a pair of outcomes (right/wrong, right/wrong), and only the rows where the models
disagree carry information about which is better.

Functions:
    wilson_interval     Score interval of a binomial proportion (Wilson 1927).
    mcnemar_exact       Exact McNemar test: two-sided binomial test on the discordant pairs.
    paired_bootstrap    Bootstrap of the accuracy difference over rows (seeded), interval and p-value.
    paired_comparison   Both tests plus the 2x2 counts, for JSON.
    sign_flip_exact     Exact sign-flip (randomization) test of paired integer scores.
    paired_vs_draws     One model's outcome vs the mean of several random draws per row (decider vs random).
    rows_needed         Rows per level to detect a given accuracy difference (assumptions stated there).
    mcnemar_power       Exact power of the exact McNemar test (enumeration), to check ``rows_needed``.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = [
    "mcnemar_exact",
    "mcnemar_power",
    "paired_bootstrap",
    "paired_comparison",
    "paired_vs_draws",
    "rows_needed",
    "sign_flip_exact",
    "wilson_interval",
]


def _z(confidence: float) -> float:
    """Two-sided standard-normal quantile: ``P(|Z| <= z) = confidence``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n``.

    The set of p for which the score test ``|k/n − p| <= z·sqrt(p(1−p)/n)`` does not reject;
    unlike the normal ("Wald") interval it stays inside [0, 1] and is not degenerate at 0 or n
    successes, which matters at the small per-level counts of an evaluation.

    Args:
        k: successes (correct rows).
        n: trials (rows); 0 gives ``(nan, nan)``.
        confidence: e.g. 0.95.

    Returns:
        ``(low, high)``.
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return float("nan"), float("nan")
    z = _z(confidence)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k = 0 (k = n) the bound is exactly 0 (1); say so rather than leave a rounding residue
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Exact McNemar p-value (two-sided).

    Under H0 (both models equally accurate on these rows) each of the ``a_only + b_only``
    discordant rows is equally likely to favour either model, so ``a_only ~ Binomial(n, 1/2)``;
    the p-value is ``min(1, 2 · P(X <= min(a_only, b_only)))``.

    Args:
        a_only: rows model A gets right and B wrong.
        b_only: rows B gets right and A wrong.

    Returns:
        p in (0, 1]; 1.0 when there is no discordant row.
    """
    if a_only < 0 or b_only < 0:
        raise ValueError(f"counts must be >= 0, got {a_only}, {b_only}")
    n = a_only + b_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1))
    return min(1.0, 2 * tail / 2**n)


def _as_bool(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x).reshape(-1)
    if a.dtype != bool and not np.isin(a, (0, 1)).all():
        raise ValueError(f"{name} must hold booleans (or 0/1), got values {np.unique(a)[:5]}")
    return a.astype(bool)


def paired_bootstrap(
    a_correct: Any, b_correct: Any, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """Paired bootstrap of the accuracy difference ``acc(A) − acc(B)`` on the same rows.

    Rows are resampled with replacement (the pair of outcomes of a row stays together), ``n_boot``
    times, from ``numpy.random.default_rng(seed)`` (one ``integers(0, n, size=n)`` draw per
    resample, in order). The interval is the percentile interval; the p-value tests H0 "no
    difference" with the null-centred bootstrap distribution, ``(1 + #{|d* − d̂| >= |d̂|}) /
    (n_boot + 1)`` (Davison & Hinkley 1997, §4.4; the +1 keeps it from being 0).

    Args:
        a_correct, b_correct: ``[n]`` per-row correctness of the two models, same row order.
        n_boot: resamples.
        seed: seed of the generator.
        confidence: interval level.

    Returns:
        ``{"difference", "ci": [low, high], "p_value", "n_boot", "seed"}`` (nan with no row).
    """
    a, b = _as_bool(a_correct, "a_correct"), _as_bool(b_correct, "b_correct")
    if a.shape != b.shape:
        raise ValueError(f"a_correct has {a.size} rows but b_correct has {b.size}")
    return _bootstrap_mean(a.astype(np.float64) - b.astype(np.float64), n_boot, seed, confidence)


def _bootstrap_mean(d: np.ndarray, n_boot: int, seed: int, confidence: float) -> dict[str, Any]:
    """Percentile bootstrap of the mean of per-row differences ``d`` ``[n]`` (see :func:`paired_bootstrap`)."""
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive int, got {n_boot!r}")
    n = d.size
    if n == 0:
        nan = float("nan")
        return {"difference": nan, "ci": [nan, nan], "p_value": nan, "n_boot": n_boot, "seed": seed}
    diff = float(d.mean())
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    chunk = max(1, 2_000_000 // n)  # bound the [chunk, n] index matrix
    for s in range(0, n_boot, chunk):
        k = min(chunk, n_boot - s)
        idx = rng.integers(0, n, size=(k, n))
        boot[s : s + k] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    # exact ties with |d̂| count as "at least as extreme"; the tolerance absorbs float rounding of means
    extreme = int((np.abs(boot - diff) >= abs(diff) - 1e-12).sum())
    return {
        "difference": diff,
        "ci": [float(lo), float(hi)],
        "p_value": (1 + extreme) / (n_boot + 1),
        "n_boot": n_boot,
        "seed": seed,
    }


def paired_comparison(
    a_correct: Any, b_correct: Any, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """Paired comparison of two models on the same rows: counts, McNemar and the bootstrap.

    Returns:
        ``{"n", "accuracy_a", "accuracy_b", "difference" (a − b), "both_right", "a_only",
        "b_only", "both_wrong", "mcnemar_p", "bootstrap": paired_bootstrap(...)}``.
    """
    a, b = _as_bool(a_correct, "a_correct"), _as_bool(b_correct, "b_correct")
    if a.shape != b.shape:
        raise ValueError(f"a_correct has {a.size} rows but b_correct has {b.size}")
    n = int(a.size)
    a_only, b_only = int((a & ~b).sum()), int((~a & b).sum())
    nan = float("nan")
    return {
        "n": n,
        "accuracy_a": float(a.mean()) if n else nan,
        "accuracy_b": float(b.mean()) if n else nan,
        "difference": float(a.mean() - b.mean()) if n else nan,
        "both_right": int((a & b).sum()),
        "a_only": a_only,
        "b_only": b_only,
        "both_wrong": int((~a & ~b).sum()),
        "mcnemar_p": mcnemar_exact(a_only, b_only),
        "bootstrap": paired_bootstrap(a, b, n_boot=n_boot, seed=seed, confidence=confidence),
    }


def sign_flip_exact(scores: Any) -> float:
    """Exact two-sided sign-flip (randomization) test of paired integer scores.

    Under H0 the two members of each pair are exchangeable, so each row's score ``e_r`` is as likely
    to have been ``−e_r``: the p-value is ``P(|Σ ε_r e_r| >= |Σ e_r|)`` over all ``2^n`` sign vectors
    ``ε`` with equal weight. Integer scores make the null distribution of the sum a convolution of
    two-point distributions on a grid of ``2·Σ|e_r| + 1`` values, computed exactly (up to float
    rounding of the probabilities) in ``O(n · Σ|e_r|)`` — no Monte-Carlo error, whatever ``n``. With
    scores in {−1, 0, 1} (a single pair of 0/1 outcomes per row) it equals :func:`mcnemar_exact`.

    Args:
        scores: ``[n]`` integers (e.g. ``k·a_r − Σ_j b_rj`` for one outcome against ``k`` draws).

    Returns:
        p in (0, 1]; 1.0 when every score is 0.
    """
    e = np.asarray(scores).reshape(-1)
    if e.size and not np.all(np.equal(np.mod(e, 1), 0)):
        raise ValueError("sign_flip_exact needs integer scores")
    e = np.abs(e.astype(np.int64))
    e = e[e != 0]
    observed = abs(int(np.asarray(scores).astype(np.int64).sum()))
    if e.size == 0:
        return 1.0
    total = int(e.sum())
    prob = np.zeros(2 * total + 1)  # prob[s + total] = P(Σ = s) over the signs drawn so far
    prob[total] = 1.0
    for v in e.tolist():
        nxt = np.zeros_like(prob)
        nxt[v:] += 0.5 * prob[:-v]
        nxt[:-v] += 0.5 * prob[v:]
        prob = nxt
    sums = np.arange(-total, total + 1)
    return float(min(1.0, prob[np.abs(sums) >= observed].sum()))


def paired_vs_draws(
    a_correct: Any, b_draws: Any, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """One deterministic model (A) against a randomized one (B) drawn ``k`` times, on the same rows.

    The decider-vs-random-allocation test of the accuracy–compute frontier: per row ``r``, ``a_r`` in
    {0, 1} is A's outcome and ``b_r`` = the mean of B's outcomes over the ``k`` draws (in [0, 1]); the
    per-row difference ``d_r = a_r − b_r`` averages out B's own randomness before the rows are compared.

    * ``difference`` = mean of ``d_r`` = acc(A) − mean over draws of acc(B);
    * ``bootstrap``: the paired bootstrap of the mean of ``d_r`` over rows (:func:`paired_bootstrap`'s
      resampling, interval and p-value, on the real-valued ``d_r``);
    * ``sign_flip_p``: exact sign-flip p-value of ``Σ d_r`` (:func:`sign_flip_exact` on ``k·d_r``,
      integers): H0 = on every row, A's allocation and a random one are exchangeable;
    * ``per_draw``: A against each single draw, with its exact McNemar p (:func:`mcnemar_exact`).

    Args:
        a_correct: ``[n]`` A's per-row correctness.
        b_draws: ``[k, n]`` B's per-row correctness, one row per draw (``[n]`` = one draw).
        n_boot, seed, confidence: as in :func:`paired_bootstrap`.

    Returns:
        ``{"n", "draws", "accuracy_a", "accuracy_b", "difference", "bootstrap", "sign_flip_p", "per_draw":
        [{"accuracy_b", "a_only", "b_only", "mcnemar_p"}, ...]}``.
    """
    a = _as_bool(a_correct, "a_correct")
    b = np.asarray(b_draws)
    b = b.reshape(1, -1) if b.ndim == 1 else b
    if b.ndim != 2 or b.shape[1] != a.size or b.shape[0] < 1:
        raise ValueError(f"b_draws must be [k, {a.size}] (k >= 1 draws of the same rows), got shape {b.shape}")
    b = np.stack([_as_bool(x, "b_draws") for x in b])
    k, n = b.shape
    scores = k * a.astype(np.int64) - b.sum(0).astype(np.int64)  # k · d_r, integers
    nan = float("nan")
    per_draw = []
    for x in b:
        a_only, b_only = int((a & ~x).sum()), int((~a & x).sum())
        per_draw.append(
            {
                "accuracy_b": float(x.mean()) if n else nan,
                "a_only": a_only,
                "b_only": b_only,
                "mcnemar_p": mcnemar_exact(a_only, b_only),
            }
        )
    return {
        "n": int(n),
        "draws": int(k),
        "accuracy_a": float(a.mean()) if n else nan,
        "accuracy_b": float(b.mean()) if n else nan,
        "difference": float(scores.mean() / k) if n else nan,
        "bootstrap": _bootstrap_mean(scores.astype(np.float64) / k, n_boot, seed, confidence),
        "sign_flip_p": sign_flip_exact(scores),
        "per_draw": per_draw,
    }


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
