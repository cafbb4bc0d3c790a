"""Do two runs of the same trial give the same numbers? Pairs a study's trials with their twins in other studies.

A twin is a finished trial with the same id (phase, arm, learning rate, seed) in another study folder whose settings
are the same but for what is being compared: the thread count, or the CPU it ran on. The settings are checked, not
assumed: the twin's key must be the one ``--twin-config`` (the study file the twin ran under, or one resolving to
the same settings) gives the trial. Per pair it reports both CPUs and thread counts, the validation or test accuracy,
how many rows differ in their outcome, the largest difference in the logged training losses and the mean answer
loss, and whether the result is the same in every number the study reads (``identical``).

    python benchmarks/study_twins.py docs/studies/core_threads1 recipes/studies/full.yaml \\
        docs/studies/full docs/studies/core_eight_seeds docs/studies/main_tuned_twice --out twins.json

Prints JSON (and writes it to ``--out``); a trial with twins in several folders is paired with each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: what a result holds that the study's statistics read (``retrofit.study.analysis``), compared for ``identical``
COMPARED = (
    "accuracy",
    "correct",
    "mean_token_nll",
    "levels",
    "mean_depth",
    "forced_depth_accuracy",
    "tokens",
    "frontier",
)


def _results(folder: Path) -> dict[str, dict]:
    """A study folder's finished trials by id (``trials/*/result.json``), or a folder of result JSONs by any name."""
    out = {}
    paths = sorted(folder.glob("trials/*/result.json")) or sorted(folder.glob("*.json"))
    for p in paths:
        r = json.loads(p.read_text())
        out[r["trial"]["id"]] = r
    return out


def _loss_gap(a: dict, b: dict) -> float | None:
    la, lb = dict(map(tuple, a["train"]["loss"])), dict(map(tuple, b["train"]["loss"]))
    common = sorted(set(la) & set(lb))
    return max((abs(la[s] - lb[s]) for s in common), default=None)


def compare(study: Path, twin_config: Path, twins: list[Path]) -> dict:
    from retrofit.study.config import load_study
    from retrofit.study.trial import Trial, trial_key

    ref = load_study(twin_config)
    names = {a.name for a in ref.arms}
    mine = _results(study)
    pairs, seen = [], set()
    for folder in twins:
        theirs = _results(folder)
        for tid, a in mine.items():
            b = theirs.get(tid)
            t = a["trial"]
            if b is None or t["arm"] not in names:
                continue
            want = trial_key(ref, Trial(t["phase"], t["arm"], t["lr"], a["seed"]))
            if b["key"] != want:
                continue  # another setting differs (a grid point of another study, another evaluation)
            if a["env"] == b["env"] and a.get("timings") == b.get("timings"):
                continue  # a copy of the same run (a study carried into another's folder), not a second run
            run = (tid, json.dumps(b["env"], sort_keys=True), b["correct"], json.dumps(b["train"]["loss"]))
            if run in seen:
                continue  # the same twin copied into another study's folder
            seen.add(run)
            ca, cb = a["correct"], b["correct"]
            pairs.append(
                {
                    "trial": tid,
                    "twin": str(folder),
                    "cpu": [a["env"].get("cpu"), b["env"].get("cpu")],
                    "cpu_id": [a["env"].get("cpu_id"), b["env"].get("cpu_id")],  # None: run before it was recorded
                    "threads": [a["env"].get("threads"), b["env"].get("threads")],
                    "accuracy": [a["accuracy"], b["accuracy"]],
                    "rows_differ": sum(x != y for x, y in zip(ca, cb)) if len(ca) == len(cb) else None,
                    "train_loss_max_gap": _loss_gap(a, b),
                    "mean_token_nll": [a["mean_token_nll"], b["mean_token_nll"]],
                    "identical": all(a.get(k) == b.get(k) for k in COMPARED),
                }
            )
    same_cpu = [p for p in pairs if p["cpu"][0] == p["cpu"][1]]
    return {
        "study": str(study),
        "twin_config": str(twin_config),
        "pairs": pairs,
        "summary": {
            "pairs": len(pairs),
            "same_cpu": len(same_cpu),
            "same_cpu_identical": sum(p["identical"] for p in same_cpu),
            "other_cpu": len(pairs) - len(same_cpu),
            "other_cpu_identical": sum(p["identical"] for p in pairs if p not in same_cpu),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", type=Path, help="the study folder whose trials are paired")
    ap.add_argument("twin_config", type=Path, help="the study file whose settings the twins must have (their keys)")
    ap.add_argument("twins", type=Path, nargs="+", help="study folders (or trial collections) holding the twins")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    res = compare(args.study, args.twin_config, args.twins)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
