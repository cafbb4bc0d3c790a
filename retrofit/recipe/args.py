"""The recipe's arguments: ``ScriptArgs`` (data, controls, report), ``RecipeSpec`` (what makes one recipe
different) and the parsers. ``LoopArgs`` (the model and how it loops) lives in ``retrofit.training.model_setup``.

    script_args, training_args, loop_args = parse_recipe_args(spec, argv)
    # = TrlParser((ScriptArgs, RetrofitSFTConfig, LoopArgs)).parse_args_and_config(...)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..model.errors import RetrofitUserError
from ..training.model_setup import loop_args_class
from .yaml_file import read_yaml

CONTROLS = ("sft", "fixed")


@dataclass
class ScriptArgs:
    """Data, controls and the report (the recipe's ``ScriptArguments``)."""

    task: str = field(
        default="mano",
        metadata={"help": "data_prep task (mano, brevo, lano, gsm, clrs_*, rg_*; `python -m data_prep.build --list`)."},
    )
    n_train: int = field(default=1000, metadata={"help": "Training rows per difficulty level."})
    n_eval: int = field(
        default=20, metadata={"help": "Test rows per level (held out from training; the report's rows). 0 = none."}
    )
    n_valid: int = field(
        default=0,
        metadata={"help": "Validation rows per level, disjoint from train and test (for choosing settings). 0 = none."},
    )
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    train_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated difficulty levels to train on; default: the task's own."}
    )
    extrap_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated held-out levels above training (in the report)."}
    )
    interp_levels: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated held-out levels inside the training range; default: the task's own, or none "
            "when --train_levels is given."
        },
    )
    data_file: str | None = field(
        default=None,
        metadata={
            "help": "Train on rows from this .jsonl/.json/.parquet file or save_to_disk folder instead of --task."
        },
    )
    eval_file: str | None = field(default=None, metadata={"help": "Evaluation rows for --data_file."})
    chat: str = field(
        default="auto",
        metadata={"help": "Format rows as chat turns: auto (if the tokenizer has a template), true, false."},
    )
    resume: bool = field(
        default=False, metadata={"help": "Continue from the newest valid checkpoint-N in --output_dir."}
    )
    control: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated control arms trained in the same run on the same data, order, steps, learning "
            "rate and seed: 'sft' (the base as a plain causal LM) and/or 'fixed' (the looped model at max depth for "
            "every token). Saved under control-<name>/ and compared in the report."
        },
    )
    report: bool = field(
        default=False,
        metadata={
            "help": "After training (with --task): evaluate the untrained base, the looped model and the controls per "
            "difficulty level on the test rows, export the looped checkpoint, write report/ and summary.json."
        },
    )
    eval_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated levels to report; default: every test level."}
    )
    eval_n: int | None = field(
        default=None, metadata={"help": "Test rows per level in the report; default: all of --n_eval."}
    )
    identity_check: bool = field(
        default=True, metadata={"help": "Check that depth-1 logits equal the base model's before training."}
    )
    calibrate_stop_share: float | None = field(
        default=None,
        metadata={
            "help": "After training, set the decider's own threshold (TaH2 exit_threshold, ANIRA-O halt_threshold) so "
            "that this share of the answer steps of --calibrate_rows training rows stops after depth 1: a compute "
            "budget (at max_depth 2, d̄ = 2 - share), fixed before any test row is seen and saved in the checkpoint "
            "(docs/evaluation.md). Default: keep the trained threshold."
        },
    )
    calibrate_rows: int = field(
        default=120, metadata={"help": "Training rows (a seeded sample) --calibrate_stop_share calibrates on."}
    )

    def __post_init__(self):
        share = self.calibrate_stop_share
        if share is not None and not 0.0 <= float(share) <= 1.0:
            raise RetrofitUserError(f"--calibrate_stop_share must lie in [0, 1], got {share!r}")
        if self.calibrate_rows < 1:
            raise RetrofitUserError(f"--calibrate_rows must be >= 1, got {self.calibrate_rows!r}")

    def controls(self) -> list[str]:
        names = [c.strip() for c in (self.control or "").split(",") if c.strip()]
        bad = [c for c in names if c not in CONTROLS]
        if bad:
            raise RetrofitUserError(f"--control {','.join(bad)} is not a control arm; allowed: {', '.join(CONTROLS)}")
        return list(dict.fromkeys(names))


@dataclass(frozen=True)
class RecipeSpec:
    """What makes one recipe different from another: its name, preset and accepted methods."""

    name: str
    preset: Path
    methods: tuple[str, ...]


def parse_levels(text: str | None) -> list[int] | None:
    if text is None or str(text).strip() == "":
        return None
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise RetrofitUserError(f"levels must be comma-separated integers, got {text!r}") from None


def parse_recipe_args(spec: RecipeSpec, argv=None):
    """``TrlParser((ScriptArgs, RetrofitSFTConfig, LoopArgs))`` with the recipe's preset as the base config.

    CLI flags win over the YAML preset (``--config`` replaces it), which wins over the dataclass defaults.
    """
    from trl import TrlParser

    from ..training.trainer import RetrofitSFTConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        argv = ["--config", str(spec.preset), *argv]
    for i, a in enumerate(argv):  # a missing or malformed preset: one error line, not the YAML parser's traceback
        if a.startswith("--config="):
            read_yaml(a.split("=", 1)[1], "--config")
        elif a == "--config" and i + 1 < len(argv):
            read_yaml(argv[i + 1], "--config")
    script, train, loop = TrlParser((ScriptArgs, RetrofitSFTConfig, loop_args_class())).parse_args_and_config(argv)
    if loop.method not in spec.methods:
        raise RetrofitUserError(f"--method must be {' or '.join(spec.methods)}, got {loop.method!r} ({spec.name})")
    return script, train, loop
