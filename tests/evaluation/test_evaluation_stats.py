"""Statistics of retrofit.evaluation.stats and the per-token difficulty analysis, each against a
brute-force computation written out independently here."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from statistics import NormalDist

import numpy as np
import pytest
import scipy.stats

from retrofit.evaluation import stats as S
from retrofit.evaluation.token_difficulty import depth_vs_token_difficulty

# ----------------------------------------------------------------------------------------------
# Wilson interval
# ----------------------------------------------------------------------------------------------


def _wilson_by_quadratic(k: int, n: int, conf: float) -> tuple[float, float]:
    """The Wilson bounds are the p solving (k/n − p)² = z²·p(1−p)/n, a quadratic a·p² + b·p + c = 0."""
    z = NormalDist().inv_cdf(0.5 + conf / 2)
    ph = k / n
    a = 1 + z * z / n
    b = -(2 * ph + z * z / n)
    c = ph * ph
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (9, 10), (10, 10), (37, 120), (0, 1), (250, 300)])
@pytest.mark.parametrize("conf", [0.9, 0.95, 0.99])
def test_wilson_matches_the_quadratic(k, n, conf):
    lo, hi = S.wilson_interval(k, n, conf)
    rlo, rhi = _wilson_by_quadratic(k, n, conf)
    assert lo == pytest.approx(rlo, abs=1e-12) and hi == pytest.approx(rhi, abs=1e-12)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_known_value_and_errors():
    # a textbook value: 8 of 10, 95% -> [0.490, 0.943] (Newcombe 1998, method 3)
    lo, hi = S.wilson_interval(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)
    assert all(math.isnan(x) for x in S.wilson_interval(0, 0))
    with pytest.raises(ValueError, match="0 <= k <= n"):
        S.wilson_interval(5, 3)


# ----------------------------------------------------------------------------------------------
# McNemar
# ----------------------------------------------------------------------------------------------


def _mcnemar_by_enumeration(b: int, c: int) -> Fraction:
    """Every way the n discordant rows could have split under H0 (each 1/2): the share at least as
    unbalanced as the observed split."""
    n = b + c
    observed = abs(b - Fraction(n, 2))
    extreme = sum(1 for signs in itertools.product((0, 1), repeat=n) if abs(sum(signs) - Fraction(n, 2)) >= observed)
    return Fraction(extreme, 2**n)


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (3, 3), (1, 7), (7, 1), (0, 9), (4, 8), (2, 11)])
def test_mcnemar_exact_matches_enumeration(b, c):
    assert S.mcnemar_exact(b, c) == pytest.approx(float(_mcnemar_by_enumeration(b, c)), abs=1e-15)


def test_mcnemar_large_counts_with_comb():
    # n = 200: the binomial tail written with math.comb and exact fractions
    b, c = 85, 115
    tail = sum(Fraction(math.comb(200, i), 2**200) for i in range(b + 1))
    assert S.mcnemar_exact(b, c) == pytest.approx(float(2 * tail), rel=1e-12)
    assert S.mcnemar_exact(c, b) == S.mcnemar_exact(b, c)


# ----------------------------------------------------------------------------------------------
# paired bootstrap
# ----------------------------------------------------------------------------------------------


def _bootstrap_slow(a, b, n_boot, seed, conf):
    rng = np.random.default_rng(seed)
    n = len(a)
    diffs = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, size=n)
        diffs.append(sum(int(a[i]) - int(b[i]) for i in idx) / n)
    observed = (sum(map(int, a)) - sum(map(int, b))) / n
    extreme = sum(1 for d in diffs if abs(d - observed) >= abs(observed) - 1e-12)
    lo, hi = np.quantile(diffs, [(1 - conf) / 2, 1 - (1 - conf) / 2])
    return observed, lo, hi, (1 + extreme) / (n_boot + 1)


@pytest.mark.parametrize("n,n_boot", [(7, 500), (40, 3000), (300, 200)])
def test_paired_bootstrap_matches_a_slow_loop(n, n_boot):
    rng = np.random.default_rng(n)
    a = rng.random(n) < 0.6
    b = rng.random(n) < 0.45
    got = S.paired_bootstrap(a, b, n_boot=n_boot, seed=3, confidence=0.9)
    diff, lo, hi, p = _bootstrap_slow(a, b, n_boot, 3, 0.9)
    assert got["difference"] == pytest.approx(diff, abs=1e-12)
    assert got["ci"] == pytest.approx([lo, hi], abs=1e-12)
    assert got["p_value"] == pytest.approx(p, abs=1e-12)


def test_paired_bootstrap_detects_a_clear_difference_and_not_none():
    a = np.array([True] * 60 + [False] * 40)
    assert S.paired_bootstrap(a, ~a & False)["p_value"] < 0.01  # 60% vs 0%
    same = S.paired_bootstrap(a, a)
    assert same["difference"] == 0.0 and same["p_value"] == 1.0
    with pytest.raises(ValueError, match="rows"):
        S.paired_bootstrap(a, a[:5])


def test_paired_comparison_counts():
    a = np.array([1, 1, 0, 0, 1, 1], dtype=bool)
    b = np.array([1, 0, 1, 0, 0, 0], dtype=bool)
    c = S.paired_comparison(a, b, n_boot=100)
    assert (c["both_right"], c["a_only"], c["b_only"], c["both_wrong"]) == (1, 3, 1, 1)
    assert c["difference"] == pytest.approx(4 / 6 - 2 / 6)
    assert c["mcnemar_p"] == S.mcnemar_exact(3, 1) == pytest.approx(0.625)


# ----------------------------------------------------------------------------------------------
# rows needed
# ----------------------------------------------------------------------------------------------


def _power_by_enumeration(n, delta, psi, alpha):
    """Every (discordant count m, A-favouring count a) with its probability; sum where the exact test rejects."""
    q = (psi + delta) / (2 * psi)
    total = 0.0
    for m in range(n + 1):
        pm = math.comb(n, m) * psi**m * (1 - psi) ** (n - m)
        for a in range(m + 1):
            if S.mcnemar_exact(a, m - a) <= alpha:
                total += pm * math.comb(m, a) * q**a * (1 - q) ** (m - a)
    return total


def test_mcnemar_power_matches_enumeration():
    for n, delta, psi in [(20, 0.2, 0.4), (35, 0.1, 0.3), (12, 0.3, 0.5)]:
        assert S.mcnemar_power(n, delta, psi) == pytest.approx(_power_by_enumeration(n, delta, psi, 0.05), abs=1e-12)


def test_rows_needed_gives_about_the_target_power():
    n = S.rows_needed(0.10)  # default: independent errors at 50% accuracy
    psi = 0.45 * 0.45 + 0.55 * 0.55
    assert n == math.ceil(
        ((1.959963984540054 * math.sqrt(psi) + 0.8416212335729143 * math.sqrt(psi - 0.01)) / 0.1) ** 2
    )
    assert 380 <= n <= 400
    assert 0.75 <= S.mcnemar_power(n, 0.10, psi) <= 0.85  # the exact test is slightly conservative
    assert S.mcnemar_power(n // 2, 0.10, psi) < 0.55
    n_corr = S.rows_needed(0.10, discordant=0.2)
    assert n_corr < n and 0.72 <= S.mcnemar_power(n_corr, 0.10, 0.2) <= 0.85
    with pytest.raises(ValueError, match="discordant share"):
        S.rows_needed(0.3, discordant=0.2)


# ----------------------------------------------------------------------------------------------
# per-token depth vs difficulty
# ----------------------------------------------------------------------------------------------


def test_depth_vs_token_difficulty_hand_built():
    # six tokens; reference losses and looped exit depths (D = 3)
    losses = [0.1, 2.0, 0.3, 1.5, 0.05, 3.0]
    depths = [1, 3, 1, 2, 2, 3]
    out = depth_vs_token_difficulty(depths, losses, max_depth=3)
    # median of the losses = (0.3 + 1.5) / 2 = 0.9: easy = {0.1, 0.3, 0.05} (depths 1, 1, 2),
    # hard = {2.0, 1.5, 3.0} (depths 3, 2, 3)
    assert out["median_loss"] == pytest.approx(0.9)
    assert out["easy"] == {
        "n": 3,
        "mean_depth": pytest.approx(4 / 3),
        "depth_counts": [2, 1, 0],
        "depth_share": pytest.approx([2 / 3, 1 / 3, 0.0]),
    }
    assert out["hard"]["depth_counts"] == [0, 1, 2] and out["hard"]["mean_depth"] == pytest.approx(8 / 3)
    # Spearman by hand: loss ranks 2,5,3,4,1,6; depth ranks (ties averaged) 1.5,5.5,1.5,3.5,3.5,5.5
    rx = np.array([2, 5, 3, 4, 1, 6], dtype=float)
    ry = np.array([1.5, 5.5, 1.5, 3.5, 3.5, 5.5])
    rho = np.corrcoef(rx, ry)[0, 1]
    assert out["spearman"] == pytest.approx(rho) and out["n_tokens"] == 6
    assert out["spearman"] == pytest.approx(scipy.stats.spearmanr(depths, losses).statistic)
    # a constant depth has no rank correlation; NaN losses are dropped
    flat = depth_vs_token_difficulty([2, 2, 2], [0.1, float("nan"), 0.2], max_depth=2)
    assert math.isnan(flat["spearman"]) and flat["n_tokens"] == 2
    with pytest.raises(ValueError, match="1..3"):
        depth_vs_token_difficulty([4], [0.1], max_depth=3)


# ----------------------------------------------------------------------------------------------
# the study's bootstrap over seeds and rows (docs/study.md)
# ----------------------------------------------------------------------------------------------


def _seed_row_brute(diff, n_boot, seed, confidence):
    """One resample at a time, by loops: S seed draws, then n row draws, from one generator; the mean over the
    drawn seeds of the mean over the drawn rows."""
    S, n = len(diff), len(diff[0])
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        seeds = rng.integers(0, S, size=S)
        rows = rng.integers(0, n, size=n)
        boots.append(sum(sum(diff[s][r] for r in rows) / n for s in seeds) / S)
    a = 1 - confidence
    return list(np.quantile(boots, [a / 2, 1 - a / 2]))


@pytest.mark.parametrize("k,n", [(1, 7), (3, 5), (4, 11)])
def test_seed_row_bootstrap_matches_loops_and_the_generic_form(k, n):
    rng = np.random.default_rng(k * 100 + n)
    diff = rng.integers(-1, 2, size=(k, n)).astype(float)
    got = S.seed_row_bootstrap(diff, n_boot=300, seed=4, confidence=0.9)
    assert got["estimate"] == pytest.approx(diff.mean())
    assert got["ci"] == pytest.approx(_seed_row_brute(diff.tolist(), 300, 4, 0.9), abs=1e-12)
    assert got["per_seed"] == pytest.approx(diff.mean(1).tolist())
    assert got["signs"] == [int(np.sign(x)) for x in diff.mean(1)]
    assert got["n_seeds"] == k and got["n_rows"] == n and got["resampled"] == "seeds and rows"
    generic = S.seed_row_bootstrap_stat(lambda s, r: float(diff[s, r].mean()), k, n, n_boot=300, seed=4, confidence=0.9)
    assert generic["ci"] == pytest.approx(got["ci"], abs=1e-12)
    assert generic["estimate"] == pytest.approx(got["estimate"])


def test_seed_row_bootstrap_sees_the_seed_spread():
    """Rows agree within each seed but the seeds disagree: resampling seeds widens the interval beyond the rows'."""
    one_sign = np.tile([[1.0] * 6 + [0.0] * 4], (3, 1))  # +0.6 in every seed
    split = np.array([[1.0] * 10, [0.0] * 10, [-1.0] * 10])  # +1, 0, −1: the mean is 0, the seeds disagree
    a = S.seed_row_bootstrap(one_sign, n_boot=2000, seed=0)
    b = S.seed_row_bootstrap(split, n_boot=2000, seed=0)
    assert a["ci"][0] > 0 and b["estimate"] == 0.0 and b["ci"][0] <= -0.3 and b["ci"][1] >= 0.3
    assert b["signs"] == [1, 0, -1]
    with pytest.raises(ValueError, match="seeds, rows"):
        S.seed_row_bootstrap(np.zeros(4))
    with pytest.raises(ValueError, match="n_boot"):
        S.seed_row_bootstrap(split, n_boot=0)


def test_one_spearman_lives_in_stats():
    from retrofit.evaluation import metrics

    assert metrics.spearman is S.spearman
    x, y = [1, 2, 2, 5, 3], [0.1, 0.4, 0.2, 0.9, 0.5]
    assert S.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic)
