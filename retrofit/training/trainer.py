"""SFT for looped models: a TRL ``SFTTrainer`` subclass with what SFT needs beyond the model's own
loss, and its config. The pieces the recipes share live next to it and are re-exported here: row
formatting and filtering in ``retrofit.training.sft_data``, model loading and LoRA in ``retrofit.training.model_setup``.

The halting methods' objectives (docs/tah2.md, docs/anira.md) belong to the model: with labels its forward
returns ``loss`` = next-token loss + the method's weighted ``aux_loss`` (``retrofit.model.modeling``), so
TRL's ``SFTTrainer``/``DPOTrainer``/``GRPOTrainer`` and ``transformers.Trainer`` all optimize
``L_NTP(mixture) + α_D · L_D`` (TaH2), ``L_CE + γ · L_C`` (ANIRA-E/O) or ``L_NTP`` (fixed). The weights
live in the model's ``LoopConfig`` only (the recipes' flags for them are made from it). ``compute_loss`` adds the
trainer-side switches (random depth, truncated backprop), scales the auxiliary loss as its method normalizes it
(``HaltingMethod.aux_loss_per_item``: a per-micro-batch mean is divided by the accumulation steps, as TRL does
for a router loss, and averaged over processes; a sum over ``num_items_in_batch`` — TaH2's under
``decider_loss_scope="global"`` — is scaled as the next-token loss is, which makes it exact under data parallelism
and gradient accumulation), and records metrics.

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
  its auxiliary loss is then NaN (``retrofit.model.modeling``), which this check names. Weights, gradients and the
  optimizer state are checked before every checkpoint (and the final model) is written: a
  non-finite checkpoint is never written, and the error names the last checkpoint on disk whose
  weights are finite (``retrofit.training.checkpointing.last_finite_checkpoint``);
- checkpoints are staged, ``fsync``-ed and renamed into place (``retrofit.training.checkpointing``): an
  interrupted save never leaves a ``checkpoint-N`` folder behind. ``train(resume_from_checkpoint=...)``
  validates the checkpoint first (``_resolve_resume``): ``True`` takes the newest *valid* one,
  skipping broken ones with a warning; an explicit broken path is a one-line error naming why;
- the run's ``output_dir`` may not be, contain or lie inside the model it starts from (the run
  replaces ``final/`` and rotates ``checkpoint-N/``);
- bad rows (missing columns, empty completions, rows longer than ``max_length``) are a clear error
  or a counted, logged skip (``retrofit.training.sft_data``: ``format_sft_dataset`` and the trainer's length
  filter ``drop_bad_rows``).
"""

from __future__ import annotations

import contextlib

from trl import SFTTrainer

from ..model.halting.base import AuxLoss
from ..model.halting.tah2 import next_token_mask
from ..model.modeling import LoopedForCausalLM
from .checkpointing import remove_stale_staging
from .config import RetrofitSFTConfig
from .fsdp2_cpu import force_fsdp2, fsdp2_requested_on_cpu
from .model_setup import (  # noqa: F401
    LORA_MODULES_TO_SAVE,
    LORA_TARGETS,
    apply_lora,
    build_looped_model,
    lora_layers_after_prelude,
    zero3_enabled,
)
from .nan_guard import NanGuardMixin, NonFiniteLossError  # noqa: F401
from .optim import add_head_groups
from .sft_data import BadDataError, drop_bad_rows, format_sft_dataset, no_eval_without_eval_set  # noqa: F401
from .trainer_checkpoints import CheckpointMixin
from .trainer_metrics import DepthMetricsMixin

# NonFiniteLossError, RetrofitSFTConfig, the model_setup names, BadDataError and format_sft_dataset are
# re-exported above (their homes: retrofit.training.nan_guard, .config, .model_setup, .sft_data)


def _unwrap_looped(model) -> LoopedForCausalLM:
    from peft import PeftModel

    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(inner, LoopedForCausalLM):
        raise TypeError(f"RetrofitSFTTrainer trains looped models (retrofit.convert(...)); got {type(inner).__name__}")
    return inner


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------
class RetrofitSFTTrainer(NanGuardMixin, CheckpointMixin, DepthMetricsMixin, SFTTrainer):
    """``SFTTrainer`` for looped models; see the module docstring.

    The concerns beside the loss live in their own modules, mixed in before ``SFTTrainer``: the NaN guard
    (``nan_guard.NanGuardMixin``), validated resume and atomic saves (``trainer_checkpoints.CheckpointMixin``),
    metrics and the depth histogram (``trainer_metrics.DepthMetricsMixin``); the heads' learning-rate groups
    are ``optim.add_head_groups``.

    Takes the same arguments as ``SFTTrainer``, with ``args`` a ``RetrofitSFTConfig`` and ``model``
    a looped model (or a PEFT wrapper of one). ``self.data_report`` counts the rows skipped for
    length or for having no trainable token.
    """

    _tag_names = ["trl", "sft", "retrofit"]

    def __init__(self, model, args: RetrofitSFTConfig, *pargs, **kwargs):
        if not isinstance(args, RetrofitSFTConfig):
            raise TypeError(f"args must be a RetrofitSFTConfig, got {type(args).__name__}")
        self._looped = _unwrap_looped(model)
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

    # -- accelerator -------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        """The Trainer's accelerator; FSDP2 asked for on CPU processes (``accelerate launch --config_file
        launch/fsdp2.yaml … --use_cpu true``), which accelerate would silently run as DDP, runs as FSDP2
        (``retrofit.training.fsdp2_cpu``)."""
        super().create_accelerator_and_postprocess()
        if fsdp2_requested_on_cpu(self.accelerator):
            force_fsdp2(self)

    # -- optimizer ---------------------------------------------------------------------------------
    def get_decay_parameter_names(self, model) -> list[str]:
        """transformers' rule (no decay on biases and on the norm weights it recognizes by name), or with
        ``decay_norms`` the TaH2 release's: weight decay on every parameter but biases, norm weights included
        (docs/tah2.md, "optimization")."""
        if not self.args.decay_norms:
            return super().get_decay_parameter_names(model)
        return [n for n, _ in model.named_parameters() if "bias" not in n.rsplit(".", 1)[-1]]

    def create_optimizer(self, model=None):
        """The standard optimizer, with the updater (``updater.*``) at ``learning_rate × heads_lr_scale`` and the
        decider (``halting.*``) at ``learning_rate × decider_lr_scale`` (default: ``heads_lr_scale``), each scale
        other than 1 in its own parameter groups (``optim.add_head_groups``)."""
        opt = super().create_optimizer(model)
        scale = getattr(self.args, "heads_lr_scale", 1.0)
        dscale = getattr(self.args, "decider_lr_scale", None)
        scales = {"updater": scale, "halting": scale if dscale is None else dscale}
        if all(v == 1.0 for v in scales.values()) or getattr(self, "_heads_groups_split", False):
            return opt
        add_head_groups(opt, (model if model is not None else self.model).named_parameters(), scales)
        self._heads_groups_split = True
        return opt

    # -- data --------------------------------------------------------------------------------------
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
        """The looped forward's loss (next-token + the method's auxiliary loss, ``retrofit.model.modeling``),
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
        per_item = (
            weighted_aux is not None
            and num_items_in_batch is not None
            and method.aux_loss_per_item(self._looped.loop.method_options)
        )
        if per_item:
            # the method divided its loss by num_items_in_batch too (TaH2's decider_loss_scope="global"):
            # both parts are sums over the global labelled tokens, scaled alike
            if scale != 1:
                loss = outputs.loss * scale
        else:
            # the auxiliary loss is a per-micro-batch mean: when num_items_in_batch is given the Trainer no
            # longer divides by the accumulation steps, so we do (as TRL does for the MoE aux loss)
            steps = (
                self.current_gradient_accumulation_steps if num_items_in_batch is not None and mode == "train" else 1
            )
            if scale != 1 or (weighted_aux is not None and steps != 1):
                loss = ntp * scale + (weighted_aux / steps if weighted_aux is not None else 0)
        aux = None
        if weighted_aux is not None:
            # logged per labelled token of this micro-batch whatever the normalizer (comparable across runs)
            shown = (
                weighted_aux * (num_items_in_batch / next_token_mask(labels).sum().clamp_min(1))
                if per_item
                else weighted_aux
            )
            aux = AuxLoss(shown, outputs.aux_metrics or {})

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
        phase = self.args.decider_phase_from
        if phase is not None and step >= phase:  # the decider alone, on the frozen backbone
            self._freeze_all_but_the_decider()
            return {"decider_phase": True}
        kw = {"depth_supervision": True} if step < warm else dict(method.train_forward_kwargs(self.args, step - warm))
        cap = self.args.depth_cap_at(step)
        if cap is not None and cap < self._looped.loop.max_depth:
            if "depth" in kw:  # a random depth of `fixed` obeys the curriculum too
                kw["depth"] = min(kw["depth"], cap)
            else:
                kw["depth_cap"] = cap
        return kw

    def _freeze_all_but_the_decider(self) -> None:
        """``decider_phase_from``: every trainable parameter outside the halting head stops training (its
        gradient stays None, so the optimizer skips it); idempotent, and re-done after a resume."""
        if getattr(self, "_decider_phase_frozen", False):
            return
        frozen = 0
        for name, p in self.model.named_parameters():
            if p.requires_grad and ".halting." not in f".{name}":
                p.requires_grad_(False)
                frozen += p.numel()
        if not any(p.requires_grad for p in self._looped.halting.parameters()):
            raise ValueError("decider_phase_from: the halting head has no trainable parameter (the fixed loop?)")
        self._decider_phase_frozen = True
        self._decider_phase_frozen_params = frozen

    # -- model card --------------------------------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The run folder's ``README.md``: retrofit's card, not TRL's ("a fine-tuned version of [None]")."""
        if self.is_world_process_zero():
            from ..hub.model_card import write_run_card

            write_run_card(self._looped, self.args.output_dir, repo_id=self.args.hub_model_id)
