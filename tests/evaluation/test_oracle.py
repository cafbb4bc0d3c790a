"""The oracle at equal compute and the accuracy ceiling (retrofit/evaluation/oracle.py, docs/evaluation.md):
the selections against hand computations and a slow greedy reference, and every decider, random, oracle and
ceiling point of the frontier against separate forwards with ``depth=`` the per-token depths it ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_looped import mixed_depth_looped

from retrofit.evaluation import oracle as O
from retrofit.evaluation.models import model_info, pad_id
from retrofit.evaluation.options import EvalOptions

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

F, T = False, True


# ----------------------------------------------------------------------------------------------
# the selections, by hand
# ----------------------------------------------------------------------------------------------

#: two rows at D = 2: row 0 has 3 answer steps (the last is its stop step), row 1 has 2
NLL = [
    np.array([[2.0, 1.0], [1.0, 1.2], [3.0, 0.5]]),  # gains +1.0, −0.2, +2.5
    np.array([[0.5, 0.4], [1.0, 1.0]]),  # gains +0.1, 0.0
]
CORRECT = [
    np.array([[F, T], [F, F], [T, T]]),  # step 0 right only at depth 2, step 1 never, the stop step at both
    np.array([[T, F], [F, T]]),  # step 0 right at depth 1 only, the stop step at depth 2 only
]


@pytest.mark.parametrize(
    "K,expected",
    [
        (0, [[1, 1, 1], [1, 1]]),
        (1, [[1, 1, 2], [1, 1]]),  # the largest gain: row 0's stop step (+2.5)
        (2, [[2, 1, 2], [1, 1]]),  # then row 0's step 0 (+1.0)
        (3, [[2, 1, 2], [2, 1]]),  # then +0.1
        (4, [[2, 1, 2], [2, 2]]),  # then 0.0, before the negative −0.2
        (5, [[2, 2, 2], [2, 2]]),
    ],
)
def test_oracle_takes_the_largest_gains_by_hand(K, expected):
    got = O.oracle_depths(NLL, K)
    assert [d.tolist() for d in got] == expected
    assert sum(int((d - 1).sum()) for d in got) == K  # equal compute: the same number of continues


def test_oracle_ties_go_to_the_earlier_step_and_nan_gains_rank_last():
    nll = [np.array([[1.0, 0.5], [np.nan, 0.0]]), np.array([[1.0, 0.5], [2.0, 1.5]])]  # three gains of +0.5
    assert [d.tolist() for d in O.oracle_depths(nll, 2)] == [[2, 1], [2, 1]]
    assert [d.tolist() for d in O.oracle_depths(nll, 3)] == [[2, 1], [2, 2]]
    assert [d.tolist() for d in O.oracle_depths(nll, 4)] == [[2, 2], [2, 2]]
    with pytest.raises(ValueError, match="n_continues must lie in 0..4"):
        O.oracle_depths(nll, 5)


def _greedy_reference(nll, K):
    """K times: scan every answer step for the largest available next gain (a step's gain after depth d + 1 only
    once it runs d + 1), the first in row order on ties."""
    depths = [[1] * len(x) for x in nll]
    D = nll[0].shape[1]
    for _ in range(K):
        best = None
        for r, x in enumerate(nll):
            for t in range(len(x)):
                d = depths[r][t]
                if d < D:
                    g = x[t, d - 1] - x[t, d]
                    if best is None or g > best[0]:
                        best = (g, r, t)
        depths[best[1]][best[2]] += 1
    return depths


@pytest.mark.parametrize("seed", range(4))
def test_oracle_at_three_depths_matches_a_slow_greedy(seed):
    rng = np.random.default_rng(seed)
    nll = [rng.random((int(rng.integers(1, 6)), 3)) * 3 for _ in range(4)]
    total = sum(len(x) for x in nll) * 2
    for K in range(total + 1):
        assert [d.tolist() for d in O.oracle_depths(nll, K)] == _greedy_reference(nll, K)


def test_ceiling_and_forced_frame_accuracies_by_hand():
    ceiling = O.ceiling_depths(CORRECT)
    assert [d.tolist() for d in ceiling] == [[2, 1, 1], [1, 2]]
    # tokens (the stop steps left out): row 0 steps 0 (right at 2) and 1 (never right), row 1 step 0 -> 2 of 3;
    # rows: row 0's step 1 is never right, row 1 is right at [1, 2] -> 1 of 2
    assert O.forced_frame_outcomes(CORRECT, ceiling) == pytest.approx((2 / 3, 1 / 2))
    # the oracle at K = 2 ([2, 1, 2], [1, 1]): tokens right T, F, T; rows: row 1's stop step is wrong at depth 1
    assert O.forced_frame_outcomes(CORRECT, O.oracle_depths(NLL, 2)) == pytest.approx((2 / 3, 0.0))
    assert O.forced_frame_outcomes(CORRECT, [np.array([2, 2, 2]), np.array([2, 2])]) == pytest.approx((1 / 3, 0.0))


def test_gap_closed_by_hand():
    assert O.gap_closed(0.6, 0.5, 0.9) == pytest.approx(0.25)
    assert O.gap_closed(0.4, 0.5, 0.9) == pytest.approx(-0.25)
    assert O.gap_closed(0.6, 0.5, 0.5) is None and O.gap_closed(0.6, None, 0.9) is None


# ----------------------------------------------------------------------------------------------
# the frontier's points against separate forwards with depth=
# ----------------------------------------------------------------------------------------------


def _row_correct(logits, ids, start, m, is_stop):
    """Greedy exact match of one unpadded row from its logits: every answer token is the argmax at its producing
    position, then a stop token."""
    top = logits[0].argmax(-1)
    gold = ids[0, start : start + m]
    return bool((top[start - 1 : start + m - 1] == gold).all()) and is_stop(int(top[start + m - 1]))


def _example(prompt_ids, answer_ids, level):
    from retrofit.evaluation.rows import Example

    m = len(answer_ids)
    return Example(
        row={"prompt": "", "answer": "", "difficulty": level},
        level=level,
        prompt_ids=list(prompt_ids),
        answer_ids=list(answer_ids),
        segment="",
        owner=np.zeros(m, dtype=np.int64),
        first_tok=np.zeros(1, dtype=np.int64),
        features=None,
    )


def _is_stop(t: int) -> bool:
    """The tests' stop rule: a third of the vocabulary stops, so a random model's stop step is often right."""
    return t % 3 == 0


def _own_greedy_examples(model, n: int, seed: int):
    """Rows whose gold answer is the model's own argmax, each token at a random forced depth (1–3 tokens): every
    allocation gets some rows right and some wrong, so the row outcomes below tell allocations apart."""
    rng = np.random.default_rng(seed)
    D, exs = model.loop.max_depth, []
    with torch.no_grad():
        for i in range(n):
            prompt = rng.integers(4, 100, size=int(rng.integers(3, 7))).tolist()
            ids = list(prompt)
            for _ in range(int(rng.integers(1, 4))):
                ids.append(int(model(torch.tensor([ids]), depth=int(rng.integers(1, D + 1))).logits[0, -1].argmax()))
            exs.append(_example(prompt, ids[len(prompt) :], level=1 + i % 2))
    return exs


def _row_correct(logits, ids, start, m):
    """Greedy exact match of one row from its logits ``[1, T, V]``: every answer token is the argmax at its
    producing position, and then a stop token (none of the gold tokens is one)."""
    top = logits[0].argmax(-1)
    gold = ids[0, start : start + m]
    no_stop_inside = not any(_is_stop(int(t)) for t in gold)
    return bool((top[start - 1 : start + m - 1] == gold).all()) and _is_stop(int(top[start + m - 1])) and no_stop_inside


@pytest.mark.parametrize("max_depth", [2, 3])
def test_frontier_points_equal_forced_forwards_at_their_depths(tok, max_depth):
    """TaH2 without its output mixture (the exit depth's readout), so that a pass whose tokens exit at given depths
    IS ``forward(depth=those depths)``. Per frontier row, unbatched and unpadded: the decider's point at a threshold
    = a forward at the depths the decider chose; the oracle's = a forward with the decider's prompt depths and the
    oracle's answer-step depths, selected from gains computed here by a depth-D forward per row; the ceiling's the
    same with the first right depth; random allocation = its own batched pass replayed with depth=."""
    from retrofit.evaluation.frontier import model_frontier, random_allocation
    from retrofit.evaluation.stats import paired_comparison
    from retrofit.evaluation.teacher_forced import argmax_pass, batch_chunks, tf_batch

    model = mixed_depth_looped(max_depth=max_depth, seed=4, mixture_output=False)
    info, pad, D = model_info(model), pad_id(tok), max_depth
    exs = _own_greedy_examples(model, 14, seed=max_depth)
    eos = [t for t in range(model.config.vocab_size) if _is_stop(t)]
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        progress=False,
        batch_size=4,
        frontier=True,
        frontier_thresholds=(0.3, 0.7),
        frontier_random_draws=2,
        frontier_rows_per_level=6,
    )
    own = argmax_pass(model, info, exs, pad, opts, _is_stop, 8, "own")
    fr, fa = model_frontier(model, info, exs, pad, opts, _is_stop, 8, "t", "looped", own, None, eos)
    exs = [exs[i] for i in fa.rows]
    points = {p["key"]: p for p in fr["points"]}
    assert {"oracle:own", "oracle:0.3", "oracle:0.7", "ceiling"} <= set(points)
    outcomes = np.concatenate([np.asarray(c, dtype=bool).reshape(-1) for c in fa.correct.values()])
    assert 0 < outcomes.sum() < outcomes.size  # rows right and wrong: the comparisons below can fail

    def tensor(e):
        return torch.tensor([e.prompt_ids + e.answer_ids])

    def correct_at(d, e):
        return _row_correct(model(tensor(e), depth=d).logits, tensor(e), len(e.prompt_ids), len(e.answer_ids))

    def with_answer_steps(d, e, x):
        d = d.clone()
        d[0, len(e.prompt_ids) - 1 :] = torch.as_tensor(x)
        return d

    with torch.no_grad():
        # reference gains and right argmaxes at every answer step and depth: one depth-D forward per row
        nll_ref, ok_ref = [], []
        for e in exs:
            ids, s, m = tensor(e), len(e.prompt_ids), len(e.answer_ids)
            z = model(ids, depth=D, output_depth_logits=True).depth_logits[:, 0].float().log_softmax(-1)  # [D, T, V]
            steps = torch.arange(m + 1) + s - 1
            tok_nll = -z[:, steps[:m]].gather(-1, ids[0, s:][None, :, None].expand(D, m, 1))[..., 0]  # [D, m]
            stop_nll = -z[:, steps[m]][:, eos].logsumexp(-1)  # [D]
            nll_ref.append(torch.cat([tok_nll, stop_nll[:, None]], 1).T.numpy())
            top = z[:, steps].argmax(-1)  # [D, m + 1]
            ok = torch.cat([top[:, :m] == ids[0, s:], torch.tensor([[_is_stop(int(t))] for t in top[:, m]])], 1)
            ok_ref.append(ok.T.numpy())

        moved = 0
        for key, tau in (("own", None), ("0.3", 0.3), ("0.7", 0.7)):
            kw = {} if tau is None else {"decider_threshold": tau}
            dec = [model(tensor(e), **kw).depths for e in exs]  # [1, T] per row
            steps = [d[0, len(e.prompt_ids) - 1 :].numpy() for d, e in zip(dec, exs)]
            # the decider's point: a forward at its own depths
            assert [correct_at(d, e) for d, e in zip(dec, exs)] == fa.correct[f"decider:{key}"].tolist(), key
            # the oracle's: the decider's prompt depths, the oracle's answer-step depths, the same continues
            K = sum(int((x - 1).sum()) for x in steps)
            sel = O.oracle_depths(nll_ref, K)
            moved += sum(not np.array_equal(a, b) for a, b in zip(sel, steps))
            want = [correct_at(with_answer_steps(d, e, x), e) for d, e, x in zip(dec, exs, sel)]
            assert want == fa.correct[f"oracle:{key}"].tolist(), key
            p = points[f"oracle:{key}"]
            assert p["n_continues"] == K and p["mean_depth"] == pytest.approx(np.concatenate(steps).mean())
            if key == "own":
                cs = O.ceiling_depths(ok_ref)
                want = [correct_at(with_answer_steps(d, e, x), e) for d, e, x in zip(dec, exs, cs)]
                assert want == fa.correct["ceiling"].tolist()
                assert points["ceiling"]["mean_depth"] == pytest.approx(np.concatenate(cs).mean())
                tok_acc, em = O.forced_frame_outcomes(ok_ref, cs)
                assert (fr["ceiling"]["token_accuracy_bound"], fr["ceiling"]["exact_match_bound"]) == pytest.approx(
                    (tok_acc, em)
                )
                assert em >= max(float(np.mean(c)) for c in fa.correct.values())  # a bound, in the forced frame
        assert moved > 0  # the oracle changed some allocation

        # random allocation: replay its batched pass, then the same batches forced to the depths it ran
        q = fr["decider_vs_random"]["own"]["random_rate"]
        for draw in range(2):
            got = np.zeros(len(exs), dtype=bool)
            for b, chunk in enumerate(batch_chunks(exs, opts.batch_size)):
                be = [exs[i] for i in chunk]
                ids, mask, starts = tf_batch(be, pad, "cpu")
                lengths = [len(e.answer_ids) for e in be]
                pol = random_allocation(q, draw)(b, starts, lengths, ids.shape[1])
                depths = model(ids, attention_mask=mask, exit_policy=pol).depths.clamp_min(1)
                logits = model(ids, attention_mask=mask, depth=depths).logits
                for r, i in enumerate(chunk):
                    got[i] = _row_correct(logits[r : r + 1], ids[r : r + 1], starts[r], lengths[r])
            assert got.tolist() == fa.correct["random:own"][draw].tolist(), draw

    t = fr["decider_vs_oracle"]["own"]
    assert t["accuracy_oracle"] == pytest.approx(fa.correct["oracle:own"].mean())
    assert t["accuracy_random"] == pytest.approx(fa.correct["random:own"].mean())
    assert t["gap_closed"] == O.gap_closed(t["accuracy_decider"], t["accuracy_random"], t["accuracy_oracle"])
    ref = paired_comparison(fa.correct["decider:own"], fa.correct["oracle:own"], n_boot=opts.bootstrap_samples)
    assert t["decider_vs_oracle"] == ref


def test_step_losses_of_the_forced_pass_equal_a_forward_per_row(tok):
    """forced_depths_argmax's step_nll / step_correct (batched, left-padded) = a depth-D forward per row."""
    from retrofit.evaluation.decoding import stop_ids, stop_rule
    from retrofit.evaluation.rows import prepare, task_rows
    from retrofit.evaluation.teacher_forced import forced_depths_argmax

    model = mixed_depth_looped(max_depth=3, seed=2)
    opts = EvalOptions(accuracy="teacher_forced_argmax", progress=False, batch_size=4)
    exs = prepare(task_rows("mano", [2, 4], n=3, seed=1), tok, opts)
    is_stop, eos = stop_rule(model, tok), sorted(stop_ids(model, tok))
    res = forced_depths_argmax(model, model_info(model), exs, pad_id(tok), opts, is_stop, 40, "f", eos)
    with torch.no_grad():
        for i, e in enumerate(exs):
            ids, s, m = torch.tensor([e.prompt_ids + e.answer_ids]), len(e.prompt_ids), len(e.answer_ids)
            z = model(ids, depth=3, output_depth_logits=True).depth_logits[:, 0].float().log_softmax(-1)
            for d in (1, 2, 3):
                lp = z[d - 1, torch.arange(m + 1) + s - 1]
                want = [-float(lp[j, t]) for j, t in enumerate(e.answer_ids)] + [-float(lp[m, eos].logsumexp(0))]
                np.testing.assert_allclose(res[d][i]["step_nll"], want, atol=1e-4)
                top = lp.argmax(-1)
                ok = [int(top[j]) == t for j, t in enumerate(e.answer_ids)] + [is_stop(int(top[m]))]
                assert res[d][i]["step_correct"].tolist() == ok


def test_oracle_policy_sets_the_answer_steps_and_keeps_the_prompt(tok):
    from retrofit.evaluation.calibrate import answer_steps_mask
    from retrofit.evaluation.rows import prepare, task_rows
    from retrofit.evaluation.teacher_forced import tf_batch

    model = mixed_depth_looped(max_depth=3, seed=1)
    exs = prepare(task_rows("mano", [3], n=4, seed=0), tok, EvalOptions())
    ids, mask, starts = tf_batch(exs, pad_id(tok), "cpu")
    lengths = [len(e.answer_ids) for e in exs]
    where = answer_steps_mask(starts, lengths, ids.shape[1])
    target = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids, attention_mask=mask).depths
        got = model(ids, attention_mask=mask, exit_policy=O.OracleContinue(target, where)).depths
    real = mask.bool()
    assert torch.equal(got[where], target[where])
    assert torch.equal(got[~where & real], own[~where & real])
    assert not torch.equal(own[where], target[where])
    with pytest.raises(ValueError, match="one shape"):
        O.OracleContinue(target, where[:, :-1])
