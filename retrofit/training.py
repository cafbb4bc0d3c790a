"""SFT for looped models: a TRL ``SFTTrainer`` subclass with what SFT needs beyond the model's own
loss, and its config. The pieces the recipes share live next to it and are re-exported here: row
formatting and filtering in ``retrofit.sft_data``, model loading and LoRA in ``retrofit.model_setup``.

The halting methods' objectives (docs/tah2.md, docs/anira.md) belong to the model: with labels its forward
returns ``loss`` = next-token loss + the method's weighted ``aux_loss`` (``retrofit.modeling``), so
TRL's ``SFTTrainer``/``DPOTrainer``/``GRPOTrainer`` and ``transformers.Trainer`` all optimize
``L_NTP(mixture) + α_D · L_D`` (TaH2), ``L_CE + γ · L_C`` (ANIRA-E/O) or ``L_NTP`` (fixed). The weights
live in the model's ``LoopConfig``; the ``RetrofitSFTConfig`` fields of the same names override them
(the trainer writes those set into the model's config). ``compute_loss`` adds the trainer-side
switches (random depth, truncated backprop), scales the auxiliary loss for gradient accumulation as
TRL does for a router loss, and records metrics.

It logs, through TRL's ``self._metrics`` (so ``report_to="tensorboard"`` picks them up):
``ntp_loss``, ``aux_loss``, ``mean_depth`` (d̄ over non-padding tokens), ``mean_depth_answer``
(d̄ over positions that predict an answer token), ``depth_frac_<d>`` (fraction of tokens per
depth), ``mean_token_accuracy`` and the method's own scalars (TaH2: ``decider_loss``, ``kappa``,
``continue_label_rate``, ``decider_accuracy``; ANIRA: ``kl_prior``, ``expected_depth_q``). With a
TensorBoard writer active it also writes a ``depth_histogram``.

Robustness:

- a NaN/inf training loss raises ``NonFiniteLossError`` naming the step *before* the backward
  pass; the loss and the halting signals are checked right after the forward too (``_check_finite``).
  The forward itself never runs the decider's BCE (which raises on NaN input) on non-finite signals:
  its auxiliary loss is then NaN (``retrofit.modeling``), which this check names. Weights, gradients and the
  optimizer state are checked before every checkpoint (and the final model) is written: a
  non-finite checkpoint is never written, and the error names the last checkpoint on disk whose
  weights are finite (``retrofit.checkpointing.last_finite_checkpoint``);
- checkpoints are staged, ``fsync``-ed and renamed into place (``retrofit.checkpointing``): an
  interrupted save never leaves a ``checkpoint-N`` folder behind. ``train(resume_from_checkpoint=...)``
  validates the checkpoint first (``_resolve_resume``): ``True`` takes the newest *valid* one,
  skipping broken ones with a warning; an explicit broken path is a one-line error naming why;
- the run's ``output_dir`` may not be, contain or lie inside the model it starts from (the run
  replaces ``final/`` and rotates ``checkpoint-N/``);
- bad rows (missing columns, empty completions, rows longer than ``max_length``) are a clear error
  or a counted, logged skip (``retrofit.sft_data``: ``format_sft_dataset`` and the trainer's length
  filter ``drop_bad_rows``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import SFTConfig, SFTTrainer

from .checkpointing import (
    STAGING_PREFIX,
    InvalidCheckpointError,
    checkpoint_problems,
    commit,
    last_checkpoint,
    last_finite_checkpoint,
    remove_stale_staging,
    staging_path,
)
from .config import LOSS_FIELDS
from .errors import RetrofitUserError
from .halting.base import AuxLoss, LossConfig
from .halting.tah2 import next_token_mask
from .model_setup import (  # noqa: F401
    LORA_MODULES_TO_SAVE,
    LORA_TARGETS,
    apply_lora,
    build_looped_model,
    lora_layers_after_prelude,
    zero3_enabled,
)
from .modeling import LoopedForCausalLM
from .sft_data import BadDataError, drop_bad_rows, format_sft_dataset, no_eval_without_eval_set  # noqa: F401

# the model_setup names, BadDataError and format_sft_dataset are re-exported above (their homes are
# retrofit.model_setup and retrofit.sft_data): recipes, tests and scripts import them from here
logger = logging.getLogger(__name__)


class NonFiniteLossError(RetrofitUserError, RuntimeError):
    """The training loss, the halting signals or the weights became NaN or infinite; training stopped
    (before the optimizer step, or before writing a checkpoint)."""


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
@dataclass
class RetrofitSFTConfig(SFTConfig):
    """``SFTConfig`` plus the looped methods' loss weights and training switches.

    Every paper choice is a field, so an ablation is one flag (``--decider_weighting uniform``,
    ``--rho 1.0``). The loss weights (``alpha_d``, ``rho``, ``decider_weighting``, ``gamma``,
    ``prior_base``) default to None, "the model's": the model's ``LoopConfig`` holds them, and a value
    set here overrides it (the trainer writes it into the model's config, so the saved checkpoint
    records it). Model-side switches (``train_decisions="sample"``, ``mixture_output=False``,
    ``fixed_graph``) live in ``LoopConfig``; the recipes expose them as flags too.

    On a machine without CUDA, ``bf16`` defaults to False (TRL defaults it to True). Unused
    parameters are expected (an adaptive depth may skip the updater in a step), so
    ``ddp_find_unused_parameters`` defaults to True.
    """

    # loss weights: None = the model's LoopConfig value (defaults in brackets)
    alpha_d: float | None = field(default=None, metadata={"help": "TaH2: weight α_D of the decider loss [0.05]."})
    rho: float | None = field(
        default=None,
        metadata={"help": "TaH2: cutoff mass ρ of the lookahead labels [0.99]; 1.0 = every positive gain."},
    )
    decider_weighting: str | None = field(
        default=None, metadata={"help": "TaH2: BCE weights, 'distance' = |δ - κ| [default] or 'uniform' (ablation)."}
    )
    gamma: float | None = field(default=None, metadata={"help": "ANIRA: weight γ of the KL-to-prior loss L_C [0.01]."})
    prior_base: float | None = field(
        default=None, metadata={"help": "ANIRA: base b of the depth prior p(d) ∝ b^(-d) [2]; 1 = entropy term only."}
    )
    dyn_pos_weight: bool | None = field(
        default=None,
        metadata={
            "help": "TaH2: BCE pos_weight = the batch's negative/positive label ratio per depth, clamped to "
            "[0.02, 50] (the authors' release) [true]; false = the static --pos_weight."
        },
    )
    pos_weight: float | None = field(
        default=None, metadata={"help": "TaH2: static BCE pos_weight when --dyn_pos_weight false [1]."}
    )
    cost_min: float | None = field(
        default=None, metadata={"help": "TaH2: lower clamp of the cost-sensitive weights |δ - κ| [1e-6]."}
    )
    cost_max: float | None = field(
        default=None, metadata={"help": "TaH2: upper clamp of the cost-sensitive weights [1]; inf = unbounded."}
    )
    decider_loss_norm: str | None = field(
        default=None,
        metadata={
            "help": "TaH2: L_D = Σ w·BCE / labelled tokens ('tokens', the release) [default] or / Σ w ('weights')."
        },
    )
    bce_margin: float | None = field(
        default=None, metadata={"help": "TaH2: BCE margin m in logit space (the release's bce_margin) [0]."}
    )
    depth_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Train every depth before the decider decides: the first N optimizer steps run every token "
            "through every depth with the mean of the per-depth next-token losses (deep supervision) and no "
            "decider; the method's own training starts at step N. 0 = off (the methods as published)."
        },
    )
    threshold_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "TaH2: for the first N steps of its phase the training threshold ramps linearly from 0 to "
            "τ_exit, so nearly every token continues early on (the release's base_warmup_steps). 0 = off."
        },
    )
    depth_schedule: str | None = field(
        default=None,
        metadata={
            "help": "Depth curriculum (the release's max_iter_schedule): 'STEP:DEPTH,...', e.g. '0:1,100:2'; from "
            "each STEP on, no token runs deeper than DEPTH (the last entry whose STEP has been reached wins)."
        },
    )
    random_depth: bool = field(
        default=False,
        metadata={"help": "fixed: draw one depth per micro-batch from Huginn's Poisson-lognormal (clipped to 1..D)."},
    )
    random_depth_mean: float | None = field(
        default=None, metadata={"help": "fixed: mean depth r̄ of the random depth; default (max_depth + 1) / 2."}
    )
    random_depth_sigma: float = field(default=0.5, metadata={"help": "fixed: σ of the log-normal rate (Huginn: 0.5)."})
    truncate_backprop: int | None = field(
        default=None,
        metadata={"help": "Backprop through the last k core iterations only (Huginn: 8); None = all iterations."},
    )
    atomic_checkpoints: bool = field(
        default=True,
        metadata={"help": "Stage each checkpoint in a hidden folder and rename it into place when complete."},
    )
    depth_histogram: bool = field(
        default=True, metadata={"help": "Write a TensorBoard histogram of exit depths at every logging step."}
    )
    heads_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "Learning rate of the new heads (updater, decider) = learning_rate × this. The heads "
            "start from scratch while the backbone is pretrained; on short runs a larger scale (10-30) "
            "lets the decider move off its deep initialization."
        },
    )
    decider_lr_scale: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the decider (halting head) = learning_rate × this; None = heads_lr_scale "
            "(the updater always uses heads_lr_scale)."
        },
    )

    def __post_init__(self):
        if self.decider_lr_scale is not None and not (self.decider_lr_scale > 0):
            raise ValueError(f"decider_lr_scale must be a positive number or None, got {self.decider_lr_scale!r}")
        if self.bf16 is None and not self.fp16 and (self.use_cpu or not torch.cuda.is_available()):
            self.bf16 = False  # TRL defaults to bf16=True, which CPUs run slowly and with other numerics
        if self.activation_checkpointing is None:  # TRL's default (on), under transformers 5's name
            self.activation_checkpointing = self.gradient_checkpointing
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = True
        if self.truncate_backprop is not None and self.truncate_backprop < 1:
            raise ValueError(f"truncate_backprop must be None or >= 1, got {self.truncate_backprop!r}")
        if self.random_depth_sigma < 0:
            raise ValueError(f"random_depth_sigma must be >= 0, got {self.random_depth_sigma!r}")
        if self.random_depth_mean is not None and self.random_depth_mean < 1:
            raise ValueError(f"random_depth_mean must be >= 1 (a depth), got {self.random_depth_mean!r}")
        for name in ("depth_warmup_steps", "threshold_warmup_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.depth_schedule_steps  # noqa: B018  (validates depth_schedule)
        _ = self.loss_config  # validates the loss weights and switches
        super().__post_init__()

    @property
    def loss_overrides(self) -> dict:
        """The loss weights set here (not None): what the trainer writes into the model's ``LoopConfig``."""
        return {k: getattr(self, k) for k in LOSS_FIELDS if getattr(self, k) is not None}

    @property
    def loss_config(self) -> LossConfig:
        """The overrides on top of the default weights (the model's own may differ where none is set)."""
        return LossConfig(**self.loss_overrides)

    @property
    def depth_schedule_steps(self) -> list[tuple[int, int]]:
        """``depth_schedule`` parsed: ``[(step, max depth), ...]`` sorted by step (empty when unset)."""
        if not self.depth_schedule:
            return []
        out = []
        for part in str(self.depth_schedule).split(","):
            try:
                a, b = part.split(":")
                step, depth = int(a), int(b)
            except ValueError:
                raise ValueError(
                    "depth_schedule must be 'STEP:DEPTH,...' with integers (e.g. '0:1,100:2'), "
                    f"got {self.depth_schedule!r}"
                ) from None
            if step < 0 or depth < 1:
                raise ValueError(f"depth_schedule needs STEP >= 0 and DEPTH >= 1, got {part!r}")
            out.append((step, depth))
        return sorted(out)

    def depth_cap_at(self, step: int) -> int | None:
        """The curriculum's depth cap after ``step`` optimizer steps (None: no cap)."""
        cap = None
        for s, d in self.depth_schedule_steps:
            if s <= step:
                cap = d
        return cap


def _unwrap_looped(model) -> LoopedForCausalLM:
    from peft import PeftModel

    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(inner, LoopedForCausalLM):
        raise TypeError(f"RetrofitSFTTrainer trains looped models (retrofit.convert(...)); got {type(inner).__name__}")
    return inner


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------
class RetrofitSFTTrainer(SFTTrainer):
    """``SFTTrainer`` for looped models; see the module docstring.

    Takes the same arguments as ``SFTTrainer``, with ``args`` a ``RetrofitSFTConfig`` and ``model``
    a looped model (or a PEFT wrapper of one). ``self.data_report`` counts the rows skipped for
    length or for having no trainable token.
    """

    _tag_names = ["trl", "sft", "retrofit"]

    def __init__(self, model, args: RetrofitSFTConfig, *pargs, **kwargs):
        if not isinstance(args, RetrofitSFTConfig):
            raise TypeError(f"args must be a RetrofitSFTConfig, got {type(args).__name__}")
        self._looped = _unwrap_looped(model)
        if args.loss_overrides:
            # the model computes its auxiliary loss from its LoopConfig: a new dict, so it is re-read
            self._looped.config.loop = {**(self._looped.config.loop or {}), **args.loss_overrides}
            self._looped.loop  # noqa: B018  (validates the new weights)
        self._staging_root: str | None = None
        self._depth_counts = {"train": None, "eval": None}
        self.data_report: dict[str, dict] = {}
        # TRL truncates long rows silently (which would cut answers); prepare untruncated, then drop
        # and count the rows that do not fit. With packing, max_length is the pack size: keep it.
        self._max_length = args.max_length if not args.packing else None  # None: TRL handles length
        no_eval_without_eval_set(args, kwargs.get("eval_dataset", pargs[2] if len(pargs) > 2 else None))
        with self._untruncated(args):
            super().__init__(model, args, *pargs, **kwargs)
        self.train_dataset = self._drop_bad_rows(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._drop_bad_rows(v, k) for k, v in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = self._drop_bad_rows(self.eval_dataset, "eval")
        if self.args.should_save:
            remove_stale_staging(self.args.output_dir)

    # -- data --------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """The standard optimizer, with the updater (``updater.*``) at ``learning_rate × heads_lr_scale`` and the
        decider (``halting.*``) at ``learning_rate × decider_lr_scale`` (default: ``heads_lr_scale``), each scale
        other than 1 in its own parameter groups (one per scale, so equal scales share a group)."""
        opt = super().create_optimizer(model)
        scale = getattr(self.args, "heads_lr_scale", 1.0)
        dscale = getattr(self.args, "decider_lr_scale", None)
        scales = {"updater": scale, "halting": scale if dscale is None else dscale}
        if all(v == 1.0 for v in scales.values()) or getattr(self, "_heads_groups_split", False):
            return opt
        scale_of = {}
        for n, p in (model if model is not None else self.model).named_parameters():
            for head, sc in scales.items():
                if f".{head}." in f".{n}" and sc != 1.0:
                    scale_of[id(p)] = sc
        extra = []
        for g in opt.param_groups:
            for sc in dict.fromkeys(scale_of[id(p)] for p in g["params"] if id(p) in scale_of):
                params = [p for p in g["params"] if scale_of.get(id(p)) == sc]
                extra.append({**{k: v for k, v in g.items() if k != "params"}, "params": params, "lr": g["lr"] * sc})
            g["params"] = [p for p in g["params"] if id(p) not in scale_of]
        for g in extra:
            opt.add_param_group(g)
        self._heads_groups_split = True
        return opt

    @contextlib.contextmanager
    def _untruncated(self, args):
        """TRL's dataset preparation without its truncation (we drop and count long rows instead)."""
        if self._max_length is None:
            yield
            return
        args.max_length = None
        try:
            yield
        finally:
            args.max_length = self._max_length

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """``SFTTrainer.evaluate``; a dataset passed here gets the same length filter as at init."""
        if eval_dataset is not None and not isinstance(eval_dataset, str) and not self._skip_prepare_dataset:
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
            named = eval_dataset if isinstance(eval_dataset, dict) else {metric_key_prefix: eval_dataset}
            with self._untruncated(self.args):
                named = {
                    k: self._prepare_dataset(v, self.processing_class, self.args, packing, self._formatting_func, k)
                    for k, v in named.items()
                }
            named = {k: self._drop_bad_rows(v, k) for k, v in named.items()}
            eval_dataset = named if isinstance(eval_dataset, dict) else named[metric_key_prefix]
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def _drop_bad_rows(self, dataset, name: str):
        """``sft_data.drop_bad_rows`` at the trainer's length limit; the counts go to ``self.data_report``."""
        dataset, report = drop_bad_rows(dataset, self._max_length, name)
        if report is not None:
            self.data_report[name] = report
        return dataset

    # -- loss --------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The looped forward's loss (next-token + the method's auxiliary loss, ``retrofit.modeling``),
        with the trainer-side switches (random depth, truncated backprop) and metrics."""
        mode = "train" if self.model.training else "eval"
        method = self._looped.halting
        labels = inputs["labels"]
        attention_mask = inputs.get("attention_mask")
        fwd = {"input_ids": inputs["input_ids"], "labels": labels}
        for key in ("attention_mask", "position_ids"):
            if inputs.get(key) is not None:
                fwd[key] = inputs[key]
        if num_items_in_batch is not None:
            fwd["num_items_in_batch"] = num_items_in_batch
        if mode == "train":
            # the loss path's vocabulary-wide work only where a label is: the same loss and gradients
            fwd["labelled_logits_only"] = True
            fwd.update(self._schedule_kwargs(method))
            if self.args.truncate_backprop is not None:
                fwd["backprop_depth"] = self.args.truncate_backprop
        outputs = model(**fwd)

        # outputs.loss = next-token loss + coef · aux_loss; split it to scale the parts as TRL does
        coef = getattr(self._looped.config, "router_aux_loss_coef", 1.0)
        weighted_aux = coef * outputs.aux_loss if outputs.aux_loss is not None else None
        ntp = outputs.loss if weighted_aux is None else outputs.loss - weighted_aux
        loss = outputs.loss
        # like Trainer/TRL: num_items_in_batch counts every rank's tokens and DDP averages gradients
        scale = 1
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            scale = self.accelerator.num_processes // self.get_tp_size()
        if mode == "train":
            # before anything reads the outputs further. The forward already turned a non-finite decider
            # into a NaN auxiliary loss instead of running TaH2's BCE on it (which raises on NaN input)
            self._check_finite(ntp, outputs=outputs)
        # the auxiliary loss is a per-micro-batch mean: when num_items_in_batch is given the Trainer no
        # longer divides by the accumulation steps, so we do (as TRL does for the MoE aux loss)
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None and mode == "train" else 1
        if scale != 1 or (weighted_aux is not None and steps != 1):
            loss = ntp * scale + (weighted_aux / steps if weighted_aux is not None else 0)
        aux = AuxLoss(weighted_aux, outputs.aux_metrics or {}) if weighted_aux is not None else None

        if mode == "train":
            # guards the total loss (next-token and auxiliary parts alike) before the backward pass
            self._check_finite(loss, ntp, aux)
        self._record_metrics(mode, outputs, labels, attention_mask, aux, num_items_in_batch, ntp)
        return (loss, outputs) if return_outputs else loss

    def _schedule_kwargs(self, method) -> dict:
        """The forward switches of this optimizer step (all read ``state.global_step``, so a resumed run is in
        the same phase as the uninterrupted one):

        - ``depth_warmup_steps``: before it, deep supervision (``depth_supervision=True``: every depth's own
          loss, no decider); from it on, the method's own training, with its step counted from the switch
          (TaH2's threshold warm-up ramps from there);
        - ``depth_schedule``: the curriculum's ``depth_cap``.
        """
        step = self.state.global_step
        warm = self.args.depth_warmup_steps
        kw = {"depth_supervision": True} if step < warm else dict(method.train_forward_kwargs(self.args, step - warm))
        cap = self.args.depth_cap_at(step)
        if cap is not None and cap < self._looped.loop.max_depth:
            if "depth" in kw:  # a random depth of `fixed` obeys the curriculum too
                kw["depth"] = min(kw["depth"], cap)
            else:
                kw["depth_cap"] = cap
        return kw

    def _check_finite(self, loss, ntp=None, aux=None, outputs=None) -> None:
        """Stop training when the loss (or the halting signals) is NaN/inf, on every process together.

        Where ``compute_loss`` must call it (train mode), so that no operation ever sees a
        non-finite input it would raise on and no bad update is applied:

        1. right after the model's forward: ``self._check_finite(ntp, outputs=outputs)``. The forward
           computes the method's auxiliary loss itself; on non-finite halting signals it returns a NaN
           ``aux_loss`` instead of running TaH2's BCE (which raises "all elements of input should be
           between 0 and 1" on a NaN continue probability), so this check names the signals;
        2. on the total loss, before it is returned to the backward pass:
           ``self._check_finite(loss, ntp, aux)``.

        Args:
            loss: the scalar to check (the next-token loss in call 1, the total loss in call 2).
            ntp, aux: the next-token loss and the method's ``AuxLoss``, for the message.
            outputs: the forward's output; its ``halt_signals`` and ``depth_logits_q`` are checked too
                (``depth_nll`` and ``depth_logits`` hold NaN by design where a depth did not run).

        Raises:
            NonFiniteLossError: naming the step, what was non-finite, whether the weights already
                are (an earlier update diverged), and the last checkpoint whose weights are finite.
        """
        bad_parts = []
        if not bool(torch.isfinite(loss.detach()).all()):
            bad_parts.append("loss")
        if outputs is not None:
            for name in ("halt_signals", "depth_logits_q"):
                t = getattr(outputs, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
                    bad_parts.append(name)
        bad = torch.tensor([float(len(bad_parts) > 0)], device=loss.device)
        if self.accelerator.num_processes > 1:
            # every rank must stop together, or the others hang in the next collective
            bad = self.accelerator.reduce(bad, reduction="sum")
        if not bool(bad.item() > 0):
            return
        step = self.state.global_step + 1
        ntp = loss if ntp is None else ntp
        parts = f"next-token loss {ntp.detach().float().mean().item():.6g}"
        if aux is not None:
            parts += f", auxiliary loss {aux.loss.detach().float().item():.6g}"
        if "halt_signals" in bad_parts or "depth_logits_q" in bad_parts:
            parts += ", non-finite halting signals"
        if not bad_parts:
            parts = "finite here; another process saw a non-finite value"
        weights = self._nonfinite_state(optimizer=False)
        if weights:
            cause = (
                f"The {' and '.join(weights)} are already non-finite: the update of step {step - 1} diverged, "
                "and training stopped before applying another."
            )
        else:
            cause = "Training stopped before the optimizer step, so no bad update was applied."
        good = last_finite_checkpoint(self.args.output_dir)
        raise NonFiniteLossError(
            f"non-finite training loss at step {step} (epoch {self.state.epoch or 0:.3f}; {parts} on this "
            f"process). {cause} Last checkpoint with finite weights: {good or 'none saved yet'}. Try a lower "
            "learning rate, gradient clipping (--max_grad_norm), fp32 instead of fp16, or check the data near "
            "this step."
        )

    @torch.no_grad()
    def _nonfinite_state(self, optimizer: bool = True) -> list[str]:
        """What holds NaN/inf on this process: ``"parameters"``, ``"gradients"``, ``"optimizer state"``.

        Under DeepSpeed ZeRO-3 a parameter's local shard (``ds_tensor``) is checked.
        """
        found = []
        params = list(self.model.parameters())

        def finite(t) -> bool:
            return t is None or not t.is_floating_point() or t.numel() == 0 or bool(torch.isfinite(t).all())

        if not all(finite(getattr(p, "ds_tensor", p)) for p in params):
            found.append("parameters")
        if not all(finite(p.grad) for p in params):
            found.append("gradients")
        if optimizer and self.optimizer is not None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            state = getattr(inner, "state", None)
            if isinstance(state, dict):
                for st in state.values():
                    if isinstance(st, dict) and not all(finite(v) for v in st.values() if isinstance(v, torch.Tensor)):
                        found.append("optimizer state")
                        break
        return found

    def _refuse_nonfinite_save(self, what: str) -> None:
        """Raise ``NonFiniteLossError`` (on every process) instead of writing non-finite weights or state."""
        found = self._nonfinite_state()
        bad = torch.tensor([float(bool(found))], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        if bool(bad.item() > 0):
            good = last_finite_checkpoint(self.args.output_dir)
            raise NonFiniteLossError(
                f"the {' and '.join(found) or 'state on another process'} became non-finite (NaN/inf) by step "
                f"{self.state.global_step}; not writing {what}. Last checkpoint with finite weights: "
                f"{good or 'none saved yet'}. Try a lower learning rate, gradient clipping (--max_grad_norm), or fp32 "
                f"instead of fp16."
            )

    # -- resume ------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` after ``_resolve_resume``: the resume checkpoint is validated first."""
        return super().train(self._resolve_resume(resume_from_checkpoint), *args, **kwargs)

    def _resolve_resume(self, resume_from_checkpoint):
        """Validate what ``train`` will resume from, and the run's output folder.

        - ``True``: the newest *valid* ``checkpoint-N`` of ``output_dir``; broken ones are skipped with a
          warning naming why (``retrofit.checkpointing.last_checkpoint``); none valid is an error.
        - a path: it must pass ``checkpoint_problems`` (safetensors headers and sizes, optimizer and
          scheduler loadable, ``trainer_state.json`` parsable), else ``InvalidCheckpointError`` naming
          the problems and the newest valid checkpoint next to it.
        - ``output_dir`` may not be, contain or lie inside the folder the model was loaded from.
        """
        from .output_paths import OutputTargetError, relation

        source = getattr(self._looped.config, "_name_or_path", None)
        if source and os.path.isdir(source) and self.args.output_dir:
            rel = relation(self.args.output_dir, source)
            if rel is not None:
                raise OutputTargetError(
                    f"--output_dir {os.path.abspath(self.args.output_dir)} {rel} the model folder "
                    f"{os.path.abspath(source)} "
                    "this run starts from; the run writes checkpoint-N/ and final/ there and deletes old checkpoints. "
                    "Choose another --output_dir"
                )
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            found = last_checkpoint(self.args.output_dir)
            if found is None:
                raise InvalidCheckpointError(f"no valid checkpoint-N folder to resume from in {self.args.output_dir}")
            return found
        problems = checkpoint_problems(resume_from_checkpoint)
        if problems:
            alt = last_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
            raise InvalidCheckpointError(
                f"cannot resume from {resume_from_checkpoint}: {'; '.join(problems)}"
                + (f"; the newest valid checkpoint next to it is {alt}" if alt else "")
            )
        return resume_from_checkpoint

    @torch.no_grad()
    def _record_metrics(self, mode, outputs, labels, attention_mask, aux: AuxLoss | None, num_items_in_batch, ntp):
        D = self._looped.loop.max_depth
        depths = outputs.depths
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(depths, dtype=torch.bool)
        ans = next_token_mask(labels) & valid
        counts = torch.stack([((depths == d) & valid).sum() for d in range(1, D + 1)]).float()
        logits = outputs.logits
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        if outputs.logits_rows is not None:  # logits of the labelled positions only
            rows = outputs.logits_rows
            hit = (logits.argmax(-1) == shift.reshape(-1)[rows]) & ans.reshape(-1)[rows]
        else:
            hit = (logits.argmax(-1) == shift) & ans
        correct = hit.sum().float()
        n_ans = ans.sum().float()
        # the next-token loss is this micro-batch's NLL sum over num_items_in_batch (or its own count)
        ntp_sum = ntp.detach().float() * (num_items_in_batch if num_items_in_batch is not None else n_ans.clamp_min(1))
        # scalars averaged over processes: the method's (with its weighted loss) and, under deep supervision
        # (the depth warm-up), each depth's own loss
        names, vals = [], []
        if aux is not None:
            names = ["aux_loss", *sorted(aux.metrics)]
            vals = [aux.loss.detach().float().reshape(())] + [aux.metrics[k].float().reshape(()) for k in names[1:]]
        if outputs.depth_ce is not None:
            names += [f"depth_loss_{d + 1}" for d in range(outputs.depth_ce.numel())]
            vals += [v.detach().float().reshape(()) for v in outputs.depth_ce]
        dev = counts.device
        local = torch.cat(
            [
                counts,
                torch.stack([(depths * ans).sum().float(), n_ans, correct, ntp_sum.to(dev)]),
                torch.stack(vals).to(dev) if vals else counts.new_zeros(0),
            ]
        )
        n_proc = self.accelerator.num_processes
        total = self.accelerator.reduce(local, reduction="sum") if n_proc > 1 else local
        counts_t = total[:D]
        depth_sum_ans, n_ans_t, correct_t, ntp_sum_t = total[D : D + 4].tolist()
        n_tok = counts_t.sum().clamp_min(1)
        d = torch.arange(1, D + 1, device=dev, dtype=torch.float32)
        m = self._metrics[mode]
        m["ntp_loss"].append(ntp_sum_t / max(n_ans_t, 1.0))
        m["mean_depth"].append(((counts_t * d).sum() / n_tok).item())
        m["mean_depth_answer"].append(depth_sum_ans / max(n_ans_t, 1.0))
        m["mean_token_accuracy"].append(correct_t / max(n_ans_t, 1.0))
        for k in range(D):
            m[f"depth_frac_{k + 1}"].append((counts_t[k] / n_tok).item())
        for name, v in zip(names, (total[D + 4 :] / n_proc).tolist()):
            m[name].append(v)
        if mode == "train":
            self._total_train_tokens += int(n_tok.item()) // self._tp_size
            m["num_tokens"] = [self._total_train_tokens]
        acc = self._depth_counts[mode]
        self._depth_counts[mode] = counts_t.cpu() if acc is None else acc + counts_t.cpu()

    # -- model card --------------------------------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The run folder's ``README.md``: retrofit's card, not TRL's ("a fine-tuned version of [None]")."""
        if self.is_world_process_zero():
            from .model_card import write_run_card

            write_run_card(self._looped, self.args.output_dir, repo_id=self.args.hub_model_id)

    # -- logging -----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        super().log(logs, start_time)
        counts, self._depth_counts[mode] = self._depth_counts[mode], None
        if counts is not None and self.args.depth_histogram:
            self._write_depth_histogram(mode, counts)

    def _write_depth_histogram(self, mode: str, counts: torch.Tensor) -> None:
        from transformers.integrations import TensorBoardCallback

        writer = next(
            (
                cb.tb_writer
                for cb in self.callback_handler.callbacks
                if isinstance(cb, TensorBoardCallback) and cb.tb_writer
            ),
            None,
        )
        if writer is None or counts.sum() <= 0:
            return
        D = counts.numel()
        d = torch.arange(1, D + 1, dtype=torch.float64)
        c = counts.double()
        writer.add_histogram_raw(
            tag=f"{mode}/depth_histogram",
            min=float(d[c > 0].min()),
            max=float(d[c > 0].max()),
            num=int(c.sum()),
            sum=float((c * d).sum()),
            sum_squares=float((c * d * d).sum()),
            bucket_limits=[k + 0.5 for k in range(1, D + 1)],
            bucket_counts=[int(x) for x in c.tolist()],
            global_step=self.state.global_step,
        )
        writer.flush()

    # -- atomic checkpoints ------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        if self._staging_root is not None:
            return self._staging_root
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        # never write (nor later name as good) a checkpoint whose weights or optimizer state are NaN/inf
        self._refuse_nonfinite_save(f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not self.args.atomic_checkpoints:
            return super()._save_checkpoint(model, trial)
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        root = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if self.args.should_save and os.path.exists(root):
            shutil.rmtree(root)
        self.accelerator.wait_for_everyone()
        # the Trainer writes <run_dir>/checkpoint-N; pointing run_dir at the staging root makes it
        # write <root>/checkpoint-N, which we fsync and rename into place once every rank is done
        self._staging_root = root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            commit(os.path.join(root, name), final)
            shutil.rmtree(root, ignore_errors=True)
            best = self.state.best_model_checkpoint
            if best is not None and best.startswith(root):
                self.state.best_model_checkpoint = final
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def save_model_atomic(self, output_dir: str) -> None:
        """``save_model`` into a staging folder, ``fsync``-ed and renamed to ``output_dir`` once complete
        (all ranks call it). Refuses (``NonFiniteLossError``) to write non-finite weights."""
        self._refuse_nonfinite_save(str(output_dir))
        tmp = str(staging_path(output_dir))
        if self.args.should_save and os.path.exists(tmp):
            shutil.rmtree(tmp)
        self.accelerator.wait_for_everyone()
        self.save_model(tmp)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            commit(tmp, output_dir)
        self.accelerator.wait_for_everyone()
