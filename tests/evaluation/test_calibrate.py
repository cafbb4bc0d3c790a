"""Placing a decider by compute (retrofit/evaluation/calibrate.py): stop-share thresholds against hand
computations and brute-force counts, calibration of a model's own threshold against a separate teacher-forced
pass, the frontier's stop-share sweep, and the threshold written into a saved checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_looped import mixed_depth_looped

from retrofit.evaluation.calibrate import (
    calibrate_stop_share,
    first_decisions,
    realized_stop_share,
    threshold_for_stop_share,
    write_threshold,
)
from retrofit.evaluation.models import model_info, pad_id
from retrofit.evaluation.options import EvalOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def _looped(method="tah2", max_depth=2, seed=1):
    return mixed_depth_looped(max_depth, method, seed, spread_anira=True)


def _rows():
    from retrofit.evaluation.runner import task_rows

    return task_rows("mano", [2, 3, 4], n=4, seed=5)


def test_threshold_for_stop_share_hand_built():
    c = [0.4, 0.1, 0.3, 0.2]
    # TaH2: continue iff c >= τ — half stop at the midpoint of 0.2 and 0.3
    assert threshold_for_stop_share(c, 0.5, "tah2") == pytest.approx(0.25)
    assert threshold_for_stop_share(c, 0.0, "tah2") == 0.0  # every decision continues
    assert realized_stop_share(c, threshold_for_stop_share(c, 1.0, "tah2"), "tah2") == 1.0
    assert threshold_for_stop_share(c, 0.25, "tah2") == pytest.approx(0.15)
    # ANIRA: continue iff c > 1 - u — stop iff c <= 0.25, u = 0.75
    for m in ("anira-o", "anira-e"):
        assert threshold_for_stop_share(c, 0.5, m) == pytest.approx(0.75)
        assert realized_stop_share(c, threshold_for_stop_share(c, 0.0, m), m) == 0.0
        assert threshold_for_stop_share(c, 1.0, m) == 0.0
    with pytest.raises(ValueError, match="stop share"):
        threshold_for_stop_share(c, 1.5, "tah2")
    with pytest.raises(ValueError, match="no decisions"):
        threshold_for_stop_share([], 0.5, "tah2")
    with pytest.raises(ValueError, match="allowed"):
        threshold_for_stop_share(c, 0.5, "fixed")


@pytest.mark.parametrize("method", ["tah2", "anira-o", "anira-e"])
def test_stop_share_matches_a_brute_force_count(method):
    """On distinct probabilities (a narrow band included), the realized share is round(s · n) / n exactly,
    counted decision by decision with the method's own rule."""
    rng = np.random.default_rng(0)
    for n in (1, 7, 100):
        for c in (rng.random(n), 0.86 + 0.03 * rng.random(n)):
            for s in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
                tau = threshold_for_stop_share(c, s, method)
                stops = sum((x < tau) if method == "tah2" else (x <= 1 - tau) for x in c)
                assert stops == round(s * n), (n, s, tau)
                assert realized_stop_share(c, tau, method) == pytest.approx(stops / n)


@pytest.mark.parametrize("method", ["tah2", "anira-o"])
def test_calibrated_threshold_gives_the_share_in_a_separate_pass(tok, method):
    """Calibrating on rows sets the model's own threshold; a separate teacher-forced argmax pass at that
    threshold (no call-time threshold) stops exactly that share of the answer steps at depth 1 (M = 2)."""
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.rows import prepare
    from retrofit.evaluation.teacher_forced import argmax_pass

    model = _looped(method)
    rows = _rows()
    res = calibrate_stop_share(model, tok, rows, 0.4, progress=False)
    field = {"tah2": "exit_threshold", "anira-o": "halt_threshold"}[method]
    assert res["field"] == field and model.config.loop["options"][field] == res["threshold"]  # the method's option
    assert getattr(model.loop.method_options, field) == pytest.approx(res["threshold"])
    assert abs(res["realized_stop_share"] - 0.4) <= 1.0 / res["n_decisions"] + 1e-9
    opts = EvalOptions(accuracy="teacher_forced_argmax", progress=False, batch_size=5)
    exs = prepare(rows, tok, opts)
    out = argmax_pass(model, model_info(model), exs, pad_id(tok), opts, stop_rule(model, tok), 40, "own")
    depths = np.concatenate([r["step_depths"] for r in out])
    assert depths.size == res["n_decisions"]
    assert float((depths == 1).mean()) == pytest.approx(res["realized_stop_share"])


def test_calibrate_refuses_a_method_without_an_own_threshold(tok):
    with pytest.raises(ValueError, match="allowed: tah2, anira-o"):
        calibrate_stop_share(_looped("anira-e"), tok, _rows(), 0.5, progress=False)


def test_frontier_stop_shares_place_the_sweep_by_compute(tok):
    """At M = 2 the point of stop share s has d̄ = 2 − (realized share) on the frontier rows; the points carry
    their share; one pass more than the threshold sweep's."""
    from retrofit.evaluation import runner as R
    from retrofit.evaluation.rows import prepare

    model = _looped("tah2")
    rows = _rows()
    shares = (0.2, 0.5, 0.8)
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        progress=False,
        batch_size=4,
        exit_policies=False,
        forced_depths=True,
        frontier=True,
        frontier_stop_shares=shares,
        frontier_random_draws=0,
        frontier_oracle=False,  # its passes: tests/evaluation/test_oracle.py
    )
    fr = R.evaluate_task(model, tok, "mano", rows=rows, options=opts)["frontier"]
    c1 = first_decisions(model, prepare(rows, tok, opts), pad_id(tok), batch_size=4)
    got = {p["stop_share"]: p for p in fr["points"] if p.get("stop_share") is not None}
    assert set(got) == set(shares)
    for s, p in got.items():
        assert p["threshold"] == pytest.approx(threshold_for_stop_share(c1, s, "tah2"))
        assert p["mean_depth"] == pytest.approx(2.0 - realized_stop_share(c1, p["threshold"], "tah2"))
        assert abs(p["mean_depth"] - (2.0 - s)) <= 1.0 / c1.size + 1e-9
    assert fr["passes"] == 1 + len(shares) + 1  # the placement pass, the shares, the gains (forced reused)
    with pytest.raises(ValueError, match="frontier_stop_shares"):
        EvalOptions(frontier_stop_shares=(0.5, 2.0))


def test_write_threshold_into_a_saved_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _looped("tah2")
    model.save_pretrained(tmp_path / "final")
    assert write_threshold(tmp_path / "final", "exit_threshold", 0.8731)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert back.loop.method_options.exit_threshold == pytest.approx(0.8731)
    (tmp_path / "adapter").mkdir()
    assert not write_threshold(tmp_path / "adapter", "exit_threshold", 0.5)  # no looped config: untouched


def test_recipe_rejects_a_bad_stop_share():
    from retrofit.model.errors import RetrofitUserError
    from retrofit.recipe import ScriptArgs

    with pytest.raises(RetrofitUserError, match="calibrate_stop_share"):
        ScriptArgs(calibrate_stop_share=1.5)
    with pytest.raises(RetrofitUserError, match="calibrate_rows"):
        ScriptArgs(calibrate_rows=0)
