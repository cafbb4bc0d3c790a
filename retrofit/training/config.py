"""``RetrofitSFTConfig``: TRL's ``SFTConfig`` plus the looped methods' training switches (the trainer that reads it:
``retrofit.training.trainer``). The methods' loss weights are the model's (its method's options,
``LoopConfig.options``), declared once there."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import SFTConfig


@dataclass
class RetrofitSFTConfig(SFTConfig):
    """``SFTConfig`` plus the looped methods' training switches (schedules, phases, head learning rates).

    The methods' loss weights and switches (TaH2's ``alpha_d``, ``rho``, ``decider_weighting``, ...; ANIRA's
    ``gamma``, ``prior_base``) are not here: the model computes its own auxiliary loss from its ``LoopConfig``, whose
    ``options`` are the method's own ``Options`` dataclass (``TaH2Options``, ``AniraOptions``), which declares them
    once; the recipes' flags for them are made from it (``retrofit.training.model_setup.loop_args_class``), and a
    model built outside a recipe takes them in its ``LoopConfig``. Every paper choice is one flag either way
    (``--decider_weighting uniform``, ``--rho 1.0``).

    On a machine without CUDA, ``bf16`` defaults to False (TRL defaults it to True). Unused
    parameters are expected (an adaptive depth may skip the updater in a step), so
    ``ddp_find_unused_parameters`` defaults to True.
    """

    decay_norms: bool = field(
        default=False,
        metadata={
            "help": "Apply weight decay to norm weights too (every parameter but biases), as the TaH2 release "
            "does; false = transformers' rule (no decay on biases and on the norm weights it recognizes by name)."
        },
    )
    depth_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Train every depth before the decider decides: the first N optimizer steps run every token "
            "through every depth with the mean of the per-depth next-token losses (deep supervision) and no "
            "decider; the method's own training starts at step N. 0 = off (the methods as published)."
        },
    )
    decider_phase_from: int | None = field(
        default=None,
        metadata={
            "help": "From this optimizer step on, train the decider alone on the frozen backbone (every parameter "
            "but the halting head stops training) with the method's decider-phase loss: Ouro's Stage II, "
            "TaH2's decider BCE, ANIRA's own loss. With --depth_warmup_steps N and this = N: train every depth, "
            "then the decider (the first TaH paper's two stages). None = off."
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
        if self.use_cpu or not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # nothing to pin for; torch warns at every epoch otherwise
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
        v = self.decider_phase_from
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < self.depth_warmup_steps):
            raise ValueError(
                f"decider_phase_from must be None or an integer step >= depth_warmup_steps "
                f"({self.depth_warmup_steps}), got {v!r}"
            )
        self.depth_schedule_steps  # noqa: B018  (validates depth_schedule)
        super().__post_init__()

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
