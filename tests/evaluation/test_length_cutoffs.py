"""Accuracy by output length (``EvalOptions.length_cutoffs``, retrofit/evaluation/length_cutoffs.py): the curve on a
hand-built case, and on a tiny looped model against separate generations at each budget (brute force)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_looped import mixed_depth_looped

from retrofit.evaluation import evaluate
from retrofit.evaluation.decoding import greedy_generate
from retrofit.evaluation.length_cutoffs import length_cutoff_curve, slope_per_doubling
from retrofit.evaluation.models import flops_per_token, model_info
from retrofit.evaluation.options import EvalOptions
from retrofit.evaluation.rows import prepare, task_rows


def test_curve_on_a_hand_built_case():
    """Two rows: one answers "ab" in 2 steps then stops, one needs 4 steps; a step at depth d costs 10·d."""
    gens = [{"ids": [1, 2, 0], "depths": [1, 2, 1]}, {"ids": [3, 3, 1, 2], "depths": [2, 2, 2, 1]}]
    letters = {0: "", 1: "a", 2: "b", 3: "x"}

    def decode(ids):
        return "".join(letters[i] for i in ids)

    def score(i, text):
        return text.endswith("ab")

    res = length_cutoff_curve(gens, decode, score, [1, 2, 4], {1: 10.0, 2: 20.0})
    p1, p2, p4 = res["points"]
    assert [p["accuracy"] for p in res["points"]] == [0.0, 0.5, 1.0]
    assert p1["decode_flops_per_row"] == (10 + 20) / 2  # each row's first step
    assert p2["decode_flops_per_row"] == (30 + 40) / 2
    assert p4["decode_flops_per_row"] == (40 + 70) / 2
    assert (p1["mean_tokens"], p2["mean_tokens"], p4["mean_tokens"]) == (1.0, 2.0, 3.5)
    assert p4["mean_depth"] == pytest.approx(11 / 7) and p4["stopped"] == 1.0 and p2["stopped"] == 0.0
    x = np.log2([15.0, 35.0, 55.0])
    assert res["slope_per_doubling"] == pytest.approx(np.polyfit(x, [0.0, 0.5, 1.0], 1)[0])
    assert slope_per_doubling([5.0, 5.0], [0.1, 0.9]) is None
    with pytest.raises(ValueError, match="2 generated ids but 1 depths"):
        length_cutoff_curve([{"ids": [1, 2], "depths": [1]}], decode, score, [1], {1: 1.0})


def test_options_refuse_bad_cutoffs():
    with pytest.raises(ValueError, match="increasing positive ints"):
        EvalOptions(length_cutoffs=(8, 4))
    with pytest.raises(ValueError, match="needs accuracy='generate'"):
        EvalOptions(length_cutoffs=(4, 8), accuracy="teacher_forced_argmax")


def test_cutoffs_equal_separate_generations(tok, tmp_path):
    """Each cutoff's accuracy, tokens and decode FLOPs equal a separate greedy generation with that budget."""
    model = mixed_depth_looped(max_depth=2, seed=3)
    info = model_info(model)
    rows = task_rows("mano", levels=[2, 3], n=3, seed=1)
    cuts = (1, 2, 4, 8)
    opts = EvalOptions(length_cutoffs=cuts, max_new_tokens=8, forced_depths=False, exit_policies=False)
    opts.progress = False
    res = evaluate(model, tok, "mano", rows={"mano": rows}, options=opts, out_dir=tmp_path)
    curve = next(iter(res["models"].values()))["tasks"]["mano"]["length_cutoffs"]
    assert [p["cutoff"] for p in curve["points"]] == list(cuts) and curve["n"] == len(rows)
    assert (tmp_path / "report.md").read_text().count("Accuracy by output length") == 1

    from data_prep.tasks import get_task

    task = get_task("mano")
    examples = prepare(rows, tok, opts)
    prompts = [e.prompt_ids for e in examples]
    for p in curve["points"]:
        gens = greedy_generate(model, tok, prompts, p["cutoff"], batch_size=opts.batch_size)
        correct = [task.score(g["text"], e.row["answer"], prompt=e.row["prompt"]) for g, e in zip(gens, examples)]
        assert p["accuracy"] == pytest.approx(float(np.mean(correct)))
        assert p["mean_tokens"] == pytest.approx(np.mean([len(g["ids"]) for g in gens]))
        flops = [flops_per_token(model, info, g["depths"]) * len(g["depths"]) if g["depths"] else 0.0 for g in gens]
        assert p["decode_flops_per_row"] == pytest.approx(float(np.mean(flops)), rel=1e-9)
        steps = torch.tensor([d for g in gens for d in g["depths"]], dtype=torch.float64)
        assert p["mean_depth"] == pytest.approx(float(steps.mean()))
    assert curve["points"][-1]["decode_flops_per_row"] > curve["points"][0]["decode_flops_per_row"]


def test_a_cutoff_above_the_budget_is_a_clear_error(tok):
    model = mixed_depth_looped(max_depth=2, seed=3)
    rows = task_rows("mano", levels=[2], n=1, seed=1)
    opts = EvalOptions(length_cutoffs=(4, 64), max_new_tokens=8, progress=False)
    with pytest.raises(ValueError, match="generation budget .* is 8: set max_new_tokens >= 64"):
        evaluate(model, tok, "mano", rows={"mano": rows}, options=opts)
