"""Per-token analyses behind ``retrofit eval``: pure functions on arrays (docs/tah2.md, docs/exits.md,
docs/evaluation.md).

Nothing here runs a model. The runner (:mod:`retrofit.evaluation.runner`) does the forwards and
hands the per-token arrays to these functions; keeping them model-free makes every alignment and
every policy checkable on hand-built inputs.

Token ↔ answer-word alignment
    Task answers are whitespace-separated *words* (a BREVO node, a LANO terminal, a number). A
    tokenizer may merge a leading space into a token (``"Ġb"``), split a word into several tokens
    or, rarely, merge two words. :func:`token_word_owner` assigns each token to the word that
    contains the token's *first non-whitespace character* (whitespace-only tokens own no word);
    :func:`first_tokens_of_words` gives each word its first owned token (``-1`` when a token that
    starts in an earlier word swallowed it, so the word has no token of its own and is dropped
    from per-word statistics rather than given a neighbour's depth).

Depth of an answer token (``alignment``)
    ``out.depths[b, t]`` is the exit depth of *position* t, which reads token t and predicts
    token t+1. Two attributions of a depth to answer token j at position p_j exist:

    * ``"input"`` (default): the depth of position ``p_j``, the compute spent while *reading*
      token j (ANIRA's convention: its decider sees the token's own prelude state; the LANO
      proxies count the parser's work when it reads token j).
    * ``"predict"``: the depth of position ``p_j - 1``, the compute spent to *produce* token j.
      This matches generation cost accounting (each emitted token costs the depth of the step
      that emitted it), the teacher-forced losses and the exit policies (which act on the
      next-token distribution of ``p_j - 1``), which therefore always use it.

Training-free exits (docs/exits.md), evaluated teacher-forced from ONE forward in which every
token runs all D depths (``depth=D``, ``output_depth_logits=True``):

    * ``kl``: exit at the first d ≥ 2 with ``KL(p_d ‖ p_{d-1}) < τ`` (Huginn), else D;
    * ``state``: exit at the first d ≥ 2 with ``‖h_d − h_{d-1}‖ / ‖h_{d-1}‖ < τ`` (fixed-point
      halting; ``h_d`` = core output at depth d), else D;
    * ``confidence``: exit at the first d ≥ 1 with ``max_v p_d(v) ≥ τ``, else D (a CALM-style
      baseline that, unlike the two above, can stop at depth 1).

    The prediction of a token that exits at d is ``argmax p_d``. This is the *full-context*
    approximation: earlier tokens ran all D depths, so a token's attention saw their deeper
    keys, which a real early-exit decode would not have (an exited token's deeper keys do not
    exist). The exit rule itself only reads the token's own depths ≤ d, so exits are exact
    given that context.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .metrics import expected_depth, regression_with_control
from .stats import spearman

__all__ = [
    "ALIGNMENTS",
    "BREVO_FEATURES",
    "LANO_PROXIES",
    "POLICIES",
    "answer_positions",
    "brevo_regression",
    "calibrate_threshold",
    "confidence_signals",
    "encode_with_offsets",
    "exit_depths",
    "expected_depth_or_exit",
    "first_tokens_of_words",
    "kl_signals",
    "lano_spearman",
    "policy_correct",
    "state_change_signals",
    "token_word_owner",
    "word_spans",
    "word_values",
]

ALIGNMENTS = ("input", "predict")
#: ANIRA Table 1's proxies (data_prep.lano); ``chart_edges`` is reported next to them as a plain parser-work count.
LANO_PROXIES = ("expansion", "convergence", "additions", "multiplications")
BREVO_FEATURES = ("hub_out_degree", "dfs_depth", "frontier_size", "newly_enabled")

#: policy -> (first depth the signal exists at, rule): "below" = exit when signal < τ (a larger τ
#: exits earlier), "above" = exit when signal ≥ τ (a larger τ exits later).
POLICIES: dict[str, tuple[int, str]] = {
    "kl": (2, "below"),
    "state": (2, "below"),
    "confidence": (1, "above"),
}

_WORD = re.compile(r"\S+")


# ----------------------------------------------------------------------------------------------
# alignment
# ----------------------------------------------------------------------------------------------


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the whitespace-separated words of ``text``."""
    return [(m.start(), m.end()) for m in _WORD.finditer(text)]


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` (no special tokens) and each token's character span.

    A fast tokenizer reports its offsets directly. For a slow tokenizer the text is cut into
    pieces (whitespace + one word) that are tokenized separately and concatenated, so each
    token's piece is known by construction; every token then carries its piece's span.

    Returns:
        ``(ids [m], offsets [m] of (start, end))``.
    """
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for m in re.finditer(r"\s*\S+|\s+$", text):
        piece = tokenizer(m.group(), add_special_tokens=False)["input_ids"]
        ids += list(piece)
        offsets += [(m.start(), m.end())] * len(piece)
    return ids, offsets


def token_word_owner(text: str, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """The word each token belongs to: the word holding the token's first non-space character.

    Args:
        text: the string that was tokenized.
        offsets: ``[m]`` character spans ``(start, end)`` of the tokens.

    Returns:
        ``[m]`` int: word index (into :func:`word_spans`), ``-1`` for a token with no
        non-whitespace character (a separator space, a special token).
    """
    char_word = np.full(len(text) + 1, -1, dtype=np.int64)
    for w, (s, e) in enumerate(word_spans(text)):
        char_word[s:e] = w
    owner = np.full(len(offsets), -1, dtype=np.int64)
    for k, (a, b) in enumerate(offsets):
        for c in range(max(a, 0), min(b, len(text))):
            if char_word[c] >= 0:
                owner[k] = char_word[c]
                break
    return owner


def first_tokens_of_words(text: str, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Index of each word's first token (see the module docstring).

    Returns:
        ``[n_words]`` int, ``-1`` for a word that owns no token (it was merged into a token that
        starts in an earlier word).
    """
    owner = token_word_owner(text, offsets)
    first = np.full(len(word_spans(text)), -1, dtype=np.int64)
    for k in range(len(owner) - 1, -1, -1):  # backwards: the smallest k wins
        if owner[k] >= 0:
            first[owner[k]] = k
    return first


def answer_positions(answer_start: int, n_tokens: int, alignment: str) -> np.ndarray:
    """Sequence positions whose depth is attributed to answer tokens ``0 … n_tokens-1``.

    Args:
        answer_start: position of the first answer token in the (padded) sequence.
        n_tokens: number of answer tokens.
        alignment: ``"predict"`` (position before each token) or ``"input"`` (the token's own).

    Returns:
        ``[n_tokens]`` int positions.
    """
    if alignment not in ALIGNMENTS:
        raise ValueError(f"unknown alignment {alignment!r}; allowed: {', '.join(ALIGNMENTS)}")
    shift = -1 if alignment == "predict" else 0
    if answer_start + shift < 0:
        raise ValueError("alignment 'predict' needs at least one prompt token before the answer")
    return np.arange(n_tokens, dtype=np.int64) + answer_start + shift


def expected_depth_or_exit(depth_probs: Any, depths: Any) -> np.ndarray:
    """Per-token expected depth ``E[d] = Σ_d d·q(d)`` (ANIRA's E_q[d]); the exit depth where a
    method has no distribution (``depth_probs`` None).

    Args:
        depth_probs: ``[..., D]`` or None.
        depths: ``[...]`` exit depths.

    Returns:
        ``[...]`` float64.
    """
    if depth_probs is None:
        return _np(depths).astype(np.float64)
    return np.asarray(expected_depth(_np(depth_probs).astype(np.float64)), dtype=np.float64)


def word_values(token_values: Any, first_tokens: Sequence[int]) -> np.ndarray:
    """Per-word values from per-token values via each word's first token (NaN where -1).

    Args:
        token_values: ``[m]`` per answer token.
        first_tokens: ``[n_words]`` from :func:`first_tokens_of_words`.

    Returns:
        ``[n_words]`` float64.
    """
    v = np.asarray(token_values, dtype=np.float64).reshape(-1)
    idx = np.asarray(first_tokens, dtype=np.int64).reshape(-1)
    out = np.full(idx.shape, np.nan)
    ok = idx >= 0
    out[ok] = v[idx[ok]]
    return out


# ----------------------------------------------------------------------------------------------
# training-free exit signals and policies (docs/exits.md)
# ----------------------------------------------------------------------------------------------


def kl_signals(depth_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_d ‖ p_{d-1})`` between successive depths' next-token distributions.

    Args:
        depth_logits: ``[D, N, V]`` per-depth logits of N tokens.

    Returns:
        ``[N, D-1]`` float32; column ``j`` is depth ``d = j + 2``.
    """
    logp = depth_logits.float().log_softmax(-1)  # [D, N, V]
    kl = (logp[1:].exp() * (logp[1:] - logp[:-1])).sum(-1)  # [D-1, N]
    return kl.clamp_min(0.0).transpose(0, 1).contiguous()


def state_change_signals(states: torch.Tensor) -> torch.Tensor:
    """Relative state change ``‖h_d − h_{d-1}‖ / ‖h_{d-1}‖``.

    Args:
        states: ``[D, N, H]`` core outputs of N tokens at depths 1 … D.

    Returns:
        ``[N, D-1]`` float32; column ``j`` is depth ``d = j + 2``.
    """
    s = states.float()
    num = (s[1:] - s[:-1]).norm(dim=-1)
    den = s[:-1].norm(dim=-1).clamp_min(1e-12)
    return (num / den).transpose(0, 1).contiguous()


def confidence_signals(depth_logits: torch.Tensor) -> torch.Tensor:
    """Top next-token probability at each depth: ``[D, N, V]`` -> ``[N, D]`` (column j = depth j+1)."""
    return depth_logits.float().softmax(-1).amax(-1).transpose(0, 1).contiguous()


def exit_depths(signal: Any, threshold: float, first_depth: int, rule: str = "below") -> np.ndarray:
    """Exit depth of each token under a threshold rule.

    Args:
        signal: ``[N, K]``; column ``j`` is the signal at depth ``first_depth + j``; the last
            column is depth ``D = first_depth + K - 1``.
        threshold: τ.
        first_depth: depth of column 0 (2 for KL / state change, 1 for confidence).
        rule: ``"below"`` exits at the first column with ``signal < τ``; ``"above"`` at the first
            with ``signal ≥ τ``. No hit: depth D.

    Returns:
        ``[N]`` int64 exit depths in ``first_depth … D``.
    """
    s = _np(signal)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"signal must be [N, K] with K >= 1, got shape {s.shape}")
    if rule == "below":
        hit = s < threshold
    elif rule == "above":
        hit = s >= threshold
    else:
        raise ValueError(f"rule must be 'below' or 'above', got {rule!r}")
    K = s.shape[1]
    idx = np.where(hit.any(1), hit.argmax(1), K - 1)
    return (idx + first_depth).astype(np.int64)


def calibrate_threshold(
    signal: Any, first_depth: int, target_mean_depth: float, rule: str = "below"
) -> tuple[float, float]:
    """The threshold whose mean exit depth is closest to ``target_mean_depth`` (equal compute).

    The mean exit depth is a step function of τ that only changes where τ crosses a signal
    value, and it is monotone (non-increasing in τ for ``"below"``, non-decreasing for
    ``"above"``), so a binary search over the sorted candidate thresholds is exact. When no
    threshold hits the target (a KL or state rule cannot stop before depth 2), the closest
    achievable one is returned; compare the returned mean with the target.

    Args:
        signal: ``[N, K]`` as for :func:`exit_depths` (N ≥ 1).
        first_depth: depth of column 0.
        target_mean_depth: the mean depth to match (e.g. the learned decider's d̄).
        rule: ``"below"`` or ``"above"``.

    Returns:
        ``(threshold, achieved mean depth)``; ties go to the smaller |difference|, then to the
        cheaper (shallower) threshold.
    """
    s = _np(signal)
    if s.size == 0:
        raise ValueError("calibrate_threshold needs at least one token")
    values = np.unique(s[np.isfinite(s)])
    if rule == "below":
        # "s < τ" flips just above each value; -inf = never exit early.
        cands = np.concatenate([[-np.inf], np.nextafter(values, np.inf)])
    elif rule == "above":
        # "s >= τ" holds up to each value; +inf = never exit early.
        cands = np.concatenate([values, [np.inf]])
    else:
        raise ValueError(f"rule must be 'below' or 'above', got {rule!r}")

    def mean(i: int) -> float:
        return float(exit_depths(s, float(cands[i]), first_depth, rule).mean())

    # Orient so that mean(i) is non-increasing in i.
    order = np.arange(len(cands)) if rule == "below" else np.arange(len(cands))[::-1]
    lo, hi = 0, len(order) - 1
    # first index whose mean <= target (or len if none)
    first = len(order)
    while lo <= hi:
        mid = (lo + hi) // 2
        if mean(int(order[mid])) <= target_mean_depth:
            first, hi = mid, mid - 1
        else:
            lo = mid + 1
    best = None
    for j in (first - 1, first):
        if 0 <= j < len(order):
            m = mean(int(order[j]))
            key = (abs(m - target_mean_depth), m)
            if best is None or key < best[0]:
                best = (key, float(cands[int(order[j])]), m)
    assert best is not None
    return best[1], best[2]


def policy_correct(per_depth_correct: Any, depths: Any) -> np.ndarray:
    """Correctness of each token's prediction at its exit depth.

    Args:
        per_depth_correct: ``[N, D]`` bool, argmax of depth d's distribution == gold token.
        depths: ``[N]`` exit depths (1-based).

    Returns:
        ``[N]`` bool.
    """
    c = _np(per_depth_correct).astype(bool)
    d = _np(depths).astype(np.int64)
    if c.ndim != 2 or d.shape != (c.shape[0],):
        raise ValueError(f"need per_depth_correct [N, D] and depths [N], got {c.shape} and {d.shape}")
    if d.size and (d.min() < 1 or d.max() > c.shape[1]):
        raise ValueError(f"depths must lie in 1..{c.shape[1]}")
    return c[np.arange(len(d)), d - 1]


# ----------------------------------------------------------------------------------------------
# LANO and BREVO (ANIRA Table 1 / Table 2)
# ----------------------------------------------------------------------------------------------


def _pool(word_depths: Sequence[Any], features: Sequence[Sequence[Mapping[str, Any]]], names):
    ys, xs, ex = [], [], []
    for i, (dep, feats) in enumerate(zip(word_depths, features, strict=True)):
        dep = np.asarray(dep, dtype=np.float64).reshape(-1)
        if len(feats) != len(dep):
            raise ValueError(
                f"example {i}: {len(feats)} feature dicts for {len(dep)} answer words; "
                "features must be one dict per whitespace-separated answer word"
            )
        for w, f in enumerate(feats):
            if math.isfinite(dep[w]):
                ys.append(dep[w])
                xs.append([float(f[k]) for k in names])
                ex.append(i)
    return np.asarray(ys), np.asarray(xs, dtype=np.float64).reshape(len(ys), len(names)), np.asarray(ex)


def lano_spearman(
    word_depths: Sequence[Any], features: Sequence[Sequence[Mapping[str, Any]]], proxies=LANO_PROXIES
) -> dict[str, dict[str, Any]]:
    """Spearman ρ of per-terminal depth with each LANO parser proxy, pooled over strings.

    Args:
        word_depths: per example, ``[n_words]`` depth (expected depth E[d] in the runner) of
            each terminal; NaN = unaligned (dropped).
        features: per example, one dict per terminal with the proxies (``data_prep.lano``).
        proxies: proxy names.

    Returns:
        ``{proxy: {"rho": float (nan when a side is constant), "n": int}}``; a proxy with fewer
        than 2 tokens gets ``rho`` nan.
    """
    y, X, _ = _pool(word_depths, features, proxies)
    out = {}
    for j, name in enumerate(proxies):
        rho = spearman(y, X[:, j]) if len(y) >= 2 else float("nan")
        out[name] = {"rho": rho, "n": len(y)}
    return out


def brevo_regression(
    word_depths: Sequence[Any],
    features: Sequence[Sequence[Mapping[str, Any]]],
    groups: Sequence[Any],
    feature_names=BREVO_FEATURES,
) -> dict[str, Any]:
    """OLS of per-node depth on the BREVO features with node count N as fixed effects.

    Args:
        word_depths: per example, ``[n_words]`` depth of each answer node (NaN = unaligned).
        features: per example, one feature dict per answer node (``data_prep.brevo``).
        groups: per example, the control (N).
        feature_names: regressors.

    Returns:
        :func:`~retrofit.evaluation.metrics.regression_with_control`'s dict.

    Raises:
        ValueError: too few tokens for the number of parameters.
    """
    y, X, ex = _pool(word_depths, features, feature_names)
    g = [groups[i] for i in ex]
    return regression_with_control(X, y, list(feature_names), g)


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)
