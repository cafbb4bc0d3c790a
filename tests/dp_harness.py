"""Data-parallel parity harness: train tiny looped models with ``RetrofitSFTTrainer`` on one process or on 2 CPU
processes under DDP, FSDP2 or DeepSpeed ZeRO-3, and write what each step saw, so that a test compares the runs
(``tests/training/test_data_parallel.py``). Also a tool, from the repository root (``OMP_NUM_THREADS=1``)::

    python tests/dp_harness.py --out /tmp/dp                                            # one process: none/
    torchrun --nproc_per_node 2 tests/dp_harness.py --engine ddp,fsdp2 --out /tmp/dp    # ddp/ then fsdp2/
    accelerate launch --config_file launch/zero3.yaml --num_processes 2 --mixed_precision no \\
        --num_cpu_threads_per_process 1 tests/dp_harness.py --engine zero3 --out /tmp/dp  # zero3/
    python tests/dp_harness.py compare /tmp/dp /tmp/dp          # max differences from the one-process run
    # resume: a fresh launch continues each run from <resume_from>/<engine>/<method>/run/checkpoint-2
    torchrun --nproc_per_node 2 tests/dp_harness.py --engine ddp,fsdp2 --out /tmp/dp_res --resume_from /tmp/dp
    python tests/dp_harness.py compare /tmp/dp_res /tmp/dp --ref_engine same

Every launch trains each of ``--methods`` in turn (``METHODS``: the fixed loop as the control, TaH2 with M = 2 and
M = 3, Ouro) for ``--steps`` optimizer steps on the same global batch of ``GLOBAL_BATCH`` rows per step (the whole
batch on one process, ``GLOBAL_BATCH / world`` rows per process otherwise: the Trainer's sampler draws the same
permutation, and accelerate hands global batch k's first half to rank 0 and its second half to rank 1; every record
keeps the rows, so a test checks this). The rows' answers have different lengths, so the ranks hold different
numbers of labelled tokens: a loss normalized per process rather than by the global ``num_items_in_batch`` shows
up. Every model is built the same way on every process (seeded), with its TaH2 decider spread
(``retrofit.testing.spread_decider``) so that no continue probability sits within rounding of the threshold.

Engines (``--engine``):

- ``none``: one process, no ``torch.distributed`` (the reference);
- ``ddp``: ``torchrun`` over ``gloo``; the Trainer wraps the model in ``DistributedDataParallel`` as it does for
  any multi-process CPU run;
- ``fsdp2``: ``torchrun`` over ``gloo``, with the environment ``accelerate launch --config_file launch/fsdp2.yaml``
  exports (``fsdp2_environment``: ``fsdp_version: 2``, ``TRANSFORMER_BASED_WRAP`` on the looped model's
  ``_no_split_modules``, ``reshard_after_forward``, ``FULL_STATE_DICT``). accelerate itself refuses FSDP on the CPU
  (it falls back to DDP); ``RetrofitSFTTrainer`` drives it past that check right after the Trainer builds its
  ``Accelerator`` (``retrofit.training.fsdp2_cpu``), and from there the Trainer's own FSDP2 path runs:
  ``accelerator.prepare`` applies ``fully_shard`` to each decoder layer, the embedding/final-norm/LM-head group and
  the root (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``), and checkpoints are saved and resumed by
  accelerate's FSDP functions (``pytorch_model_fsdp.bin``, ``optimizer.bin``);
- ``zero3``: ``accelerate launch --config_file launch/zero3.yaml`` (DeepSpeed ZeRO-3 on CPU).

Under FSDP2 and ZeRO-3 every rank must run the same modules the same number of times in every step (FSDP2's
all-gathers and ZeRO-3's parameter fetches are collectives), so the loop's depth is fixed there
(``LoopConfig.fixed_graph=True``, which the recipes set under DeepSpeed and FSDP); ``--fixed_graph auto`` (the
default) does this. ``fixed_graph`` only runs iterations in which no token is active: one process gives bitwise
the same losses and weights with and without it (measured for every method here), so one reference serves every
engine.

Output, per engine and method, under ``<out>/<engine>/<method>/``: the Trainer's ``output_dir`` (``run/``, holding
``checkpoint-2`` with the default ``--save_steps``), ``record.json`` and, from rank 0, ``weights.pt`` (the full
state dict after the last step, gathered under FSDP2/ZeRO-3, fp32 on the CPU). ``record.json`` holds, per
micro-step (``records``), every rank's ``rows`` (its token ids, padding dropped), ``ntp`` (the next-token part of
its forward's loss, divided by the global ``num_items_in_batch``, so the ranks' values sum to the global next-token
loss), ``aux`` (the method's auxiliary loss as its forward computed it), ``loss`` (what ``compute_loss`` returned
to the backward pass, after the trainer's scaling), and the method's ``aux_metrics`` (TaH2: ``kappa``,
``decisions``, ``continue_label_rate`` and ``positives`` = rate × decisions); and the Trainer's ``log_history`` (its
logged ``loss`` and ``grad_norm``, and the metrics ``RetrofitSFTTrainer`` averages over processes).
``global_steps``, ``logged`` and ``differences`` read them back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: import this checkout's retrofit
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

#: the methods one launch can train: LoopConfig fields (the fixed loop is the control: no halting decision)
METHODS = {
    "fixed": dict(method="fixed", max_depth=3),
    "tah2_m2": dict(method="tah2", max_depth=2),
    "tah2_m3": dict(method="tah2", max_depth=3),
    "ouro": dict(method="ouro", max_depth=3),
}
#: ``--methods`` may also name these (not run by default): TaH2 without any batch-level statistic (ρ = 1, uniform
#: weights, a static pos_weight), whose only data-parallel difference is its decider loss's per-process normalization
EXTRA_METHODS = {
    "tah2_kappa_free": dict(
        method="tah2", max_depth=3, rho=1.0, decider_weighting="uniform", dyn_pos_weight=False, alpha_d=1.0
    ),
}
#: rows per optimizer step, over all processes
GLOBAL_BATCH = 4
#: shared by every method: a small prelude, the rest looped, a small TaH2 decider
LOOP = dict(prelude=1, core=4, decider_top_k=8)


def rows(n: int) -> list[dict]:
    """``n`` prompt/answer rows whose answers (and so labelled-token counts) differ in length from row to row."""
    out = []
    for i in range(n):
        a, b = 3 + 7 * i, 2 + 5 * i * i
        out.append({"prompt": f"{a}*{b}=", "answer": str(a * b)})
    return out


def build_model(name: str, fixed_graph: bool):
    """The method's tiny looped Llama, drawn the same way on every process."""
    import retrofit
    from retrofit.testing import spread_decider, tiny_base

    with torch.random.fork_rng():
        torch.manual_seed(0)
        cfg = retrofit.LoopConfig.from_fields(
            dict(**LOOP, **{**METHODS, **EXTRA_METHODS}[name], fixed_graph=fixed_graph), strict=False
        )
        model = retrofit.convert(tiny_base("llama", seed=0), cfg)
    if cfg.method == "tah2":
        with torch.no_grad():
            spread_decider(model, logit_std=2.0, generator=torch.Generator().manual_seed(1))
    return model.train()


def _is_fsdp_module(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _gather(obj):
    """Every rank's ``obj`` (a list, rank order); ``[obj]`` without ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _no_final_save():
    """A callback that drops the Trainer's save at the last step when ``save_steps`` does not divide it
    (transformers saves at the end of a ``save_strategy="steps"`` run): the runs only need the resume point."""
    from transformers import TrainerCallback

    class NoFinalSave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps and state.global_step % args.save_steps != 0:
                control.should_save = False
            return control

    return NoFinalSave()


def _poison_zero3_padding():
    """A callback that, under ZeRO-3, writes NaN into every padding element of this rank's parameter shards when
    training begins and after every optimizer step (before the Trainer's save), and counts them (``poisoned``).

    DeepSpeed pads each parameter to a multiple of the world size and allocates the shards and its fp32 master
    copy with ``torch.empty``, so the padding holds whatever memory held and the optimizer step copies the master's
    padding back: measured here as NaN, -3.2e13 or a small number from one launch to the next (Ouro's 1-element
    gate bias has a whole padding shard on rank 1 of 2; a CI machine's NaN guard once refused to save its
    ``checkpoint-2`` for it). Poisoning it on purpose makes the worst case every machine's: the runs must train,
    save and match as before. Under the other engines it does nothing."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class PoisonPadding(TrainerCallback):
        poisoned = None

        def _poison(self, model) -> int:
            count = 0
            for p in model.parameters():
                shard = getattr(p, "ds_tensor", None)
                if shard is None:
                    continue
                size = shard.numel()
                held = min(size, max(0, p.ds_numel - dist.get_rank() * size))  # the elements of p this rank holds
                with torch.no_grad():
                    shard.view(-1)[held:] = float("nan")
                count += size - held
            return count

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.poisoned = self._poison(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self._poison(model)

    return PoisonPadding()


def fsdp2_environment(config: Path = REPO / "launch" / "fsdp2.yaml") -> dict[str, str]:
    """What ``accelerate launch --config_file launch/fsdp2.yaml`` exports for its ``fsdp_config``
    (``ACCELERATE_USE_FSDP`` and ``FSDP_<KEY>`` per ``fsdp_<key>``), so that a ``torchrun`` launch runs the same
    FSDP2 setup as that config."""
    import yaml

    fsdp = yaml.safe_load(config.read_text())["fsdp_config"]
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, value in fsdp.items():
        env[f"FSDP_{key.removeprefix('fsdp_').upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def _trainer_class():
    from retrofit.training import RetrofitSFTTrainer

    class RecordingTrainer(RetrofitSFTTrainer):
        """``RetrofitSFTTrainer`` unchanged, except that ``compute_loss`` also records what every rank saw and
        returned (the real trainer's loss scaling is what runs)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            if torch.is_grad_enabled():  # training steps only (evaluation runs under no_grad)
                self._record(inputs, outputs, loss, num_items_in_batch)
            return (loss, outputs) if return_outputs else loss

        def _record(self, inputs, outputs, loss, num_items_in_batch):
            coef = getattr(self._looped.config, "router_aux_loss_coef", 1.0)
            aux = outputs.aux_loss
            ntp = outputs.loss - coef * aux if aux is not None else outputs.loss
            mask = inputs["attention_mask"].bool()
            metrics = {k: float(v) for k, v in (outputs.aux_metrics or {}).items()}
            if "continue_label_rate" in metrics:
                metrics["positives"] = metrics["continue_label_rate"] * metrics["decisions"]
            per_item = num_items_in_batch is not None and self._looped.halting.aux_loss_per_item(
                self._looped.loop.method_options
            )
            mine = {
                "aux_per_item": bool(per_item),
                "rows": [ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask)],
                "ntp": float(ntp.detach()),
                "aux": None if aux is None else float(aux.detach()),
                "loss": float(loss.detach()),
                "num_items_in_batch": None if num_items_in_batch is None else float(num_items_in_batch),
                "metrics": metrics,
            }
            ranks = _gather(mine)
            self.records.append({"step": self.state.global_step, "ranks": ranks})

    return RecordingTrainer


def train_one(name: str, engine: str, args, world: int) -> None:
    """Train method ``name`` under ``engine``; write ``<out>/<engine>/<method>/{record.json,weights.pt,run/}``."""
    import datasets

    from retrofit.testing import char_tokenizer
    from retrofit.training import RetrofitSFTConfig, format_sft_dataset

    fixed_graph = args.fixed_graph == "true" or (args.fixed_graph == "auto" and engine in SHARDED)
    if engine == "fsdp2":  # RetrofitSFTTrainer turns accelerate's CPU fallback (DDP) into FSDP2
        os.environ.update(fsdp2_environment())
    out = Path(args.out) / engine / name
    out.mkdir(parents=True, exist_ok=True)
    times = {"start": time.time()}
    model = build_model(name, fixed_graph)
    train, _ = format_sft_dataset(datasets.Dataset.from_list(rows(GLOBAL_BATCH * args.steps)))
    targs = RetrofitSFTConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to="none",
        use_cpu=True,
        activation_checkpointing=False,
        disable_tqdm=True,
        max_length=32,
        bf16=False,
    )
    poison = _poison_zero3_padding()
    trainer = _trainer_class()(
        model, targs, train_dataset=train, processing_class=char_tokenizer(), callbacks=[_no_final_save(), poison]
    )
    trainer.records = []
    times["init"] = time.time()
    resume = None
    if args.resume_from:
        resume = str(Path(args.resume_from) / engine / name / "run" / f"checkpoint-{args.resume_step}")
    trainer.train(resume_from_checkpoint=resume)
    times["train"] = time.time()
    wrapped = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
    state = trainer.accelerator.get_state_dict(wrapped)  # collective under FSDP2 / ZeRO-3
    poisoned = _gather(poison.poisoned)  # collective: on every rank
    if trainer.accelerator.is_main_process:
        weights = {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()}
        torch.save(weights, out / "weights.pt")
        record = {
            "method": name,
            "engine": engine,
            "world_size": world,
            "fixed_graph": fixed_graph,
            "resumed_from": resume,
            # what actually ran: the accelerator's type and the class of the model the Trainer trained
            "distributed_type": str(trainer.accelerator.distributed_type),
            "wrapped": type(trainer.model_wrapped).__name__,
            "fsdp_module": _is_fsdp_module(trainer.model),
            # ZeRO-3 padding elements set to NaN on each rank (``_poison_zero3_padding``)
            "poisoned_padding": poisoned,
            "seconds": {k: round(times[k] - times["start"], 2) for k in ("init", "train")},
            "records": trainer.records,
            "log_history": trainer.state.log_history,
        }
        (out / "record.json").write_text(json.dumps(record, indent=1))
    trainer.accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------------
# Reading the runs back: the global quantity of every step, and the differences between two runs
# ------------------------------------------------------------------------------------------------
def load(run: Path | str, engine: str, method: str) -> dict:
    """``record.json`` of ``<run>/<engine>/<method>``, with its ``weights.pt`` under ``"weights"``."""
    d = Path(run) / engine / method
    record = json.loads((d / "record.json").read_text())
    record["weights"] = torch.load(d / "weights.pt")
    return record


def global_steps(record: dict) -> dict[int, dict]:
    """Per optimizer step, what the whole batch saw (every rank's part combined):

    - ``rows``: every rank's rows, in rank order (rank 0 holds the first half of the global batch);
    - ``ntp``: the next-token loss (each rank's part is its sum over the global ``num_items_in_batch``: summed);
    - ``aux``: the auxiliary loss the step optimizes: summed over ranks when each rank's is its sum over the global
      ``num_items_in_batch`` (``aux_loss_per_item``: TaH2's release normalizer; the trainer scales it like the
      next-token loss), else the mean over ranks of each rank's own mean (data parallelism averages the gradients);
      ``None`` without one;
    - ``kappa``: every rank's cutoff κ (a list; one process: one entry);
    - ``decisions``, ``positives``: TaH2's decisions made and "continue" labels, summed over ranks.
    """
    out = {}
    for r in record["records"]:
        ranks = r["ranks"]
        step = {
            "rows": [row for x in ranks for row in x["rows"]],
            "ntp": sum(x["ntp"] for x in ranks),
            "aux": None
            if ranks[0]["aux"] is None
            else sum(x["aux"] for x in ranks) / (1 if ranks[0].get("aux_per_item") else len(ranks)),
        }
        metrics = [x["metrics"] for x in ranks]
        if "kappa" in metrics[0]:
            step["kappa"] = [m["kappa"] for m in metrics]
            step["decisions"] = round(sum(m["decisions"] for m in metrics))
            step["positives"] = round(sum(m["positives"] for m in metrics))
        out[r["step"]] = step
    return out


def logged(record: dict) -> dict[int, dict]:
    """The Trainer's logged ``loss`` and ``grad_norm`` per optimizer step (0-based: ``log_history``'s step - 1)."""
    return {h["step"] - 1: h for h in record["log_history"] if "loss" in h}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def differences(run: dict, ref: dict) -> dict:
    """The largest differences of ``run`` from ``ref`` over the steps both recorded (two ``load`` results):
    relative for losses, gradient norms and κ (every rank's κ against the reference's: its one κ, or the same rank's
    when both ran on as many processes), absolute for label counts and for the final weights (max |Δ| over every
    parameter)."""
    a, b = global_steps(run), global_steps(ref)
    la, lb = logged(run), logged(ref)
    steps = sorted(set(a) & set(b))
    d = {
        "steps": steps,
        "same_rows": all(a[s]["rows"] == b[s]["rows"] for s in steps),
        "loss_step0": _rel(la[0]["loss"], lb[0]["loss"]) if 0 in la and 0 in lb else None,
        "ntp_step0": _rel(a[0]["ntp"], b[0]["ntp"]) if 0 in steps else None,
        "loss": max(_rel(la[s]["loss"], lb[s]["loss"]) for s in steps),
        "ntp": max(_rel(a[s]["ntp"], b[s]["ntp"]) for s in steps),
        "grad_norm": max(_rel(la[s]["grad_norm"], lb[s]["grad_norm"]) for s in steps),
    }
    if b[steps[0]]["aux"] is not None:
        d["aux"] = max(_rel(a[s]["aux"], b[s]["aux"]) for s in steps)
    if "kappa" in b[steps[0]]:
        # every rank's κ against the reference's rank's (same world size) or against its one κ (one process)
        def ref_kappa(s, rank):
            return b[s]["kappa"][rank if len(b[s]["kappa"]) == len(a[s]["kappa"]) else 0]

        d["kappa"] = max(_rel(k, ref_kappa(s, r)) for s in steps for r, k in enumerate(a[s]["kappa"]))
        d["decisions_step0"] = abs(a[steps[0]]["decisions"] - b[steps[0]]["decisions"])
        d["decisions"] = max(abs(a[s]["decisions"] - b[s]["decisions"]) for s in steps)
        d["positives"] = max(abs(a[s]["positives"] - b[s]["positives"]) for s in steps)
    wa, wb = run["weights"], ref["weights"]
    if set(wa) != set(wb):
        raise AssertionError(f"different parameters: {sorted(set(wa) ^ set(wb))}")
    d["weights"] = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    return d


def compare_main(argv) -> int:
    """``dp_harness.py compare RUN REF [--engines ...] [--ref_engine none]``: print ``differences`` per method."""
    p = argparse.ArgumentParser(prog="dp_harness.py compare")
    p.add_argument("run")
    p.add_argument("ref")
    p.add_argument("--engines", default="ddp,fsdp2,zero3")
    p.add_argument("--ref_engine", default="none", help="the reference's engine folder; 'same' = each engine's own")
    p.add_argument("--methods", default=",".join([*METHODS, *EXTRA_METHODS]))
    args = p.parse_args(argv)
    for engine in args.engines.split(","):
        for method in args.methods.split(","):
            if not (Path(args.run) / engine / method / "record.json").exists():
                continue
            ref_engine = engine if args.ref_engine == "same" else args.ref_engine
            d = differences(load(args.run, engine, method), load(args.ref, ref_engine, method))
            shown = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in d.items()}
            print(f"{engine:6s} {method:8s} {shown}")
    return 0


#: engines that shard parameters: the loop's depth is fixed there (module docstring)
SHARDED = ("fsdp2", "zero3")
#: what one launch may run: torchrun runs DDP, then FSDP2 (forcing accelerate into FSDP2 is not undone)
ENGINE_ORDER = ("ddp", "fsdp2")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--engine",
        default="none",
        help="none (one process), or under 2 processes: ddp, fsdp2 or ddp,fsdp2 (torchrun), zero3 (accelerate launch)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save_steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fixed_graph", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--resume_from", default=None, help="an earlier --out: resume each run from its checkpoint")
    p.add_argument("--resume_step", type=int, default=2)
    args = p.parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engines = args.engine.split(",")
    known = ("none", "ddp", "fsdp2", "zero3")
    if any(e not in known for e in engines):
        p.error(f"--engine {args.engine}: each of {', '.join(known)}")
    if (engines == ["none"]) != (world == 1):
        p.error(f"--engine {args.engine} with WORLD_SIZE={world}: 'none' is the one-process run, the others need 2")
    if len(engines) > 1 and [e for e in ENGINE_ORDER if e in engines] != engines:
        p.error(f"--engine {args.engine}: one launch runs {' then '.join(ENGINE_ORDER)} (torchrun), or one engine")
    methods = args.methods.split(",")
    for name in methods:
        if name not in METHODS and name not in EXTRA_METHODS:
            p.error(f"unknown method {name!r}; known: {', '.join([*METHODS, *EXTRA_METHODS])}")
    for engine in engines:
        for name in methods:
            train_one(name, engine, args, world)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"dp_harness: {args.engine} x{world}: {time.time() - t0:.1f} s for {args.methods}", flush=True)
    from retrofit.recipe.run import finish_process

    finish_process(0)  # as the recipes end: a ZeRO-3 rank can abort in the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
