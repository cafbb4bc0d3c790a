"""Tests for retrofit.evaluation: metrics, plots, HTML, reports (CPU, seconds)."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import scipy.stats
import torch

from retrofit.evaluation.html import ansi_depth_text, depth_colored_html, write_depth_html
from retrofit.evaluation.metrics import (
    LOSS_CHANGE_BIN_EDGES,
    accuracy_by_level,
    cost_exec,
    expected_depth,
    flops_ratio,
    linear_regression,
    loss_change_stats,
    regression_with_control,
    spearman,
)
from retrofit.evaluation.plots import (
    plot_accuracy_vs_compute,
    plot_accuracy_vs_difficulty,
    plot_depth_vs_difficulty,
    plot_loss_change_histogram,
)
from retrofit.evaluation.report import summary_table, write_json, write_markdown_report
from retrofit.hub.atomic_io import write_json_atomic

# ----------------------------------------------------------------------------------------------
# spearman
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_spearman_matches_scipy_with_ties(seed):
    stats = scipy.stats  # the test extra installs scipy: a missing scipy fails here instead of skipping
    rng = np.random.default_rng(seed)
    n = 200
    x = rng.integers(0, 6, size=n).astype(float)  # heavy ties
    y = 0.5 * x + rng.integers(0, 4, size=n)  # ties too, correlated
    ref = stats.spearmanr(x, y).statistic
    assert spearman(x, y) == pytest.approx(ref, abs=1e-12)
    z = rng.normal(size=n)
    assert spearman(z, y) == pytest.approx(stats.spearmanr(z, y).statistic, abs=1e-12)


def test_spearman_edge_cases():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3]), np.array([3, 2, 1])) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # constant side -> nan
    with pytest.raises(ValueError, match="x has 3 values but y has 2"):
        spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2"):
        spearman([1.0], [2.0])
    # NaN pairs are dropped by default, rejected with nan_policy="raise"
    assert spearman([1, 2, np.nan, 4], [1, 2, 3, 4]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="non-finite"):
        spearman([1, 2, np.nan, 4], [1, 2, 3, 4], nan_policy="raise")
    with pytest.raises(ValueError, match="at least 2"):
        spearman([np.nan, 1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------------------------
# regression
# ----------------------------------------------------------------------------------------------


def test_linear_regression_recovers_planted_coefficients():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=500), rng.normal(size=500)
    y = 2 * a - 3 * b + 1 + 1e-3 * rng.normal(size=500)
    out = linear_regression(np.column_stack([a, b]), y, ["a", "b"])
    assert out["coefficients"]["a"] == pytest.approx(2, abs=1e-2)
    assert out["coefficients"]["b"] == pytest.approx(-3, abs=1e-2)
    assert out["intercept"] == pytest.approx(1, abs=1e-2)
    assert out["r2"] > 0.99 and out["n"] == 500 and out["rank"] == 3
    with pytest.raises(ValueError, match="feature names"):
        linear_regression(np.column_stack([a, b]), y, ["a"])
    with pytest.raises(ValueError, match="rows"):
        linear_regression(np.column_stack([a, b]), y[:-1], ["a", "b"])


def test_regression_with_control_recovers_coefficients_with_group_offsets():
    rng = np.random.default_rng(1)
    n = 600
    groups = rng.choice([10, 20, 30], size=n)  # BREVO node count N
    offsets = {10: 0.0, 20: 4.0, 30: -2.5}
    # Feature correlated with the group, so ignoring the control would bias the slope.
    a = rng.normal(size=n) + groups / 10
    b = rng.normal(size=n)
    y = 2 * a - 3 * b + 1 + np.array([offsets[g] for g in groups]) + 1e-3 * rng.normal(size=n)
    out = regression_with_control(np.column_stack([a, b]), y, ["a", "b"], groups)
    assert out["coefficients"]["a"] == pytest.approx(2, abs=1e-2)
    assert out["coefficients"]["b"] == pytest.approx(-3, abs=1e-2)
    assert out["intercept"] == pytest.approx(1, abs=1e-2)
    assert out["reference_group"] == 10 and out["n_groups"] == 3
    assert out["group_effects"][20] == pytest.approx(4.0, abs=1e-2)
    assert out["group_effects"][30] == pytest.approx(-2.5, abs=1e-2)
    assert out["r2"] > 0.99
    assert out["r2_controls"] < out["r2"] and out["r2_gain"] == pytest.approx(out["r2"] - out["r2_controls"])
    # Without the control the slope of a is biased by the group offsets.
    naive = linear_regression(np.column_stack([a, b]), y, ["a", "b"])
    assert abs(naive["coefficients"]["a"] - 2) > 0.1


# ----------------------------------------------------------------------------------------------
# loss change
# ----------------------------------------------------------------------------------------------


def test_loss_change_stats_known_shares():
    first = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0])
    # deltas: 0, +5e-4, -5e-4 (unchanged x3), +0.5, +0.2 (worse x2),
    #         -1, -0.3, -0.01, -2 (improved x4), 7 (masked out)
    delta = np.array([0.0, 5e-4, -5e-4, 0.5, 0.2, -1.0, -0.3, -0.01, -2.0, 7.0])
    mask = np.array([True] * 9 + [False])
    s = loss_change_stats(torch.tensor(first), torch.tensor(first + delta), tol=1e-3, mask=torch.tensor(mask))
    assert s["n"] == 9
    assert s["share_unchanged"] == pytest.approx(3 / 9)
    assert s["share_worse"] == pytest.approx(2 / 9)
    assert s["share_improved"] == pytest.approx(4 / 9)
    assert s["mean_delta"] == pytest.approx(delta[:9].mean())
    assert sum(s["counts"]) == 9
    assert s["bin_edges"] == pytest.approx(list(LOSS_CHANGE_BIN_EDGES))
    assert len(s["counts"]) == len(s["bin_edges"]) - 1 == 81
    centre = s["counts"][40]  # bin [-0.05, 0.05): three unchanged tokens and -0.01
    assert centre == 4
    json.dumps(s)  # plain Python types only


def test_loss_change_stats_clips_outliers_and_handles_empty():
    s = loss_change_stats(np.zeros(3), np.array([-10.0, 0.0, 10.0]))
    assert s["counts"][0] == 1 and s["counts"][-1] == 1
    assert s["n_clipped_low"] == 1 and s["n_clipped_high"] == 1
    e = loss_change_stats(np.zeros(2), np.ones(2), mask=np.zeros(2, dtype=bool))
    assert e["n"] == 0 and math.isnan(e["share_unchanged"]) and sum(e["counts"]) == 0
    with pytest.raises(ValueError, match="shape"):
        loss_change_stats(np.zeros(2), np.zeros(3))


# ----------------------------------------------------------------------------------------------
# cost and FLOPs
# ----------------------------------------------------------------------------------------------


def test_cost_exec_hand_worked():
    depths = torch.tensor([[1, 2, 3], [2, 2, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    c = cost_exec(depths, mask=mask, max_depth=3)
    # valid depths 1,2,3,2,2: |A_1| = 5, |A_2| = 4, |A_3| = 1
    assert c["active_per_depth"] == [5, 4, 1]
    assert c["cost_exec"] == 10 == int(depths[mask].sum())
    assert c["n_tokens"] == 5
    assert c["mean_depth"] == pytest.approx(2.0)
    assert c["saving"] == pytest.approx(2 / 3)
    assert c["depth_histogram"] == [1, 3, 1]
    assert c["cost_fixed"] == 15
    # D larger than any observed depth: trailing zeros
    c4 = cost_exec(np.array([1, 1, 2]), max_depth=4)
    assert c4["active_per_depth"] == [3, 1, 0, 0] and c4["saving"] == pytest.approx(4 / 3 / 4)
    with pytest.raises(ValueError, match="1..3"):
        cost_exec(depths, max_depth=3)  # the masked 0 is now valid -> out of range
    with pytest.raises(ValueError, match="1..2"):
        cost_exec([1, 3], max_depth=2)


def test_flops_ratio_hand_computed():
    # 24-layer base, prelude 4 / core 16 / coda 4, D = 2, d̄ = 1.25
    r = flops_ratio(1.25, 2, n_layers=24, prelude=4, core=16, coda=4)
    assert r["layers_base"] == 24
    assert r["layers_fixed"] == 4 + 32 + 4 == 40
    assert r["layers_adaptive"] == pytest.approx(4 + 20 + 4)
    assert r["adaptive_vs_fixed"] == pytest.approx(28 / 40)
    assert r["adaptive_vs_base"] == pytest.approx(28 / 24)
    assert r["fixed_vs_base"] == pytest.approx(40 / 24)
    # whole-stack loop at d̄ = 1 costs exactly the base model
    assert flops_ratio(1.0, 4, 12, 0, 12, 0)["adaptive_vs_base"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mean_depth"):
        flops_ratio(3.0, 2, 24, 4, 16, 4)


def test_accuracy_by_level_and_expected_depth():
    recs = [
        {"level": 2, "correct": True, "mean_depth": 1.0},
        {"level": 2, "correct": False, "mean_depth": 2.0},
        {"level": 1, "correct": True},
        {"level": 1, "correct": True, "mean_depth": 1.5},
    ]
    out = accuracy_by_level(recs)
    assert list(out) == [1, 2]
    assert out[2]["accuracy"] == 0.5 and out[2]["n"] == 2
    assert out[2]["accuracy_se"] == pytest.approx(math.sqrt(0.25 / 2))
    assert out[2]["mean_depth"] == pytest.approx(1.5)
    assert out[2]["mean_depth_se"] == pytest.approx(np.std([1.0, 2.0], ddof=1) / math.sqrt(2))
    assert out[1]["accuracy"] == 1.0 and out[1]["accuracy_se"] == 0.0
    assert out[1]["mean_depth"] == 1.5 and out[1]["n_depth"] == 1 and math.isnan(out[1]["mean_depth_se"])

    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], requires_grad=True)
    e = expected_depth(q)
    assert torch.allclose(e, torch.tensor([1.5, 3.0]))
    e.sum().backward()  # differentiable (used in KL-to-prior losses)
    assert torch.allclose(q.grad, torch.tensor([[1.0, 2, 3], [1, 2, 3]]))
    assert float(expected_depth(np.array([0.25, 0.25, 0.5]))) == pytest.approx(2.25)


# ----------------------------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------------------------


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _assert_png(path):
    from PIL import Image

    assert os.path.getsize(path) > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] > 100 and im.size[1] > 100


def test_plots_write_pngs(tmp_path):
    depth = {"tah2": {4: 1.2, 8: 1.6, 16: 2.4}, "anira-o": {"4": 1.1, "8": 1.9, "16": float("nan")}}
    acc = {"base": {4: 0.9, 8: 0.6, 16: 0.2}, "tah2": {4: 0.95, 8: 0.8, 16: 0.3}}
    _assert_png(plot_depth_vs_difficulty(depth, tmp_path / "depth.png", max_depth=3))
    _assert_png(plot_accuracy_vs_difficulty(acc, tmp_path / "sub" / "acc.png", train_levels=(4, "8")))
    _assert_png(
        plot_accuracy_vs_difficulty({"m": {"MAIN": 0.8, "P1": 0.6, "P2": 0.4}}, tmp_path / "gsm.png", ("MAIN",))
    )
    pts = {
        "tah2": [(1, 0.5, 1), (2, 0.6, "d=2"), (3, 0.62, "depth 3"), (1.4, 0.61, "τ=0.5")],
        "base": [(1, 0.45, "base")],
    }
    _assert_png(plot_accuracy_vs_compute(pts, tmp_path / "scaling.png"))
    _assert_png(plot_accuracy_vs_compute(pts, tmp_path / "scaling_log.png", logx=True))
    rng = np.random.default_rng(0)
    deltas = np.concatenate([np.zeros(50), rng.normal(0, 1, 50)])
    _assert_png(plot_loss_change_histogram(deltas, tmp_path / "lc1.png"))
    stats = loss_change_stats(np.zeros(100), deltas)
    _assert_png(plot_loss_change_histogram(stats, tmp_path / "lc2.png", log_y=True))
    _assert_png(
        plot_loss_change_histogram({"ouro": stats, "huginn": torch.tensor(deltas[::-1].copy())}, tmp_path / "lc3.png")
    )


# ----------------------------------------------------------------------------------------------
# HTML / terminal
# ----------------------------------------------------------------------------------------------


def test_depth_html_escapes_and_one_span_per_token(tmp_path):
    tokens = ["<b>", "bold", " & ", "\n", "x"]
    depths = [1, 3, 2, 4, 0]
    page = depth_colored_html(tokens, depths, max_depth=4, title="a <script> title")
    assert page.startswith("<!DOCTYPE html>")
    assert "<b>" not in page and "&lt;b&gt;" in page and "&amp;" in page
    assert "<script>" not in page
    spans = re.findall(r'<span class="tok d(\d+)" title="([^"]*)" data-depth="(\d+)">', page)
    assert len(spans) == len(tokens)
    assert [int(s[0]) for s in spans] == depths
    assert [s[1] for s in spans] == ["depth 1", "depth 3", "depth 2", "depth 4", "no depth"]
    assert "white-space:pre-wrap" in page
    assert "mean depth d̄ = 2.50" in page  # over the 4 tokens with a depth
    assert "http" not in page  # no external assets
    for d in range(1, 5):
        assert f'class="swatch d{d}"' in page
    with pytest.raises(ValueError, match="outside"):
        depth_colored_html(["a"], [5], max_depth=4)
    with pytest.raises(ValueError, match="tokens"):
        depth_colored_html(["a", "b"], [1], max_depth=4)

    out = write_depth_html(
        [
            {"tokens": ["a", "b"], "depths": [1, 2], "title": "s1"},
            {"tokens": ["c"], "depths": torch.tensor([2])},
        ],
        tmp_path / "d.html",
        max_depth=2,
    )
    text = _read(out)
    assert text.count('<span class="tok ') == 3 and "s1" in text

    t = ansi_depth_text(tokens, depths, max_depth=4)
    assert t.plain == "".join(tokens)
    assert len({str(span.style) for span in t.spans}) >= 4


# ----------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------


def _results():
    return {
        "config": {"base_model": "tiny-llama", "max_depth": 3, "seeds": [0, 1]},
        "models": {
            "base": {"tasks": {"mano": {"levels": {4: {"accuracy": 0.9, "n": 100}, 8: {"accuracy": 0.5, "n": 100}}}}},
            "tah2": {
                "tasks": {
                    "mano": {
                        "levels": {
                            "4": {
                                "accuracy": 0.95,
                                "mean_depth": 1.2,
                                "cost_exec": 1200,
                                "saving": 0.4,
                                "n": 100,
                            },
                            "8": {
                                "accuracy": 0.7,
                                "mean_depth": 2.1,
                                "cost_exec": 2100,
                                "saving": 0.7,
                                "n": 100,
                            },
                        },
                        "forced_depth_accuracy": {1: 0.6, 2: 0.7, 3: 0.72},
                        "exit_policies": {
                            "tah2": {"accuracy": 0.71, "mean_depth": 1.6},
                            "kl": {"accuracy": 0.65, "mean_depth": 2.0},
                        },
                        "spearman": {"expansion": 0.666, "convergence": {"rho": 0.4, "n": 1000}},
                        "regression": {
                            "coefficients": {"hub_out_degree": 0.3},
                            "intercept": 1.0,
                            "r2": 0.72,
                            "r2_controls": 0.5,
                            "n": 900,
                        },
                        "loss_change": loss_change_stats(np.zeros(4), np.array([0.0, 0.0, 0.5, -0.5])),
                    }
                }
            },
        },
    }


def test_markdown_report_tables_and_missing_sections(tmp_path):
    plot = tmp_path / "plots" / "acc.png"
    plot.parent.mkdir()
    plot.write_bytes(b"")
    path = write_markdown_report(_results(), tmp_path / "report.md", plots={"accuracy vs difficulty": plot})
    md = _read(path)
    assert "## Task: mano" in md
    assert "| level | n | acc (base) | acc (tah2) | d̄ (tah2) | d̄/D (tah2) | Cost_exec (tah2) |" in md
    # level keys 4 (base) and "4" (tah2, as after a JSON round trip) are one row
    assert md.count("| 4 | 100 | 90.0% | 95.0% | 1.20 | 0.40 | 1,200 |") == 1
    assert "| 8 | 100 | 50.0% | 70.0% | 2.10 | 0.70 | 2,100 |" in md
    assert "| 3 | 72.0% |" in md  # scaling table row
    assert "| tah2 | kl | 65.0% | 2.00 | – |" in md
    assert "| tah2 | expansion | 0.666 | – |" in md and "| tah2 | convergence | 0.400 | 1,000 |" in md
    assert "| tah2 | hub_out_degree | 0.300 |" in md and "| tah2 | 0.720 | 0.500 | 900 |" in md
    assert "| tah2 | 0.001 | 50.0% | 25.0% | 25.0% | 0.0000 | 4 |" in md
    assert "![accuracy vs difficulty](plots/acc.png)" in md

    # Missing / empty sections are skipped, not errors.
    for results in (
        {},
        {"models": {}},
        {"models": {"m": {"tasks": {"t": {}}}}},
        {"models": {"m": {"tasks": {"t": {"levels": {1: {"n": 3}}}}}}},
    ):
        md = _read(write_markdown_report(results, tmp_path / "r2.md"))
        assert md.startswith("# Retrofit evaluation report")
        assert "Exit policies" not in md and "loss change" not in md

    # JSON round trip (keys become strings) renders the same level rows.
    write_json(_results(), tmp_path / "results.json")
    reloaded = json.loads(_read(tmp_path / "results.json"))
    md2 = _read(write_markdown_report(reloaded, tmp_path / "r3.md"))
    assert "| 4 | 100 | 90.0% | 95.0% | 1.20 | 0.40 | 1,200 |" in md2

    table = summary_table(_results())
    assert table.row_count == 4


def test_strict_json_writer_converts_and_is_atomic(tmp_path):
    path = tmp_path / "out.json"
    obj = {
        "np_float": np.float32(0.5),
        "np_int": np.int64(3),
        "nan": float("nan"),
        "np_nan": np.float64("nan"),
        "arr": np.array([[1.0, np.nan], [np.inf, 2.0]]),
        "tensor": torch.tensor([1.5, float("nan")]),
        "scalar_tensor": torch.tensor(7),
        "bool": np.bool_(True),
        np.int64(4): "int key",
        "tuple": (1, 2),
    }
    write_json_atomic(path, obj, strict=True)
    back = json.loads(_read(path))
    assert back == {
        "np_float": 0.5,
        "np_int": 3,
        "nan": None,
        "np_nan": None,
        "arr": [[1.0, None], [None, 2.0]],
        "tensor": [1.5, None],
        "scalar_tensor": 7,
        "bool": True,
        "4": "int key",
        "tuple": [1, 2],
    }
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"object at \$\.models\.bad"):
        write_json_atomic(path, {"models": {"bad": object()}}, strict=True)
    assert path.read_bytes() == before  # old file intact
    assert sorted(os.listdir(tmp_path)) == ["out.json"]  # no temp file left behind
    # the old name, with its argument order, writes the same bytes
    assert write_json(obj, tmp_path / "old.json") == str(tmp_path / "old.json")
    assert (tmp_path / "old.json").read_bytes() == before
