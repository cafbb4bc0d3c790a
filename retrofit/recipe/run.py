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
   (``retrofit.recipe.controls``);
5. with ``--report`` and a ``--task``: evaluate the untrained base, the looped model and every control
   on the held-out test rows, with intervals and paired tests, export the looped checkpoint and write
   ``report/`` and ``summary.json`` (``retrofit.recipe.main_job``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..model.errors import RetrofitUserError
from ..training.model_setup import identity_check, prepare_model
from .args import RecipeSpec, ScriptArgs, parse_recipe_args
from .data import load_data, task_splits, use_chat

logger = logging.getLogger("retrofit.recipe")


def train_and_save(model, tokenizer, train_args, train, evals, *, resume: bool, lora: bool, out: Path):
    """Train with ``RetrofitSFTTrainer``, save ``out/final`` atomically (and ``final-merged`` for LoRA).

    Returns:
        ``(trainer, looped)``: the trainer and the trained looped model (LoRA merged), or raises
        ``NonFiniteLossError``.
    """
    from ..hub.atomic_io import atomic_dir
    from ..training.checkpointing import last_checkpoint
    from ..training.model_setup import zero3_enabled
    from ..training.trainer import RetrofitSFTTrainer

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

    from ..model.convert import base_model_of
    from ..training.model_setup import build_looped_model, sharded_training, zero3_enabled
    from ..training.trainer import NonFiniteLossError

    script, targs, largs = parse_recipe_args(spec, argv)
    t_start = time.time()
    logging.basicConfig(level=logging.INFO if targs.should_log else logging.WARNING)
    controls = script.controls()
    if (controls or script.report) and zero3_enabled(targs):
        raise RetrofitUserError(
            "--control and --report run on one process; drop them under ZeRO-3 and evaluate the saved checkpoints"
        )
    set_seed(targs.seed)

    # 1. The looped model. Under DeepSpeed and FSDP the loop always unrolls max_depth iterations: ZeRO-3's
    #    parameter prefetch traces the module order, ZeRO-2 reduces gradients in buckets that every rank must fill
    #    alike, and FSDP all-gathers each layer every time it runs; a data-dependent depth breaks all three
    #    (model_setup.deepspeed_enabled, fsdp_enabled).
    loop = largs.loop_config(fixed_graph=sharded_training(targs))
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
        from ..hub.atomic_io import write_json_atomic

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
            from .main_job import ReportInputs, main_job_report

            main_job_report(
                ReportInputs(
                    looped=looped,
                    tokenizer=tokenizer,
                    pristine=pristine,
                    controls=trained_controls,
                    out=out,
                    script=script,
                    splits=splits,
                    identity_err=identity_err,
                    t_start=t_start,
                    timings=timings,
                    calibration=calibration,
                    base=largs.model,
                    dtype=largs.dtype,
                )
            )
    return 0


def calibrate(looped, tokenizer, script: ScriptArgs, splits, seed: int, out: Path) -> dict:
    """``--calibrate_stop_share``: place the trained decider's own threshold by compute on a seeded sample
    of the training rows (``evaluation/calibrate.py``), and write it into the saved checkpoints' configs
    (``final``, ``final-merged``) and ``calibration.json``."""
    from ..evaluation.calibrate import calibrate_stop_share, write_threshold
    from ..hub.atomic_io import write_json_atomic

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


def finish_process(rc: int):
    """End a recipe's process with exit code ``rc``; never returns.

    After a run that succeeded the process group torch.distributed was given is shut down (PyTorch's documented
    shutdown; destroying it after a failed run could hang on a rank still in a collective). In a launch of several ranks
    (``WORLD_SIZE`` > 1) the process then leaves with ``os._exit`` once stdout, stderr and logging are flushed,
    skipping the interpreter's teardown: there a rank can still abort in C++ ("terminate called without an active
    exception", seen under ZeRO-3 on 2 CPU processes with the group already destroyed), which turns a run whose
    checkpoints are saved into a failed launch. Everything a run writes is written and closed before it returns;
    ``atexit`` handlers do not run in that case. A failed run, or a one-process one, exits normally."""
    if rc == 0:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
    sys.exit(rc)


def quiet_cpu_env() -> None:
    """Environment defaults for training on a machine without CUDA: DeepSpeed (imported by the trainer) would warn
    once per process that it fell back to the CPU, and tokenizers that it forks after use; a user setting either
    keeps theirs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def recipe_main(spec: RecipeSpec) -> None:
    """``if __name__ == "__main__": recipe_main(SPEC)``: bad input ends in one ``error:`` line, exit code 2
    (``retrofit.model.errors.run_cli``)."""
    from ..model.errors import run_cli

    quiet_cpu_env()
    finish_process(run_cli(run_recipe, spec))
