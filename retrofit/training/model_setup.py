"""Model helpers the recipes share: the model arguments (``LoopArgs``), load and retrofit a model, freeze the
prelude, check identity at init, wrap it for LoRA, detect ZeRO-3.

``retrofit.training`` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from dataclasses import dataclass, field

import torch

from ..model.config import LoopConfig
from ..model.errors import RetrofitUserError
from ..model.modeling import LoopedForCausalLM

logger = logging.getLogger(__name__)


#: LoRA targets per looped model type: the backbone's attention and MLP projections. PEFT has no
#: defaults for unknown model types (ECOSYSTEM.md), so they are explicit.
LORA_TARGETS: dict[str, list[str]] = {
    "looped_llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "looped_qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
#: modules that train fully next to the adapters (and are saved with them)
LORA_MODULES_TO_SAVE = ["updater", "halting"]


def apply_lora(model: LoopedForCausalLM, r: int = 16, alpha: int = 32, dropout: float = 0.0, targets=None, layers=None):
    """Wrap ``model`` for LoRA: adapters on the backbone projections, updater and decider trained fully.

    Args:
        model: a looped model.
        r, alpha, dropout: LoRA rank, scaling numerator and dropout.
        targets: module names to adapt; default ``LORA_TARGETS[model_type]``.
        layers: decoder-layer indices that get adapters; default all. With a frozen prelude, pass the
            core and coda layers (``lora_layers_after_prelude``): adapters on frozen prelude layers would
            train them anyway and take the backward through the whole stack.

    Returns:
        A ``peft.PeftModel``.

    Raises:
        ValueError: no default targets for this model type and none given.
    """
    from peft import LoraConfig, get_peft_model

    mt = model.config.model_type
    if targets is None:
        if mt not in LORA_TARGETS:
            raise ValueError(
                f"no default LoRA targets for model type {mt!r} (known: {sorted(LORA_TARGETS)}); pass targets="
            )
        targets = LORA_TARGETS[mt]
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        layers_to_transform=None if layers is None else sorted(int(i) for i in layers),
        layers_pattern=None if layers is None else "layers",
        modules_to_save=list(LORA_MODULES_TO_SAVE),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def lora_layers_after_prelude(model: LoopedForCausalLM) -> list[int]:
    """Indices of the decoder layers after the prelude (core and coda): where LoRA goes when the prelude is frozen."""
    return list(range(len(model.prelude_layers), model.config.num_hidden_layers))


def zero3_enabled(args=None) -> bool:
    """DeepSpeed ZeRO stage 3 is configured (by ``TrainingArguments`` or ``accelerate launch``)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return True
    return (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") == "3"
    )


def deepspeed_enabled(args=None) -> bool:
    """DeepSpeed (any ZeRO stage) is configured, by ``TrainingArguments.deepspeed`` or ``accelerate launch``.

    The recipes then unroll every depth (``LoopConfig.fixed_graph``): ZeRO reduces gradients in buckets as
    parameters become ready, so every rank must use the same parameters in every step — with adaptive depth
    one rank whose tokens all exit at depth 1 would leave the updater unused and desynchronize the
    reductions (ZeRO-2), or thrash the parameter prefetch trace (ZeRO-3).
    """
    if zero3_enabled(args):
        return True
    if args is not None and getattr(args, "deepspeed", None):
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def fsdp_enabled(args=None) -> bool:
    """FSDP is configured, by ``TrainingArguments.fsdp`` or ``accelerate launch`` (``launch/fsdp2.yaml``, on GPUs
    or on CPU processes: ``retrofit.training.fsdp2_cpu``).

    FSDP all-gathers a layer's parameters each time it runs: a rank that runs the core fewer times than the others
    (its tokens all exited) leaves their collectives waiting forever, so the recipes unroll every depth here too.
    """
    if args is not None and getattr(args, "fsdp", None):
        return True
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def sharded_training(args=None) -> bool:
    """DeepSpeed or FSDP: every rank must run the same modules the same number of times in every step, so the
    recipes set ``LoopConfig.fixed_graph`` (``deepspeed_enabled``, ``fsdp_enabled``)."""
    return deepspeed_enabled(args) or fsdp_enabled(args)


def build_looped_model(spec: str, loop: LoopConfig, dtype=None, attn_implementation: str | None = None):
    """Load ``spec`` (``retrofit.hub.loading.load_model``) and retrofit it with ``loop``.

    A folder that already holds a looped checkpoint is loaded as is (its own ``LoopConfig`` wins;
    a different ``loop`` only logs a warning, except ``fixed_graph``, which is set).

    Args:
        attn_implementation: load with this attention implementation (``"sdpa"``, ``"flex_attention"``,
            ``"flash_attention_2"``, ``"eager"``; None = transformers' default); the looped model keeps it
            (docs/long-context.md).

    Returns:
        ``(model, tokenizer)``.
    """
    from ..hub.loading import load_model
    from ..model.convert import convert

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    base, tok = load_model(spec, dtype=dtype, **extra)
    if isinstance(base, LoopedForCausalLM):
        have = base.loop

        # a field or option the request leaves None (decider_top_k, decider_hidden) was resolved into the checkpoint
        def settings(lc) -> dict:
            d = lc.to_dict()
            return {
                **{k: v for k, v in d.items() if k != "options"},
                **{("options", k): v for k, v in d["options"].items()},
            }

        want = {k: v for k, v in settings(loop).items() if v is not None}
        if {k: v for k, v in settings(have).items() if k in want} != {**want, "fixed_graph": have.fixed_graph}:
            logger.warning("%s is already looped with %s; ignoring the requested %s", spec, have, loop)
        if loop.fixed_graph and not have.fixed_graph:
            base.config.loop = {**base.config.loop, "fixed_graph": True}
        return base, tok
    return convert(base, loop), tok


@dataclass
class ModelArgs:
    """The base model, its dtype, freezing and LoRA: the recipe's model arguments beside the loop's."""

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


def _loop_config(self, fixed_graph: bool = False, **override) -> LoopConfig:
    """The ``LoopConfig`` these arguments describe: every ``LoopConfig`` field that ``LoopArgs`` has
    (``LoopConfig.from_fields``); ``fixed_graph=True`` forces a static graph (the recipes under ZeRO-3 and FSDP),
    else the flag's value; ``override`` replaces fields, e.g. for a control."""
    return LoopConfig.from_fields(self, fixed_graph=bool(fixed_graph or self.fixed_graph), **override)


def _loop_fields() -> list[tuple]:
    """Every ``LoopConfig`` field (its loss weights included) as a flag: its own type, default and help, declared
    once there (``options`` and ``extra`` aside: a method's options get flags of their own, ``loop_args_class``)."""
    hints = typing.get_type_hints(LoopConfig)
    out = []
    for f in dataclasses.fields(LoopConfig):
        if f.name in ("options", "extra"):
            continue
        out.append((f.name, hints[f.name], field(default=f.default, metadata=dict(f.metadata))))
    return out


#: The model and how it loops (the recipe's ``ModelConfig``): ``ModelArgs`` plus every ``LoopConfig`` field, made
#: from ``LoopConfig`` itself (its defaults and help), so no setting has a second declaration with a default of its own.
LoopArgs = dataclasses.make_dataclass(
    "LoopArgs", _loop_fields(), bases=(ModelArgs,), namespace={"loop_config": _loop_config}
)
LoopArgs.__module__ = __name__
LoopArgs.__doc__ = (
    "The model and how it loops: ``ModelArgs`` (model, dtype, freezing, LoRA) plus every ``LoopConfig`` field, "
    "generated from ``LoopConfig`` (same names, types, defaults and help)."
)


_LOOP_ARGS_WITH_OPTIONS: dict[tuple, type] = {}


def loop_args_class() -> type:
    """``LoopArgs`` plus one flag per registered method option (``retrofit.model.registry.option_fields``): a
    method's options are declared once, in its ``Options`` dataclass, and every flag defaults to None (the
    method's own default). ``LoopArgs.loop_config`` routes the set ones into ``LoopConfig.options``."""
    from dataclasses import make_dataclass

    from ..model import registry

    opts = registry.option_fields()
    key = tuple(sorted(opts))
    if key not in _LOOP_ARGS_WITH_OPTIONS:
        extra = []
        for name, (f, owners) in opts.items():
            hint = typing.get_type_hints(registry.method_class(owners[0]).Options)[name]
            help_ = f"{' / '.join(owners)}: " + (f.metadata.get("help") or "a method option")
            extra.append((name, hint | None, field(default=None, metadata={"help": help_})))
        _LOOP_ARGS_WITH_OPTIONS[key] = make_dataclass("LoopArgs", extra, bases=(LoopArgs,))
    return _LOOP_ARGS_WITH_OPTIONS[key]


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


#: the probe prompt of ``identity_check`` when it is given a tokenizer
IDENTITY_PROBE = "+ 3 * 4 5 = 17"


class IdentityCheckError(RetrofitUserError, RuntimeError):
    """The converted model does not reproduce the base model at depth 1."""


@torch.no_grad()
def identity_check(model, base, tokenizer=None, *, atol: float | None = None) -> float:
    """Max |looped logits with every token exiting at depth 1 - base logits| on a probe (0 at init): the one
    identity check. Callers choose what to do with it: the recipes log it, ``retrofit convert`` passes ``atol``.

    Args:
        model: the looped model; base: the model it was converted from (both are run in eval mode and left
            in the mode they were in).
        tokenizer: the probe is ``IDENTITY_PROBE`` through it; without one, 2 x 8 seeded random token ids.
        atol: raise ``IdentityCheckError`` when the error exceeds it (for a low-precision base, when it
            exceeds 2% of the logits' scale instead); None: only return the error.
    """
    dev = next(base.parameters()).device
    if tokenizer is not None:
        ids = tokenizer(IDENTITY_PROBE, return_tensors="pt").input_ids.to(dev)
    else:
        ids = torch.randint(0, base.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    was = model.training, base.training
    model.eval()
    base.eval()
    try:
        ref = base(ids).logits.float()
        got = model(ids, depth=1).logits.float()
    finally:
        model.train(was[0])
        base.train(was[1])
    err = (got - ref).abs().max().item()
    if atol is not None:
        dtype = next(base.parameters()).dtype
        tol = atol if dtype == torch.float32 else 2e-2 * max(1.0, ref.abs().max().item())
        if not err <= tol:
            raise IdentityCheckError(f"depth-1 logits differ from the base model's by {err:.3g} (> {tol:.3g})")
    return err


def prepare_model(model, loop_args: LoopArgs):
    """Freeze and/or wrap with LoRA, as the arguments say (the same for the looped arm and controls)."""
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
