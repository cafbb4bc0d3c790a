"""README's evidence is the default study's: the tables between README's study markers are exactly what
``retrofit study recipes/studies/main.yaml --out docs/studies/main --readme README.md`` writes from the committed
``docs/studies/main/study.json`` (a study rerun without its README, or a hand-edited figure, fails here), and the
figures README's prose quotes from the one-CPU core study are ``docs/studies/core_eight_seeds/study.json``'s."""

from __future__ import annotations

import json
from pathlib import Path

from retrofit.study.report import README_BEGIN, README_END, _ci, _pts, readme_markdown

REPO = Path(__file__).resolve().parents[2]


def test_readme_tables_are_the_committed_default_study():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    i, j = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    study = json.loads((REPO / "docs" / "studies" / "main" / "study.json").read_text(encoding="utf-8"))
    want = readme_markdown(study, "recipes/studies/main.yaml", "docs/studies/main")
    assert text[i:j].strip("\n") == want, (
        "README's study tables differ from docs/studies/main/study.json: run "
        "`retrofit study recipes/studies/main.yaml --out docs/studies/main --finished-only --readme README.md`"
    )
    for c in study["claims"].values():  # every claim is in the block, marked as study.json marks it
        assert c["effect"].split(",")[0] in want


def _figure(across: dict) -> str:
    """An across-seed effect as README's prose writes it: study.md's ``+2.6 [-2.8, +8.6]`` with Unicode minus."""
    return f"{_pts(across['estimate'])} {_ci(across['ci'])}".replace("-", "−")


def test_readme_one_cpu_paragraph_is_the_committed_core_study():
    """README's paragraph on the one-CPU, eight-seed core study quotes docs/studies/core_eight_seeds/study.json."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("**On one CPU with eight seeds.**")
    para = " ".join(text[start : text.index("\n\n", start)].split())  # as one line: reflowing it changes nothing
    study = json.loads((REPO / "docs" / "studies" / "core_eight_seeds" / "study.json").read_text(encoding="utf-8"))
    assert study["testing"]["seeds"] == [1, 2, 3, 4, 5, 7, 8, 9]
    cpus = {p["env"]["cpu"] for p in _trials(study)}
    assert cpus == {"AMD EPYC"}, f"every test trial of the core study runs on one CPU, got {cpus}"
    for arm in ("sft", "fixed", "tah2"):
        per_seed = study["testing"]["arms"][arm]["per_seed"]
        mean = sum(p["accuracy"] for p in per_seed) / len(per_seed)
        assert f"{100 * mean:.1f}%" in para, (arm, mean)
    quoted = {
        ("vs_tuned_sft", "fixed"),
        ("vs_tuned_sft", "tah2"),
        ("adaptive_vs_fixed_at_equal_flops", "tah2"),
        ("decider_vs_random", "tah2"),
    }
    for e in study["effects"]:
        if (e["effect"], e["a"]) in quoted:
            assert _figure(e["across_seeds"]) in para, (e["effect"], e["a"], _figure(e["across_seeds"]))
            quoted.discard((e["effect"], e["a"]))
    assert not quoted, f"effects missing from study.json: {quoted}"


def _trials(study: dict) -> list[dict]:
    """The result JSONs of a committed study's test trials at the chosen rates."""
    folder = REPO / "docs" / "studies" / study["name"] / "trials"
    return [
        json.loads((folder / p["trial"] / "result.json").read_text(encoding="utf-8"))
        for arm in study["testing"]["arms"].values()
        for p in arm["per_seed"]
    ]
