"""Independent references for the halting methods' losses and outputs, written out with Python loops
and plain formulas: they share no code with ``retrofit.model.halting`` (which they check). The brute-force
references of the looped forward itself are in ``bruteforce.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def brute_force_labels(nll, mask, rho):
    """Python loops over tokens and depths: the rule as written in docs/tah2.md."""
    B, T, D = nll.shape
    nll = nll.double().tolist()
    deltas = {}
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            for d in range(D - 1):
                a, c = nll[b][t][d], nll[b][t][d + 1]
                if math.isfinite(a) and math.isfinite(c):
                    deltas[(b, t, d)] = a - c
    gains = sorted((g for g in deltas.values() if g > 0), reverse=True)
    if gains:
        total, acc, kappa = sum(gains), 0.0, None
        for g in gains:
            acc += g
            kappa = g
            if acc >= rho * total:
                break
    else:
        kappa = 0.0
    labels, weights = {}, {}
    for b in range(B):
        for t in range(T):
            stopped = False
            for d in range(D - 1):
                if (b, t, d) not in deltas:
                    continue
                g = deltas[(b, t, d)]
                y = 0 if stopped else int(g >= kappa and g > 0)
                stopped = stopped or y == 0
                labels[(b, t, d)] = y
                weights[(b, t, d)] = abs(g - kappa)
    return kappa, labels, weights


def _cutoff(gains, rho):
    """The ρ rule over a list of gains, by hand: the smallest kept positive gain (0 when none is positive)."""
    pos = sorted((g for g in gains if g > 0), reverse=True)
    total, acc = sum(pos), 0.0
    for g in pos:
        acc += g
        if acc >= rho * total:
            return g
    return 0.0


def brute_force_labels_per_boundary(nll, mask, rho):
    """The release's per-boundary rule (docs/tah2.md, "lookahead labels") with Python loops: boundary d's
    candidates are the tokens that continued at every boundary before and made decision d; κ_d is the ρ rule
    over their gains; a candidate continues iff δ ≥ κ_d (and δ > 0), weight |δ - κ_d|; a decision that was no
    candidate is "stop" with weight None (the loss gives it cost_min).

    Returns:
        ``(kappas [D - 1], labels {(b, t, d): y}, weights {(b, t, d): w or None})``.
    """
    B, T, D = nll.shape
    nll = nll.double().tolist()
    decided = {}
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                for d in range(D - 1):
                    a, c = nll[b][t][d], nll[b][t][d + 1]
                    if math.isfinite(a) and math.isfinite(c):
                        decided[(b, t, d)] = a - c
    going = {(b, t) for b in range(B) for t in range(T) if mask[b][t]}
    kappas, labels, weights = [], {}, {}
    for d in range(D - 1):
        cands = {(b, t) for (b, t) in going if (b, t, d) in decided}
        kappa = _cutoff([decided[(b, t, d)] for b, t in cands], rho)
        kappas.append(kappa)
        for (b, t, dd), g in decided.items():
            if dd != d:
                continue
            if (b, t) in cands:
                labels[(b, t, d)] = int(g >= kappa and g > 0)
                weights[(b, t, d)] = abs(g - kappa)
            else:
                labels[(b, t, d)], weights[(b, t, d)] = 0, None
        going = {(b, t) for (b, t) in cands if labels[(b, t, d)] == 1}
    return kappas, labels, weights


def hand_decider_loss(
    depth_nll,
    labels,
    logits,
    rho=0.99,
    weighting="distance",
    *,
    dyn_pos_weight=True,
    pos_weight=1.0,
    cost_min=1e-6,
    cost_max=1.0,
    norm="tokens",
    margin=0.0,
    scope="pooled",
    n_items=None,
):
    """α-free TaH2 decider loss written out (defaults: ``LossConfig``'s but the pooled scope): brute-force labels
    and weights (``brute_force_labels``, or ``brute_force_labels_per_boundary`` with ``scope="per-boundary"``,
    where a non-candidate decision weighs ``cost_min``), the weights clamped to ``[cost_min, cost_max]``,
    per-depth ``pos_weight`` = negatives / positives clamped to [0.02, 50] (1 if a class is absent), BCE on
    ``logit - margin·(2y-1)`` by hand, summed with weights and divided by the labelled tokens (``norm="tokens"``;
    by ``n_items`` when given) or the weights' sum. Differentiable in ``logits`` ``[B, T, k]``. Returns
    ``(loss, number of decisions)``."""
    mask = (F.pad(labels[:, 1:], (0, 1), value=-100) != -100).tolist()
    if scope == "per-boundary":
        _, ys, ws = brute_force_labels_per_boundary(depth_nll.detach(), mask, rho)
    else:
        _, ys, ws = brute_force_labels(depth_nll.detach(), mask, rho)
    ys = {k: v for k, v in ys.items() if k[2] < logits.shape[-1]}
    pws = {}
    for d in {k[2] for k in ys}:
        pos = sum(1 for k, y in ys.items() if k[2] == d and y == 1)
        neg = sum(1 for k, y in ys.items() if k[2] == d and y == 0)
        pws[d] = (
            min(max(neg / pos, 0.02), 50.0)
            if (dyn_pos_weight and pos and neg)
            else (1.0 if dyn_pos_weight else pos_weight)
        )
    num = den = 0.0
    for (b, t, d), y in ys.items():
        s = logits[b, t, d].float() - margin * (2 * y - 1)
        if weighting == "distance" and ws[(b, t, d)] is None:  # not a cutoff candidate
            w = cost_min
        elif weighting == "distance":
            w = max(ws[(b, t, d)], cost_min)
            w = w if cost_max is None else min(w, cost_max)
        else:
            w = 1.0
        p = torch.sigmoid(s)
        num = num - w * (pws[d] * y * torch.log(p) + (1 - y) * torch.log(1 - p))
        den += w
    if norm == "tokens":
        den = sum(sum(row) for row in mask) if n_items is None else float(n_items)
    return num / max(den, 1e-12), len(ys)


def hand_decider_loss_cfg(depth_nll, labels, logits, cfg, n_items=None):
    """``hand_decider_loss`` with the switches of a ``LossConfig`` (``n_items``: the forward's
    ``num_items_in_batch``, used under ``decider_loss_scope="global"``)."""
    return hand_decider_loss(
        depth_nll,
        labels,
        logits,
        cfg.rho,
        cfg.decider_weighting,
        dyn_pos_weight=cfg.dyn_pos_weight,
        pos_weight=cfg.pos_weight,
        cost_min=cfg.cost_min,
        cost_max=cfg.cost_max,
        norm=cfg.decider_loss_norm,
        margin=cfg.bce_margin,
        scope=cfg.kappa_scope,
        n_items=n_items if cfg.decider_loss_scope == "global" else None,
    )


def direct_kl_to_prior(q: torch.Tensor, base: float) -> torch.Tensor:
    """KL(q ‖ p), p(d) ∝ base^(-d), written out per token: ``[..., D]`` -> ``[...]`` (float64)."""
    D = q.shape[-1]
    p = torch.tensor([base ** (-d) for d in range(1, D + 1)], dtype=torch.float64)
    p = p / p.sum()
    qd = q.double()
    return torch.where(qd > 0, qd * (qd.clamp_min(1e-300).log() - p.log()), torch.zeros_like(qd)).sum(-1)


def hand_mixture_weights(c: torch.Tensor, depths: torch.Tensor, D: int) -> torch.Tensor:
    """π ``[B, T, D]`` with Python loops: ``(1 - c_d) Π_{j<d} c_j`` before the exit, ``Π_{j<d*} c_j`` at it."""
    B, T = depths.shape
    rows = []
    for b in range(B):
        for t in range(T):
            k, surv, w = int(depths[b, t]), 1.0, []
            for d in range(1, D + 1):
                if d < k:
                    w.append(surv * (1 - c[b, t, d - 1]))
                    surv = surv * c[b, t, d - 1]
                else:
                    w.append(surv if d == k else torch.zeros(()))
            rows.append(torch.stack([torch.as_tensor(x) for x in w]))
    return torch.stack(rows).view(B, T, D)


def next_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position t scored on label t + 1, -100 ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
