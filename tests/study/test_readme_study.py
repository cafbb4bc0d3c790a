"""README's evidence is the studies': the tables between README's study markers are exactly what
``retrofit study recipes/studies/main.yaml --out docs/studies/main --readme README.md`` (and the same for full.yaml,
between its own markers) writes from the committed ``study.json`` (a study rerun without its README, or a
hand-edited figure, fails here), and the figures README's prose quotes are those studies'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrofit.study.report import README_BEGIN, README_END, _ci, _pts, readme_markdown, readme_markers

REPO = Path(__file__).resolve().parents[2]


def _study(name: str) -> dict:
    """``docs/studies/<name>/study.json``."""
    return json.loads((REPO / "docs" / "studies" / name / "study.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name, markers", [("main", (README_BEGIN, README_END)), ("full", readme_markers("full"))])
def test_readme_tables_are_the_committed_studies(name, markers):
    text = (REPO / "README.md").read_text(encoding="utf-8")
    i, j = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    study = _study(name)
    assert study["name"] == name
    want = readme_markdown(study, f"recipes/studies/{name}.yaml", f"docs/studies/{name}")
    assert text[i:j].strip("\n") == want, (
        f"README's study tables differ from docs/studies/{name}/study.json: run `retrofit study "
        f"recipes/studies/{name}.yaml --out docs/studies/{name} --finished-only --readme README.md`"
    )
    for c in study["claims"].values():  # every claim is in the block, marked as study.json marks it
        assert c["effect"].split(",")[0] in want


@pytest.mark.parametrize(
    "name", ["main", "full", "two_stage", "exit_readout", "price", "main_tuned_twice", "core_eight_seeds"]
)
def test_the_committed_study_is_what_its_file_gives_from_its_trials(name, tmp_path):
    """``docs/studies/<name>/study.json`` is what ``retrofit study recipes/studies/<name>.yaml --finished-only``
    writes from the committed result JSONs alone (its own, and those of the folders its ``reuse`` names): an edit of
    the study file that changes a trial's key (its trials would no longer count), a reused trial deleted from its
    folder, or a study.json not rebuilt after one, fails here."""
    import shutil

    from retrofit.study.runner import report_finished

    shutil.copytree(REPO / "docs" / "studies" / name / "trials", tmp_path / "trials")
    got = report_finished(REPO / "recipes" / "studies" / f"{name}.yaml", tmp_path)
    want = _study(name)
    assert not got.get("warnings") and json.loads((tmp_path / "study.json").read_text(encoding="utf-8")) == want


def _paragraph(start: str) -> str:
    """README's paragraph that starts with ``start``, as one line (reflowing it changes nothing)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    i = text.index(start)
    return " ".join(text[i : text.index("\n\n", i)].split())


def _quotes(para: str, study: dict, quoted: set[tuple[str, str]]) -> None:
    """Each (effect, arm) of ``quoted`` is in ``para`` as its across-seed figure in ``study``."""
    quoted = set(quoted)
    for e in study["effects"]:
        if (e["effect"], e["a"]) in quoted:
            assert _figure(e["across_seeds"]) in para, (e["effect"], e["a"], _figure(e["across_seeds"]))
            quoted.discard((e["effect"], e["a"]))
    assert not quoted, f"effects missing from study.json: {quoted}"


def test_readme_default_study_paragraph_is_the_committed_default_study():
    """README's reading of the default study quotes docs/studies/main/study.json: the effects, no claim met, one CPU,
    and each arm's held-out accuracy per seed."""
    para = _paragraph("**What it shows.** *No claim is met.*")
    study = _study("main")
    assert not any(c["met"] for c in study["claims"].values())
    assert study["environment"]["cpus"] == ["Intel(R) Xeon(R) Processor"]
    _quotes(
        para,
        study,
        {
            ("vs_tuned_sft", "fixed"),
            ("vs_tuned_sft", "tah2"),
            ("own_vs_depth1", "tah2"),
            ("adaptive_vs_fixed_at_equal_flops", "tah2"),
        },
    )
    for arm in ("sft", "fixed", "tah2"):
        held = [t["levels"]["8"]["accuracy"] for t in _trials(study, arm)]
        assert " / ".join(f"{100 * a:.0f}" for a in held) in para, (arm, held)
    assert study["tuning"]["arms"]["sft"]["chosen_lr"] == 1e-3


def _figure(across: dict) -> str:
    """An across-seed effect as README's prose writes it: study.md's ``+2.6 [-2.8, +8.6]`` with Unicode minus."""
    return f"{_pts(across['estimate'])} {_ci(across['ci'])}".replace("-", "−")


def _rho_quote(study: dict, arm: str) -> str:
    """The across-seed Spearman of ``arm``'s token depth against the SFT control's token loss, as README quotes it."""
    rho = next(e for e in study["effects"] if (e["effect"], e["a"]) == ("depth_vs_token_loss", arm))
    lo, hi = rho["across_seeds"]["ci"]
    return f"ρ {rho['across_seeds']['estimate']:+.3f} [{lo:+.2f}, {hi:+.2f}]"


def _flops_vs_sft(study: dict, arm: str) -> str:
    """``arm``'s mean FLOPs per answer token over the SFT control's, as README quotes it."""
    flops = {
        a: sum(s["flops_per_token"] for s in v["per_seed"]) / len(v["per_seed"])
        for a, v in study["testing"]["arms"].items()
    }
    return f"{flops[arm] / flops['sft']:.2f}× its FLOPs"


def test_readme_one_cpu_paragraph_is_the_committed_core_study():
    """README's paragraph on the one-CPU, eight-seed core study quotes docs/studies/core_eight_seeds/study.json."""
    para = _paragraph("**On one CPU with eight seeds.**")
    study = _study("core_eight_seeds")
    assert study["testing"]["seeds"] == [1, 2, 3, 4, 5, 7, 8, 9]
    cpus = {p["env"]["cpu"] for p in _trials(study)}
    assert cpus == {"AMD EPYC"}, f"every test trial of the core study runs on one CPU, got {cpus}"
    for arm in ("sft", "fixed", "tah2"):
        per_seed = study["testing"]["arms"][arm]["per_seed"]
        mean = sum(p["accuracy"] for p in per_seed) / len(per_seed)
        assert f"{100 * mean:.1f}%" in para, (arm, mean)
    _quotes(
        para,
        study,
        {
            ("vs_tuned_sft", "fixed"),
            ("vs_tuned_sft", "tah2"),
            ("adaptive_vs_fixed_at_equal_flops", "tah2"),
            ("decider_vs_random", "tah2"),
        },
    )


def _trials(study: dict, arm: str | None = None) -> list[dict]:
    """The result JSONs of a committed study's test trials at the chosen rates (of ``arm``, or of every arm), seed
    by seed; a trial the study reuses from another study's folder (study.json's ``reused``) is read there."""
    where = {tid: name for name, ids in study.get("reused", {}).items() for tid in ids}
    studies = REPO / "docs" / "studies"
    return [
        json.loads(
            (studies / where.get(p["trial"], study["name"]) / "trials" / p["trial"] / "result.json").read_text(
                encoding="utf-8"
            )
        )
        for name, a in study["testing"]["arms"].items()
        if arm in (None, name)
        for p in a["per_seed"]
    ]


def test_readme_two_stage_paragraph_is_the_committed_studies():
    """README's paragraph on TaH2's flat frontier quotes the second pass of every committed TaH2 test trial
    (study.json's ``second_pass``), the losses before training (docs/studies/two_stage/init_gains.json) and the
    two-stage arm's effects (docs/studies/two_stage/study.json)."""
    para = _paragraph("**Why the frontier is flat, and TaH2 in two stages.**")
    distinct = {}
    for name in ("main", "full", "core_eight_seeds"):
        study = _study(name)
        for row in study["second_pass"]["tah2"]:
            distinct[json.dumps(row, sort_keys=True)] = row
    rows = list(distinct.values())
    assert f"0% in all {len(rows)} TaH2 test trials" in para and all(r["forced"]["2"] == 0 for r in rows)
    gains = [r["gain_mean"] for r in rows]
    assert f"loses {-max(gains):.1f} to {-min(gains):.1f} nats" in para and max(gains) < 0
    init = json.loads((REPO / "docs" / "studies" / "two_stage" / "init_gains.json").read_text(encoding="utf-8"))
    l1 = {round(v["loss_depth1"], 2) for v in init["seeds"].values()}
    l2 = [v["loss_depth2"] for v in init["seeds"].values()]
    assert len(l1) == 1 and f"{min(l2):.1f}–{max(l2):.1f} nats against depth 1's {l1.pop():.2f}" in para

    study = _study("two_stage")
    assert study["claims"]["depth_follows_difficulty:tah2_two_stage"]["met"]
    assert not any(c["met"] for k, c in study["claims"].items() if k != "depth_follows_difficulty:tah2_two_stage")
    _quotes(
        para,
        study,
        {
            ("decider_vs_random", "tah2_two_stage"),
            ("decider_vs_oracle", "tah2_two_stage"),
            ("vs_tuned_sft", "tah2_two_stage"),
        },
    )
    assert _rho_quote(study, "tah2_two_stage") in para


def test_readme_exit_readout_paragraph_is_the_committed_study():
    """README's paragraph on TaH2 read out at its exit depth quotes docs/studies/exit_readout/study.json (no claim
    met, its effects, the seeds that continue every token) and the residual-updater diagnostic's second pass."""
    para = _paragraph("**TaH2 read out at its exit depth.**")
    study = _study("exit_readout")
    assert not any(c["met"] for c in study["claims"].values())
    arm = "tah2_exit_readout"
    _quotes(
        para,
        study,
        {
            ("own_vs_depth1", arm),
            ("decider_vs_random", arm),
            ("vs_tuned_sft", arm),
            ("adaptive_vs_fixed_at_equal_flops", arm),
        },
    )
    every = [r["seed"] for r in study["second_pass"][arm] if r["continue_prob"]["min"] > 0.5]
    assert "in two seeds (d̄ 2.00)" in para and len(every) == 2
    assert _flops_vs_sft(study, arm) in para
    diag = json.loads(
        (REPO / "docs" / "studies" / "two_stage" / "residual-lr0.001-s1.json").read_text(encoding="utf-8")
    )
    assert diag["forced_depth_accuracy"]["2"] == 0.0 and "still scores 0% (one seed)" in para


def test_readme_price_paragraph_is_the_committed_study():
    """README's paragraph on TaH2 priced higher quotes docs/studies/price/study.json: its one met claim (depth follows
    the SFT control's token loss), its effects and d̄, its FLOPs against SFT, and the sweep's collapse at ρ 0.5."""
    para = _paragraph("**TaH2 with the second pass priced higher.**")
    study = _study("price")
    arm = "tah2_price"
    assert [k for k, c in study["claims"].items() if c["met"]] == [f"depth_follows_difficulty:{arm}"]
    _quotes(
        para,
        study,
        {
            ("decider_vs_oracle", arm),
            ("decider_vs_random", arm),
            ("vs_tuned_sft", arm),
            ("adaptive_vs_fixed_at_equal_flops", arm),
        },
    )
    assert _rho_quote(study, arm) in para
    per = study["testing"]["arms"]
    depth = sum(s["mean_depth"] for s in per[arm]["per_seed"]) / 3
    assert f"d̄ {depth:.2f}" in para
    assert _flops_vs_sft(study, arm) in para
    collapse = json.loads((REPO / "docs" / "studies" / "price" / "rho0.5-lr0.0005-s2.json").read_text(encoding="utf-8"))
    assert (
        collapse["forced_depth_accuracy"]["2"] == 0.0
        and collapse["mean_depth"] == 1.0
        and "at 0.5 TaH2 collapses as released" in para
    )


def test_readme_twice_the_steps_paragraph_is_the_committed_diagnostic():
    """README's paragraph on the 480-step diagnostic quotes its result JSONs (docs/studies/price/*_steps480-*.json)
    and the studies' 240-step test trials: each arm's mean test accuracy at both budgets, looped − SFT per arm with
    its sign in every seed, the held-out level's range and TaH2's d̄ per seed."""
    para = _paragraph("**Twice the steps (a diagnostic, not a study).**")
    studies = REPO / "docs" / "studies"

    def runs(kind: str, rate: str, short: str, long: str) -> dict[int, list[dict]]:
        read = lambda p: json.loads(p.read_text(encoding="utf-8"))  # noqa: E731
        at240 = [read(studies / short / "trials" / f"test-{kind}-lr{rate}-s{s}" / "result.json") for s in (1, 2, 3)]
        at480 = [read(studies / "price" / f"{long}_steps480-lr{rate}-s{s}.json") for s in (1, 2, 3)]
        assert all(r["train"]["steps"] == 480 for r in at480) and all(r["train"]["steps"] == 240 for r in at240)
        return {240: at240, 480: at480}

    def mean(rs: list[dict]) -> float:
        return 100 * sum(r["accuracy"] for r in rs) / len(rs)

    sft = runs("sft", "0.001", "main", "sft")
    looped = {"fixed": runs("fixed", "0.002", "main", "fixed"), "tah2": runs("tah2_price", "0.001", "price", "price")}
    assert f"SFT {mean(sft[480]):.1f}% (from {mean(sft[240]):.1f}%)" in para
    assert f"the fixed loop {mean(looped['fixed'][480]):.1f}% (from {mean(looped['fixed'][240]):.1f}%)" in para
    assert f"TaH2 priced higher {mean(looped['tah2'][480]):.1f}% (from {mean(looped['tah2'][240]):.1f}%)" in para
    for name, quoted in (("fixed", "for the fixed loop"), ("tah2", "for TaH2")):
        diffs = [a["accuracy"] - b["accuracy"] for a, b in zip(looped[name][480], sft[480])]
        assert all(d < 0 for d in diffs) and f"{100 * sum(diffs) / 3:.1f} points {quoted}" in para.replace("−", "-")
    held = lambda rs: [round(100 * r["levels"]["8"]["accuracy"]) for r in rs]  # noqa: E731
    assert f"SFT reaches {min(held(sft[480]))}–{max(held(sft[480]))}%" in para
    lows = held(looped["fixed"][480]) + held(looped["tah2"][480])
    assert f"fall to {min(lows)}–{max(lows)}%" in para
    assert "d̄ " + " / ".join(f"{r['mean_depth']:.2f}" for r in looped["tah2"][480]) in para
