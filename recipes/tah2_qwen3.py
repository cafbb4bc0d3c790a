"""TaH2 on Qwen3, as in the TaH2 paper: Qwen3-1.7B-Base, maximum depth M = 2 (METHODS.md §3).

Retrofits a pretrained Qwen3 base model into a looped model with a token-level iteration decider
and fine-tunes it with SFT: next-token loss on the halting-weighted mixture of per-depth
distributions, plus α_D · the cost-sensitive BCE of the decider against lookahead labels
(ρ = 0.99, α_D = 0.05, on-policy threshold decisions, τ_exit = 0.5).

The paper trains on 273K distilled math/code/QA prompts at 16K context; no such set ships
offline, so the preset uses the GSM-Symbolic task of ``data_prep`` (natural-language math with a
clause-count difficulty knob); point ``--data_file`` at your own prompt/answer rows for more.

Run it (``Qwen/Qwen3-1.7B-Base`` comes from the Hugging Face hub; a local folder or a .gguf works too)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py
    accelerate launch --config_file launch/zero3.yaml recipes/tah2_qwen3.py --config recipes/configs/tah2_qwen3.yaml
    accelerate launch --config_file launch/fsdp2.yaml recipes/tah2_qwen3.py --model /models/Qwen3-4B-Base
    # LoRA on the backbone, updater and decider trained fully
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py --lora
    # CPU smoke test on a tiny random Qwen3
    accelerate launch --config_file launch/cpu.yaml recipes/tah2_qwen3.py \
        --model tiny-qwen3 --data_file rows.jsonl --max_steps 3 --output_dir /tmp/tah2q
    # continue an interrupted run from its last complete checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py --resume

Ablations of the TaH2 seed, one flag each: ``--decider_weighting uniform`` (−3.6),
``--rho 1.0`` (−1.9), ``--train_decisions sample`` (−1.3), ``--mixture_output false`` (−1.0).

Outputs under ``--output_dir``: ``checkpoint-N/`` (atomic, resumable), ``final/`` (model or LoRA
adapter, and tokenizer), ``final-merged/`` (with ``--lora``), ``data_report.json``, TensorBoard
logs in ``runs/``.
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

logger = logging.getLogger("tah2_qwen3")
PRESET = Path(__file__).parent / "configs" / "tah2_qwen3.yaml"


@dataclass
class ModelArgs:
    model: str = field(
        default="Qwen/Qwen3-1.7B-Base",
        metadata={"help": "Hub id, local folder, .gguf file, or 'tiny-qwen3' (random, tests)."},
    )
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 (use --bf16 for mixed precision) or bfloat16."})
    prelude: int = field(default=0, metadata={"help": "Layers run once before the loop (0 = whole-stack looping, as TaH2)."})
    core: int | None = field(default=None, metadata={"help": "Layers looped after the prelude; None = all remaining."})
    max_depth: int = field(default=2, metadata={"help": "Maximum iterations M (TaH2 reports M = 2 and 8). Cost grows ~linearly."})
    exit_threshold: float = field(default=0.5, metadata={"help": "τ_exit: stop at the first depth whose continue prob < τ."})
    decider_top_k: int = field(default=10, metadata={"help": "Top-K next-token probabilities the decider reads."})
    train_decisions: str = field(default="threshold", metadata={"help": "'threshold' (on-policy) or 'sample' (ablation)."})
    mixture_output: bool = field(default=True, metadata={"help": "Mixture of per-depth outputs; false = final depth only (ablation)."})
    updater_hidden: int | None = field(default=None, metadata={"help": "Updater MLP width; None = hidden size."})
    decider_hidden: int | None = field(default=None, metadata={"help": "Decider FFN width; None = hidden size / 4."})
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters on the backbone; updater and decider train fully."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_targets: str | None = field(default=None, metadata={"help": "Comma-separated module names; default: attention + MLP projections."})


@dataclass
class DataArgs:
    task: str = field(default="gsm", metadata={"help": "data_prep task (mano, brevo, lano, gsm, clrs_*, ...)."})
    n_train: int = field(default=2000, metadata={"help": "Training rows per difficulty level."})
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
        method="tah2",
        exit_threshold=margs.exit_threshold,
        decider_top_k=margs.decider_top_k,
        train_decisions=margs.train_decisions,
        mixture_output=margs.mixture_output,
        updater_hidden=margs.updater_hidden,
        decider_hidden=margs.decider_hidden,
        fixed_graph=zero3_enabled(targs),
    )
    model, tokenizer = build_looped_model(margs.model, loop, dtype=getattr(torch, margs.dtype))
    if margs.lora:
        targets = margs.lora_targets.split(",") if margs.lora_targets else None
        model = apply_lora(model, r=margs.lora_r, alpha=margs.lora_alpha, dropout=margs.lora_dropout, targets=targets)
        model.print_trainable_parameters()

    # 2. Data: prompt/completion rows; the loss covers the completion only.
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
