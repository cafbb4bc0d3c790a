"""The contract every halting method fulfils.

A method owns, in its one file, its decider modules, its exit rule (inference and training), how
its per-depth outputs combine into the model's output, and its auxiliary loss (STYLE.md: they
change together). The depth loop (``retrofit.model.loop``) calls, in order:

1. ``plan(e, ctx)`` once, with the core input ``e`` ``[B, T, H]``: a method that decides before the
   loop (ANIRA-E) returns the planned exit depth ``[B, T]``; online methods return ``None``.
2. ``step(d, e, h, probs, ctx)`` after each depth ``d < D`` on the (passthrough) state ``h``:
   returns ``continue`` ``[B, T]`` bool (meaningful for tokens still active) or ``None`` (always
   continue). ``probs`` is the depth-``d`` next-token distribution when ``needs_depth_readout``.
3. ``combiner(ctx)`` (only for methods with ``needs_depth_readout``): a ``DepthCombiner`` that
   receives every executed depth's logits and returns the output logits (TaH2's mixture).
4. ``distribution(ctx, depths)`` after the loop: the halting distribution over depths
   ``[B, T, D]`` (or ``None`` for a method without one) and, for training, the straight-through
   weights used to combine per-depth states (``None`` when the hard exit state is used as is).

When the exit depth is forced (``depth=``), the loop calls none of these: no decider runs, and
the output is each token's exit-depth readout.

The auxiliary loss: ``loss(outputs, labels, cfg, attention_mask=None, num_items_in_batch=None)`` returns the
method's loss,
already weighted (``α_D · L_D`` for TaH2, ``γ · L_C`` for ANIRA), plus detached scalars to log.
The model's forward calls it with ``cfg = LoopConfig.method_options`` (the method's own ``Options``) whenever it
gets labels, adds it
to ``loss`` and exposes it as ``aux_loss`` (the mixture-of-experts convention TRL's trainers know).
A method whose loss reads per-depth next-token losses sets ``needs_depth_losses`` (TaH2: the
forward then runs the lookahead iteration). ``train_forward_kwargs(cfg)`` gives trainer-side
extra forward arguments (``fixed``'s random depth per batch, TaH2's threshold warm-up).

``ctx`` is a ``HaltContext`` created per forward: all per-call state lives there, so a module can
serve concurrent forwards and checkpoint recomputation.

**What the rest of retrofit asks a method** (class attributes and class methods, read through the registry,
``retrofit.model.registry``; nothing outside ``halting/`` branches on a method's name): its one-line
``description`` (model cards), its ``default_attention``, its own ``Options`` dataclass (the fields of
``LoopConfig.options``), its decision threshold (``threshold_field``, what it means, ``threshold_rule``, and
``continue_probabilities`` for calibration and the frontier), how often its decider runs (``decider_runs``,
for FLOPs), whether it reads out every depth (``reads_every_depth``, for memory), its model-card rows
(``card_rows``) and whether the vLLM plugin serves it (``vllm_supported``). docs/architecture.md says how to
add a method.

**The main-loss hook.** A method whose objective replaces the next-token loss of the output logits (Ouro's
expected loss over its exit distribution) sets ``needs_depth_ce``: the forward then runs every token through
every depth in training and hands ``main_loss`` each executed depth's per-token cross-entropy *with*
gradient (``outputs.depth_ce_tokens`` ``[B, T, D]``), and the value it returns becomes the model's ``loss``
(the auxiliary loss is added to it as for any method).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn

from ..config import LoopConfig

__all__ = [
    "THRESHOLD_RULES",
    "AuxLoss",
    "DepthCombiner",
    "ExitLogits",
    "HaltContext",
    "HaltingMethod",
    "NoOptions",
]


@dataclass
class AuxLoss:
    """A method's auxiliary training loss.

    Attributes:
        loss: scalar, already weighted; the model adds it to the next-token loss.
        metrics: detached scalars to log (e.g. the unweighted decider loss, the cutoff κ).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HaltContext:
    """Per-forward state of a halting method."""

    training: bool
    max_depth: int
    signals: list[torch.Tensor] = field(default_factory=list)  # one [B, T] per decided depth
    extra: dict = field(default_factory=dict)
    #: this call's decision threshold, replacing the method's own (``forward(decider_threshold=)``): TaH2's
    #: τ_exit, ANIRA-O's cumulative halting mass, ANIRA-E's quantile of q; None = the ``LoopConfig``'s
    threshold: float | None = None


class DepthCombiner:
    """Turns the logits of every executed depth into a token's output logits, depth by depth.

    ``add`` is called once per executed depth with tensors over the same tokens (any leading shape,
    e.g. ``[B, T]``, or ``[N]`` for a serving engine's tokens); all state is per token.
    """

    def add(
        self,
        d: int,
        z: torch.Tensor,
        logp: torch.Tensor | None,
        active: torch.Tensor,
        stop: torch.Tensor,
        signal: torch.Tensor | None,
    ) -> None:
        """Depth ``d``'s logits ``z [..., V]`` (``logp``: their log-softmax, when already computed).

        ``active``: the token executed depth ``d``; ``stop``: it exits at ``d``; ``signal``: the
        decider's output after depth ``d`` (None when it made no decision there).
        """
        raise NotImplementedError

    def logits(self, depths: torch.Tensor) -> torch.Tensor:
        """The output logits ``[..., V]`` given the exit depths ``[...]``."""
        raise NotImplementedError

    @property
    def needs_log_probs(self) -> bool:
        """``add`` reads ``logp`` (the caller then computes it once for the decider and for this)."""
        return False


class ExitLogits(DepthCombiner):
    """The exit depth's logits: ``z^(d*)`` per token."""

    def __init__(self):
        self.z_exit = None

    def add(self, d, z, logp, active, stop, signal):
        self.z_exit = z if self.z_exit is None else torch.where(stop[..., None], z, self.z_exit)

    def logits(self, depths):
        return self.z_exit


@dataclass
class NoOptions:
    """The options of a method that has none of its own."""


#: the threshold rules a method may declare (``HaltingMethod.threshold_rule``)
THRESHOLD_RULES = {
    "continue_at_or_above": "continue iff the continue probability c >= the threshold",
    "halt_mass": "continue iff c > 1 - the threshold (a cumulative halting mass)",
}


class HaltingMethod(nn.Module):
    """Base class; see the module docstring for the call order and the declarations."""

    name: str = ""
    #: one line for model cards and ``retrofit convert --help``
    description: str = ""
    #: the attention across depths the method is trained with (``LoopConfig.attention=None`` picks it)
    default_attention: str = "same-depth"
    #: the method's own options: a dataclass whose fields ``LoopConfig.options`` holds (validated by it)
    Options: type = NoOptions
    #: where the decision threshold lives (a ``LoopConfig`` field, or a field of ``Options``); None: no
    #: threshold the frontier can sweep or calibration can set
    threshold_field: str | None = None
    #: what the threshold means, for reports
    threshold_meaning: str = ""
    #: how the threshold reads the continue probability (a key of ``THRESHOLD_RULES``)
    threshold_rule: str | None = None
    #: how often the decider runs per token, for FLOPs: "per_depth", "once", or None (no decider)
    decider_runs: str | None = None
    #: the vLLM plugin (``retrofit.vllm_plugin``) serves checkpoints of this method; otherwise it refuses them
    vllm_supported: bool = False
    #: what the method's paper claims that the main job's report checks for it: "depth_follows_level" (ANIRA:
    #: per-example d̄ rises with the difficulty level)
    paper_claims: tuple[str, ...] = ()
    #: the method reads the next-token distribution of every executed depth (TaH2's decider input);
    #: its output then comes from ``combiner`` instead of one readout of the exit state
    needs_depth_readout: bool = False
    #: the method's objective replaces the output's next-token loss (``main_loss``; module docstring)
    needs_depth_ce: bool = False
    #: the method's defaults of the model-side fields a ``LoopConfig`` leaves None (``config.GENERIC_DEFAULTS``
    #: lists them and the values of a method that declares none)
    loop_defaults: dict = {}

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__()
        self.hidden_size = hidden_size
        self.loop = loop

    # -- declarations read by the rest of retrofit (class methods: no model needed) ----------------------
    @classmethod
    def has_decider(cls) -> bool:
        """A decider decides each token's depth (every method but the fixed loop)."""
        return cls.decider_runs is not None

    @classmethod
    def reads_every_depth(cls, loop: LoopConfig) -> bool:
        """Inference reads out (coda, final norm, LM head) every executed depth, not only the exit depth."""
        return False

    @classmethod
    def resolve_shapes(cls, loop: LoopConfig, hidden_size: int, updater_params: int, base_params: int) -> dict:
        """The ``LoopConfig`` fields whose value depends on the model (e.g. a width chosen to fit the heads' budget),
        resolved for this one (the method's own options under ``"options"``): the model stores them in
        ``config.loop``, so a checkpoint states its shapes."""
        return {}

    @classmethod
    def card_rows(cls, loop: LoopConfig) -> list[tuple[str, str]]:
        """Rows ``(field, value)`` the model card adds to its loop table for this method."""
        return []

    @classmethod
    def get_threshold(cls, loop: LoopConfig) -> float | None:
        """The decision threshold ``loop`` runs with (``threshold_field``), or None."""
        if cls.threshold_field is None:
            return None
        if cls.threshold_field in loop.options:
            return float(loop.options[cls.threshold_field])
        return float(getattr(loop, cls.threshold_field))

    @classmethod
    def with_threshold(cls, loop_dict: dict, value: float) -> dict:
        """A stored loop dict (``config.loop``) with the decision threshold set to ``value``."""
        out = dict(loop_dict)
        if cls.threshold_field in {f.name for f in fields(cls.Options)}:
            out["options"] = {**(out.get("options") or {}), cls.threshold_field: float(value)}
        else:
            out[cls.threshold_field] = float(value)
        return out

    @classmethod
    def continue_probabilities(cls, out, max_depth: int) -> torch.Tensor:
        """The decider's probability to continue after depth ``d`` ``[B, T, k]`` (column ``d - 1``, ``k <= D - 1``)
        from a forward's outputs, in the sense of ``threshold_rule`` (calibration and the frontier)."""
        raise ValueError(f"method {cls.name!r} has no decider whose continue probability could be read")

    @property
    def mixture_output(self) -> bool:
        """Output = halting-weighted mixture of per-depth distributions (TaH2 only)."""
        return False

    @property
    def readout_grad(self) -> bool:
        """The per-depth next-token distributions the decider reads keep their gradient (TaH2's
        ``decider_topk_grad``); False: the loop computes them under ``no_grad``."""
        return False

    def new_context(self, training: bool, threshold: float | None = None) -> HaltContext:
        return HaltContext(training=training, max_depth=self.loop.max_depth, threshold=threshold)

    def plan(self, e: torch.Tensor, ctx: HaltContext) -> torch.Tensor | None:
        return None

    def step(self, d: int, e: torch.Tensor, h: torch.Tensor, probs: torch.Tensor | None, ctx: HaltContext):
        return None

    def combiner(self, ctx: HaltContext) -> DepthCombiner:
        """How the per-depth logits combine (read when ``needs_depth_readout``): the exit depth's."""
        return ExitLogits()

    def distribution(self, ctx: HaltContext, depths: torch.Tensor):
        """Returns ``(depth_probs [B, T, D] or None, straight_through [B, T, D] or None)``."""
        return None, None

    # -- training ------------------------------------------------------------------------------
    #: the loss reads ``outputs.depth_nll``: the forward computes it (and the lookahead iteration)
    needs_depth_losses: bool = False

    def train_forward_kwargs(self, cfg, step: int = 0) -> dict:
        """Extra forward keyword arguments for one training step (``cfg``: the trainer's config; ``step``:
        the optimizer steps done so far, for schedules such as TaH2's threshold warm-up)."""
        return {}

    def loss(
        self,
        outputs,
        labels: torch.Tensor,
        cfg,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> AuxLoss | None:
        """The method's weighted auxiliary loss for one batch, or ``None`` (plain next-token loss).

        Args:
            outputs: the ``LoopedCausalLMOutput`` of the forward (its fields, not its loss).
            labels: ``[B, T]`` unshifted labels (-100 = ignored), as given to the forward.
            cfg: the method's options, its loss weights and switches among them (the model passes
                ``LoopConfig.method_options``, an instance of the method's ``Options``).
            attention_mask: ``[B, T]`` 1 for real tokens; ``None`` = every token is real.
            num_items_in_batch: the labelled tokens of every rank and accumulation step (what the Trainer
                passes to the forward), or None; a method whose ``aux_loss_per_item`` is true divides by it.
        """
        return None

    def aux_loss_per_item(self, cfg) -> bool:
        """``loss(..., num_items_in_batch=N)`` divides by ``N`` (TaH2 with ``decider_loss_scope="global"``): a
        trainer then scales the auxiliary loss exactly as it scales the LM loss (no division by the
        accumulation steps). False: the auxiliary loss is a mean over this micro-batch."""
        return False

    def main_loss(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor | None:
        """The model's main loss, replacing the next-token loss of ``outputs.logits`` (``needs_depth_ce`` methods).

        Args:
            outputs: the forward's outputs; ``outputs.depth_ce_tokens`` ``[B, T, D]`` holds every executed
                depth's per-token next-token cross-entropy with gradient (0 where the label is -100).
            labels: ``[B, T]`` unshifted labels.
            num_items_in_batch: the labelled tokens of the whole step (all ranks and accumulation steps), when
                the trainer passes it; the normalizer then, as for transformers' own loss.

        Returns:
            A scalar, or None to keep the next-token loss of the output logits.
        """
        return None

    def decider_phase_loss(self, outputs, labels: torch.Tensor, cfg, num_items_in_batch=None) -> AuxLoss | None:
        """The loss of the decider-only phase (``forward(decider_phase=True)``: the trainer has frozen everything
        but the decider, after the backbone learned every depth). None: the method's usual loss, which then only
        moves the decider (ANIRA: its straight-through weights and KL reach the decider). TaH2 returns its
        decider BCE, Ouro its Stage II gate loss."""
        return None

    @property
    def decider_hidden(self) -> int:
        """The decider's width: ``LoopConfig.decider_hidden``, else the width rule's (``"release"``: the hidden
        size, which ``LoopedForCausalLM`` narrows to the heads' budget and stores; ``"quarter"``: ``H // 4``)."""
        if self.loop.decider_hidden:
            return self.loop.decider_hidden
        if self.loop.decider_width_rule == "release":
            return self.hidden_size
        return max(1, self.hidden_size // 4)
