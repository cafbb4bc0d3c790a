"""The recipes' data: the validation split, and training text equal to the text evaluation scores."""

from __future__ import annotations

import datasets

from data_prep.tasks import build_splits, get_task
from retrofit.training import format_sft_dataset


def test_valid_split_is_disjoint_from_train_and_every_test_split():
    sp = build_splits(
        "clrs_sorting",
        n_train=40,
        n_eval=15,
        seed=3,
        train_levels=[4, 5],
        extrap_levels=[8],
        interp_levels=[],
        n_valid=12,
    )
    task = get_task("clrs_sorting")
    keys = {name: {task.dedup_key(r) for r in sp[name]} for name in sp}
    assert sorted(sp["valid"]["difficulty"]) == [4] * 12 + [5] * 12 + [8] * 12
    for other in ("train", "eval", "eval_extrap"):
        assert not keys["valid"] & keys[other], other
    # the test rows do not depend on whether a validation split is drawn
    without = build_splits(
        "clrs_sorting", n_train=40, n_eval=15, seed=3, train_levels=[4, 5], extrap_levels=[8], interp_levels=[]
    )
    assert "valid" not in without
    assert list(without["eval"]["prompt"]) == list(sp["eval"]["prompt"])


def test_raw_training_text_is_prompt_space_answer_like_the_evaluator():
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "+ 3 4 =", "answer": "7"},
        ]
    )
    ds, report = format_sft_dataset(rows, chat=False)
    assert report["kept"] == 1
    assert [p + c for p, c in zip(ds["prompt"], ds["completion"])] == ["+ 3 4 = 7"]
    # a literal completion column is trained as given
    lit, _ = format_sft_dataset(datasets.Dataset.from_list([{"prompt": "a=", "completion": "b"}]), chat=False)
    assert lit["completion"] == ["b"]
    # the evaluator's separator is the same default
    from retrofit.evaluation.options import EvalOptions

    assert EvalOptions().answer_sep == " "
