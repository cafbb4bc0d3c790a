"""``run_study``: tuning, then testing, then the statistics; resumable from the trials' result JSONs
(docs/study.md).

Layout of a study folder (``--out``)::

    trials/<phase>-<arm>-lr<lr>-s<seed>/result.json   one per trial (the only thing resuming needs)
    study.json     every figure: the grid and each arm's choice, the effects per seed and across seeds, the
                   frontier per seed, the claims, the environment (no times, no absolute paths: the same
                   trials give the same file)
    timings.json   seconds per trial (training, evaluation, frontier), and the totals
    study.md       the tables; study.png the accuracy-vs-FLOPs plot

**Resuming.** The same command continues where it stopped: a trial whose ``result.json`` exists, with the key of
the trial the config asks for (``trial.trial_key``: its settings — the preset's, its own flags winning —, its
evaluation options, the thread count), is not run again; a folder without one is a trial that did not finish and
starts over; a result with another key means the config changed under it and stops the study with an error that
names the trial (nothing is overwritten). The statistics are computed from the result JSONs after reading them
back, also right after a trial ran, so a resumed and an uninterrupted study give the same ``study.json``.

**Reusing another study's trials.** A study file's ``reuse: [FOLDER, ...]`` names other study folders: a trial this
folder lacks counts as done when one of them (in the order listed) holds a result with the same id and key: a study
that adds an arm to another runs that arm's trials only, and nothing is copied. A result there with another key is
not this study's trial and is passed over. The trials a study took from elsewhere are listed in study.json
(``reused``: folder name → trial ids); ``--no-reuse`` ignores the folders (and runs those trials into ``--out``).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ..model.errors import RetrofitUserError
from . import analysis as A
from .config import StudyConfig, load_study, select
from .env import environment
from .trial import Trial, check_arms, read_result, run_trial, trial_key

logger = logging.getLogger(__name__)


def tuning_trials(cfg: StudyConfig) -> list[Trial]:
    """Every arm at every learning rate of its grid, on each tuning seed (validation rows)."""
    return [Trial("tune", a.name, lr, s) for s in cfg.tuning_seeds for a in cfg.arms for lr in a.learning_rates]


def test_trials(cfg: StudyConfig, choices: dict[str, dict]) -> list[Trial]:
    """Every arm at its chosen learning rate, at every test seed (test rows), seed by seed (``order``)."""
    return [Trial("test", a.name, choices[a.name]["chosen_lr"], s) for s in cfg.test_seeds for a in cfg.arms]


class Study:
    """A study's folder: where each trial lives, which are done, and running the rest."""

    def __init__(self, cfg: StudyConfig, out: Path, progress: bool = True, runner=run_trial, executor=None):
        """``executor``: where ``--jobs`` > 1 runs its trials: by default a pool of spawned processes, each running
        ``run_trial`` (``_worker``); a ``concurrent.futures`` executor class instead (tests: ``ThreadPoolExecutor``)
        runs ``runner`` in it."""
        self.cfg, self.out, self.progress, self.runner, self.executor = cfg, Path(out), progress, runner, executor
        here = self.out.resolve()
        self.reuse = [p for p in cfg.reuse if p.resolve() != here]
        for p in self.reuse:
            if not (p / "trials").is_dir():
                raise RetrofitUserError(
                    f"reuse: {p} is not a study folder (it has no trials/ folder). Fix the path in {cfg.path.name} "
                    "(relative to that file), or run with --no-reuse to run every trial into --out"
                )
        #: trial id -> the name of the ``reuse`` folder its result was read from
        self.reused: dict[str, str] = {}

    def folder(self, t: Trial) -> Path:
        return self.out / "trials" / t.id

    def result(self, t: Trial) -> dict | None:
        """The finished trial's result, or None: this folder's, else a ``reuse`` folder's with the same key; a result
        of other settings in this folder stops the study (module docstring)."""
        r = read_result(self.folder(t))
        if r is None:  # the key (the trial's settings parsed) only where there is a result to check
            want = trial_key(self.cfg, t) if self.reuse else None
            for p in self.reuse:
                r = read_result(p / "trials" / t.id)
                if r is not None and r.get("key") == want:
                    self.reused[t.id] = p.name
                    return r
            return None
        want = trial_key(self.cfg, t)
        if r.get("key") != want:
            raise RetrofitUserError(
                f"{self.folder(t)} holds a result of other settings (key {r.get('key')} != {want}): the config or a "
                "preset changed since it ran. Restore them, study into another --out, or delete that folder to run "
                "the trial again"
            )
        self.reused.pop(t.id, None)
        return r

    def sources(self, results: dict[Trial, dict]) -> dict[str, list[str]]:
        """study.json's ``reused``: for each ``reuse`` folder that gave some of ``results``, those trials' ids."""
        out: dict[str, list[str]] = {}
        for tid in sorted(t.id for t in results if t.id in self.reused):
            out.setdefault(self.reused[tid], []).append(tid)
        return out

    def run(self, trials: list[Trial], jobs: int, bar, unlock=None) -> dict[Trial, dict]:
        """Run the trials that are not done, ``jobs`` at a time (each its own process when > 1), the ready one
        first in ``order``; return every trial's result as read back from its JSON.

        ``unlock(trial, results)`` (optional) returns the trials that a finished one makes runnable: ``run_study``
        queues an arm's test trials as soon as that arm's tuning is done, so with ``--jobs 2`` a worker that would
        wait for another arm's last tuning trial starts a test trial instead."""
        results: dict[Trial, dict] = {}
        queue: list[Trial] = []

        def add(new: list[Trial]) -> None:
            for t in new:
                r = self.result(t)
                if r is None:
                    queue.append(t)
                else:
                    finished(t, r)

        def finished(t: Trial, r: dict | None) -> None:
            if r is None:
                raise RuntimeError(f"trial {t.id} finished without {self.folder(t)}/result.json")
            results[t] = r
            bar.update(1)
            if unlock is not None:
                add(unlock(t, results))

        def take() -> Trial:
            t = min(queue, key=lambda t: order(self.cfg, t))
            queue.remove(t)
            return t

        add(trials)
        if jobs <= 1:
            while queue:
                t = take()
                bar.set_postfix_str(t.id)
                self.runner(self.cfg, t, self.folder(t), progress=self.progress)
                finished(t, self.result(t))
            return results
        if self.executor is None:
            pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
            start = lambda t: pool.submit(_worker, str(self.cfg.path), t, str(self.folder(t)))  # noqa: E731
        else:
            pool = self.executor(max_workers=jobs)
            start = lambda t: pool.submit(self.runner, self.cfg, t, self.folder(t), progress=False)  # noqa: E731
        try:
            running: dict = {}
            while queue or running:
                while queue and len(running) < jobs:
                    t = take()
                    running[start(t)] = t
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    t = running.pop(f)
                    f.result()  # a failed trial stops the study (the other worker's trial is left to finish)
                    bar.set_postfix_str(t.id)
                    finished(t, self.result(t))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return results


def order(cfg: StudyConfig, t: Trial) -> tuple:
    """Which ready trial runs first: the tuning trials (the config's order: seed, arm, rate), then the test trials
    seed by seed, arm by arm, so that a study stopped early mostly holds whole seeds. A seed or rate the config does
    not list (``benchmarks/study_jobs.py`` runs other tuning seeds) sorts after those it lists, by value."""

    def at(values, x):
        values = list(values)
        return (values.index(x), 0) if x in values else (len(values), x)

    arm = at([a.name for a in cfg.arms], t.arm)
    if t.phase == "tune":
        return (0, at(cfg.tuning_seeds, t.seed), arm, at(cfg.arm(t.arm).learning_rates, t.lr))
    return (1, at(cfg.test_seeds, t.seed), arm, (0, 0))


def arm_tests(cfg: StudyConfig, arm, results: dict[Trial, dict]) -> list[Trial] | None:
    """The arm's test trials at its chosen rate (``analysis.choose``), or None while its tuning is not done."""
    if any(Trial("tune", arm.name, lr, s) not in results for s in cfg.tuning_seeds for lr in arm.learning_rates):
        return None
    lr = A.choose(cfg, results, [arm])[arm.name]["chosen_lr"]
    return [Trial("test", arm.name, lr, s) for s in cfg.test_seeds]


def tests_of_tuned_arms(cfg: StudyConfig):
    """``Study.run``'s ``unlock`` for a whole study: the tuning trial that completes its arm's tuning makes that
    arm's test trials runnable."""
    return lambda t, results: (arm_tests(cfg, cfg.arm(t.arm), results) or []) if t.phase == "tune" else []


def _worker(config: str, trial: Trial, folder: str) -> None:
    """One trial in a worker process of ``--jobs``: the study's config read again, the trial run quietly (``run_trial``
    sets the environment: ``recipe.run.quiet_cpu_env``)."""
    run_trial(load_study(config), trial, Path(folder), progress=False)


def default_out(cfg: StudyConfig) -> Path:
    return cfg.out or Path("outputs") / "studies" / cfg.name


def _open(config, out, arms, seeds, progress: bool = False, runner=run_trial, reuse: bool = True) -> Study:
    """The study in ``config`` (the part ``arms`` / ``seeds`` selects), its arms checked, in ``out`` (default:
    ``default_out``); ``reuse=False`` (``--no-reuse``) drops the config's ``reuse`` folders."""
    cfg = select(load_study(config), arms, seeds)
    if not reuse:
        cfg = dataclasses.replace(cfg, reuse=())
    check_arms(cfg)
    return Study(cfg, Path(out) if out is not None else default_out(cfg), progress, runner)


def run_study(
    config: str | Path,
    out: str | Path | None = None,
    jobs: int = 1,
    progress: bool = True,
    runner=run_trial,
    *,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    reuse: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the study in ``config`` into ``out`` (default: the config's ``out``, else
    ``outputs/studies/<name>``); write study.json, timings.json, study.md and study.png; return the study dict.

    Args:
        jobs: trials at a time (``--jobs``; each worker uses the config's ``threads``).
        runner: the trial runner (tests inject failures through it).
        arms, seeds: run and report only these arms and test seeds (``config.select``: a part of the study, whose
            trials the whole study later reuses).
        reuse: False (``--no-reuse``): take no trial from the config's ``reuse`` folders (module docstring).
    """
    from tqdm.auto import tqdm

    study = _open(config, out, arms, seeds, progress, runner, reuse)
    cfg = study.cfg
    for w in cfg.warnings:
        logger.warning("%s: %s", cfg.path.name, w)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise RetrofitUserError(f"--jobs must be a positive integer, got {jobs!r}")
    n = sum(len(a.learning_rates) + len(cfg.test_seeds) for a in cfg.arms)
    with tqdm(total=n, desc=f"study {cfg.name}", unit="trial", disable=not progress, dynamic_ncols=True) as bar:
        results = study.run(tuning_trials(cfg), jobs, bar, tests_of_tuned_arms(cfg))
    return write_study(cfg, study.out, A.choose(cfg, results), results, study.sources(results))


def report_finished(
    config: str | Path,
    out: str | Path | None = None,
    *,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    reuse: bool = True,
) -> dict[str, Any]:
    """``--finished-only``: write study.json, study.md and the plot from the trials that have finished, running
    none: the tuning must be complete; the test seeds are those at which every arm has finished (trials run seed
    by seed, so a study stopped early has whole seeds). With fewer seeds than the config lists, study.json and
    study.md carry a warning that says so; rerunning the study without the flag runs the rest."""
    study = _open(config, out, arms, seeds, reuse=reuse)
    cfg = study.cfg
    tuned = {t: study.result(t) for t in tuning_trials(cfg)}
    missing = [t.id for t, r in tuned.items() if r is None]
    if missing:
        raise RetrofitUserError(
            f"--finished-only needs every tuning trial finished; still to run: {', '.join(missing)}"
        )
    choices = A.choose(cfg, tuned)
    results: dict[Trial, dict] = dict(tuned)
    seeds = []
    for seed in cfg.test_seeds:
        done = {t: study.result(t) for t in test_trials(cfg, choices) if t.seed == seed}
        if all(done.values()):
            seeds.append(seed)
            results.update(done)
    if not seeds:
        raise RetrofitUserError("--finished-only: no test seed has finished for every arm yet")
    if len(seeds) < len(cfg.test_seeds):
        rest = [s for s in cfg.test_seeds if s not in seeds]
        note = (
            f"partial: test seeds {', '.join(map(str, seeds))} of {', '.join(map(str, cfg.test_seeds))} have "
            f"finished for every arm (seed(s) {', '.join(map(str, rest))} still to run); this report covers those"
        )
        cfg = dataclasses.replace(cfg, test_seeds=tuple(seeds), warnings=(*cfg.warnings, note))
    return write_study(cfg, study.out, choices, results, study.sources(results))


def plan(
    config: str | Path,
    out: str | Path | None = None,
    *,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    reuse: bool = True,
) -> list[tuple[str, str]]:
    """``--dry-run``: ``[(trial id or phase, state)]``: which trials are done (``done in NAME``: in that ``reuse``
    folder), which would run next."""
    study = _open(config, out, arms, seeds, reuse=reuse)
    cfg = study.cfg

    def state(t: Trial, r: dict | None) -> str:
        if r is None:
            return "to run"
        return f"done in {study.reused[t.id]}" if t.id in study.reused else "done"

    tuned = {t: study.result(t) for t in tuning_trials(cfg)}
    rows = [(t.id, state(t, r)) for t, r in tuned.items()]
    done = {t: r for t, r in tuned.items() if r}
    tests = {a.name: arm_tests(cfg, a, done) for a in cfg.arms}
    ready = sorted((t for ts in tests.values() if ts for t in ts), key=lambda t: order(cfg, t))
    rows += [(t.id, state(t, study.result(t))) for t in ready]
    rows += [
        (f"test-{arm} x {len(cfg.test_seeds)} seeds", "after its tuning") for arm, ts in tests.items() if ts is None
    ]
    return rows


def write_study(
    cfg: StudyConfig, out: Path, choices: dict, results: dict[Trial, dict], reused: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """study.json, timings.json, study.md and study.png from the trials' results (``analysis``); ``reused``: the
    trials read from ``reuse`` folders (``Study.sources``), listed in study.json when there are any."""
    from ..hub.atomic_io import write_json_atomic
    from .report import plot_study, study_markdown

    test = {
        a.name: {s: results[Trial("test", a.name, choices[a.name]["chosen_lr"], s)] for s in cfg.test_seeds}
        for a in cfg.arms
    }
    found = A.effects(cfg, test)
    tune_rows = results[tuning_trials(cfg)[0]]["rows"]
    test_rows = next(iter(next(iter(test.values())).values()))["rows"]
    study = {
        "name": cfg.name,
        "description": cfg.description,
        "config": cfg.path.name,
        "warnings": list(cfg.warnings),
        **({"reused": reused} if reused else {}),
        "environment": environment(results),
        "arms": {
            a.name: {
                "kind": a.kind,
                "preset": a.preset.name,
                "flags": dict(a.flags),
                "learning_rates": list(a.learning_rates),
                "description": a.description,
            }
            for a in cfg.arms
        },
        "tuning": {
            **({"seed": cfg.tuning_seed} if len(cfg.tuning_seeds) == 1 else {"seeds": list(cfg.tuning_seeds)}),
            "rows": tune_rows["split"],
            "n_rows": tune_rows["n"],
            "rule": A.CHOICE_RULE,
            "eval": cfg.tune_eval,
            "arms": choices,
        },
        "testing": {
            "seeds": list(cfg.test_seeds),
            "rows": test_rows["split"],
            "n_rows": test_rows["n"],
            "eval": cfg.test_eval,
            "arms": {
                arm: {
                    "lr": choices[arm]["chosen_lr"],
                    "per_seed": [
                        {
                            "seed": s,
                            "trial": r["trial"]["id"],
                            "accuracy": r["accuracy"],
                            "accuracy_ci": r["accuracy_ci"],
                            "splits": r["splits"],
                            "mean_depth": r["mean_depth"],
                            "flops_per_token": r["flops_per_token"],
                            "forced_depth_accuracy": r["forced_depth_accuracy"],
                        }
                        for s, r in by_seed.items()
                    ],
                }
                for arm, by_seed in test.items()
            },
        },
        "bootstrap": {
            "across_seeds": "crossed: each resample draws the seeds and, independently, the rows with replacement (one "
            "row draw for every seed, as every seed is scored on the same test rows); percentile 95% interval",
            "resamples": A.N_BOOT,
            "resamples_spearman": A.N_BOOT_SPEARMAN,
        },
        "effects": found,
        "claims": A.claims(found),
        "frontier": A.frontier_summary(test, list(cfg.test_seeds)),
        "second_pass": A.second_pass(test, list(cfg.test_seeds)),
    }
    timings = {t.id: r.get("timings") for t, r in sorted(results.items(), key=lambda kv: kv[0].id) if r.get("timings")}
    totals = {k: round(sum((v or {}).get(k) or 0 for v in timings.values()), 1) for k in ("train_s", "eval_s")}
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "study.json", study, strict=True)
    write_json_atomic(out / "timings.json", {"trials": timings, "total": totals}, strict=True)
    from ..hub.atomic_io import write_text_atomic

    write_text_atomic(out / "study.md", study_markdown(study, {"trials": timings, "total": totals}))
    plot_study(study, out / "study.png")
    return study
