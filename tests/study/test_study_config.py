"""A study file's checks (retrofit/study/config.py): each bad config gives one clear error before anything trains,
few seeds or learning rates only warn, and ``retrofit study`` says so on one line (exit code 2)."""

from __future__ import annotations

import dataclasses

import pytest
from test_study_resume import PRESET, STUDY, write_study

from retrofit.model.errors import RetrofitUserError
from retrofit.study.config import load_study
from retrofit.study.trial import check_arms


def _load(tmp_path, study):
    path = write_study(tmp_path, study=study)
    cfg = load_study(path)
    check_arms(cfg)
    return cfg


@pytest.mark.parametrize(
    "change,match",
    [
        (
            ("  tah2: {{kind: looped}}", "  tah2: {{kind: adaptive}}"),
            r"arms.tah2.kind must be one of sft, fixed, looped",
        ),
        (
            ("  fixed: {{kind: fixed}}", "  fixed: {{kind: fixed, learning_rates: [1.0e-3]}}"),
            r"grid sizes differ: sft 2, fixed 1, tah2 2",
        ),
        (("threads: 1", "threads: 1\nlearning_rate: 3"), r"unknown key\(s\) learning_rate; allowed: name"),
        (("threads: 1", "threads: 1\nset: {{seed: 4}}"), r"set: seed is set by the study per trial"),
        (("threads: 1", "threads: 1\nset: {{no_such_flag: 4}}"), r"arms.sft: the recipe rejects its flags"),
        (
            ("  tah2: {{kind: looped}}", "  tah2: {{kind: looped, set: {{n_train: 4}}}}"),
            r"arms sft and tah2 differ in n_train \(8 vs 4\)",
        ),
        (("threads: 1", "threads: 1\nbudget: {{max_steps: 3}}\n"), None),
        (("seeds: [1, 2]", "seeds: [1, 1]"), r"testing.seeds must be distinct"),
        (("{{seed: 0,", "{{seed: 0, seeds: [0, 5],"), r"tuning: give seed \(one tuning seed\) or seeds"),
        (("{{seed: 0,", "{{seeds: [0, 0],"), r"tuning.seeds must be distinct"),
        (("{{seed: 0,", "{{seeds: 4,"), r"tuning.seeds must be a non-empty list of integers"),
        (("{{seed: 0,", "{{seeds: [0, 5],"), None),
        (("seeds: [1, 2]", "seeds: []"), r"testing.seeds must be a non-empty list"),
        (
            ("learning_rates: [1.0e-3, 3.0e-3]", "learning_rates: [1.0e-3, -3.0e-3]"),
            r"distinct positive learning rates",
        ),
        (
            ("bootstrap_samples: 200", "bootstrap_samples: 200, batch: 4"),
            r"testing.eval: unknown EvalOptions field\(s\) batch",
        ),
        (("  sft: {{kind: sft}}", "  sft: {{kind: sft, enabled: false}}"), None),
    ],
)
def test_bad_configs_give_one_clear_error(tmp_path, change, match):
    study = STUDY.replace(*change)
    assert study != STUDY, change
    if match is None:
        _load(tmp_path, study)  # valid variants: the budget block, a disabled arm
        return
    with pytest.raises(RetrofitUserError, match=match):
        _load(tmp_path, study)


def test_an_arm_that_overrides_the_budget_is_refused(tmp_path):
    study = STUDY.replace("threads: 1", "threads: 1\nbudget: {{max_steps: 3}}").replace(
        "  tah2: {{kind: looped}}", "  tah2: {{kind: looped, set: {{max_steps: 9}}}}"
    )
    with pytest.raises(RetrofitUserError, match=r"arms.tah2.set overrides the budget \(max_steps\)"):
        _load(tmp_path, study)


def test_no_validation_rows_is_refused(tmp_path):
    path = write_study(tmp_path)
    (tmp_path / "tiny_preset.yaml").write_text(PRESET.replace("n_valid: 3", "n_valid: 0"))
    with pytest.raises(RetrofitUserError, match="tuning needs validation rows: set n_valid"):
        check_arms(load_study(path))


def test_few_seeds_and_learning_rates_warn_and_three_do_not(tmp_path):
    cfg = _load(tmp_path / "a", STUDY)
    assert [w.split(" (")[0] for w in cfg.warnings] == ["2 learning rate(s) per arm", "2 test seed(s)"]
    full = STUDY.replace("[1.0e-3, 3.0e-3]", "[1.0e-3, 2.0e-3, 3.0e-3]").replace("seeds: [1, 2]", "seeds: [1, 2, 3]")
    assert _load(tmp_path / "b", full).warnings == ()
    overlap = full.replace("seeds: [1, 2, 3]", "seeds: [0, 1, 2]")
    assert "also a test seed" in _load(tmp_path / "c", overlap).warnings[0]
    several = full.replace("{{seed: 0,", "{{seeds: [2, 7],")
    cfg = _load(tmp_path / "d", several)
    assert cfg.tuning_seeds == (2, 7) and cfg.warnings == (
        "tuning seed 2 is also a test seed: that test run was part of the choice",
    )


def test_the_command_reports_a_bad_config_on_one_line(tmp_path, capsys):
    from retrofit.cli import main

    path = write_study(tmp_path, study=STUDY.replace("  tah2: {{kind: looped}}", "  tah2: {{kind: nope}}"))
    assert main(["study", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: arms.tah2.kind must be one of")
    good = write_study(tmp_path / "good")
    assert main(["study", str(good), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("to run") == 6 and out.count("after its tuning") == 3 and "tune-tah2-lr0.003-s0" in out


def test_a_part_of_the_study_keeps_its_trials_and_says_what_it_leaves_out(tmp_path, capsys):
    """``--arms`` / ``--seeds`` (``config.select``): the chosen arms and seeds in the config's order, the trials'
    keys unchanged (a part's results are the whole study's), a warning naming what is left out; unknown names and
    seeds are refused naming what is allowed."""
    from retrofit.cli import main
    from retrofit.study.config import select
    from retrofit.study.trial import Trial, trial_key

    full = STUDY.replace("[1.0e-3, 3.0e-3]", "[1.0e-3, 2.0e-3, 3.0e-3]").replace("seeds: [1, 2]", "seeds: [1, 2, 3]")
    cfg = _load(tmp_path, full)
    assert select(cfg) is cfg
    part = select(cfg, ["tah2", "sft"], [3, 1])
    assert [a.name for a in part.arms] == ["sft", "tah2"] and part.test_seeds == (1, 3)
    assert part.warnings == (
        "a part of the study: it leaves out arm(s) fixed and test seed(s) 2 (--arms / --seeds)",
        "2 test seed(s) (< 3): the across-seed intervals are not a result",
    )
    for t in (Trial("tune", "tah2", 2e-3, 0), Trial("test", "sft", 1e-3, 3)):
        assert trial_key(part, t) == trial_key(cfg, t)
    assert select(cfg, arms=["fixed", "sft", "tah2"]).warnings == ()
    with pytest.raises(RetrofitUserError, match=r"--arms: ouro not among the enabled arms of tiny.yaml \(sft, fixed"):
        select(cfg, ["sft", "ouro"])
    with pytest.raises(RetrofitUserError, match=r"--seeds: 7 not among the test seeds of tiny.yaml \(1, 2, 3\)"):
        select(cfg, seeds=[1, 7])
    path = tmp_path / "tiny.yaml"
    assert main(["study", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--arms", "sft", "--seeds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("sft" in line or "after its tuning" in line for line in lines)
    with pytest.raises(SystemExit):
        main(["study", str(path), "--dry-run", "--seeds", "one"])


def test_a_study_that_extends_another_is_the_copy_it_replaces(tmp_path):
    """``extends`` (``config._read``): a file written as changes to another resolves to the study it would be as a
    full copy — the same arms, flags, grid, seeds, evaluation and trial keys — with mappings merged key by key,
    null removing a key (an arm; ``seed`` before ``seeds``) but not inside ``set``, where null is a flag's value,
    paths relative to the file that wrote them, and cycles or a missing base refused."""
    from retrofit.study.trial import Trial, trial_key

    full = STUDY.replace("[1.0e-3, 3.0e-3]", "[1.0e-3, 2.0e-3, 3.0e-3]").replace("seeds: [1, 2]", "seeds: [1, 2, 3]")
    write_study(tmp_path / "base", study=full)
    copy = full.replace("name: tiny", "name: child").replace("{{seed: 0,", "{{seeds: [0, 6],")
    copy = copy.replace("  tah2: {{kind: looped}}\n", "  tah2: {{kind: looped, set: {{decider_top_k: null}}}}\n")
    copy = copy.replace("  fixed: {{kind: fixed}}\n", "")
    want = _load(tmp_path / "copy", copy)
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "child.yaml"
    child.write_text(
        "extends: ../base/tiny.yaml\n"
        "tuning: {seed: null, seeds: [0, 6]}\n"
        "arms:\n  fixed: null\n  tah2: {set: {decider_top_k: null}}\n"
    )
    got = load_study(child)
    check_arms(got)
    assert got.name == "child"  # its own stem: a name is not inherited
    assert [a.name for a in got.arms] == ["sft", "tah2"]
    assert dict(got.arm("tah2").flags)["decider_top_k"] is None
    assert got.arm("sft").preset == (tmp_path / "base" / "tiny_preset.yaml").resolve()  # the copy has its own
    for field in ("tuning_seeds", "test_seeds", "tune_eval", "test_eval", "threads", "keep_models", "warnings"):
        assert getattr(got, field) == getattr(want, field), field
    assert [(a.kind, a.flags, a.learning_rates) for a in got.arms] == [
        (a.kind, a.flags, a.learning_rates) for a in want.arms
    ]
    for t in (Trial("tune", "tah2", 2e-3, 6), Trial("test", "sft", 1e-3, 3)):
        assert trial_key(got, t) == trial_key(want, t)

    child.write_text("extends: ../base/tiny.yaml\ntuning: {seeds: [0, 6]}\n")
    with pytest.raises(RetrofitUserError, match=r"tuning: give seed \(one tuning seed\) or seeds"):
        load_study(child)
    child.write_text("extends: nowhere.yaml\n")
    with pytest.raises(RetrofitUserError, match=r"nowhere.yaml does not exist \(extends of .*child.yaml\)"):
        load_study(child)
    child.write_text("extends: child.yaml\n")
    with pytest.raises(RetrofitUserError, match=r"extends: child.yaml -> child.yaml is a cycle"):
        load_study(child)
    child.write_text("extends: [../base/tiny.yaml]\n")
    with pytest.raises(RetrofitUserError, match=r"extends must be the path of another study file"):
        load_study(child)
    child.write_text("extends: ../base/tiny.yaml\ndescription: two stages: every depth, then the decider\n")
    with pytest.raises(RetrofitUserError, match=r"child.yaml is not valid YAML at line 2, column 24: mapping values"):
        load_study(child)


def test_an_arm_like_another_is_that_arm_with_its_changes(tmp_path):
    """``like: OTHER`` (``config._like``): the arm is the other arm's kind, preset, flags and grid with its own keys
    over them (``set`` merged flag by flag, null a flag's value), its own description and enabled; the other arm may
    be disabled or itself ``like`` a third, follows an extending file's change of the other arm, and an unknown or
    cyclic ``like`` is one clear error."""
    from retrofit.study.trial import Trial, trial_key

    study = STUDY.replace(
        "  tah2: {{kind: looped}}\n",
        "  tah2: {{kind: looped, set: {{decider_top_k: 4, heads_lr_scale: 2}}, learning_rates: [2.0e-3, 4.0e-3],"
        " enabled: false, description: the base arm}}\n"
        "  late: {{like: tah2, set: {{decider_top_k: null, depth_warmup_steps: 1}}}}\n"
        "  later: {{like: late, set: {{decider_phase_from: 2}}, description: two stages}}\n",
    )
    got = _load(tmp_path / "like", study)
    copy = STUDY.replace(
        "  tah2: {{kind: looped}}\n",
        "  late: {{kind: looped, set: {{decider_top_k: null, heads_lr_scale: 2, depth_warmup_steps: 1}},"
        " learning_rates: [2.0e-3, 4.0e-3]}}\n"
        "  later: {{kind: looped, set: {{decider_top_k: null, heads_lr_scale: 2, depth_warmup_steps: 1,"
        " decider_phase_from: 2}}, learning_rates: [2.0e-3, 4.0e-3], description: two stages}}\n",
    )
    want = _load(tmp_path / "copy", copy)
    assert [a.name for a in got.arms] == ["sft", "fixed", "late", "later"]  # tah2 stays off: enabled is not copied
    assert got.arms == tuple(dataclasses.replace(a, preset=b.preset) for a, b in zip(want.arms, got.arms))
    assert dict(got.arm("later").flags)["decider_top_k"] is None and got.arm("late").description == ""
    assert got.arm("late").learning_rates == (2e-3, 4e-3) != got.arm("sft").learning_rates == (1e-3, 3e-3)
    t = Trial("test", "later", 4e-3, 2)
    assert trial_key(got, t) == trial_key(want, t)

    # an extending file that changes the base arm changes the arms like it
    child = tmp_path / "like" / "child.yaml"
    child.write_text("extends: tiny.yaml\narms:\n  tah2: {set: {heads_lr_scale: 3}}\n")
    ext = load_study(child)
    assert dict(ext.arm("later").flags)["heads_lr_scale"] == 3 and dict(ext.arm("later").flags)["decider_top_k"] is None

    for old, new, match in [
        (
            "like: tah2, set",
            "like: ghost, set",
            r"arms.late.like must name another arm of the study \(sft, fixed, tah2",
        ),
        ("like: tah2, set", "like: later, set", r"arms.late.like: late -> later -> late is a cycle"),
        ("like: late, set", "like: later, set", r"arms.later.like: later -> later is a cycle"),
        ("{{like: late,", "{{like: late, lr: 3,", r"arms.later: unknown key\(s\) lr; allowed: kind"),
    ]:
        with pytest.raises(RetrofitUserError, match=match):
            load_study(write_study(tmp_path / "bad", study=study.replace(old, new)))


def test_the_committed_studies_that_extend_main_resolve_to_its_arms():
    """The committed studies written as changes to another keep its settings: full is main with ANIRA-E, Ouro, test
    seeds 1-5 and 2 threads; main_tuned_twice is full tuned with seeds 0 and 6; core_eight_seeds is that with sft,
    fixed and tah2 only and eight test seeds; core_threads1 is main under its own name (the same
    trials); two_stage is main with TaH2 in two stages; exit_readout is main with TaH2 read out at the exit depth; price
    is exit_readout with that arm at rho 0.9."""
    from pathlib import Path

    studies = Path(__file__).resolve().parents[2] / "recipes" / "studies"
    main, full, twice, core, threads1 = (
        load_study(studies / f"{n}.yaml")
        for n in ("main", "full", "main_tuned_twice", "core_eight_seeds", "core_threads1")
    )
    assert (main.name, main.threads, main.test_seeds, main.tuning_seeds) == ("main", 1, (1, 2, 3), (0,))
    assert [a.name for a in main.arms] == ["sft", "fixed", "tah2"]
    assert (full.name, full.threads, full.test_seeds) == ("full", 2, (1, 2, 3, 4, 5))
    assert [a.name for a in full.arms] == ["sft", "fixed", "tah2", "anira_e", "ouro"]  # tah2_two_stage: off
    assert full.arms[:3] == main.arms and full.test_eval == main.test_eval and full.tune_eval == main.tune_eval
    assert (twice.name, twice.tuning_seeds, twice.test_seeds) == ("main_tuned_twice", (0, 6), full.test_seeds)
    assert twice.arms == full.arms and twice.test_eval == full.test_eval and twice.description == full.description
    assert [a.name for a in core.arms] == ["sft", "fixed", "tah2"] and core.tuning_seeds == (0, 6)
    assert core.arms == full.arms[:3] and core.test_seeds == (1, 2, 3, 4, 5, 7, 8, 9)
    same = dataclasses.replace(threads1, name="main", description=main.description, path=main.path)
    assert threads1.name == "core_threads1" and same == main
    # two_stage is main with one more arm: the tah2 arm's flags and the two stages
    two = load_study(studies / "two_stage.yaml")
    assert two.arms[:3] == main.arms and (two.test_seeds, two.threads) == (main.test_seeds, main.threads)
    staged = dict(two.arm("tah2_two_stage").flags)
    assert staged == {**dict(main.arm("tah2").flags), "depth_warmup_steps": 80, "decider_phase_from": 80}
    # exit_readout is main with one more arm: the tah2 arm's flags, the residual updater and no mixture
    exit_ = load_study(studies / "exit_readout.yaml")
    assert exit_.arms[:3] == main.arms and (exit_.test_seeds, exit_.threads) == (main.test_seeds, main.threads)
    assert exit_.test_eval == main.test_eval and exit_.tune_eval == main.tune_eval
    read = dict(exit_.arm("tah2_exit_readout").flags)
    assert read == {**dict(main.arm("tah2").flags), "updater": "residual", "mixture_output": False}
    # price is exit_readout with one more arm: its TaH2 arm at rho 0.9
    price = load_study(studies / "price.yaml")
    assert price.arms[:4] == exit_.arms and (price.test_seeds, price.test_eval) == (exit_.test_seeds, exit_.test_eval)
    assert dict(price.arm("tah2_price").flags) == {**read, "rho": 0.9}
