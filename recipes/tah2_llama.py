"""TaH2 on a Llama-family model: the project's main training job (METHODS.md §3).

Retrofits a pretrained causal LM into a looped model with a token-level iteration decider and
fine-tunes it with SFT: next-token loss on the halting-weighted mixture of per-depth
distributions, plus α_D · the cost-sensitive BCE of the decider against lookahead labels.

With no arguments this is the project's main job (README's first command), sized for 2 CPU
cores and ~15 minutes (preset ``recipes/configs/tah2_llama.yaml``, which explains its split): it
retrofits the embedded SmolLM2-135M-Instruct (a real pretrained Llama, no network needed), checks
that depth-1 logits equal the base model's, fine-tunes on MANO — prefix-notation arithmetic mod 23
whose difficulty is the number of operators (METHODS.md §7) — evaluates base vs looped on
held-out rows of every level (accuracy, d̄, Spearman of depth vs difficulty), saves and exports
the looped checkpoint and writes the report::

    accelerate launch --config_file launch/cpu.yaml recipes/tah2_llama.py

On a GPU, with the larger preset (11 MANO levels × 1000 rows, whole-stack looping)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py --config recipes/configs/tah2_llama_gpu.yaml

Other ways to run it::

    # any preset, plus CLI overrides (CLI wins over YAML, YAML over the dataclass defaults)
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py \\
        --config recipes/configs/tah2_llama.yaml --max_depth 3 --learning_rate 5e-5
    # CPU smoke test on a tiny random model and your own rows (JSON lines with prompt + answer)
    accelerate launch --config_file launch/cpu.yaml recipes/tah2_llama.py \\
        --model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/tah2
    # 8 GPUs, ZeRO-2 (ZeRO-3 sets LoopConfig.fixed_graph automatically)
    accelerate launch --config_file launch/zero2.yaml recipes/tah2_llama.py
    # continue an interrupted run from its last complete checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py --resume

Ablations of the TaH2 seed, one flag each: ``--decider_weighting uniform`` (−3.6),
``--rho 1.0`` (−1.9), ``--train_decisions sample`` (−1.3), ``--mixture_output false`` (−1.0).
LoRA: ``--lora`` (adapters on the backbone; updater and decider train fully).

Outputs under ``--output_dir``: ``checkpoint-N/`` (atomic, resumable), ``final/`` (model or LoRA
adapter, and tokenizer), ``final-merged/`` (with ``--lora``: adapters merged into a plain looped
model), ``data_report.json`` (rows skipped and why), TensorBoard logs in ``runs/``; with
``--report true`` (the default) also ``report/`` (results.json, report.md, PNG plots,
samples.html), ``export/`` (a self-contained Hub folder) and ``summary.json`` (wall time, peak
RSS, accuracy and d̄ per level for base and looped).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import set_seed
from trl import TrlParser

from retrofit import LoopConfig
from retrofit.convert import base_model_of
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

logger = logging.getLogger("tah2_llama")
PRESET = Path(__file__).parent / "configs" / "tah2_llama.yaml"


@dataclass
class ModelArgs:
    model: str = field(
        default="smollm2",
        metadata={"help": "Hub id, local folder, .gguf file, 'smollm2' (embedded) or 'tiny-llama' (random, tests)."},
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
    deep_init_logit: float = field(
        default=3.0, metadata={"help": "Initial continue logit of the decider (> 0 = starts deep, σ(3) = 0.95)."}
    )
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
    train_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated difficulty levels to train on; default: the task's own."}
    )
    extrap_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated held-out levels above training, evaluated in the report."}
    )
    interp_levels: str | None = field(
        default=None,
        metadata={"help": "Comma-separated held-out levels inside the training range; default: the task's own, "
                  "or none when --train_levels is given."},
    )
    data_file: str | None = field(default=None, metadata={"help": "Use rows from this .jsonl/.json/.parquet file or save_to_disk folder instead of --task."})
    eval_file: str | None = field(default=None, metadata={"help": "Evaluation rows for --data_file."})
    chat: str = field(default="auto", metadata={"help": "Format rows as chat turns: auto (if the tokenizer has a template), true, false."})
    resume: bool = field(default=False, metadata={"help": "Continue from the last complete checkpoint in --output_dir."})


@dataclass
class ReportArgs:
    report: bool = field(
        default=True,
        metadata={"help": "After training: evaluate base vs looped per difficulty level, export the looped "
                  "checkpoint and write the report (the main job). false = train and save only."},
    )
    eval_levels: str | None = field(
        default=None, metadata={"help": "Comma-separated levels to evaluate; default: the training levels plus one above."}
    )
    eval_n: int = field(default=8, metadata={"help": "Evaluation examples per level (more = tighter accuracy, slower)."})
    freeze_prelude: bool = field(
        default=False,
        metadata={"help": "Freeze the embeddings (and a tied LM head) and the prelude layers: no backward through "
                  "them, a cheaper step on CPU."},
    )


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        argv = ["--config", str(PRESET), *argv]
    return TrlParser((ModelArgs, DataArgs, ReportArgs, RetrofitSFTConfig)).parse_args_and_config(argv)


def read_rows(path: str) -> datasets.Dataset:
    """Rows of a .jsonl/.json/.parquet file or a save_to_disk folder (clear ``DataError`` otherwise)."""
    from data_prep.chat import load_rows

    return datasets.Dataset.from_list(load_rows(path))


def parse_levels(text: str | None) -> list[int] | None:
    return None if not text else [int(x) for x in str(text).split(",") if str(x).strip()]


def task_splits(args: DataArgs):
    """The task's train / eval / eval_extrap splits (deterministic: the report rebuilds the same ones)."""
    from data_prep.tasks import build_splits

    return build_splits(
        args.task, n_train=args.n_train, n_eval=max(args.n_eval, 1), seed=args.task_seed,
        train_levels=parse_levels(args.train_levels), extrap_levels=parse_levels(args.extrap_levels),
        interp_levels=parse_levels(args.interp_levels) or ([] if args.train_levels else None),
    )


def load_data(args: DataArgs, tokenizer):
    """-> (train, eval or None) as TRL prompt/completion rows, plus a report of skipped rows."""
    if args.data_file:
        train = read_rows(args.data_file)
        evals = read_rows(args.eval_file) if args.eval_file else None
    else:
        splits = task_splits(args)
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
    margs, dargs, rargs, targs = parse_args(argv)
    t_start = time.time()
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
        deep_init_logit=margs.deep_init_logit,
        fixed_graph=zero3_enabled(targs),
    )
    model, tokenizer = build_looped_model(margs.model, loop, dtype=getattr(torch, margs.dtype))
    base_ref = identity_err = None
    if rargs.report:
        # the untouched pretrained model for the side-by-side report: a copy, since `model` shares
        # (and will train) the base's own modules
        base_ref = base_model_of(copy.deepcopy(model)).eval()
        identity_err = identity_check(model, base_ref, tokenizer)
        logger.info("identity at init: max |looped(depth=1) - base| = %.2e", identity_err)
    if rargs.freeze_prelude:
        freeze_prelude(model)
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

    # 5. The main job's report: base vs looped per difficulty level, export, plots, summary.
    if rargs.report and trainer.accelerator.is_main_process and not dargs.data_file:
        looped = trainer.accelerator.unwrap_model(trainer.model)
        if margs.lora:
            looped = looped.merge_and_unload()
        main_job_report(looped, tokenizer, base_ref, out, dargs, rargs, identity_err, t_start)
    return 0


def identity_check(model, base, tokenizer) -> float:
    """Max |looped logits at depth 1 - base logits| on a probe prompt (0 at init, METHODS.md §1)."""
    ids = tokenizer("+ 3 * 4 5 = 17", return_tensors="pt").input_ids.to(next(model.parameters()).device)
    was = model.training
    model.eval()
    with torch.no_grad():
        err = (model(ids, depth=1).logits - base(ids).logits).abs().max().item()
    model.train(was)
    return err


def freeze_prelude(model) -> None:
    """No gradients for the embeddings (so a tied LM head too) and the prelude layers."""
    model.model.embed_tokens.weight.requires_grad_(False)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.requires_grad_(False)
    for layer in model.prelude_layers:
        layer.requires_grad_(False)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("frozen embeddings + %d prelude layers; %.1fM parameters train", len(model.prelude_layers), n / 1e6)


def main_job_report(model, tokenizer, base, out: Path, dargs, rargs, identity_err, t_start) -> dict:
    """Evaluate base vs looped on held-out rows of every level, export the looped checkpoint,
    write ``report/`` (results.json, report.md, PNG plots, samples.html) and ``summary.json``."""
    from retrofit.evaluation import evaluate
    from retrofit.evaluation.report import to_jsonable, write_json
    from retrofit.export import export_model

    splits = task_splits(dargs)  # the same rows training held out
    rows = [r for name in ("eval", "eval_interp", "eval_extrap") if name in splits for r in splits[name]]
    levels = parse_levels(rargs.eval_levels) or sorted({int(r["difficulty"]) for r in rows})
    per_level: dict[int, list] = {}
    for r in rows:
        if int(r["difficulty"]) in levels and len(per_level.setdefault(int(r["difficulty"]), [])) < rargs.eval_n:
            per_level[int(r["difficulty"])].append(r)
    rows = [r for lv in sorted(per_level) for r in per_level[lv]]
    train_levels = sorted({int(x) for x in splits["train"]["difficulty"]})
    model.eval()
    t_eval = time.time()
    results = evaluate(
        model, tokenizer, tasks=dargs.task, rows={dargs.task: rows}, out_dir=out / "report", name="looped",
        compare=(base, tokenizer), compare_name="base", train_levels=train_levels,
        policy_generation=False, print_summary=True,
        config={"identity_at_init_max_abs_diff": identity_err, "loop": model.loop.to_dict()},
    )
    eval_s = time.time() - t_eval
    (out / "final" / "retrofit_eval.json").write_text(json.dumps(results, default=str))  # feeds the model card
    export_model(model, out / "export", tokenizer=tokenizer, overwrite=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    task = results["models"]["looped"]["tasks"][dargs.task]
    base_task = results["models"]["base"]["tasks"][dargs.task]
    summary = {
        "wall_time_s": round(time.time() - t_start, 1),
        "eval_time_s": round(eval_s, 1),
        "peak_rss_mb": round(peak_mb),
        "identity_at_init_max_abs_diff": identity_err,
        "train_levels": train_levels,
        "levels": {
            str(lv): {
                "base_accuracy": base_task["levels"][lv]["accuracy"] if lv in base_task["levels"] else base_task["levels"][str(lv)]["accuracy"],
                "looped_accuracy": (task["levels"].get(lv) or task["levels"][str(lv)])["accuracy"],
                "looped_mean_depth": (task["levels"].get(lv) or task["levels"][str(lv)]).get("mean_depth"),
            }
            for lv in levels
        },
        "spearman_depth_vs_level": task.get("overall", {}).get("depth_difficulty_spearman"),
        "outputs": {"checkpoint": str(out / "final"), "export": str(out / "export"), "report": str(out / "report")},
    }
    write_json(summary, out / "summary.json")
    print(json.dumps(to_jsonable(summary), indent=2))
    return summary


if __name__ == "__main__":
    from retrofit.errors import run_cli  # bad input: one `error:` line, exit code 2

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(main))
