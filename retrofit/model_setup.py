"""Model helpers the recipes share: load and retrofit a model, wrap it for LoRA, detect ZeRO-3.

``retrofit.training`` re-exports these names.
"""

from __future__ import annotations

import logging
import os

from .config import LoopConfig
from .modeling import LoopedForCausalLM

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


def build_looped_model(spec: str, loop: LoopConfig, dtype=None, attn_implementation: str | None = None):
    """Load ``spec`` (``retrofit.loading.load_model``) and retrofit it with ``loop``.

    A folder that already holds a looped checkpoint is loaded as is (its own ``LoopConfig`` wins;
    a different ``loop`` only logs a warning, except ``fixed_graph``, which is set).

    Args:
        attn_implementation: load with this attention implementation (``"sdpa"``, ``"flex_attention"``,
            ``"flash_attention_2"``, ``"eager"``; None = transformers' default); the looped model keeps it
            (docs/long-context.md).

    Returns:
        ``(model, tokenizer)``.
    """
    from .convert import convert
    from .loading import load_model

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    base, tok = load_model(spec, dtype=dtype, **extra)
    if isinstance(base, LoopedForCausalLM):
        have = base.loop
        if have.to_dict() != {**loop.to_dict(), "fixed_graph": have.fixed_graph}:
            logger.warning("%s is already looped with %s; ignoring the requested %s", spec, have, loop)
        if loop.fixed_graph and not have.fixed_graph:
            base.config.loop = {**base.config.loop, "fixed_graph": True}
        return base, tok
    return convert(base, loop), tok
