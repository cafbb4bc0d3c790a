"""The order trials run in (retrofit/study/runner.py: ``Study.run``, ``order``, ``tests_of_tuned_arms``), with a
runner that trains nothing: one at a time it is tuning then the tests seed by seed; two at a time an arm's test
trials start as soon as that arm's tuning is done, while another arm's last tuning trial still runs; both give the
same results, and ``--dry-run`` lists the test trials of the arms whose tuning is done."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from test_study_config import _load
from test_study_resume import STUDY
from tqdm.auto import tqdm

from retrofit.hub.atomic_io import write_json_atomic
from retrofit.study import runner as R
from retrofit.study.trial import RESULT, Trial, trial_key

FULL = STUDY.replace("[1.0e-3, 3.0e-3]", "[1.0e-3, 2.0e-3, 3.0e-3]")  # 9 tuning trials, then 6 test trials


class Fake:
    """A runner that writes a result with the trial's key (the SFT arm scores best at the highest rate, the others
    at the lowest, so the choices differ) and logs when each trial starts and ends; the trials in ``slow`` take
    ``hold`` seconds."""

    def __init__(self, slow=(), hold=0.0):
        self.events, self.slow, self.hold, self.lock = [], set(slow), hold, threading.Lock()

    def __call__(self, cfg, trial, folder, progress=True):
        with self.lock:
            self.events.append(("start", trial.id))
        if trial.id in self.slow:
            time.sleep(self.hold)
        accuracy = 0.5 + (trial.lr if trial.arm == "sft" else -trial.lr) * 10
        folder.mkdir(parents=True, exist_ok=True)
        result = {"key": trial_key(cfg, trial), "accuracy": accuracy, "mean_token_nll": 1.0, "trial": {"id": trial.id}}
        write_json_atomic(folder / RESULT, {**result, "rows": {"n": 3}})
        with self.lock:
            self.events.append(("end", trial.id))

    def starts(self):
        return [i for e, i in self.events if e == "start"]

    def when(self, event, trial_id):
        return self.events.index((event, trial_id))


def _run(cfg, out, jobs, fake):
    study = R.Study(cfg, out, progress=False, runner=fake, executor=ThreadPoolExecutor)
    return study.run(R.tuning_trials(cfg), jobs, tqdm(disable=True), R.tests_of_tuned_arms(cfg))


def test_one_at_a_time_runs_the_tuning_then_the_tests_seed_by_seed(tmp_path):
    cfg = _load(tmp_path / "cfg", FULL)
    fake = Fake()
    results = _run(cfg, tmp_path / "out", 1, fake)
    tuning = [t.id for t in R.tuning_trials(cfg)]
    tests = [
        f"test-{arm}-lr{lr}-s{s}" for s in (1, 2) for arm, lr in (("sft", 0.003), ("fixed", 0.001), ("tah2", 0.001))
    ]
    assert fake.starts() == tuning + tests
    assert sorted(t.id for t in results) == sorted(tuning + tests)
    assert all(r["trial"]["id"] == t.id for t, r in results.items())
    # nothing left to run: a second pass reads every result back and runs none
    again = Fake()
    assert _run(cfg, tmp_path / "out", 1, again) == results and again.events == []


def test_two_at_a_time_an_arms_tests_start_while_another_arm_still_tunes(tmp_path):
    """tah2's first tuning trial holds one worker; the other worker runs tah2's two other rates, then the SFT and
    fixed arms' test trials, before it ends; tah2's own tests wait for it."""
    cfg = _load(tmp_path / "cfg", FULL)
    slow = "tune-tah2-lr0.001-s0"
    fake = Fake(slow={slow}, hold=2.0)
    results = _run(cfg, tmp_path / "two", 2, fake)
    end = fake.when("end", slow)
    assert fake.when("start", "test-sft-lr0.003-s1") < end and fake.when("start", "test-fixed-lr0.001-s2") < end
    assert all(fake.when("start", f"test-tah2-lr0.001-s{s}") > end for s in (1, 2))
    # the same trials and results as one at a time
    one = _run(cfg, tmp_path / "one", 1, Fake())
    assert {t.id: r for t, r in results.items()} == {t.id: r for t, r in one.items()}


def test_dry_run_lists_the_tests_of_the_arms_whose_tuning_is_done(tmp_path):
    cfg = _load(tmp_path / "cfg", FULL)
    out = tmp_path / "out"
    fake = Fake()
    for t in R.tuning_trials(cfg):
        if t.arm != "tah2":
            fake(cfg, t, out / "trials" / t.id)
    fake(cfg, Trial("test", "sft", 3e-3, 1), out / "trials" / "test-sft-lr0.003-s1")
    rows = R.plan(tmp_path / "cfg" / "tiny.yaml", out)
    tests = [(i, state) for i, state in rows if i.startswith("test")]
    assert tests == [
        ("test-sft-lr0.003-s1", "done"),
        ("test-fixed-lr0.001-s1", "to run"),
        ("test-sft-lr0.003-s2", "to run"),
        ("test-fixed-lr0.001-s2", "to run"),
        ("test-tah2 x 2 seeds", "after its tuning"),
    ]


def test_trials_the_config_does_not_list_run_after_those_it_lists(tmp_path):
    """``benchmarks/study_jobs.py`` runs tuning trials at seeds the config does not tune with."""
    cfg = _load(tmp_path / "cfg", FULL)
    trials = [Trial("tune", "tah2", 1e-3, 6), Trial("tune", "tah2", 1e-3, 0), Trial("tune", "tah2", 5e-3, 0)]
    fake = Fake()
    R.Study(cfg, tmp_path / "out", progress=False, runner=fake).run(trials, 1, tqdm(disable=True))
    assert fake.starts() == ["tune-tah2-lr0.001-s0", "tune-tah2-lr0.005-s0", "tune-tah2-lr0.001-s6"]
