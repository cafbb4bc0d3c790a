"""What every recipe shares: its arguments, its data, and the train → save → (controls, report) block.

A recipe in ``recipes/`` is a short script that names its preset and its methods and calls
``run_recipe`` — the same shape as TRL's scripts, which parse
``TrlParser((ScriptArguments, SFTConfig, ModelConfig))``::

    script_args, training_args, loop_args = parse_recipe_args(spec, argv)
    # = TrlParser((ScriptArgs, RetrofitSFTConfig, LoopArgs)).parse_args_and_config(...)

Every flag exists with the same name and meaning in every recipe; a recipe only changes the defaults
(its YAML preset in ``recipes/configs/``) and which ``--method`` values it accepts.

The block ``run_recipe`` runs, top to bottom:

1. build the looped model (``LoopArgs.loop_config``) from ``--model`` and check identity at init;
2. load the data (``--task`` from ``data_prep`` or ``--data_file``), format it as prompt/completion rows;
3. train with ``RetrofitSFTTrainer`` (``--resume`` continues from the newest valid checkpoint), save
   ``final/`` atomically, merge LoRA adapters into ``final-merged/``;
4. train each ``--control`` arm on the same data, order, steps, learning rate and seed
   (``retrofit.controls``);
5. with ``--report`` and a ``--task``: evaluate the untrained base, the looped model and every control
   on the held-out test rows, with intervals and paired tests, export the looped checkpoint and write
   ``report/`` and ``summary.json`` (``retrofit.main_job``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import LoopConfig
from .errors import RetrofitUserError

logger = logging.getLogger("retrofit.recipe")

CONTROLS = ("sft", "fixed")


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
@dataclass
class LoopArgs:
    """The model and how it loops (the recipe's ``ModelConfig``)."""

    model: str = field(
        default="smollm2",
        metadata={
            "help": "Hub id, local folder, .gguf file, 'smollm2' (embedded SmolLM2-135M-Instruct) or "
            "'tiny-llama'/'tiny-qwen3' (random, tests)."
        },
    )
    dtype: str = field(
        default="float32", metadata={"help": "Weights dtype: float32 (use --bf16 for mixed precision) or bfloat16."}
    )
    method: str = field(
        default="tah2",
        metadata={"help": "Halting method: tah2, anira-e, anira-o or fixed (the recipe says which it takes)."},
    )
    prelude: int = field(
        default=0, metadata={"help": "Layers run once before the loop (0 = whole-stack looping, as TaH2 and Ouro)."}
    )
    core: int | None = field(
        default=None,
        metadata={"help": "Layers looped after the prelude; the rest form the coda. None = all remaining."},
    )
    max_depth: int = field(
        default=2, metadata={"help": "Maximum iterations (TaH2's M; ANIRA's D). Compute grows ~linearly with it."}
    )
    attention: str | None = field(
        default=None, metadata={"help": "duo-causal (TaH2) or same-depth (ANIRA); default: the method's own."}
    )
    exit_threshold: float = field(
        default=0.5, metadata={"help": "tah2: τ_exit, stop at the first depth whose continue prob < τ."}
    )
    decider_top_k: int = field(
        default=2048,
        metadata={"help": "tah2: top-K next-token probabilities the decider reads (the release: 2048; 0 = none)."},
    )
    decider_arch: str = field(
        default="swiglu",
        metadata={
            "help": "tah2: the decider's body: 'swiglu' (the authors' release: per-part norms, SwiGLU MLP, bias-free "
            "score at N(0, 0.01)) or 'ffn' (retrofit < 0.2, starts at deep_init_logit).",
            "choices": ["swiglu", "ffn"],
        },
    )
    decider_init_std: float = field(
        default=0.01, metadata={"help": "tah2 'swiglu' decider: std of the score layer at init (release: 0.01)."}
    )
    train_decisions: str = field(
        default="threshold", metadata={"help": "tah2: 'threshold' (on-policy) or 'sample' (ablation)."}
    )
    mixture_output: bool = field(
        default=True, metadata={"help": "tah2: mixture of per-depth outputs; false = final depth only (ablation)."}
    )
    halt_threshold: float = field(
        default=0.5,
        metadata={"help": "anira-o inference: stop once the cumulative halting mass reaches it (0.5 = median)."},
    )
    gumbel_tau: float = field(default=1.0, metadata={"help": "anira-e training: Gumbel-softmax temperature."})
    updater_hidden: int | None = field(default=None, metadata={"help": "Updater MLP width; None = hidden size."})
    decider_hidden: int | None = field(default=None, metadata={"help": "Decider FFN width; None = hidden size / 4."})
    deep_init_logit: float = field(
        default=3.0, metadata={"help": "Initial continue logit of the deciders (> 0 = start deep; σ(3) = 0.95)."}
    )
    freeze_prelude: bool = field(
        default=False,
        metadata={
            "help": "Freeze the embeddings (and a tied LM head) and the prelude layers' weights. Controls freeze the "
            "same parameters. With --lora, --lora_layers says whether the prelude still gets adapters."
        },
    )
    lora: bool = field(
        default=False, metadata={"help": "Train LoRA adapters on the backbone; updater and decider train fully."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_layers: str = field(
        default="all",
        metadata={
            "help": "Which decoder layers get LoRA adapters: 'all', or 'after_prelude' (core and coda only: with "
            "--freeze_prelude no backward runs through the prelude, a faster step; on the main job's validation "
            "split it cost the looped arm 27 points, docs/main-job.md).",
            "choices": ["all", "after_prelude"],
        },
    )
    lora_targets: str | None = field(
        default=None, metadata={"help": "Comma-separated module names; default: attention + MLP projections."}
    )

    def __post_init__(self):
        if self.lora_layers not in ("all", "after_prelude"):
            raise ValueError(f"lora_layers must be 'all' or 'after_prelude'; got {self.lora_layers!r}")

    def loop_config(self, fixed_graph: bool = False, **override) -> LoopConfig:
        """The ``LoopConfig`` these arguments describe (``override`` replaces fields, e.g. for a control)."""
        fields = dict(
            prelude=self.prelude,
            core=self.core,
            max_depth=self.max_depth,
            method=self.method,
            attention=self.attention,
            exit_threshold=self.exit_threshold,
            decider_top_k=self.decider_top_k,
            decider_arch=self.decider_arch,
            decider_init_std=self.decider_init_std,
            train_decisions=self.train_decisions,
            mixture_output=self.mixture_output,
            halt_threshold=self.halt_threshold,
            gumbel_tau=self.gumbel_tau,
            updater_hidden=self.updater_hidden,
            decider_hidden=self.decider_hidden,
            deep_init_logit=self.deep_init_logit,
            fixed_graph=fixed_graph,
        )
        fields.update(override)
        return LoopConfig(**fields)


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

    from .training import RetrofitSFTConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        argv = ["--config", str(spec.preset), *argv]
    script, train, loop = TrlParser((ScriptArgs, RetrofitSFTConfig, LoopArgs)).parse_args_and_config(argv)
    if loop.method not in spec.methods:
        raise RetrofitUserError(f"--method must be {' or '.join(spec.methods)}, got {loop.method!r} ({spec.name})")
    return script, train, loop


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def task_splits(args: ScriptArgs):
    """The task's train / eval (test) / eval_interp / eval_extrap (/ valid) splits. Deterministic: the
    report rebuilds exactly the rows training held out."""
    from data_prep.tasks import build_splits

    return build_splits(
        args.task,
        n_train=args.n_train,
        n_eval=max(args.n_eval, 1),
        seed=args.task_seed,
        train_levels=parse_levels(args.train_levels),
        extrap_levels=parse_levels(args.extrap_levels),
        interp_levels=parse_levels(args.interp_levels) if args.interp_levels else ([] if args.train_levels else None),
        n_valid=args.n_valid,
    )


def use_chat(args: ScriptArgs, tokenizer) -> bool:
    if args.chat not in ("auto", "true", "false"):
        raise RetrofitUserError(f"--chat must be auto, true or false, got {args.chat!r}")
    return args.chat == "true" or (args.chat == "auto" and tokenizer.chat_template is not None)


def load_data(args: ScriptArgs, tokenizer, splits=None):
    """-> ``(train, eval or None, reports)``: TRL prompt/completion rows and the counts of skipped rows.

    ``splits``: the task's ``task_splits(args)`` when the caller already built them (``--task`` runs)."""
    import datasets

    from data_prep.chat import load_rows

    from .sft_data import format_sft_dataset

    if args.data_file:
        train = datasets.Dataset.from_list(load_rows(args.data_file))
        evals = datasets.Dataset.from_list(load_rows(args.eval_file)) if args.eval_file else None
    else:
        splits = task_splits(args) if splits is None else splits
        train = splits["train"]
        evals = splits["valid"] if "valid" in splits else None
    chat = use_chat(args, tokenizer)
    train, report = format_sft_dataset(train, chat=chat)
    reports = {"train_rows": report}
    if evals is not None:
        evals, reports["eval_rows"] = format_sft_dataset(evals, chat=chat)
    return train, evals, reports


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def freeze_prelude(model) -> int:
    """No gradients for the embeddings (so a tied LM head too) and the prelude layers; returns the
    number of parameters that still train."""
    inner = model.model
    inner.embed_tokens.weight.requires_grad_(False)
    if model.lm_head.weight is not inner.embed_tokens.weight:
        model.lm_head.weight.requires_grad_(False)
    for layer in model.prelude_layers:
        layer.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def identity_check(model, base, tokenizer) -> float:
    """Max |looped logits with every token exiting at depth 1 - base logits| on a probe prompt (0 at init)."""
    dev = next(model.parameters()).device
    ids = tokenizer("+ 3 * 4 5 = 17", return_tensors="pt").input_ids.to(dev)
    was = model.training
    model.eval()
    with torch.no_grad():
        err = (model(ids, depth=1).logits - base(ids).logits).abs().max().item()
    model.train(was)
    return err


def prepare_model(model, loop_args: LoopArgs):
    """Freeze and/or wrap with LoRA, as the arguments say (the same for the looped arm and controls)."""
    from .model_setup import apply_lora, lora_layers_after_prelude

    if loop_args.freeze_prelude:
        n = freeze_prelude(model)
        logger.info("frozen embeddings + %d prelude layers; %.1fM parameters train", len(model.prelude_layers), n / 1e6)
    if loop_args.lora:
        targets = loop_args.lora_targets.split(",") if loop_args.lora_targets else None
        layers = lora_layers_after_prelude(model) if loop_args.lora_layers == "after_prelude" else None
        model = apply_lora(
            model,
            r=loop_args.lora_r,
            alpha=loop_args.lora_alpha,
            dropout=loop_args.lora_dropout,
            targets=targets,
            layers=layers,
        )
    return model


# ------------------------------------------------------------------------------------------------
# Train → save
# ------------------------------------------------------------------------------------------------
def train_and_save(model, tokenizer, train_args, train, evals, *, resume: bool, lora: bool, out: Path):
    """Train with ``RetrofitSFTTrainer``, save ``out/final`` atomically (and ``final-merged`` for LoRA).

    Returns:
        ``(trainer, looped)``: the trainer and the trained looped model (LoRA merged), or raises
        ``NonFiniteLossError``.
    """
    from .checkpointing import atomic_dir, last_checkpoint
    from .model_setup import zero3_enabled
    from .training import RetrofitSFTTrainer

    trainer = RetrofitSFTTrainer(model, train_args, train_dataset=train, eval_dataset=evals, processing_class=tokenizer)
    start = train_args.resume_from_checkpoint
    if resume:
        start = last_checkpoint(train_args.output_dir)
        if start is None:
            raise RetrofitUserError(f"--resume: no complete checkpoint-N folder in {train_args.output_dir}")
        logger.info("resuming from %s", start)
    trainer.train(resume_from_checkpoint=start)
    trainer.save_model_atomic(str(out / "final"))
    looped = trainer.accelerator.unwrap_model(trainer.model)
    if lora:
        if zero3_enabled(train_args):
            logger.warning("not merging LoRA under ZeRO-3 (weights are sharded); merge the saved adapter offline")
        else:
            looped = looped.merge_and_unload()
            if trainer.accelerator.is_main_process:
                with atomic_dir(out / "final-merged") as tmp:
                    looped.save_pretrained(tmp)
                    tokenizer.save_pretrained(tmp)
    return trainer, looped


def run_recipe(spec: RecipeSpec, argv=None) -> int:
    """Parse the arguments and run the recipe's whole block (see the module docstring)."""
    import copy

    from transformers import set_seed

    from .convert import base_model_of
    from .model_setup import build_looped_model, deepspeed_enabled, zero3_enabled
    from .training import NonFiniteLossError

    script, targs, largs = parse_recipe_args(spec, argv)
    t_start = time.time()
    logging.basicConfig(level=logging.INFO if targs.should_log else logging.WARNING)
    controls = script.controls()
    if (controls or script.report) and zero3_enabled(targs):
        raise RetrofitUserError(
            "--control and --report run on one process; drop them under ZeRO-3 and evaluate the saved checkpoints"
        )
    set_seed(targs.seed)

    # 1. The looped model. Under DeepSpeed the loop always unrolls max_depth iterations: ZeRO-3's parameter
    #    prefetch traces the module order, and ZeRO-2 reduces gradients in buckets that every rank must fill
    #    alike; a data-dependent depth breaks both (model_setup.deepspeed_enabled).
    loop = largs.loop_config(fixed_graph=deepspeed_enabled(targs))
    model, tokenizer = build_looped_model(largs.model, loop, dtype=getattr(torch, largs.dtype))
    pristine = None
    if controls or script.report:
        # the untouched pretrained base: `model` shares (and will train) the base's own modules
        pristine = base_model_of(copy.deepcopy(model)).eval()
    identity_err = None
    if script.identity_check and pristine is not None:
        identity_err = identity_check(model, pristine, tokenizer)
        logger.info("identity at init: max |looped(depth=1) - base| = %.2e", identity_err)
    model = prepare_model(model, largs)

    # 2. Data: prompt/completion rows; the loss covers the completion only.
    if script.calibrate_stop_share is not None and script.data_file:
        raise RetrofitUserError("--calibrate_stop_share calibrates on --task rows; it does not take --data_file yet")
    splits = None if script.data_file else task_splits(script)  # built once: training and the report's test rows
    train, evals, reports = load_data(script, tokenizer, splits)

    # 3. Train and save. A NaN/inf loss stops the run before the bad update.
    out = Path(targs.output_dir)
    t_train = time.time()
    try:
        trainer, looped = train_and_save(
            model, tokenizer, targs, train, evals, resume=script.resume, lora=largs.lora, out=out
        )
    except NonFiniteLossError as err:
        logger.error("%s", err)
        return 1
    timings = {"train_looped_s": round(time.time() - t_train, 1)}
    reports.update(trainer.data_report)
    main = trainer.accelerator.is_main_process
    calibration = None
    if script.calibrate_stop_share is not None and main:
        t0 = time.time()
        calibration = calibrate(looped, tokenizer, script, splits, targs.seed, out)
        timings["calibrate_s"] = round(time.time() - t0, 1)
    if main:
        from .checkpointing import write_json_atomic

        write_json_atomic(out / "data_report.json", reports)
        logger.info("saved %s; rows: %s", out / "final", reports)

    # 4. Control arms: same data, order, steps, learning rate and seed.
    trained_controls = {}
    if controls and main:
        from .controls import train_control

        for name in controls:
            t0 = time.time()
            trained_controls[name] = train_control(name, pristine, tokenizer, targs, largs, train, out)
            timings[f"train_control_{name}_s"] = round(time.time() - t0, 1)

    # 5. The report: base, looped and controls per difficulty level on the test rows.
    if script.report and main:
        if script.data_file:
            logger.warning("--report needs --task rows with difficulty levels; skipped for --data_file")
        else:
            from .main_job import main_job_report

            main_job_report(
                looped,
                tokenizer,
                pristine,
                trained_controls,
                out,
                script,
                splits,
                identity_err,
                t_start,
                timings,
                calibration=calibration,
            )
    return 0


def calibrate(looped, tokenizer, script: ScriptArgs, splits, seed: int, out: Path) -> dict:
    """``--calibrate_stop_share``: place the trained decider's own threshold by compute on a seeded sample
    of the training rows (``evaluation/calibrate.py``), and write it into the saved checkpoints' configs
    (``final``, ``final-merged``) and ``calibration.json``."""
    from .checkpointing import write_json_atomic
    from .evaluation.calibrate import calibrate_stop_share, write_threshold

    train_rows = splits["train"]
    n = min(script.calibrate_rows, len(train_rows))
    sample = train_rows.shuffle(seed=seed).select(range(n))
    rows = [{k: r[k] for k in ("prompt", "answer", "difficulty")} for r in sample]
    res = calibrate_stop_share(looped, tokenizer, rows, script.calibrate_stop_share, chat=use_chat(script, tokenizer))
    res["saved_in"] = [
        str(out / d) for d in ("final", "final-merged") if write_threshold(out / d, res["field"], res["threshold"])
    ]
    write_json_atomic(out / "calibration.json", res)
    logger.info(
        "calibrated %s = %.6f (was %.4g): %.1f%% of %d answer steps of %d training rows stop after depth 1",
        res["field"],
        res["threshold"],
        res["previous_threshold"],
        100 * res["realized_stop_share"],
        res["n_decisions"],
        res["n_rows"],
    )
    return res


def recipe_main(spec: RecipeSpec) -> None:
    """``if __name__ == "__main__": recipe_main(SPEC)``: bad input ends in one ``error:`` line, exit code 2
    (``retrofit.errors.run_cli``)."""
    from .errors import run_cli

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(run_recipe, spec))
