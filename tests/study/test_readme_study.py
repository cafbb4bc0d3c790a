"""README's evidence is the default study's: the tables between README's study markers are exactly what
``retrofit study recipes/studies/main.yaml --out docs/studies/main --readme README.md`` writes from the committed
``docs/studies/main/study.json`` (a study rerun without its README, or a hand-edited figure, fails here)."""

from __future__ import annotations

import json
from pathlib import Path

from retrofit.study.report import README_BEGIN, README_END, readme_markdown

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
