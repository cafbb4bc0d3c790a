"""Is ``retrofit study --jobs 2`` with one thread per trial faster than one trial at a time with two threads?

The study's trials are independent, so on a 2-core machine they can run one at a time with ``threads: 2`` (the
committed studies) or two at a time with ``threads: 1`` (``--jobs 2``). Which is faster depends on how well one
trial's matmuls use the second core. This runs the same trials of a study file both ways, one way after the other
(alone on the machine: no other torch process), and reports the wall time of each and their ratio.

Each mode is the study file with ``threads`` and the budget's ``max_steps`` replaced (``--steps``, default 60:
the ratio, not the absolute time, is the figure), run through ``retrofit.study.runner.Study`` on ``--seeds``
tuning trials of ``--arm`` at ``--lr`` (one trial per seed; use as many seeds as jobs, so that the parallel mode has
no tail). The thread count is part of a trial's key, as it may change floating-point sums: each mode's validation
accuracy, mean answer-token loss and logged training losses are reported, and ``same_numbers`` says whether the two
modes agree on all of them.

    python benchmarks/study_jobs.py                                   # tah2, 1e-3, seeds 0 and 6, 60 steps
    python benchmarks/study_jobs.py --arm sft --steps 240 --out jobs.json
    python benchmarks/study_jobs.py --steps 240 --keep runs/   # and keep the trials (study_twins.py pairs them)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import yaml


def _variant(config: Path, threads: int, steps: int, where: Path) -> Path:
    """The study file with ``threads`` and ``budget.max_steps`` replaced: a file that extends it (its own presets and
    bases resolve from its folder) and drops its ``out``."""
    from retrofit.study.config import load_study

    name = load_study(config).name
    raw = {
        "extends": str(config.resolve()),
        "name": name,
        "threads": threads,
        "budget": {"max_steps": steps},
        "out": None,
    }
    path = where / f"{config.stem}-t{threads}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_mode(config: Path, arm: str, lr: float, seeds: list[int], threads: int, jobs: int, steps: int, tmp: Path):
    from tqdm.auto import tqdm

    from retrofit.study.config import load_study
    from retrofit.study.runner import Study
    from retrofit.study.trial import Trial, check_arms

    cfg = load_study(_variant(config, threads, steps, tmp))
    check_arms(cfg)
    cfg.arm(arm)  # a clear error for an unknown arm
    trials = [Trial("tune", arm, lr, s) for s in seeds]
    study = Study(cfg, tmp / f"t{threads}-j{jobs}", progress=False)
    t0 = time.perf_counter()
    results = study.run(trials, jobs, tqdm(disable=True))
    wall = time.perf_counter() - t0
    return {
        "threads": threads,
        "jobs": jobs,
        "wall_s": round(wall, 1),
        "trials": {
            t.id: {
                "accuracy": r.get("accuracy"),
                "mean_token_nll": r.get("mean_token_nll"),
                "train_loss": (r.get("train") or {}).get("loss"),
                **{k: r.get("timings", {}).get(k) for k in ("train_s", "eval_s")},
            }
            for t, r in results.items()
        },
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="recipes/studies/main.yaml", help="the study file whose trials to time")
    p.add_argument("--arm", default="tah2", help="the arm whose tuning trials run (default: tah2)")
    p.add_argument("--lr", type=float, default=1e-3, help="its learning rate (default: 1e-3)")
    p.add_argument("--seeds", default="0,6", help="tuning seeds, one trial each (default: 0,6)")
    p.add_argument("--steps", type=int, default=60, help="training steps per trial (default: 60)")
    p.add_argument("--cores", type=int, default=2, help="cores to use: threads per trial x jobs (default: 2)")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="keep each mode's trial folders under DIR (t<threads>-j<jobs>/trials/<trial>/result.json, with the keys "
        "the study gives them: benchmarks/study_twins.py can pair them) instead of a temporary folder",
    )
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.steps < 1 or a.cores < 2:
        p.error("--steps must be >= 1 and --cores >= 2")
    import torch

    from retrofit.study.env import cpu_id, cpu_model

    with contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(prefix="study_jobs-") as d:
        tmp = Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        config = Path(a.config).resolve()
        seq = run_mode(config, a.arm, a.lr, seeds, a.cores, 1, a.steps, tmp)
        par = run_mode(config, a.arm, a.lr, seeds, 1, a.cores, a.steps, tmp)
    out = {
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "torch": torch.__version__,
        "config": a.config,
        "arm": a.arm,
        "lr": a.lr,
        "steps": a.steps,
        "seeds": seeds,
        "one_at_a_time": seq,
        "parallel": par,
        "speedup_parallel": round(seq["wall_s"] / par["wall_s"], 3),
        # does the thread count change the trial's numbers here? (it is part of the trial key either way)
        "same_numbers": all(
            {k: v for k, v in seq["trials"][t].items() if not k.endswith("_s")}
            == {k: v for k, v in par["trials"][t].items() if not k.endswith("_s")}
            for t in seq["trials"]
        ),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
