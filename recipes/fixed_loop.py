"""Fixed-depth looped SFT: the baseline every adaptive method is compared against.

Every token runs all ``--max_depth`` iterations of the looped core (Ouro with ``--prelude 0``, or
a Huginn / retrofitted-recurrence middle block with ``--prelude p --core c``); the loss is the
plain next-token loss. Two options of the looped-pretraining literature:

- ``--random_depth``: each micro-batch runs at one depth drawn from Huginn's Poisson-lognormal
  (``τ ~ N(log(r̄ - 1) - σ²/2, σ)``, ``r = 1 + Poisson(e^τ)``, clipped to ``1 … max_depth``;
  ``--random_depth_mean`` r̄ defaults to ``(max_depth + 1) / 2``, ``--random_depth_sigma`` σ = 0.5),
  so the model works at every depth and can be evaluated at several;
- ``--truncate_backprop k``: gradients flow through the last k iterations only (Huginn: k = 8),
  which bounds activation memory at large depths.

Works on Llama and Qwen3 models alike. With no arguments it fine-tunes the embedded
SmolLM2-135M-Instruct on MANO at depth 2 (preset ``recipes/configs/fixed_loop.yaml``)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py
    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py \
        --prelude 4 --core 22 --max_depth 8 --random_depth true --truncate_backprop 4
    # CPU smoke test; and the same on 2 CPU processes with DeepSpeed ZeRO-2
    accelerate launch --config_file launch/cpu.yaml recipes/fixed_loop.py \
        --model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/fixed
    accelerate launch --config_file launch/zero2.yaml --num_processes 2 --mixed_precision no recipes/fixed_loop.py \
        --model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/fixed-z2 --use_cpu true
    # continue an interrupted run from its last complete checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py --resume

Outputs under ``--output_dir``: ``checkpoint-N/`` (atomic, resumable), ``final/``,
``final-merged/`` (with ``--lora``), ``data_report.json``, TensorBoard logs in ``runs/``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import set_seed
from trl import TrlParser

from retrofit import LoopConfig
from retrofit.checkpointing import last_checkpoint
from retrofit.training import (
    NonFiniteLossError,
    RetrofitSFTConfig,
    RetrofitSFTTrainer,
    apply_lora,
    build_looped_model,
    format_sft_dataset,
    zero3_enabled,
)

logger = logging.getLogger("fixed_loop")
PRESET = Path(__file__).parent / "configs" / "fixed_loop.yaml"


@dataclass
class ModelArgs:
    model: str = field(
        default="smollm2",
        metadata={"help": "Hub id, local folder, .gguf file, 'smollm2' (embedded), 'tiny-llama' or 'tiny-qwen3' (random, tests)."},
    )
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 (use --bf16 for mixed precision) or bfloat16."})
    prelude: int = field(default=0, metadata={"help": "Layers run once before the loop (0 = whole-stack looping, as Ouro)."})
    core: int | None = field(default=None, metadata={"help": "Layers looped after the prelude; the rest form the coda. None = all remaining."})
    max_depth: int = field(default=2, metadata={"help": "Iterations per token (Huginn trains at a mean of 32). Cost grows ~linearly."})
    attention: str | None = field(default=None, metadata={"help": "same-depth (default for fixed) or duo-causal."})
    updater_hidden: int | None = field(default=None, metadata={"help": "Updater MLP width; None = hidden size."})
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters on the backbone; updater and decider train fully."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_targets: str | None = field(default=None, metadata={"help": "Comma-separated module names; default: attention + MLP projections."})


@dataclass
class DataArgs:
    task: str = field(default="mano", metadata={"help": "data_prep task (mano, brevo, lano, gsm, clrs_*, ...)."})
    n_train: int = field(default=1000, metadata={"help": "Training rows per difficulty level."})
    n_eval: int = field(default=20, metadata={"help": "Evaluation rows per level (0 = no evaluation set)."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    data_file: str | None = field(default=None, metadata={"help": "Use rows from this .jsonl/.json/.parquet file or save_to_disk folder instead of --task."})
    eval_file: str | None = field(default=None, metadata={"help": "Evaluation rows for --data_file."})
    chat: str = field(default="auto", metadata={"help": "Format rows as chat turns: auto (if the tokenizer has a template), true, false."})
    resume: bool = field(default=False, metadata={"help": "Continue from the last complete checkpoint in --output_dir."})


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        argv = ["--config", str(PRESET), *argv]
    return TrlParser((ModelArgs, DataArgs, RetrofitSFTConfig)).parse_args_and_config(argv)


def read_rows(path: str) -> datasets.Dataset:
    """Rows of a .jsonl/.json/.parquet file or a save_to_disk folder (clear ``DataError`` otherwise)."""
    from data_prep.chat import load_rows

    return datasets.Dataset.from_list(load_rows(path))


def load_data(args: DataArgs, tokenizer):
    """-> (train, eval or None) as TRL prompt/completion rows, plus a report of skipped rows."""
    if args.data_file:
        train = read_rows(args.data_file)
        evals = read_rows(args.eval_file) if args.eval_file else None
    else:
        from data_prep.tasks import build_splits

        splits = build_splits(args.task, n_train=args.n_train, n_eval=max(args.n_eval, 1), seed=args.task_seed)
        train, evals = splits["train"], (splits["eval"] if args.n_eval > 0 else None)
    if args.chat not in ("auto", "true", "false"):
        raise SystemExit(f"--chat must be auto, true or false, got {args.chat!r}")
    chat = args.chat == "true" or (args.chat == "auto" and tokenizer.chat_template is not None)
    train, report = format_sft_dataset(train, chat=chat)
    reports = {"train_rows": report}
    if evals is not None:
        evals, reports["eval_rows"] = format_sft_dataset(evals, chat=chat)
    return train, evals, reports


def main(argv=None) -> int:
    margs, dargs, targs = parse_args(argv)
    logging.basicConfig(level=logging.INFO if targs.should_log else logging.WARNING)
    set_seed(targs.seed)

    # 1. The looped model. Under ZeRO-3 the loop always unrolls max_depth iterations: DeepSpeed's
    #    parameter prefetch traces the module order, and a data-dependent depth thrashes it.
    loop = LoopConfig(
        prelude=margs.prelude,
        core=margs.core,
        max_depth=margs.max_depth,
        method="fixed",
        attention=margs.attention,
        updater_hidden=margs.updater_hidden,
        fixed_graph=zero3_enabled(targs),
    )
    model, tokenizer = build_looped_model(margs.model, loop, dtype=getattr(torch, margs.dtype))
    if margs.lora:
        targets = margs.lora_targets.split(",") if margs.lora_targets else None
        model = apply_lora(model, r=margs.lora_r, alpha=margs.lora_alpha, dropout=margs.lora_dropout, targets=targets)
        model.print_trainable_parameters()

    # 2. Data: prompt/completion rows; the loss covers the completion only.
    #    (--random_depth and --truncate_backprop are RetrofitSFTConfig fields: the trainer applies them.)
    train, evals, reports = load_data(dargs, tokenizer)

    # 3. Train. A NaN/inf loss stops the run before the bad update; the last checkpoint stays good.
    trainer = RetrofitSFTTrainer(model, targs, train_dataset=train, eval_dataset=evals, processing_class=tokenizer)
    reports.update(trainer.data_report)
    resume = targs.resume_from_checkpoint
    if dargs.resume:
        resume = last_checkpoint(targs.output_dir)
        if resume is None:
            raise SystemExit(f"--resume: no complete checkpoint-N folder in {targs.output_dir}")
        logger.info("resuming from %s", resume)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except NonFiniteLossError as err:
        logger.error("%s", err)
        return 1

    # 4. Save: the final model (or adapter) atomically, and the merged model for LoRA.
    out = Path(targs.output_dir)
    trainer.save_model_atomic(str(out / "final"))
    if margs.lora and trainer.accelerator.is_main_process:
        if zero3_enabled(targs):
            logger.warning("not merging LoRA under ZeRO-3 (weights are sharded); merge the saved adapter offline")
        else:
            from retrofit.checkpointing import atomic_dir

            merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
            with atomic_dir(out / "final-merged") as tmp:
                merged.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
    if trainer.accelerator.is_main_process:
        (out / "data_report.json").write_text(json.dumps(reports, indent=2))
        logger.info("saved %s; rows: %s", out / "final", reports)
    return 0


if __name__ == "__main__":
    from retrofit.errors import run_cli  # bad input: one `error:` line, exit code 2

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(main))
