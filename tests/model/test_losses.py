"""Training losses of the halting methods (docs/tah2.md, docs/anira.md): TaH2 lookahead labels and decider BCE
against hand-worked examples and a brute-force reference, ANIRA's KL-to-prior against a direct
computation and its decomposition, straight-through gradients, and a contract test over every
registered method."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from references import brute_force_labels as _brute_force_labels
from references import brute_force_labels_per_boundary, direct_kl_to_prior, hand_decider_loss_cfg, hand_mixture_weights

import retrofit
from retrofit.model.halting import HALTING_METHODS
from retrofit.model.halting.anira import AniraOptions, kl_to_prior, log_prior
from retrofit.model.halting.base import AuxLoss
from retrofit.model.halting.fixed import sample_poisson_lognormal_depth
from retrofit.model.halting.tah2 import (
    TaH2Options,
    decider_loss,
    dynamic_pos_weight,
    gain_cutoff,
    lookahead_labels,
    next_token_mask,
)
from retrofit.testing import perturb_updater, spread_decider, tiny_base

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# TaH2 labels: hand-worked example
# ------------------------------------------------------------------------------------------------
# Five positions, D = 3; dyadic numbers so every difference is exact.
#   t0: ℓ = 2, 1, 0.875        δ = 1.0, 0.125       (ran to depth 3)
#   t1: ℓ = 1, 1.5, -           δ = -0.5             (stopped at 1; depth 2 is the lookahead)
#   t2: ℓ = 3, 2.625, 2         δ = 0.375, 0.625
#   t3: ℓ = 1, 0.984375, -      δ = 0.015625
#   t4: no next-token label (masked) although its gains are positive
# Positive gains, descending: 1, 0.625, 0.375, 0.125, 0.015625; total 2.140625.
HAND_NLL = torch.tensor(
    [[[2.0, 1.0, 0.875], [1.0, 1.5, NAN], [3.0, 2.625, 2.0], [1.0, 0.984375, NAN], [0.5, 0.25, 0.0]]]
)
HAND_MASK = torch.tensor([[True, True, True, True, False]])


@pytest.mark.parametrize(
    "rho, kappa, labels, weights",
    [
        # 0.99 · 2.140625 = 2.1192…: prefix sums 1, 1.625, 2, 2.125 → 4 gains kept, κ = 0.125.
        # t0 continues twice (0.125 ≥ κ: ties continue); t2 twice; t1, t3 stop.
        (0.99, 0.125, [[1, 1], [0, 0], [1, 1], [0, 0]], [[0.875, 0.0], [0.625, 0], [0.25, 0.5], [0.109375, 0]]),
        # 0.75 · total = 1.6054…: prefix 1.625 → κ = 0.625. t2: δ1 = 0.375 < κ stops, so its δ2 = 0.625 ≥ κ
        # is overridden by the absorbing stop.
        (0.75, 0.625, [[1, 0], [0, 0], [0, 0], [0, 0]], [[0.375, 0.5], [1.125, 0], [0.25, 0.0], [0.609375, 0]]),
        # ρ = 1 keeps every positive gain: κ = 0.015625, t3 continues.
        (
            1.0,
            0.015625,
            [[1, 1], [0, 0], [1, 1], [1, 0]],
            [[0.984375, 0.109375], [0.515625, 0], [0.359375, 0.609375], [0.0, 0]],
        ),
    ],
)
def test_lookahead_labels_hand_example(rho, kappa, labels, weights):
    """The pooled rule (``kappa_scope=\"pooled\"``, retrofit < 0.3): one κ over every decision."""
    lab = lookahead_labels(HAND_NLL, HAND_MASK, rho=rho, scope="pooled")
    assert lab.kappa.item() == kappa
    decided = [[True, True], [True, False], [True, True], [True, False], [False, False]]
    assert lab.decided[0].tolist() == decided
    assert lab.labels[0, :4].tolist() == labels
    assert lab.labels[0, 4].tolist() == [0, 0]
    assert lab.weights[0, :4].tolist() == weights
    assert lab.weights[0, 4].tolist() == [0, 0]
    assert torch.isnan(lab.delta[0, 1, 1]) and torch.isnan(lab.delta[0, 4]).all()


def test_no_positive_gain_labels_everything_stop():
    nll = torch.tensor([[[1.0, 1.25, 1.5], [2.0, 2.0, NAN]]])
    lab = lookahead_labels(nll, torch.ones(1, 2, dtype=torch.bool), rho=0.99, scope="pooled")
    assert lab.kappa.item() == 0.0
    assert lab.labels.sum() == 0
    assert lab.decided[0].tolist() == [[True, True], [True, False]]
    # |δ - 0|; a zero gain gets weight 0
    assert lab.weights[0].tolist() == [[0.25, 0.25], [0.0, 0.0]]


def test_gain_cutoff_examples():
    g = torch.tensor([0.5, -1.0, 0.25, 0.25, NAN])
    # positive: 0.5, 0.25, 0.25 (total 1): 0.5 covers 50%, 0.75 covers 75%, ...
    assert gain_cutoff(g[torch.isfinite(g)], 0.5).item() == 0.5
    assert gain_cutoff(g[torch.isfinite(g)], 0.6).item() == 0.25
    assert gain_cutoff(g[torch.isfinite(g)], 1.0).item() == 0.25
    assert gain_cutoff(torch.tensor([-1.0, 0.0]), 0.99).item() == 0.0


def _random_depth_nll(B, T, D, gen):
    """NaN beyond each token's d* + 1 (the lookahead), as the model returns."""
    nll = torch.rand(B, T, D, generator=gen, dtype=torch.float64) * 4
    dstar = torch.randint(1, D + 1, (B, T), generator=gen)
    for b in range(B):
        for t in range(T):
            nll[b, t, min(D, int(dstar[b, t]) + 1) :] = NAN
    return nll


@pytest.mark.parametrize("scope", ["pooled", "per-boundary"])
@pytest.mark.parametrize("seed", range(6))
def test_lookahead_labels_match_brute_force(seed, scope):
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    B, T, D = rnd.randint(1, 3), rnd.randint(1, 9), rnd.randint(2, 5)
    nll = _random_depth_nll(B, T, D, gen)
    mask = torch.rand(B, T, generator=gen) < 0.8
    rho = rnd.choice([0.5, 0.9, 0.99, 1.0])
    if scope == "pooled":
        kappa, labels, weights = _brute_force_labels(nll, mask.tolist(), rho)
    else:
        kappa, labels, weights = brute_force_labels_per_boundary(nll, mask.tolist(), rho)
    lab = lookahead_labels(nll, mask, rho=rho, scope=scope)
    assert lab.kappa.tolist() == pytest.approx(kappa, abs=1e-12)
    got = {tuple(i): lab.labels[tuple(i)].item() for i in lab.decided.nonzero().tolist()}
    assert set(got) == set(labels)
    assert got == {k: float(v) for k, v in labels.items()}
    for k, w in weights.items():
        assert lab.weights[k].item() == pytest.approx(0.0 if w is None else w, abs=1e-12)
        assert bool(lab.candidate[k]) == (w is not None)
    assert lab.weights[~lab.decided].abs().sum() == 0


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


HAND_C = [[0.9, 0.6], [0.3, 0.5], [0.7, 0.2], [0.8, 0.5], [0.5, 0.5]]
# decided: (t0,d1..2), (t1,d1), (t2,d1..2), (t3,d1); ρ = 0.99 labels and |δ - κ| weights (the example above)
HAND_Y = {(0, 0): 1, (0, 1): 1, (1, 0): 0, (2, 0): 1, (2, 1): 1, (3, 0): 0}
HAND_W = {(0, 0): 0.875, (0, 1): 0.0, (1, 0): 0.625, (2, 0): 0.25, (2, 1): 0.5, (3, 0): 0.109375}


def _bce(p, y, pw=1.0):
    return -(pw * y * math.log(p) + (1 - y) * math.log(1 - p))


def _hand_logits():
    return torch.tensor([[[_logit(p) for p in row] for row in HAND_C]], requires_grad=True)


def test_decider_loss_matches_direct_computation():
    """retrofit < 0.2 (normalized by the weights' sum, no clamps, no pos_weight), by hand."""
    lab = lookahead_labels(HAND_NLL, HAND_MASK, rho=0.99, scope="pooled")
    s = _hand_logits()
    legacy = TaH2Options(dyn_pos_weight=False, cost_min=0.0, cost_max=None, decider_loss_norm="weights")
    loss, metrics = decider_loss(s, lab, legacy)
    direct = sum(HAND_W[k] * _bce(HAND_C[k[0]][k[1]], HAND_Y[k]) for k in HAND_Y) / sum(HAND_W.values())
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    uniform, _ = decider_loss(
        s, lab, TaH2Options(decider_weighting="uniform", dyn_pos_weight=False, decider_loss_norm="weights")
    )
    assert uniform.item() == pytest.approx(sum(_bce(HAND_C[k[0]][k[1]], HAND_Y[k]) for k in HAND_Y) / 6, rel=1e-6)
    assert metrics["decisions"].item() == 6
    assert metrics["continue_label_rate"].item() == pytest.approx(4 / 6)
    # decisions at τ = 0.5: c ≥ 0.5 ↔ continue. t0: 1,1 ✓✓; t1: 0 ✓; t2: 1 ✓, 0 ✗; t3: 1 ✗
    assert metrics["decider_accuracy"].item() == pytest.approx(4 / 6)
    loss.backward()
    assert s.grad[0, 4].abs().sum() == 0  # undecided position: no gradient
    assert s.grad[0, 1, 1] == 0 and s.grad[0, 0, 1] == 0  # undecided / zero weight
    assert s.grad[0, 0, 0] < 0 and s.grad[0, 1, 0] > 0  # pushed toward its label


def test_decider_loss_release_defaults_by_hand():
    """The release's loss: weights clamped to [1e-6, 1] (the zero weight becomes 1e-6), pos_weight = neg/pos per
    depth (depth 1: 2 continue / 2 stop -> 1; depth 2: only continues -> 1), Σ w·BCE / labelled tokens (4)."""
    lab = lookahead_labels(HAND_NLL, HAND_MASK, rho=0.99, scope="pooled")
    s = _hand_logits()
    loss, metrics = decider_loss(s, lab, TaH2Options(kappa_scope="pooled"), n_tokens=HAND_MASK.sum())
    w = {k: min(max(v, 1e-6), 1.0) for k, v in HAND_W.items()}
    direct = sum(w[k] * _bce(HAND_C[k[0]][k[1]], HAND_Y[k]) for k in HAND_Y) / 4
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    assert metrics["pos_weight"].item() == 1.0
    loss.backward()
    assert s.grad[0, 0, 1] != 0  # the clamp keeps a zero-distance decision in the loss (weight 1e-6)
    # cost_max clamps a large distance: scale every gain by 4 (weights 3.5, 0, 2.5, 1, 2, 0.4375)
    lab4 = lookahead_labels(HAND_NLL * 4, HAND_MASK, rho=0.99, scope="pooled")
    l4, _ = decider_loss(s.detach(), lab4, TaH2Options(kappa_scope="pooled"), n_tokens=4)
    w4 = {k: min(max(4 * v, 1e-6), 1.0) for k, v in HAND_W.items()}
    assert l4.item() == pytest.approx(sum(w4[k] * _bce(HAND_C[k[0]][k[1]], HAND_Y[k]) for k in HAND_Y) / 4, rel=1e-6)


# ------------------------------------------------------------------------------------------------
# TaH2 labels at M = 3: one cutoff per depth boundary (the release) against the pooled one, by hand
# ------------------------------------------------------------------------------------------------
# Six positions, D = 3 (dyadic numbers, exact differences):
#   t0: ℓ = 2, 1, 0.875        δ = 1.0, 0.125         (ran to depth 3)
#   t1: ℓ = 1, 1.5, -           δ = -0.5               (stopped at 1; depth 2 is the lookahead)
#   t2: ℓ = 3, 2.625, 2         δ = 0.375, 0.625
#   t3: ℓ = 1, 0.984375, -      δ = 0.015625           (stopped at 1)
#   t4: ℓ = 1, 1.25, 0.5        δ = -0.25, 0.75        (ran to depth 3 although its first gain is negative)
#   t5: no next-token label
# Per boundary, ρ = 0.99:
#   d = 1: candidates t0..t4; positive gains 1, 0.375, 0.015625 (total 1.390625, target 1.376…): prefix sums
#          1, 1.375, 1.390625 -> κ_1 = 0.015625; continue: t0, t2, t3.
#   d = 2: candidates = continued at d = 1 and executed depth 2 = t0, t2 (t3 stopped at 1); gains 0.625, 0.125
#          (total 0.75, target 0.7425): prefix 0.625, 0.75 -> κ_2 = 0.125; continue: t0, t2.
#          t4 executed depth 2 but stopped at d = 1: a "stop" of weight cost_min, not |0.75 - κ|.
# Pooled, ρ = 0.99: positive gains 1, 0.75, 0.625, 0.375, 0.125, 0.015625 (total 2.890625, target 2.8617…):
#   prefix 1, 1.75, 2.375, 2.75, 2.875 -> κ = 0.125; t3 (0.015625 < κ) stops; t4 stops twice at full weight.
M3_NLL = torch.tensor(
    [
        [
            [2.0, 1.0, 0.875],
            [1.0, 1.5, NAN],
            [3.0, 2.625, 2.0],
            [1.0, 0.984375, NAN],
            [1.0, 1.25, 0.5],
            [0.5, 0.25, 0.0],
        ]
    ]
)
M3_MASK = torch.tensor([[True, True, True, True, True, False]])
M3_DECIDED = [[True, True], [True, False], [True, True], [True, False], [True, True], [False, False]]


def test_per_boundary_labels_at_depth_three_by_hand():
    lab = lookahead_labels(M3_NLL, M3_MASK, rho=0.99, scope="per-boundary")
    assert lab.kappa.tolist() == [0.015625, 0.125]
    assert lab.decided[0].tolist() == M3_DECIDED
    assert lab.labels[0].tolist() == [[1, 1], [0, 0], [1, 1], [1, 0], [0, 0], [0, 0]]
    # |δ - κ_d| for the candidates; 0 (-> cost_min in the loss) for t4's second decision, which was none
    assert lab.weights[0].tolist() == [
        [0.984375, 0.0],
        [0.515625, 0.0],
        [0.359375, 0.5],
        [0.0, 0.0],
        [0.265625, 0.0],
        [0.0, 0.0],
    ]
    assert lab.candidate[0].tolist() == [
        [True, True],
        [True, False],
        [True, True],
        [True, False],
        [True, False],
        [False, False],
    ]

    pooled = lookahead_labels(M3_NLL, M3_MASK, rho=0.99, scope="pooled")
    assert pooled.kappa.item() == 0.125
    assert pooled.labels[0].tolist() == [[1, 1], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0]]
    assert pooled.weights[0].tolist() == [
        [0.875, 0.0],
        [0.625, 0.0],
        [0.25, 0.5],
        [0.109375, 0.0],
        [0.375, 0.625],
        [0.0, 0.0],
    ]

    # at D = 2 (the first boundary only) the two scopes agree
    two = M3_NLL[..., :2]
    a, b = (lookahead_labels(two, M3_MASK, rho=0.99, scope=sc) for sc in ("per-boundary", "pooled"))
    assert a.kappa.tolist() == [b.kappa.item()]
    assert torch.equal(a.labels, b.labels) and torch.equal(a.weights, b.weights)


def test_per_boundary_decider_loss_at_depth_three_by_hand():
    """The release's loss on the labels above: weights clamped to [1e-6, 1] (t0's and t3's zero distances and
    t4's non-candidate decision weigh 1e-6), pos_weight per depth = stop / continue labels among the decisions
    made there (depth 1: 2 / 3; depth 2: 1 / 2), Σ w·BCE over the five labelled tokens."""
    c = [[0.9, 0.6], [0.3, 0.5], [0.7, 0.2], [0.8, 0.5], [0.4, 0.7], [0.5, 0.5]]
    s = torch.tensor([[[_logit(p) for p in row] for row in c]], requires_grad=True)
    lab = lookahead_labels(M3_NLL, M3_MASK, rho=0.99, scope="per-boundary")
    loss, metrics = decider_loss(s, lab, TaH2Options(), n_tokens=5)
    y = {(0, 0): 1, (0, 1): 1, (1, 0): 0, (2, 0): 1, (2, 1): 1, (3, 0): 1, (4, 0): 0, (4, 1): 0}
    w = {(0, 0): 0.984375, (0, 1): 1e-6, (1, 0): 0.515625, (2, 0): 0.359375, (2, 1): 0.5, (3, 0): 1e-6}
    w.update({(4, 0): 0.265625, (4, 1): 1e-6})
    pw = {0: 2 / 3, 1: 1 / 2}
    direct = sum(w[k] * _bce(c[k[0]][k[1]], y[k], pw[k[1]]) for k in y) / 5
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    assert metrics["kappa"].item() == 0.015625 and metrics["kappa_2"].item() == 0.125
    assert metrics["pos_weight"].item() == pytest.approx((2 / 3 + 1 / 2) / 2, rel=1e-6)
    loss.backward()
    assert s.grad[0, 4, 1] > 0  # t4's second decision: pushed toward "stop", with the smallest weight
    assert s.grad[0, 4, 1].abs() < 1e-5 < s.grad[0, 4, 0].abs()


def _kappa_worker(rank: int, world: int, init_file: str, out_dir: str, nll, mask, logits, n_decisions) -> None:
    """One data-parallel rank of ``test_gathered_kappa_equals_the_single_process_kappa``: its half of the
    batch, the release's labels with the cutoff's gains gathered (gloo), saved for the parent to compare."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        rows = slice(rank * nll.shape[0] // world, (rank + 1) * nll.shape[0] // world)
        k = n_decisions[rank]
        res = {}
        for scope in ("per-boundary", "pooled"):
            lab = lookahead_labels(nll[rows], mask[rows], rho=0.9, n_decisions=k, scope=scope, gather=True)
            _, metrics = decider_loss(logits[rows, :, :k], lab, TaH2Options(kappa_scope=scope), n_tokens=1)
            res[scope] = (lab.kappa.clone(), lab.labels.clone(), metrics["pos_weight"].clone())
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gathered_kappa_equals_the_single_process_kappa(tmp_path):
    """κ with ``kappa_gather`` on 2 gloo processes, each with half the batch, equals the one-process κ over the
    union of their tokens (per boundary and pooled), and so do the labels and the dynamic pos_weight. Rank 1's
    tokens all stop at depth 1, so it makes one decision where rank 0 makes two: the ranks still call the
    collectives the same number of times (the test would hang otherwise)."""
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(7)
    B, T, D = 4, 7, 3
    nll = _random_depth_nll(B, T, D, gen)
    nll[:2, :, 2] = torch.rand(2, T, generator=gen, dtype=torch.float64) * 4  # rank 0's tokens ran to depth 3
    nll[2:, :, 2] = NAN  # rank 1's tokens all stopped at depth 1 (depth 2 is their lookahead)
    nll[2:, :, 1] = torch.rand(2, T, generator=gen, dtype=torch.float64) * 4
    mask = torch.rand(B, T, generator=gen) < 0.85
    logits = torch.randn(B, T, D - 1, generator=gen)
    mp.spawn(
        _kappa_worker,
        args=(2, str(tmp_path / "pg"), str(tmp_path), nll, mask, logits, [2, 1]),
        nprocs=2,
        join=True,
    )
    for scope in ("per-boundary", "pooled"):
        ref = lookahead_labels(nll, mask, rho=0.9, scope=scope)
        _, ref_m = decider_loss(logits, ref, TaH2Options(kappa_scope=scope), n_tokens=1)
        alone = [
            lookahead_labels(nll[r * 2 : r * 2 + 2], mask[r * 2 : r * 2 + 2], rho=0.9, scope=scope) for r in (0, 1)
        ]
        assert any(not torch.equal(a.kappa, ref.kappa) for a in alone), "per-process κ would differ: a real test"
        for r in (0, 1):
            kappa, labels, pos_weight = torch.load(tmp_path / f"rank{r}.pt")[scope]
            torch.testing.assert_close(kappa, ref.kappa, rtol=0, atol=0)
            k = labels.shape[-1]
            assert torch.equal(labels, ref.labels[r * 2 : r * 2 + 2, :, :k]), (scope, r)
            # the union's per-depth pos_weight at the depths this rank decided at (mean over them)
            want = ref_m["pos_weight"] if k == D - 1 else dynamic_pos_weight(ref.labels, ref.decided)[:k].mean()
            torch.testing.assert_close(pos_weight, want)


def test_decider_loss_divides_by_the_global_num_items():
    """``decider_loss_scope="global"`` (the release): given ``num_items_in_batch = N`` (every rank's and every
    accumulation step's labelled tokens), the forward's auxiliary loss is α_D · (Σ w·BCE written out) / N, the LM
    loss is its NLL sum / N, and the logged ``decider_loss`` stays per labelled token of the batch; without N,
    and under ``"local"``, the divisor is the batch's own labelled tokens."""
    model = _mixed_depth_tah2()
    ids, labels = _batch(B=3, T=14)
    alpha = model.loop.method_options.alpha_d
    n_local = int(next_token_mask(labels).sum())
    N = 4 * n_local + 3
    out = model(ids, labels=labels, num_items_in_batch=torch.tensor(N))
    total, n = hand_decider_loss_cfg(out.depth_nll, labels, out.halt_logits, model.loop.method_options, n_items=1)
    assert n > 0
    torch.testing.assert_close(out.aux_loss, alpha * total / N)
    torch.testing.assert_close(out.aux_metrics["decider_loss"], (total / n_local).detach())
    assert model.halting.aux_loss_per_item(model.loop.method_options)
    plain = model(ids, labels=labels)
    torch.testing.assert_close(plain.aux_loss, alpha * total / n_local)
    model.config.loop = {
        **model.config.loop,
        "options": {**model.config.loop["options"], "decider_loss_scope": "local"},
    }
    local = model(ids, labels=labels, num_items_in_batch=torch.tensor(N))
    torch.testing.assert_close(local.aux_loss, alpha * total / n_local)
    assert not model.halting.aux_loss_per_item(model.loop.method_options)


def _labels_by_hand(y, w):
    """A ``LookaheadLabels`` with one decision per token at depth 1: labels ``y``, weights ``w``."""
    from retrofit.model.halting.tah2 import LookaheadLabels

    y = torch.tensor(y, dtype=torch.float64)[None, :, None]
    w = torch.tensor(w, dtype=torch.float64)[None, :, None]
    return LookaheadLabels(
        delta=w,
        decided=torch.ones_like(y, dtype=torch.bool),
        labels=y,
        weights=w,
        kappa=torch.zeros((), dtype=torch.float64),
    )


@pytest.mark.parametrize("n_pos, n_neg, pw", [(1, 3, 3.0), (3, 1, 1 / 3), (1, 99, 50.0), (99, 1, 0.02), (0, 4, 1.0)])
def test_dynamic_pos_weight_is_the_clamped_negative_positive_ratio(n_pos, n_neg, pw):
    y = [1] * n_pos + [0] * n_neg
    lab = _labels_by_hand(y, [0.5] * len(y))
    s = torch.linspace(-1, 1, len(y))[None, :, None]
    loss, metrics = decider_loss(s, lab, TaH2Options(), n_tokens=len(y))
    assert metrics["pos_weight"].item() == pytest.approx(pw, rel=1e-6)
    ps = torch.sigmoid(s).flatten().tolist()
    direct = sum(0.5 * _bce(p, yy, pw) for p, yy in zip(ps, y)) / len(y)
    assert loss.item() == pytest.approx(direct, rel=1e-5)
    static, m2 = decider_loss(s, lab, TaH2Options(dyn_pos_weight=False, pos_weight=2.0), n_tokens=len(y))
    assert m2["pos_weight"].item() == 2.0
    assert static.item() == pytest.approx(sum(0.5 * _bce(p, yy, 2.0) for p, yy in zip(ps, y)) / len(y), rel=1e-5)


def test_bce_margin_shifts_the_logit_toward_the_wrong_side():
    lab = _labels_by_hand([1, 0], [1.0, 1.0])
    s = torch.tensor([[[2.0], [-0.5]]])
    loss, _ = decider_loss(s, lab, TaH2Options(bce_margin=1.5, dyn_pos_weight=False), n_tokens=2)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    direct = (_bce(sig(2.0 - 1.5), 1) + _bce(sig(-0.5 + 1.5), 0)) / 2
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    plain, _ = decider_loss(s, lab, TaH2Options(dyn_pos_weight=False), n_tokens=2)
    assert loss.item() > plain.item()


def test_loss_config_rejects_bad_switches():
    with pytest.raises(ValueError, match="uniform"):
        TaH2Options(decider_weighting="squared")
    with pytest.raises(ValueError, match="decider_loss_norm"):
        TaH2Options(decider_loss_norm="mean")
    with pytest.raises(ValueError, match="cost_max"):
        TaH2Options(cost_min=0.5, cost_max=0.1)
    with pytest.raises(ValueError, match="bce_margin"):
        TaH2Options(bce_margin=-1.0)
    with pytest.raises(ValueError, match="pos_weight"):
        TaH2Options(pos_weight=0.0)


def test_next_token_mask_shifts_labels():
    labels = torch.tensor([[-100, -100, 5, 6, -100]])
    assert next_token_mask(labels).tolist() == [[False, True, True, False, False]]


# ------------------------------------------------------------------------------------------------
# TaH2 loss on a real forward
# ------------------------------------------------------------------------------------------------
def _batch(B=2, T=12, seed=0, prompt=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 104, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = -100
    return ids, labels


def test_tah2_loss_uses_depth_nll_and_signals():
    torch.manual_seed(0)
    model = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=3, method="tah2")).train()
    ids, labels = _batch()
    out = model(ids, labels=labels)
    cfg = TaH2Options()
    aux = model.halting.loss(out, labels, cfg)
    ref, n = hand_decider_loss_cfg(out.depth_nll, labels, out.halt_logits, cfg)
    assert torch.allclose(aux.loss, cfg.alpha_d * ref)
    assert aux.metrics["decisions"].item() == n > 0
    # the forward's own loss: the mixture NLL plus the weighted decider loss, the latter in aux_loss
    ntp = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(out.aux_loss, cfg.alpha_d * ref)
    torch.testing.assert_close(out.loss, ntp + cfg.alpha_d * ref)
    # prompt positions (no next-token label) are never supervised: their depth losses are 0, not gains
    assert (out.depth_nll[:, :3].nan_to_num() == 0).all()


def test_tah2_loss_in_eval_needs_depth_losses():
    model = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=2, method="tah2")).eval()
    ids, labels = _batch()
    # without the auxiliary loss the forward skips the per-depth losses, which the method's loss needs
    plain = model(ids, labels=labels, output_router_logits=False)
    assert plain.depth_nll is None and plain.aux_loss is None
    with pytest.raises(ValueError, match="output_depth_losses"):
        model.halting.loss(plain, labels, TaH2Options())
    out = model(ids, labels=labels, output_depth_losses=True, output_router_logits=False)
    assert torch.isfinite(model.halting.loss(out, labels, TaH2Options()).loss)
    # by default (config.output_router_logits) the eval forward computes it too
    default = model(ids, labels=labels)
    torch.testing.assert_close(default.aux_loss, model.halting.loss(out, labels, TaH2Options()).loss)


def test_lookahead_loss_equals_forcing_the_token_one_depth_deeper():
    """ℓ^(d*+1) of the lookahead iteration = the loss when that token alone is forced to d* + 1."""
    model = _mixed_depth_tah2(seed=1, prelude=0).eval()  # a seed whose exits are mixed
    ids, labels = _batch(B=2, T=12, seed=5, prompt=0)
    with torch.no_grad():
        out = model(ids, labels=labels, output_depth_losses=True)
    D = model.loop.max_depth
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    cand = [(b, t) for b in range(2) for t in range(11) if out.depths[b, t] < D]
    assert len(cand) >= 3, "the test needs tokens that exited early"
    for b, t in cand[:4]:
        k = int(out.depths[b, t])
        for forced_k, col in ((k, k - 1), (k + 1, k)):  # the exit depth and the lookahead depth
            depth = out.depths.clone()
            depth[b, t] = forced_k
            with torch.no_grad():
                rerun = model(ids, depth=depth).logits[b, t]
            want = F.cross_entropy(rerun[None], shift[b, t : t + 1]).item()
            assert out.depth_nll[b, t, col].item() == pytest.approx(want, abs=2e-5), (b, t, forced_k)
        assert torch.isnan(out.depth_nll[b, t, k + 1 :]).all()  # nothing beyond the lookahead
        delta = out.depth_nll[b, t, k - 1] - out.depth_nll[b, t, k]
        assert torch.isfinite(delta)


# ------------------------------------------------------------------------------------------------
# ANIRA: KL to the geometric prior
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [1.0, 2.0, 3.5])
def test_kl_to_prior_matches_direct_and_decomposition(base):
    g = torch.Generator().manual_seed(1)
    D = 5
    q = torch.softmax(torch.randn(7, D, generator=g, dtype=torch.float64) * 2, -1)
    q[0] = torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64)  # a point mass: 0 log 0 = 0
    kl = kl_to_prior(q, base)
    p = [base ** (-d) for d in range(1, D + 1)]
    Z = sum(p)
    p = [x / Z for x in p]
    for i in range(q.shape[0]):
        qi = q[i].tolist()
        direct = sum(a * math.log(a / b) for a, b in zip(qi, p) if a > 0)
        H = -sum(a * math.log(a) for a in qi if a > 0)
        Ed = sum((d + 1) * a for d, a in enumerate(qi))
        decomposition = -H + math.log(base) * Ed + math.log(sum(base ** (-d) for d in range(1, D + 1)))
        assert kl[i].item() == pytest.approx(direct, abs=1e-5)
        assert kl[i].item() == pytest.approx(decomposition, abs=1e-5)
    assert log_prior(D, base).exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    if base == 1.0:  # only the entropy term: KL = log D - H(q)
        assert kl[0].item() == pytest.approx(math.log(D), abs=1e-6)


def test_kl_with_log_q_equals_kl_from_q():
    logits = torch.randn(3, 4, 6)
    q = logits.softmax(-1)
    assert torch.allclose(kl_to_prior(q, 2.0), kl_to_prior(q, 2.0, logits.log_softmax(-1)), atol=1e-5)


@pytest.mark.parametrize("method", ["anira-e", "anira-o"])
def test_anira_loss_is_gamma_times_masked_mean_kl(method):
    torch.manual_seed(0)
    model = retrofit.convert(
        tiny_base("llama"),
        retrofit.LoopConfig(prelude=1, core=4, max_depth=3, method=method, options={"gamma": 0.3, "prior_base": 2.0}),
    ).train()
    ids, labels = _batch()
    attn = torch.ones_like(ids)
    attn[1, -3:] = 0  # padding
    out = model(ids, attention_mask=attn, labels=labels)
    cfg = AniraOptions(gamma=0.3, prior_base=2.0)
    aux = model.halting.loss(out, labels, cfg, attention_mask=attn)
    ref = direct_kl_to_prior(out.depth_probs.detach(), 2.0)[attn.bool()].mean()  # all non-pad tokens, prompt too
    assert aux.loss.item() == pytest.approx(0.3 * ref.item(), abs=1e-6)
    assert aux.metrics["kl_prior"].item() == pytest.approx(ref.item(), abs=1e-6)
    # the model's forward used the weights of its LoopConfig: the same auxiliary loss, added to its loss
    assert out.aux_loss.item() == pytest.approx(0.3 * ref.item(), abs=1e-6)
    ntp = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert out.loss.item() == pytest.approx(ntp.item() + 0.3 * ref.item(), abs=1e-5)


@pytest.mark.parametrize("method", ["anira-e", "anira-o"])
def test_straight_through_passes_ce_gradient_to_the_decider(method):
    torch.manual_seed(0)
    model = retrofit.convert(
        tiny_base("llama"), retrofit.LoopConfig(prelude=1, core=4, max_depth=3, method=method)
    ).train()
    # make the updater non-trivial so that the depths' states differ
    perturb_updater(model, 0.05)
    ids, labels = _batch()
    torch.manual_seed(1)
    out = model(ids, labels=labels, output_router_logits=False)
    assert out.aux_loss is None
    out.loss.backward()  # CE only: no γ · L_C
    grads = [p.grad for p in model.halting.parameters()]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    # forward value of the straight-through combination = the hard exit state
    with torch.no_grad():
        ref = model.eval()(ids, depth=out.depths)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# fixed: random depth
# ------------------------------------------------------------------------------------------------
def test_poisson_lognormal_depth_mean_and_range():
    gen = torch.Generator().manual_seed(0)
    xs = [sample_poisson_lognormal_depth(8.0, 0.5, 1000, gen) for _ in range(3000)]
    assert sum(xs) / len(xs) == pytest.approx(8.0, rel=0.05)
    ys = [sample_poisson_lognormal_depth(2.0, 0.5, 3, gen) for _ in range(300)]
    assert set(ys) <= {1, 2, 3} and len(set(ys)) == 3
    assert sample_poisson_lognormal_depth(1.0, 0.5, 4, gen) == 1
    with pytest.raises(ValueError, match="mean"):
        sample_poisson_lognormal_depth(0.5, 0.5, 4)


def test_truncated_backprop_runs_early_iterations_without_autograd():
    model = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=3, method="fixed")).train()
    perturb_updater(model, 0.05)
    ids, labels = _batch()
    seen = []
    hook = model.core_layers[0].register_forward_hook(lambda *a: seen.append(torch.is_grad_enabled()))
    full = model(ids, labels=labels)
    assert seen == [True, True, True]
    seen.clear()
    trunc = model(ids, labels=labels, backprop_depth=1)
    assert seen == [False, False, True]
    seen.clear()
    forced = model(ids, labels=labels, depth=2, backprop_depth=1)
    assert seen == [False, True]  # the last k of the iterations actually run
    hook.remove()
    assert torch.equal(full.loss, trunc.loss)  # forward unchanged
    full.loss.backward()
    g_full = [p.grad.clone() for p in model.core_layers[0].parameters()]
    model.zero_grad()
    trunc.loss.backward()
    g_trunc = [p.grad.clone() for p in model.core_layers[0].parameters()]
    assert all(g.abs().sum() > 0 for g in g_trunc)
    assert any(not torch.allclose(a, b) for a, b in zip(g_full, g_trunc))
    model.zero_grad()
    same = model(ids, labels=labels, backprop_depth=3)
    same.loss.backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(g_full, model.core_layers[0].parameters()))
    with pytest.raises(ValueError, match="backprop_depth"):
        model(ids, backprop_depth=0)
    del forced


# ------------------------------------------------------------------------------------------------
# Contract over every registered method
# ------------------------------------------------------------------------------------------------
def _method_model(name, seed=0):
    kwargs = dict(prelude=1, core=4) if name.startswith("anira") else {}
    torch.manual_seed(seed)
    model = retrofit.convert(tiny_base("llama", seed=seed), retrofit.LoopConfig(max_depth=3, method=name, **kwargs))
    if name == "tah2":  # the release's init puts every decision at p ≈ 0.5 on one side: spread them
        spread_decider(model, logit_std=2.0, generator=torch.Generator().manual_seed(seed))
    return model


def _total_loss(model, ids, labels, cfg):
    """The forward's loss, which holds the weighted auxiliary loss (checked against the method's)."""
    out = model(ids, labels=labels)
    aux = model.halting.loss(out, labels, cfg)
    assert aux is None or isinstance(aux, AuxLoss)
    assert (aux is None) == (out.aux_loss is None)
    if aux is not None:
        torch.testing.assert_close(out.aux_loss, aux.loss)
    return out.loss, out, aux


@pytest.mark.parametrize("name", sorted(HALTING_METHODS))
def test_method_contract(name):
    model = _method_model(name).train()
    cfg = model.loop.method_options
    ids, labels = _batch(B=4, T=16)

    # loss finite, gradients reach the updater and the decider
    torch.manual_seed(0)
    loss, out, aux = _total_loss(model, ids, labels, cfg)
    assert torch.isfinite(loss)
    assert out.depths.min() >= 1 and out.depths.max() <= 3
    if aux is not None:
        assert torch.isfinite(aux.loss) and all(torch.isfinite(v) for v in aux.metrics.values())
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.updater.parameters())
    heads = list(model.halting.parameters())
    if name != "fixed":
        assert heads and all(p.grad is not None for p in heads)
        assert sum(p.grad.abs().sum() for p in heads) > 0
    else:
        assert heads == []

    # a few optimizer steps on one batch lower the loss
    model.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1)
    first = None
    for _ in range(12):
        loss, _, _ = _total_loss(model, ids, labels, cfg)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        after, _, _ = _total_loss(model, ids, labels, cfg)
    assert after.item() < 0.8 * first, (first, after.item())

    # eval forward is deterministic
    with torch.no_grad():
        a = model(ids, labels=labels)
        b = model(ids, labels=labels)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.depths, b.depths)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="rho"):
        TaH2Options(rho=0.0)
    with pytest.raises(ValueError, match="decider_weighting"):
        TaH2Options(decider_weighting="squared")
    with pytest.raises(ValueError, match="prior_base"):
        AniraOptions(prior_base=0)


# ------------------------------------------------------------------------------------------------
# TaH2 training forward: the fast paths equal the reference computation
# ------------------------------------------------------------------------------------------------
def _mixed_depth_tah2(seed=0, **loop):
    """A TaH2 model whose decider stops about half the tokens at depth 1 (and a non-trivial updater)."""
    torch.manual_seed(seed)
    model = retrofit.convert(
        tiny_base("llama", seed=seed), retrofit.LoopConfig(max_depth=3, method="tah2", **loop)
    ).train()
    with torch.no_grad():
        perturb_updater(model, 0.05)
        spread_decider(model, logit_std=2.0)
    return model


def test_tah2_training_forward_matches_reference_mixture_and_losses():
    """Loss, gradients and per-depth losses of the training forward (one readout per depth, the
    lookahead folded into it, shift detached) equal a direct computation from the per-depth logits:
    the mixture NLL plus α_D times the decider loss, both written out."""
    model = _mixed_depth_tah2()
    ids, labels = _batch(B=3, T=14)
    out = model(ids, labels=labels)
    assert 1 < out.depths.float().mean() < 3  # mixed depths, so lookahead tokens exist
    out.loss.backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    ref = model(ids, labels=labels, output_depth_logits=True)  # the two-readout reference path
    assert torch.equal(ref.depths, out.depths)
    torch.testing.assert_close(ref.depth_nll, out.depth_nll, equal_nan=True)
    z = ref.depth_logits  # [D, B, T, V], NaN beyond each token's lookahead
    D = z.shape[0]
    pi = hand_mixture_weights(ref.halt_signals, ref.depths, D)  # [B, T, D]
    probs = sum(pi[..., d, None] * torch.nan_to_num(z[d]).softmax(-1) for d in range(D))
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    m = shift != -100
    nll = -probs.gather(-1, shift.clamp_min(0)[..., None]).squeeze(-1).log()
    l_d, n = hand_decider_loss_cfg(ref.depth_nll, labels, ref.halt_logits, model.loop.method_options)
    assert n > 0
    total = nll[m].mean() + model.loop.method_options.alpha_d * l_d
    assert torch.allclose(out.loss, total, atol=1e-5)
    assert torch.allclose(out.aux_loss, model.loop.method_options.alpha_d * l_d, atol=1e-6)
    total.backward()
    for n, g in fast.items():
        torch.testing.assert_close(g, model.get_parameter(n).grad, atol=1e-5, rtol=1e-4, msg=n)
    # per-depth losses are the cross-entropy of the per-depth logits (the lookahead depth included)
    for d in range(D):
        fin = torch.isfinite(out.depth_nll[..., d])
        ce = F.cross_entropy(torch.nan_to_num(z[d]).flatten(0, 1), shift.flatten(), reduction="none").view_as(shift)
        assert torch.equal(out.depth_nll[..., d][fin], ce.detach()[fin])


@pytest.mark.parametrize("name", sorted(HALTING_METHODS))
def test_forced_depth_has_no_auxiliary_loss(name):
    """A forced depth runs no decider, so there is no decision to supervise: the loss is the next-token
    loss alone, for every method."""
    model = _method_model(name).train()
    ids, labels = _batch()
    out = model(ids, labels=labels, depth=2)
    assert out.aux_loss is None and model.halting.loss(out, labels, TaH2Options()) is None
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))


@pytest.mark.parametrize("method", ["tah2", "anira-e", "anira-o"])
def test_nan_decider_gives_a_nan_aux_loss_not_an_error(method):
    """Diverged decider weights: the forward returns a NaN ``aux_loss`` (TaH2's BCE would raise on its
    NaN continue probabilities), so any trainer sees a non-finite loss; finite deciders give finite ones."""
    split = {"prelude": 1, "core": 4} if method.startswith("anira") else {}
    model = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=2, method=method, **split)).eval()
    ids, labels = _batch()
    with torch.no_grad():
        good = model(ids, labels=labels)
        assert good.aux_loss is not None and torch.isfinite(good.aux_loss) and torch.isfinite(good.loss)
        for p in model.halting.parameters():
            p.fill_(float("nan"))
        bad = model(ids, labels=labels)
    assert bad.aux_loss is not None and torch.isnan(bad.aux_loss) and torch.isnan(bad.loss)
    signals = bad.halt_signals if bad.halt_signals is not None else bad.depth_logits_q
    assert signals is not None and not torch.isfinite(signals).all()
