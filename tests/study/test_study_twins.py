"""benchmarks/study_twins.py pairs a study's trials with their reruns elsewhere: by id, only where the twin's key is
the one the given study file gives the trial, never with a copy of the same run, and compares what the study reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_study_resume import write_study

from retrofit.study.config import load_study
from retrofit.study.trial import Trial, trial_key

REPO = Path(__file__).resolve().parents[2]


def _twins():
    spec = importlib.util.spec_from_file_location("study_twins", REPO / "benchmarks" / "study_twins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(folder: Path, key: str, cpu: str, threads: int, correct: str, loss: float, train_s: float) -> None:
    tid = "tune-sft-lr0.001-s0"
    r = {
        "key": key,
        "trial": {"id": tid, "phase": "tune", "arm": "sft", "kind": "sft", "lr": 1e-3},
        "seed": 0,
        "train": {"loss": [[1, 0.5], [2, loss]]},
        "accuracy": correct.count("1") / len(correct),
        "correct": correct,
        "mean_token_nll": loss,
        "env": {"cpu": cpu, "threads": threads},
        "timings": {"train_s": train_s},
    }
    (folder / "trials" / tid).mkdir(parents=True)
    (folder / "trials" / tid / "result.json").write_text(json.dumps(r))


def test_twins_are_paired_by_key_and_copies_are_not_reruns(tmp_path):
    cfg_path = write_study(tmp_path / "cfg")
    want = trial_key(load_study(cfg_path), Trial("tune", "sft", 1e-3, 0))
    mine, rerun, copy, other, far = (tmp_path / n for n in ("mine", "rerun", "copy", "other", "far"))
    _result(mine, "k-threads-1", "CPU A", 1, "0110", 0.25, 10.0)
    _result(rerun, want, "CPU A", 2, "0110", 0.25, 12.0)  # the same numbers on one thread and two
    _result(copy, want, "CPU A", 1, "0110", 0.25, 10.0)  # the very run, carried into another folder
    _result(other, "another-setting", "CPU A", 2, "0000", 0.9, 11.0)  # same id, other settings: no twin
    _result(far, want, "CPU B", 2, "0111", 0.2, 9.0)  # another CPU: one row and the losses move
    res = _twins().compare(mine, cfg_path, [rerun, copy, other, far])
    got = {p["twin"]: p for p in res["pairs"]}
    assert set(got) == {str(rerun), str(far)}
    assert got[str(rerun)]["identical"] and got[str(rerun)]["rows_differ"] == 0
    assert got[str(rerun)]["train_loss_max_gap"] == 0.0 and got[str(rerun)]["threads"] == [1, 2]
    f = got[str(far)]
    assert not f["identical"] and f["rows_differ"] == 1 and abs(f["train_loss_max_gap"] - 0.05) < 1e-12
    assert res["summary"] == {
        "pairs": 2,
        "same_cpu": 1,
        "same_cpu_identical": 1,
        "other_cpu": 1,
        "other_cpu_identical": 0,
    }
