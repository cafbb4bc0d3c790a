"""The accuracy–compute frontier (retrofit/evaluation/frontier.py, issue 24), each piece against a slow,
obviously-correct reference: the decider-vs-random statistics against enumeration, the decile table and the
break-even d̄ against hand computations, the frontier's points against separate passes, random allocation
against the decider's d̄ it is matched to, and the main job's report on tiny models.
"""

from __future__ import annotations

import itertools
import json
import types

import numpy as np
import pytest
import torch
from tiny_looped import mixed_depth_looped

from retrofit.evaluation import stats as S
from retrofit.evaluation.decider_metrics import decider_decisions, gain_by_decile
from retrofit.evaluation.models import model_info, pad_id
from retrofit.evaluation.options import EvalOptions

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


_looped = mixed_depth_looped


def _example(prompt_ids, answer_ids, level=1):
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


# ----------------------------------------------------------------------------------------------
# decider vs random: the paired statistics
# ----------------------------------------------------------------------------------------------


def _sign_flip_brute(d):
    """P(|Σ ε_r d_r| >= |Σ d_r|) over all 2^n sign vectors, by enumeration."""
    obs = abs(sum(d))
    hits = sum(
        abs(sum(e * x for e, x in zip(signs, d))) >= obs - 1e-9 for signs in itertools.product((1, -1), repeat=len(d))
    )
    return hits / 2 ** len(d)


@pytest.mark.parametrize("seed", range(6))
def test_sign_flip_exact_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    e = rng.integers(-3, 4, size=int(rng.integers(1, 13)))
    assert S.sign_flip_exact(e) == pytest.approx(_sign_flip_brute(e.tolist()), abs=1e-12)


@pytest.mark.parametrize("a_only,b_only", [(0, 0), (5, 2), (2, 5), (9, 1), (12, 12)])
def test_sign_flip_on_one_draw_is_mcnemar(a_only, b_only):
    """Scores in {−1, 0, 1}: the sign-flip test is the exact McNemar test."""
    scores = [1] * a_only + [-1] * b_only + [0] * 7
    assert S.sign_flip_exact(scores) == pytest.approx(S.mcnemar_exact(a_only, b_only), rel=1e-12)
    with pytest.raises(ValueError, match="integer"):
        S.sign_flip_exact([0.5, 1])


@pytest.mark.parametrize("n,k", [(9, 3), (11, 1), (8, 4)])
def test_paired_vs_draws_matches_brute_force(n, k):
    rng = np.random.default_rng(n * 10 + k)
    a = rng.random(n) < 0.6
    b = rng.random((k, n)) < 0.4
    got = S.paired_vs_draws(a, b, n_boot=400, seed=5, confidence=0.9)
    d = [float(a[r]) - float(b[:, r].mean()) for r in range(n)]
    assert got["n"] == n and got["draws"] == k
    assert got["difference"] == pytest.approx(sum(d) / n, abs=1e-12)
    assert got["accuracy_a"] == pytest.approx(a.mean()) and got["accuracy_b"] == pytest.approx(b.mean())
    assert got["sign_flip_p"] == pytest.approx(_sign_flip_brute(d), abs=1e-12)
    # the bootstrap: rows resampled with replacement, the same generator draws as paired_bootstrap's
    g = np.random.default_rng(5)
    boots = [sum(d[i] for i in g.integers(0, n, size=n)) / n for _ in range(400)]
    obs = sum(d) / n
    assert got["bootstrap"]["ci"] == pytest.approx(list(np.quantile(boots, [0.05, 0.95])), abs=1e-12)
    extreme = sum(abs(x - obs) >= abs(obs) - 1e-12 for x in boots)
    assert got["bootstrap"]["p_value"] == pytest.approx((1 + extreme) / 401)
    for x, pd in zip(b, got["per_draw"]):
        a_only, b_only = int((a & ~x).sum()), int((~a & x).sum())
        assert (pd["a_only"], pd["b_only"]) == (a_only, b_only)
        assert pd["mcnemar_p"] == S.mcnemar_exact(a_only, b_only)
    with pytest.raises(ValueError, match="b_draws"):
        S.paired_vs_draws(a, b[:, :-1])


# ----------------------------------------------------------------------------------------------
# gain per decile of the continue probability
# ----------------------------------------------------------------------------------------------


def test_decider_decisions_hand_built():
    """Each token's decisions d = 1 … min(d*, D − 1), the gain ℓ(d) − ℓ(d+1) from the lookahead at d = d*."""
    nan = float("nan")
    exit_depth = [1, 2, 3, 2]
    nll = [
        [2.0, 1.5, nan],  # d* = 1: one decision (stop), its gain from the lookahead depth 2
        [3.0, 2.0, 1.8],  # d* = 2: continue at 1, stop at 2 (lookahead depth 3)
        [1.0, 0.9, 0.7],  # d* = D = 3: decisions after 1 and 2 only
        [nan, nan, nan],  # no label here: no decision counted
    ]
    cont = [[0.1, 0.9], [0.8, 0.3], [0.7, 0.6], [0.5, 0.5]]
    got = decider_decisions(exit_depth, nll, cont)
    assert got["gain"] == pytest.approx([0.5, 1.0, 0.2, 0.1, 0.2])
    assert got["continue_prob"].tolist() == [0.1, 0.8, 0.3, 0.7, 0.6]
    assert got["depth"].tolist() == [1, 1, 2, 1, 2]
    assert got["continued"].tolist() == [False, True, False, True, True]
    # an early-stopped loop decided fewer depths: the missing column is never read by a token that exited
    short = decider_decisions([1, 1], [[2.0, 1.0, nan], [1.0, 1.5, nan]], [[0.2], [0.4]])
    assert short["gain"] == pytest.approx([1.0, -0.5]) and short["continue_prob"].tolist() == [0.2, 0.4]


def test_gain_by_decile_hand_built():
    # 20 decisions, two per decile: decile i holds probabilities 0.05·(2i − 1), 0.05·2i and gains i, i + 0.5
    probs = np.array([0.05 * j for j in range(1, 21)])
    gains = np.array([(j + 1) // 2 + (0.5 if j % 2 == 0 else 0.0) for j in range(1, 21)])
    perm = np.random.default_rng(0).permutation(20)  # the input order does not matter
    got = gain_by_decile(gains[perm], probs[perm])
    assert got["n_decisions"] == 20 and got["n_bins"] == 10
    for i, b in enumerate(got["bins"], start=1):
        assert b["n"] == 2
        assert b["prob_mean"] == pytest.approx(0.05 * (2 * i - 1 + 2 * i) / 2)
        assert (b["prob_min"], b["prob_max"]) == pytest.approx((0.05 * (2 * i - 1), 0.05 * 2 * i))
        assert b["gain_mean"] == pytest.approx(i + 0.25)
        assert b["share_gain_positive"] == 1.0
    assert got["spearman"] == pytest.approx(1.0)
    assert gain_by_decile(-gains, probs)["spearman"] == pytest.approx(-1.0)
    # 23 decisions: equal-count bins differ by at most one; NaN pairs are dropped; 4 decisions give 4 bins
    g23 = gain_by_decile(np.arange(23.0), np.arange(23.0) / 23)
    assert [b["n"] for b in g23["bins"]] == [3, 3, 3, 2, 2, 2, 2, 2, 2, 2]
    few = gain_by_decile([1.0, np.nan, 2.0, 0.5, 3.0], [0.1, 0.2, 0.3, 0.4, np.nan])
    assert few["n_decisions"] == 3 and [b["gain_mean"] for b in few["bins"]] == [1.0, 2.0, 0.5]
    assert np.isnan(gain_by_decile([1.0, 1.0], [0.1, 0.2])["spearman"])  # constant gain: undefined


def test_gain_table_from_the_model_matches_a_per_row_forward(tok):
    """decision_gains (batched, labelled positions only) = per row: the adaptive forward with labels, its exit
    depths, per-depth losses and TaH2's continue probabilities, unbatched; the depths equal the adaptive pass's."""
    from retrofit.evaluation.frontier import decision_gains
    from retrofit.evaluation.rows import prepare, task_rows

    model = _looped(seed=2)
    rows = task_rows("mano", [2, 3], n=3, seed=1)
    opts = EvalOptions(accuracy="teacher_forced_argmax", progress=False, batch_size=4)
    exs = prepare(rows, tok, opts)
    got = decision_gains(model, model_info(model), exs, pad_id(tok), opts, "gains")
    ref = {"gain": [], "continue_prob": [], "depth": []}
    with torch.no_grad():
        for e in exs:
            ids = torch.tensor([e.prompt_ids + e.answer_ids])
            labels = torch.full_like(ids, -100)
            s = len(e.prompt_ids)
            labels[0, s:] = torch.tensor(e.answer_ids)
            out = model(ids, labels=labels, output_depth_losses=True)
            plain = model(ids)
            assert torch.equal(out.depths, plain.depths)
            for j in range(len(e.answer_ids)):
                t = s - 1 + j
                d_star = int(out.depths[0, t])
                for d in range(1, min(d_star, 2) + 1):
                    ref["gain"].append(float(out.depth_nll[0, t, d - 1] - out.depth_nll[0, t, d]))
                    ref["continue_prob"].append(float(out.halt_signals[0, t, d - 1]))
                    ref["depth"].append(d)
    order = lambda x: np.lexsort((x["depth"], x["continue_prob"]))  # noqa: E731 - batch order differs from row order
    gg = {k: np.asarray(v)[order(got)] for k, v in got.items() if k in ref}
    rr = {k: np.asarray(v)[order(ref)] for k, v in ref.items()}
    assert len(gg["gain"]) == len(rr["gain"]) >= 10
    np.testing.assert_allclose(gg["continue_prob"], rr["continue_prob"], atol=1e-5)
    np.testing.assert_allclose(gg["gain"], rr["gain"], atol=1e-4)
    assert gg["depth"].tolist() == rr["depth"].tolist()
    assert 1 in gg["depth"] and 2 in gg["depth"]  # decisions at more than one depth


# ----------------------------------------------------------------------------------------------
# break-even d̄
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [2, 3])
def test_break_even_mean_depth_vs_hand_computation(D):
    from retrofit.model.flops import break_even_mean_depth, cost_report, model_costs

    model = _looped(max_depth=D, prelude=2, core=2)  # a coda of 2 layers: TaH2 runs it at every depth
    c = model_costs(model)

    def f(d):  # TaH2 per token: prelude, d cores, d − 1 updates, an LM head per depth, the coda at every depth,
        # the decider after every depth but the last
        return (
            2 * (c["prelude"] + d * c["core"] + (d - 1) * c["updater"] + d * c["head"] + D * c["coda"])
            + 2 * min(d, D - 1) * c["decider"]
        )

    fixed = 2 * (c["prelude"] + D * c["core"] + (D - 1) * c["updater"] + c["coda"] + c["head"])
    got = break_even_mean_depth(model)
    assert got["flops_fixed_per_token"] == fixed
    assert got["flops_fixed_per_token"] == cost_report(model, [D])["flops_fixed"]  # the fixed loop's cost
    assert got["flops_at_depth"] == {d: pytest.approx(f(d)) for d in range(1, D + 1)}
    k = next(d for d in range(1, D) if f(d) <= fixed < f(d + 1))
    x = k + (fixed - f(k)) / (f(k + 1) - f(k))
    assert got["mean_depth"] == pytest.approx(x) and got["reason"] is None
    assert 1 < x < D
    # at that d̄ (every token at depth k or k + 1) the adaptive run costs what the fixed loop costs
    share = x - k
    n = 1000
    depths = [k + 1] * round(share * n) + [k] * (n - round(share * n))
    assert cost_report(model, depths)["flops"] / n == pytest.approx(fixed, rel=2e-3)


def test_break_even_mean_depth_edge_cases(monkeypatch):
    import retrofit.model.flops as F

    model = _looped(max_depth=2)
    costs = F.model_costs(model)
    monkeypatch.setattr(F, "model_costs", lambda m: {**costs, "decider": 10 * costs["all_layers"]})
    got = F.break_even_mean_depth(model)
    assert got["mean_depth"] is None and "even every token at depth 1 costs more" in got["reason"]
    monkeypatch.setattr(F, "model_costs", lambda m: {**costs, "decider": 0, "head": 0})  # no readout cost left
    assert F.break_even_mean_depth(model)["mean_depth"] == 2.0


# ----------------------------------------------------------------------------------------------
# the frontier's points
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forced_depths", [True, False])
def test_frontier_points_equal_separate_passes(tok, forced_depths):
    """Forced-depth points (reused from the forced-depth curve, or run on the frontier rows) and decider points
    equal separate argmax passes over the frontier rows (the first rows of each level); the own-threshold point
    is the adaptive pass; FLOPs are cost_report's at the answer steps (no decider for a forced depth)."""
    from retrofit.evaluation import runner as R
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.rows import prepare
    from retrofit.evaluation.teacher_forced import argmax_pass
    from retrofit.model.flops import cost_report

    model = _looped(seed=3)
    rows = R.task_rows("mano", [2, 3, 4], n=4, seed=5)
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        progress=False,
        batch_size=3,
        exit_policies=False,
        forced_depths=forced_depths,
        frontier=True,
        frontier_thresholds=(0.3, 0.5, 0.8),
        frontier_random_draws=0,
        frontier_rows_per_level=3,
        frontier_oracle=False,  # the oracle's points: tests/evaluation/test_oracle.py
    )
    res = R.evaluate_task(model, tok, "mano", rows=rows, options=opts)
    fr = res["frontier"]
    exs = prepare(rows, tok, opts)
    keep = [i for i, e in enumerate(exs) if [x.level for x in exs[: i + 1]].count(e.level) <= 3]
    assert fr["rows"] == len(keep) == 9
    sub = [exs[i] for i in keep]
    info, is_stop = model_info(model), stop_rule(model, tok)
    max_new = max(len(e.answer_ids) for e in exs) + 2
    points = {p["key"]: p for p in fr["points"]}
    assert set(points) == {"forced:1", "forced:2", "forced:3", "decider:own", "decider:0.3", "decider:0.8"}

    def check(point, res_rows, decider):
        steps = np.concatenate([r["step_depths"] for r in res_rows])
        assert point["accuracy"] == pytest.approx(np.mean([r["row_correct"] for r in res_rows]))
        assert point["mean_depth"] == pytest.approx(steps.mean())
        assert point["n"] == len(res_rows)
        rep = cost_report(model, steps, decider=decider)
        assert point["flops_per_token"] == pytest.approx(rep["flops"] / rep["n_tokens"])

    for d in (1, 2, 3):
        check(
            points[f"forced:{d}"],
            argmax_pass(model, info, sub, pad_id(tok), opts, is_stop, max_new, "f", depth=d),
            False,
        )
    for tau in (0.3, 0.8):
        ref = argmax_pass(model, info, sub, pad_id(tok), opts, is_stop, max_new, "t", decider_threshold=tau)
        check(points[f"decider:{tau:g}"], ref, True)
    own = argmax_pass(model, info, sub, pad_id(tok), opts, is_stop, max_new, "own")
    check(points["decider:own"], own, True)
    assert points["decider:own"]["threshold"] == 0.5 and points["decider:own"]["own"]
    # the sweep changes the compute: more depth at the lower τ_exit
    assert points["decider:0.3"]["mean_depth"] > points["decider:0.8"]["mean_depth"]
    assert fr["passes"] == 2 + (0 if forced_depths else 1) + 1  # two thresholds, (the forced depths), the gains


def test_random_allocation_hits_the_deciders_mean_depth_and_is_seeded(tok):
    """At the evaluation level: random allocation of the answer steps at the decider's d̄ measures that d̄ within
    0.02 on >= 10k answer steps, per draw; it is seeded (the same draw repeats exactly, another draw differs);
    prompt positions keep the decider's depths."""
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.frontier import answer_steps_mask, model_frontier, random_allocation, random_rate
    from retrofit.evaluation.teacher_forced import argmax_pass, tf_batch

    model = _looped(seed=1)
    info = model_info(model)
    rng = np.random.default_rng(0)
    exs = [_example(rng.integers(4, 100, size=6).tolist(), rng.integers(4, 100, size=59).tolist()) for _ in range(170)]
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        progress=False,
        batch_size=34,
        frontier=True,
        frontier_thresholds=(),
        frontier_random_draws=2,
    )
    pad, is_stop = pad_id(tok), stop_rule(model, tok)
    own = argmax_pass(model, info, exs, pad, opts, is_stop, 80, "own")
    steps = np.concatenate([r["step_depths"] for r in own])
    assert steps.size >= 10_000 and 1.2 < steps.mean() < 2.8
    entry, arr = model_frontier(model, info, exs, pad, opts, is_stop, 80, "t", "looped", own, None)
    vs = entry["decider_vs_random"]["own"]
    assert vs["decider_mean_depth"] == pytest.approx(steps.mean())
    assert vs["random_rate"] == pytest.approx(random_rate(steps.mean(), 3))
    for d in vs["per_draw"]:
        assert abs(d["mean_depth"] - steps.mean()) < 0.02
    assert abs(vs["random_mean_depth"] - steps.mean()) < 0.02
    assert arr.correct["random:own"].shape == (2, len(exs))
    # seeded: draw 1 again gives the same depths; draw 0 differs
    q = vs["random_rate"]
    again = [
        argmax_pass(model, info, exs, pad, opts, is_stop, 80, "r", policy_for_batch=random_allocation(q, draw))
        for draw in (1, 1, 0)
    ]
    depth = [np.concatenate([r["step_depths"] for r in x]) for x in again]
    assert np.array_equal(depth[0], depth[1]) and not np.array_equal(depth[0], depth[2])
    assert float(depth[0].mean()) == pytest.approx(vs["per_draw"][1]["mean_depth"])
    # one batch at the model level: prompt positions keep the decider's depths, answer steps are redrawn
    ids, mask, starts = tf_batch(exs[:8], pad, "cpu")
    where = answer_steps_mask(starts, [59] * 8, ids.shape[1])
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).depths
        rnd = model(
            ids, attention_mask=mask, exit_policy=random_allocation(q, 0)(0, starts, [59] * 8, ids.shape[1])
        ).depths
    assert torch.equal(ref[~where & mask.bool()], rnd[~where & mask.bool()])
    assert not torch.equal(ref[where], rnd[where])
    assert where.sum() == 8 * 60


# ----------------------------------------------------------------------------------------------
# options, CLI, the main job's report
# ----------------------------------------------------------------------------------------------


def test_frontier_options_validation_and_cli_flags():
    from retrofit.evaluation import cli as C

    with pytest.raises(ValueError, match="teacher_forced_argmax"):
        EvalOptions(frontier=True)
    with pytest.raises(ValueError, match="frontier_thresholds"):
        EvalOptions(frontier_thresholds=(0.5, 1.5))
    with pytest.raises(ValueError, match="frontier_random_draws"):
        EvalOptions(frontier_random_draws=-1)
    with pytest.raises(ValueError, match="frontier_rows_per_level"):
        EvalOptions(frontier_rows_per_level=0)
    assert EvalOptions(frontier_thresholds=[0, 1]).frontier_thresholds == (0.0, 1.0)
    import argparse

    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--model", "x", "--frontier", "--frontier-thresholds", "0.2,0.8", "--frontier-draws", "5"])
    assert a.frontier and a.frontier_thresholds == (0.2, 0.8) and a.frontier_random_draws == 5
    assert a.frontier_rows_per_level is None
    d = p.parse_args(["--model", "x"])
    assert not d.frontier and d.frontier_thresholds == (0.1, 0.3, 0.5, 0.7, 0.9) and d.frontier_random_draws == 3


def test_every_eval_option_has_its_flag_made_from_the_field():
    """``retrofit eval``'s flags are made from ``EvalOptions`` (one per field, its default and help): the main job's
    frontier settings included, so ``retrofit eval`` runs what the main job runs; booleans take true/false, the old
    ``--no-X`` spellings still switch them off."""
    import argparse
    import dataclasses

    import retrofit.evaluation.cli as C

    p = argparse.ArgumentParser()
    C.add_arguments(p)
    d = p.parse_args(["--model", "x"])
    for f in dataclasses.fields(EvalOptions):
        assert getattr(d, f.name) == f.default, f.name
    help_text = p.format_help()
    for f in dataclasses.fields(EvalOptions):
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    a = p.parse_args(
        ["--model", "x", "--frontier-stop-shares", "0.1,0.9", "--bootstrap-samples", "50", "--stats-seed", "3"]
        + ["--confidence", "0.9", "--no-forced-depths", "--exit-policies", "false", "--chat", "--quiet"]
    )
    opts = EvalOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(EvalOptions)})
    assert opts.frontier_stop_shares == (0.1, 0.9) and (opts.bootstrap_samples, opts.stats_seed) == (50, 3)
    assert opts.confidence == 0.9 and not opts.forced_depths and not opts.exit_policies and opts.chat
    assert not opts.progress


def test_option_flags_are_the_inverse_of_the_generated_flags():
    """``option_flags`` (what the main job prints as its reproducing command) parses back to the same options."""
    import argparse
    import dataclasses

    import retrofit.evaluation.cli as C

    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        forced_depths=True,
        exit_policies=False,
        policy_generation=False,
        frontier=True,
        frontier_thresholds=(0.2, 0.8),
        frontier_stop_shares=(0.1, 0.5),
        frontier_random_draws=2,
        frontier_rows_per_level=4,
        difficulty_reference="sft",
        bootstrap_samples=77,
        confidence=0.9,
    )
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--model", "x", *C.option_flags(opts)])
    assert EvalOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(EvalOptions)}) == opts
    assert C.option_flags(EvalOptions()) == []


def test_cli_rows_file_scores_exactly_those_rows(tok, tmp_path):
    """``retrofit eval --rows FILE`` scores the given rows: the same numbers as the API on the same rows, and
    clear errors for a malformed file or a second source of rows."""
    from retrofit.cli import main
    from retrofit.evaluation import evaluate
    from retrofit.evaluation.cli import read_rows, write_rows
    from retrofit.evaluation.rows import task_rows

    ckpt = tmp_path / "ckpt"
    model = _looped(max_depth=2)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    rows = task_rows("mano", levels=[2, 3], n=2, seed=5)
    write_rows(tmp_path / "rows.jsonl", rows)
    assert read_rows(tmp_path / "rows.jsonl") == [dict(r) for r in rows]
    opts = EvalOptions(accuracy="teacher_forced_argmax", exit_policies=False, progress=False)
    api = evaluate(model.eval(), tok, "mano", rows={"mano": rows}, out_dir=tmp_path / "api", options=opts)
    argv = ["eval", "--model", str(ckpt), "--task", "mano", "--rows", str(tmp_path / "rows.jsonl"), "--quiet"]
    argv += ["--accuracy", "teacher_forced_argmax", "--exit-policies", "false", "--out", str(tmp_path / "cli")]
    assert main(argv) == 0
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())
    (name,) = api["models"]
    a, b = api["models"][name]["tasks"]["mano"], cli["models"][next(iter(cli["models"]))]["tasks"]["mano"]
    assert json.dumps(a["levels"], sort_keys=True, default=str) == json.dumps(b["levels"], sort_keys=True)
    (tmp_path / "bad.jsonl").write_text('{"difficulty": 2}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_rows(tmp_path / "bad.jsonl")
    assert main([*argv[:-2], "--levels", "2", "--out", str(tmp_path / "x")]) == 2


def test_cli_frontier_end_to_end(tok, tmp_path, capsys):
    """``retrofit eval --frontier`` writes the frontier into results.json, report.md and accuracy_vs_flops.png."""
    from retrofit.cli import main

    ckpt = tmp_path / "ckpt"
    _looped(max_depth=2).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(ckpt), "--name", "looped", "--compare", "tiny-llama=base", "--task", "mano"]
    argv += ["--levels", "2,3", "--n", "3", "--accuracy", "teacher_forced_argmax", "--no-exit-policies", "--quiet"]
    argv += [
        "--frontier",
        "--frontier-thresholds",
        "0.3,0.7",
        "--frontier-draws",
        "2",
        "--frontier-rows-per-level",
        "2",
    ]
    assert main(argv + ["--out", str(out)]) == 0
    fr = json.loads((out / "results.json").read_text())["frontier"]["mano"]
    assert fr["rows"] == 4 and fr["rows_per_level"] == 2
    keys = {(p["model"], p["key"]) for p in fr["points"]}
    assert ("base", "plain") in keys and ("looped", "decider:0.3") in keys and ("looped", "random:own") in keys
    assert all(len(p["seeds"]) == 2 for p in fr["points"] if p["policy"] == "random")
    assert (out / "accuracy_vs_flops.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "Accuracy–compute frontier" in report and "the oracle at equal compute" in report
    assert "accuracy ceiling" in report and ("looped", "oracle:own") in keys and ("looped", "ceiling") in keys
    with pytest.raises(SystemExit):  # argparse rejects a malformed threshold list
        main(["eval", "--model", str(ckpt), "--frontier-thresholds", "a,b"])
    assert main(["eval", "--model", str(ckpt), "--frontier", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "teacher_forced_argmax" in capsys.readouterr().err


def test_main_job_report_writes_every_new_summary_key(tok, tmp_path, capsys):
    """main_job_report on tiny models (looped TaH2, a fixed-depth control, an SFT stand-in, the base): summary.json
    holds the frontier (every model and policy), the decider-vs-random tests, the gain table, the break-even d̄,
    the fixed-control comparison and every target; the plot is in report/; the summary prints the tables."""
    from retrofit.evaluation.rows import task_rows
    from retrofit.recipe.controls import TrainedControl
    from retrofit.recipe.main_job import ReportInputs, check_targets, main_job_report
    from retrofit.testing import tiny_base

    looped = _looped(max_depth=2, prelude=2, core=2)
    fixed = _looped(max_depth=2, method="fixed", prelude=2, core=2)
    rows = task_rows("mano", [2, 3], n=3, seed=2)
    splits = {"eval": rows, "train": {"difficulty": [2]}}
    script = types.SimpleNamespace(task="mano", eval_levels=None, eval_n=None, n_eval=3)
    controls = {
        "sft": TrainedControl("sft", tiny_base("llama", seed=5), tmp_path / "c-sft", []),
        "fixed": TrainedControl("fixed", fixed, tmp_path / "c-fixed", []),
    }
    summary = main_job_report(
        ReportInputs(
            looped=looped,
            tokenizer=tok,
            pristine=tiny_base("llama", seed=7),
            controls=controls,
            out=tmp_path,
            script=script,
            splits=splits,
            identity_err=0.0,
            t_start=0.0,
            timings={},
        )
    )
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "frontier",
        "frontier_rows",
        "decider_vs_random",
        "gain_by_decile",
        "break_even_mean_depth",
        "fixed_control",
    ):
        assert on_disk.get(key) is not None, key
    assert on_disk["frontier_rows"] == 6
    assert on_disk["frontier_cost"]["looped"]["passes"] >= 5 and on_disk["frontier_cost"]["sft"]["passes"] == 0
    policies = {(p["model"], p["policy"]) for p in on_disk["frontier"]}
    assert policies == {
        ("looped", "decider"),
        ("looped", "random"),
        ("looped", "oracle"),
        ("looped", "ceiling"),
        ("looped", "forced"),
        ("fixed", "forced"),
        ("sft", "plain"),
        ("base", "plain"),
    }
    for p in on_disk["frontier"]:
        lo, hi = p["accuracy_ci"]
        assert 0.0 <= lo <= p["accuracy"] <= hi <= 1.0 and p["flops_per_token"] > 0 and p["n"] == 6
        assert (p["mean_depth"] is None) == (p["policy"] == "plain")
    # the main job places its sweep by compute (FRONTIER_STOP_SHARES): one decider point per stop share
    swept = [p for p in on_disk["frontier"] if p["policy"] == "decider" and not p["own"]]
    assert sorted(p["stop_share"] for p in swept) == [0.5, 0.7, 0.9]
    assert sorted(p["mean_depth"] for p in swept) == [
        p["mean_depth"] for p in sorted(swept, key=lambda p: -p["stop_share"])
    ]
    keys = {p["key"].split(":", 1)[1] for p in swept}
    assert set(on_disk["decider_vs_random"]) == {"own"} | keys
    for t in on_disk["decider_vs_random"].values():
        assert t["draws"] == 2 and len(t["per_draw"]) == 2 and 0.0 <= t["sign_flip_p"] <= 1.0
    # the oracle at every decider point, on the same rows as random allocation; the ceiling beside it
    assert set(on_disk["decider_vs_oracle"]) == set(on_disk["decider_vs_random"])
    for k, t in on_disk["decider_vs_oracle"].items():
        assert t["oracle_mean_depth"] == pytest.approx(t["decider_mean_depth"])
        assert t["accuracy_random"] == pytest.approx(on_disk["decider_vs_random"][k]["accuracy_b"])
        assert t["decider_vs_oracle"]["n"] == 6 and 0.0 <= t["decider_vs_oracle"]["mcnemar_p"] <= 1.0
    ceil = on_disk["accuracy_ceiling"]
    assert 0.0 <= ceil["exact_match_bound"] <= 1.0 and 0.0 <= ceil["token_accuracy_bound"] <= 1.0
    assert on_disk["gain_by_decile"]["n_bins"] == 10
    be = on_disk["break_even_mean_depth"]
    assert be["mean_depth"] is None or 1.0 <= be["mean_depth"] <= 2.0
    fc = on_disk["fixed_control"]
    assert fc["fixed"] == "fixed" and fc["n"] == 6 and fc["flops_ratio"] > 0
    assert {p["key"] for p in fc["frontier_points"]} == {f"decider:{k}" for k in {"own"} | keys}
    assert set(on_disk["targets"]) == {
        "control_learns",
        "looped_beats_control",
        "depth_follows_difficulty",
        "adaptive_not_worse_than_fixed",
        "decider_beats_random",
        "gain_rises_with_continue_probability",
    }
    assert all(isinstance(t["met"], bool) for t in on_disk["targets"].values())
    assert (tmp_path / "report" / "accuracy_vs_flops.png").stat().st_size > 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert results["frontier"]["mano"]["points"] == on_disk["frontier"]
    out = capsys.readouterr().out
    for text in (
        "accuracy-compute frontier",
        "decider vs random at the same d̄",
        "decider vs the oracle at equal compute",
        "accuracy ceiling",
        "realized gain per decile",
        "break-even",
    ):
        assert text in out, text
    # the ANIRA arm adds its own target; without a fixed control or a frontier, the new targets say why not met
    bare = {k: v for k, v in summary.items() if k not in ("fixed_control", "decider_vs_random", "gain_by_decile")}
    bare["looped_method"] = "anira-o"
    t = check_targets(bare)
    assert "anira_depth_follows_level" in t and not t["adaptive_not_worse_than_fixed"]["met"]
    assert "reason" in t["decider_beats_random"] and "reason" in t["gain_rises_with_continue_probability"]


def _without_times(x):
    if isinstance(x, dict):
        return {k: _without_times(v) for k, v in x.items() if k not in ("wall_s",)}
    if isinstance(x, list):
        return [_without_times(v) for v in x]
    return x


def test_shared_first_depth_changes_no_number_of_the_evaluation(tok, monkeypatch):
    """EvalOptions.share_first_depth: the evaluation with its passes sharing their first depth (the teacher-forced
    pass and the forced depths, then the frontier's thresholds, random draws, oracle, ceiling and gains) equals,
    number for number, the evaluation where every pass computes everything; and the sharing does happen."""
    from retrofit.evaluation import runner as R
    from retrofit.model import backends

    stores = []  # every FirstDepthShare the evaluation opens, in order
    init = backends.FirstDepthShare.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        stores.append(self)

    monkeypatch.setattr(backends.FirstDepthShare, "__init__", recording)

    model = _looped(max_depth=2, seed=3)
    rows = R.task_rows("mano", [2, 3], n=4, seed=5)
    opts = dict(
        accuracy="teacher_forced_argmax",
        progress=False,
        batch_size=3,
        exit_policies=False,
        forced_depths=True,
        frontier=True,
        frontier_stop_shares=(0.3, 0.7),
        frontier_random_draws=2,
        frontier_rows_per_level=3,
    )
    shared = R.evaluate_task(model, tok, "mano", rows=rows, options=EvalOptions(**opts))
    n_hits = [st.hits for st in stores]
    alone = R.evaluate_task(model, tok, "mano", rows=rows, options=EvalOptions(**opts, share_first_depth=False))
    assert [st.hits for st in stores] == n_hits  # the second evaluation shared nothing
    assert len(n_hits) == 2 and n_hits[0] >= 3 and n_hits[1] >= 2 * 6  # forced depths; the frontier's passes
    assert json.dumps(_without_times(shared), sort_keys=True, default=str) == json.dumps(
        _without_times(alone), sort_keys=True, default=str
    )
    fr = shared["frontier"]
    assert {p["policy"] for p in fr["points"]} >= {"decider", "random", "oracle", "ceiling", "forced"}
