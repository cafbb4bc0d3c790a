"""Statistics for accuracy comparisons: Wilson intervals, paired tests, rank correlation, bootstraps over seeds.

Pure functions (Python + NumPy). Two models evaluated on the *same* rows are compared pairwise:
each row gives a pair of outcomes (right/wrong, right/wrong), and only the rows where the models
disagree carry information about which is better. Every test of the project lives here once: the
evaluation engine, the main job and ``retrofit study`` (docs/study.md) all call these.

Functions:
    wilson_interval     Score interval of a binomial proportion (Wilson 1927).
    mcnemar_exact       Exact McNemar test: two-sided binomial test on the discordant pairs.
    paired_bootstrap    Bootstrap of the accuracy difference over rows (seeded), interval and p-value.
    paired_comparison   Both tests plus the 2x2 counts, for JSON.
    sign_flip_exact     Exact sign-flip (randomization) test of paired integer scores.
    paired_vs_draws     One model's outcome vs the mean of several random draws per row (decider vs random).
    spearman            Spearman rank correlation (average ranks for ties).
    seed_row_bootstrap  Mean over seeds of a per-row difference, bootstrapped over seeds and rows (crossed).
    seed_row_bootstrap_stat  The same resampling for any statistic of (seed, rows) (e.g. a Spearman).
    rows_needed, mcnemar_power  Planning (:mod:`retrofit.evaluation.power`, re-exported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import numpy as np

from ..model.depth_cost import _to_numpy
from .power import mcnemar_power, rows_needed

__all__ = [
    "mcnemar_exact",
    "mcnemar_power",
    "paired_bootstrap",
    "paired_comparison",
    "paired_vs_draws",
    "rows_needed",
    "seed_row_bootstrap",
    "seed_row_bootstrap_stat",
    "sign_flip_exact",
    "spearman",
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


def _rank_average(a: np.ndarray) -> np.ndarray:
    """1-based ranks of a 1-D array, ties receiving the average of the ranks they span."""
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    # Sorted distinct values occupy rank blocks [cum - count + 1, cum]; the block mean is
    # cum - (count - 1) / 2.
    cum = np.cumsum(counts)
    avg = cum - (counts - 1) / 2.0
    return avg[inverse.reshape(-1)].astype(np.float64)


def spearman(x: Any, y: Any, nan_policy: str = "omit") -> float:
    """Spearman rank correlation with average ranks for ties.

    The Pearson correlation of the average ranks of ``x`` and ``y`` (same definition as
    ``scipy.stats.spearmanr``). Used for per-token depth vs a difficulty proxy (ANIRA's LANO
    Spearman, the SFT control's token loss), per-example d̄ vs level, and the decile table.

    Args:
        x: values, any shape ``[...]``; flattened.
        y: values with the same number of elements as ``x``; flattened.
        nan_policy: ``"omit"`` (default) drops every pair in which either side is NaN or
            infinite; ``"raise"`` raises ``ValueError`` if any such pair exists.

    Returns:
        rho in [-1, 1] as a float, or ``nan`` when either side is constant over the retained
        pairs (the correlation is undefined then).

    Raises:
        ValueError: if the sizes differ, fewer than 2 (finite) pairs remain, or
            ``nan_policy="raise"`` and a non-finite value is present.
    """
    if nan_policy not in ("omit", "raise"):
        raise ValueError(f"nan_policy must be 'omit' or 'raise', got {nan_policy!r}")
    xa = _to_numpy(x, np.float64).reshape(-1)
    ya = _to_numpy(y, np.float64).reshape(-1)
    if xa.shape != ya.shape:
        raise ValueError(f"spearman: x has {xa.size} values but y has {ya.size}")
    finite = np.isfinite(xa) & np.isfinite(ya)
    if not finite.all():
        if nan_policy == "raise":
            raise ValueError(f"spearman: {int((~finite).sum())} non-finite pair(s) in the input")
        xa, ya = xa[finite], ya[finite]
    if xa.size < 2:
        raise ValueError(f"spearman needs at least 2 finite pairs, got {xa.size}")
    rx, ry = _rank_average(xa), _rank_average(ya)
    rx -= rx.mean()
    ry -= ry.mean()
    denom = math.sqrt(float(np.dot(rx, rx)) * float(np.dot(ry, ry)))
    if denom == 0.0:
        return float("nan")
    return float(np.clip(np.dot(rx, ry) / denom, -1.0, 1.0))


def _resamples(S: int, n: int, n_boot: int, seed: int):
    """The crossed resamples of :func:`seed_row_bootstrap`: per resample, ``S`` seed indices and then ``n`` row
    indices, drawn with replacement in that order from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        yield rng.integers(0, S, size=S), rng.integers(0, n, size=n)


def _check_boot(n_boot: int, confidence: float) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive int, got {n_boot!r}")
    _z(confidence)


def seed_row_bootstrap_stat(
    stat: Callable[[int, np.ndarray], float],
    n_seeds: int,
    n_rows: int,
    n_boot: int = 2_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Crossed bootstrap over seeds and rows of ``mean_s stat(s, rows)`` (docs/study.md).

    Every seed of a study is scored on the *same* rows, so seeds and rows are crossed factors: each
    resample draws ``n_seeds`` seeds with replacement and, independently, ``n_rows`` rows with replacement
    (one row draw shared by every seed: the rows stay paired across seeds), and computes the mean over the
    drawn seeds of ``stat(s, drawn rows)``. The interval is the percentile interval; ``estimate`` is the
    statistic on the original seeds and rows. Resampling both factors lets the interval include the spread
    from one training run to the next (seeds) and from one test sample to the next (rows); with few seeds the
    seed part is coarse (3 seeds give 10 distinct multisets).

    Args:
        stat: ``(seed index, row indices [n]) -> float`` (NaN results are dropped from the interval).
        n_seeds, n_rows: the sizes of the two factors.
        n_boot: resamples; ``seed``: the generator's seed; ``confidence``: the interval level.

    Returns:
        ``{"estimate", "ci": [low, high], "n_seeds", "n_rows", "n_boot", "seed", "resampled": "seeds and rows"}``.
    """
    _check_boot(n_boot, confidence)
    if n_seeds < 1 or n_rows < 1:
        raise ValueError(f"need at least one seed and one row, got {n_seeds} seeds and {n_rows} rows")
    rows = np.arange(n_rows)
    est = float(np.mean([stat(s, rows) for s in range(n_seeds)]))
    boot = np.array([np.mean([stat(int(s), r) for s in ss]) for ss, r in _resamples(n_seeds, n_rows, n_boot, seed)])
    boot = boot[np.isfinite(boot)]
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2]) if boot.size else (float("nan"), float("nan"))
    return {
        "estimate": est,
        "ci": [float(lo), float(hi)],
        "n_seeds": int(n_seeds),
        "n_rows": int(n_rows),
        "n_boot": n_boot,
        "seed": seed,
        "resampled": "seeds and rows",
    }


def seed_row_bootstrap(diff: Any, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """:func:`seed_row_bootstrap_stat` for the mean of a per-row difference, vectorized.

    Args:
        diff: ``[S, n]`` per seed and row, e.g. ``a_r − b_r`` of two models' 0/1 outcomes (or ``a_r`` minus the
            mean of random draws); the same rows in every seed's row.

    Returns:
        :func:`seed_row_bootstrap_stat`'s dict, ``estimate`` = the mean difference over seeds and rows, plus
        ``per_seed`` (each seed's mean difference) and ``signs`` (+1 / 0 / −1 per seed).
    """
    d = np.asarray(diff, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] < 1:
        raise ValueError(f"diff must be [seeds, rows] with at least one of each, got shape {d.shape}")
    _check_boot(n_boot, confidence)
    S, n = d.shape
    boot = np.empty(n_boot)
    for i, (ss, r) in enumerate(_resamples(S, n, n_boot, seed)):
        boot[i] = d[np.ix_(ss, r)].mean()
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    per_seed = d.mean(axis=1)
    return {
        "estimate": float(d.mean()),
        "ci": [float(lo), float(hi)],
        "n_seeds": int(S),
        "n_rows": int(n),
        "n_boot": n_boot,
        "seed": seed,
        "resampled": "seeds and rows",
        "per_seed": [float(x) for x in per_seed],
        "signs": [int(np.sign(x)) for x in per_seed],
    }
