"""One trial of a study: one training run through the recipe machinery, one evaluation through the evaluation
engine, one small result JSON (docs/study.md).

A trial is ``(phase, arm, learning rate, seed)``. It parses the arm's recipe flags with the recipes' own parser
(``retrofit.recipe.parse_recipe_args``: the preset, the study's and the arm's ``set``, the budget, then the
trial's ``--learning_rate`` / ``--seed`` / ``--output_dir``), retrofits a copy of the base model (loaded once per
process) with the arm's ``LoopConfig`` after ``set_seed``, trains it
with ``train_and_save`` (a looped arm) or ``train_control`` (``sft``, ``fixed``) — the recipes' trainer, no loop
of its own — and evaluates it once with ``evaluate_task_arrays`` on the validation rows (tuning) or the test
rows (testing): the same code for both. ``result.json`` is written atomically, last; a folder without it is a
trial that did not finish and is run again from the start.

What the result keeps is what the study's statistics need, per row, and nothing that differs between two runs of
the same trial on the same machine (the times go to ``timings``, which study.json leaves out).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..model import registry
from ..model.errors import RetrofitUserError
from .config import SHARED, Arm, StudyConfig
from .env import trial_env

logger = logging.getLogger(__name__)

#: bump when the result's layout changes: older results are then run again
SCHEMA = 1
RESULT = "result.json"


@dataclass(frozen=True)
class Trial:
    """``phase`` is ``"tune"`` (validation rows, the tuning seed) or ``"test"`` (test rows, a test seed)."""

    phase: str
    arm: str
    lr: float
    seed: int

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.arm}-lr{self.lr:.3g}-s{self.seed}"


def trial_argv(arm: Arm, lr: float, seed: int, folder: Path) -> list[str]:
    """The recipe flags of one trial (the preset first; the study's own settings last, so they win)."""
    argv = ["--config", str(arm.preset)]
    for k, v in arm.flags:
        argv += [f"--{k}", _flag(v)]
    argv += ["--learning_rate", repr(float(lr)), "--seed", str(int(seed)), "--output_dir", str(folder)]
    # no control arms or report inside a trial (the study is the report), no checkpoints (a trial restarts whole)
    argv += ["--control", "", "--report", "false", "--save_strategy", "no", "--report_to", "none"]
    return argv


def _flag(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def parse_trial_args(arm: Arm, lr: float, seed: int, folder: Path, quiet: bool = True):
    """``(ScriptArgs, RetrofitSFTConfig, LoopArgs)`` of a trial, by the recipes' parser."""
    from ..recipe.args import RecipeSpec, parse_recipe_args

    argv = trial_argv(arm, lr, seed, folder) + (["--disable_tqdm", "true"] if quiet else [])
    return parse_recipe_args(RecipeSpec(f"study arm {arm.name}", arm.preset, registry.names()), argv)


def check_arms(cfg: StudyConfig) -> dict[str, dict[str, Any]]:
    """Parse every arm's recipe flags as a trial would (``parse_recipe_args``), before anything trains, and check
    that the arms share the data and the budget (``SHARED``). Returns ``{arm: {shared setting: value}}``."""
    seen: dict[str, dict[str, Any]] = {}
    for a in cfg.arms:
        try:
            script, targs, largs = parse_trial_args(a, a.learning_rates[0], cfg.tuning_seed, Path("/nonexistent"))
        except RetrofitUserError as e:
            raise RetrofitUserError(f"arms.{a.name}: {e}") from None
        except (SystemExit, ValueError) as e:  # the parser: an unknown flag, a bad value
            raise RetrofitUserError(f"arms.{a.name}: the recipe rejects its flags ({e})") from None
        if a.kind == "looped" and not registry.method_class(largs.method).has_decider():
            raise RetrofitUserError(
                f"arms.{a.name}: kind looped needs a method with a decider, got {largs.method!r}; use kind: fixed"
            )
        values = {**vars(script), **vars(largs), **targs.to_dict()}
        seen[a.name] = {k: values.get(k) for k in SHARED}
    first = next(iter(seen))
    if not seen[first]["n_valid"]:
        raise RetrofitUserError(
            "tuning needs validation rows: set n_valid (validation rows per level, disjoint from train and test) in "
            "the study's set: or its preset"
        )
    for name, v in seen.items():
        diff = sorted(k for k in SHARED if v[k] != seen[first][k])
        if diff:
            raise RetrofitUserError(
                f"arms {first} and {name} differ in {', '.join(f'{k} ({seen[first][k]!r} vs {v[k]!r})' for k in diff)}"
                "; every arm must train on the same rows with the same budget (put it in set: or budget:)"
            )
    return seen


def trial_settings(arm: Arm, lr: float, seed: int) -> dict[str, Any]:
    """The settings a trial runs with: its preset's (not its comments), each replaced by the trial's own flag where
    it has one (``trial_argv``: the flags win). A preset value every trial overrides (the budget, the learning
    rate, the seed) therefore decides no trial: the main job may change it without invalidating the study."""
    import yaml

    flags = trial_argv(arm, lr, seed, Path("OUT"))[2:]
    if len(flags) % 2 or not all(f.startswith("--") for f in flags[::2]):
        raise ValueError(f"trial flags are not '--key value' pairs: {flags}")
    return {**(yaml.safe_load(arm.preset.read_text()) or {}), **{k[2:]: v for k, v in zip(flags[::2], flags[1::2])}}


def trial_key(cfg: StudyConfig, trial: Trial) -> str:
    """What decides a trial's numbers, hashed: its settings (``trial_settings``), its evaluation, the threads."""
    arm = cfg.arm(trial.arm)
    spec = {
        "schema": SCHEMA,
        "kind": arm.kind,
        "settings": {k: str(v) for k, v in trial_settings(arm, trial.lr, trial.seed).items()},
        "phase": trial.phase,
        "eval": {k: list(v) if isinstance(v, tuple) else v for k, v in _eval_options(cfg, trial.phase).items()},
        "threads": cfg.threads,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _eval_options(cfg: StudyConfig, phase: str) -> dict:
    return dict(cfg.tune_eval if phase == "tune" else cfg.test_eval)


def _bits(x) -> str:
    return "".join("1" if bool(v) else "0" for v in np.asarray(x).reshape(-1))


def _digits(x) -> str:
    return "".join(str(int(v)) for v in np.asarray(x).reshape(-1))


_BASE: dict = {}


def base_model(spec: str, dtype):
    """A deep copy of the base model (and its tokenizer), loaded once per process: loading SmolLM2 from its GGUF
    file takes ~15 s, more than a tiny trial. The load happens before the trial's ``set_seed``, so a cached and a
    fresh load give the same trial."""
    from ..hub.loading import load_model
    from ..model.errors import RetrofitUserError
    from ..model.modeling import LoopedForCausalLM

    key = (spec, str(dtype))
    if key not in _BASE:
        _BASE.clear()  # one base at a time
        _BASE[key] = load_model(spec, dtype=dtype)
    base, tok = _BASE[key]
    if isinstance(base, LoopedForCausalLM):
        raise RetrofitUserError(f"--model {spec} is a looped checkpoint; a study's arms start from a base model")
    return copy.deepcopy(base), copy.deepcopy(tok)


@contextlib.contextmanager
def quiet_libraries(quiet: bool):
    """A trial without its libraries' chatter when the study runs quietly (``--quiet``, or a ``--jobs`` worker whose
    output would interleave with the other's): no progress bars from datasets' maps, the trainer's data preparation
    or the saves, and the trainer's printed log lines (the losses are in the result's ``train.loss``) to
    ``/dev/null``. Warnings and errors still reach stderr; the libraries' bars are on again afterwards."""
    if not quiet:
        yield
        return
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    was = (
        datasets.is_progress_bar_enabled(),
        hf_logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
    )
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        if was[0]:
            datasets.enable_progress_bars()
        if was[1]:
            hf_logging.enable_progress_bar()
        if not was[2]:
            hub_utils.enable_progress_bars()


def run_trial(cfg: StudyConfig, trial: Trial, folder: Path, progress: bool = True) -> dict[str, Any]:
    """Train and evaluate one trial in ``folder`` and write ``folder/result.json`` (module docstring); with
    ``progress`` off, quietly (``quiet_libraries``)."""
    with quiet_libraries(not progress):
        return _run_trial(cfg, trial, folder, progress)


def _run_trial(cfg: StudyConfig, trial: Trial, folder: Path, progress: bool) -> dict[str, Any]:
    import torch
    from transformers import set_seed

    from ..evaluation.options import EvalOptions
    from ..evaluation.task_eval import evaluate_task_arrays
    from ..hub.atomic_io import write_json_atomic
    from ..model.convert import base_model_of, convert
    from ..recipe.controls import train_control
    from ..recipe.data import load_data, task_splits, use_chat
    from ..recipe.main_job import test_rows
    from ..recipe.run import quiet_cpu_env, train_and_save
    from ..training.model_setup import prepare_model

    quiet_cpu_env()
    arm = cfg.arm(trial.arm)
    if folder.exists():
        shutil.rmtree(folder)  # an unfinished trial starts over
    folder.mkdir(parents=True)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    script, targs, largs = parse_trial_args(arm, trial.lr, trial.seed, folder, quiet=not progress)
    t0 = time.time()
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sys.stderr if progress else sink):
        # transformers' GGUF reader draws its own tqdm bar, deaf to the switches of quiet_libraries; its warnings
        # go through logging handlers, which keep the real stderr
        base, tok = base_model(largs.model, getattr(torch, largs.dtype))
    set_seed(targs.seed)  # the heads' init draws from the seeded global generator, after the (cached) load
    model = convert(base, largs.loop_config())
    splits = task_splits(script)
    train, _, data_report = load_data(script, tok, splits)
    if arm.kind == "looped":
        trainer, trained = train_and_save(
            prepare_model(model, largs), tok, targs, train, None, resume=False, lora=largs.lora, out=folder
        )
        log = trainer.state.log_history
        del trainer
    else:
        pristine = base_model_of(copy.deepcopy(model)).eval()
        del model
        control = train_control(arm.kind, pristine, tok, targs, largs, train, folder)
        trained, log = control.model, control.log_history
    trained.eval()
    train_s = time.time() - t0

    if trial.phase == "tune":
        rows = [dict(r) for r in splits["valid"]]
        train_levels = sorted({int(x) for x in splits["train"]["difficulty"]})
    else:
        rows, train_levels = test_rows(script, splits)
    opts = EvalOptions(**_eval_options(cfg, trial.phase), chat=use_chat(script, tok), progress=progress)
    t1 = time.time()
    with torch.no_grad():
        entry, arrays = evaluate_task_arrays(
            trained, tok, script.task, rows=rows, train_levels=train_levels, name=arm.name, options=opts
        )
    eval_s = time.time() - t1
    result = _result(cfg, trial, arm, trained, entry, arrays, log, data_report)
    result["env"] = trial_env(cfg.threads)
    result["timings"] = {
        "train_s": round(train_s, 1),
        "eval_s": round(eval_s, 1),
        "frontier_s": (entry.get("frontier") or {}).get("wall_s"),
    }
    del trained
    gc.collect()
    if not cfg.keep_models:
        for p in folder.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
    write_json_atomic(folder / RESULT, result, strict=True)
    return result


def _result(cfg, trial: Trial, arm: Arm, model, entry: dict, arrays, log: list, data_report: dict) -> dict[str, Any]:
    """The trial's result (module docstring): summary figures and the per-row arrays the statistics pair."""
    from ..evaluation.models import model_info

    info = model_info(model)
    overall = entry["overall"]
    nll = np.concatenate([x[c] for x, c in zip(arrays.nll, arrays.content)]) if arrays.nll else np.zeros(0)
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "key": trial_key(cfg, trial),
        "trial": {"id": trial.id, "phase": trial.phase, "arm": arm.name, "kind": arm.kind, "lr": trial.lr},
        "seed": trial.seed,
        "model": {"looped": info.looped, "method": info.method, "max_depth": info.max_depth},
        "loop": model.loop.to_dict() if info.looped else None,
        "train": {
            "steps": max((h.get("step", 0) for h in log), default=0),
            "loss": [[h["step"], round(float(h["loss"]), 6)] for h in log if "loss" in h],
            "rows": data_report.get("train_rows"),
        },
        "rows": {
            "split": "valid" if trial.phase == "tune" else "test",
            "n": len(arrays.levels),
            "levels": [int(x) for x in arrays.levels],
            "answers": hashlib.sha256(json.dumps(arrays.answer_ids).encode()).hexdigest()[:16],
        },
        "accuracy": overall["accuracy"],
        "accuracy_ci": overall.get("accuracy_ci"),
        "mean_token_nll": float(nll.mean()) if nll.size else None,
        "levels": {
            str(lv): {k: e.get(k) for k in ("n", "accuracy", "accuracy_ci", "mean_depth", "flops_per_token")}
            for lv, e in entry["levels"].items()
        },
        "splits": {k: {"accuracy": v.get("accuracy"), "n": v.get("n")} for k, v in (entry.get("splits") or {}).items()},
        "mean_depth": overall.get("gen_mean_depth"),
        "flops_per_token": overall.get("gen_flops_per_token"),
        "forced_depth_accuracy": entry.get("forced_depth_accuracy"),
        "depth_difficulty_spearman": overall.get("depth_difficulty_spearman"),
        "correct": _bits(arrays.correct),
    }
    if trial.phase == "test":
        tokens: dict[str, Any] = {}
        if info.looped:  # per row: the exit depths of its content tokens (producing positions)
            tokens["depth"] = [_digits(d[c]) for d, c in zip(arrays.pred_depth, arrays.content)]
        else:  # a plain model's loss per content token: the difficulty the looped arms' depths are set against
            tokens["nll"] = [[round(float(v), 6) for v in x[c]] for x, c in zip(arrays.nll, arrays.content)]
        out["tokens"] = tokens
        fr = entry.get("frontier")
        if fr:
            fa = arrays.frontier
            keep = ("decider_vs_random", "decider_vs_oracle", "ceiling", "gain_by_decile", "break_even_mean_depth")
            out["frontier"] = {
                "rows": [int(i) for i in fa.rows],
                "points": fr["points"],
                **{k: fr.get(k) for k in keep if fr.get(k) is not None},
                "correct": {k: (_bits(v) if np.ndim(v) == 1 else [_bits(x) for x in v]) for k, v in fa.correct.items()},
            }
    return out


def read_result(folder: Path) -> dict[str, Any] | None:
    """The trial's result JSON, or None when it has none (an unfinished trial)."""
    from ..hub.atomic_io import read_json

    path = folder / RESULT
    return read_json(path) if path.is_file() else None


def bits(s: str) -> np.ndarray:
    """A result's ``"0110…"`` string as ``[n]`` bool."""
    return np.frombuffer(s.encode(), dtype=np.uint8) == ord("1")
