"""``convert``: turn a loaded base model into a looped one, reusing its modules by reference."""

from __future__ import annotations

import warnings

from torch import nn

from .config import LoopConfig
from .depth_attention import HONOURED_IMPLEMENTATIONS
from .families import family_for
from .modeling import LOOPED_CLASSES, LoopedForCausalLM

_DROP_KEYS = {"model_type", "architectures", "auto_map", "transformers_version", "loop"}


def looped_config_for(base_config, loop: LoopConfig):
    """The looped config (``LoopedLlamaConfig`` / ``LoopedQwen3Config``) for ``base_config``."""
    fam = family_for(base_config)
    cfg_cls, _ = LOOPED_CLASSES[fam.name]
    d = {k: v for k, v in base_config.to_dict().items() if k not in _DROP_KEYS}
    loop.layer_ranges(base_config.num_hidden_layers)  # fail early with the clear message
    cfg = cfg_cls(**d, loop=loop.to_dict())
    cfg.architectures = [LOOPED_CLASSES[fam.name][1].__name__]
    return cfg


def convert(base_model: nn.Module, loop_config: LoopConfig | None = None, **loop_kwargs) -> LoopedForCausalLM:
    """Retrofit ``base_model`` into a looped model.

    The returned model holds the base model's embedding, decoder layers, final norm, rotary
    embedding and LM head *by reference* (no weight copies; training the looped model trains them)
    and adds an updater and the method's decider, initialized so that the looped model computes
    the base model's function when every token exits at depth 1. The base model's attention
    implementation is kept (sdpa, eager, flex_attention, flash_attention_2/3; see
    ``retrofit.model.depth_attention``); any other falls back to sdpa with a warning.

    Args:
        base_model: a ``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` (see ``retrofit.model.families``).
        loop_config: the loop spec; or pass its fields as keyword arguments.

    Returns:
        ``LoopedLlamaForCausalLM`` or ``LoopedQwen3ForCausalLM`` on the base model's device and dtype.

    Raises:
        UnsupportedArchitectureError: the model is not a supported family.
        LoopConfigError: the layer ranges or other settings are invalid.
    """
    if isinstance(base_model, LoopedForCausalLM):
        raise TypeError("this model is already looped; convert its base model instead")
    if loop_config is None:
        loop_config = LoopConfig(**loop_kwargs)
    elif loop_kwargs:
        raise TypeError("pass either a LoopConfig or its fields as keyword arguments, not both")
    fam = family_for(base_model.config)
    if not isinstance(base_model, fam.causal_lm_cls):
        raise TypeError(
            f"convert expects a {fam.causal_lm_cls.__name__} (a causal LM with `.model` and `.lm_head`), "
            f"got {type(base_model).__name__}"
        )
    cfg = looped_config_for(base_model.config, loop_config)
    # the looped model runs the base model's own attention implementation (retrofit.model.depth_attention): the
    # prelude and coda exactly as the base does, the core's depth attention with a kernel of that family
    impl = base_model.config._attn_implementation or "sdpa"
    if impl not in HONOURED_IMPLEMENTATIONS:
        warnings.warn(
            f"attention implementation {impl!r} is not one a looped model runs "
            f"({', '.join(HONOURED_IMPLEMENTATIONS)}); using 'sdpa'"
        )
        impl = "sdpa"
    base_model.config._attn_implementation = impl
    cfg._attn_implementation = impl
    _, cls = LOOPED_CLASSES[fam.name]
    model = cls(cfg, backbone=base_model.model, lm_head=base_model.lm_head)
    p = next(base_model.parameters())
    model.updater.to(device=p.device, dtype=p.dtype)
    model.halting.to(device=p.device, dtype=p.dtype)
    if base_model.generation_config is not None:
        model.generation_config = base_model.generation_config
    model.train(base_model.training)
    return model


def base_model_of(looped: LoopedForCausalLM) -> nn.Module:
    """The plain base causal LM that ``looped`` wraps, sharing its modules (no weight copies).

    Useful for side-by-side evaluation: ``base_model_of(copy.deepcopy(looped))`` before training
    is the untouched pretrained model.
    """
    import torch

    fam = family_for(looped.config)
    d = {k: v for k, v in looped.config.to_dict().items() if k not in _DROP_KEYS}
    d = {k: v for k, v in d.items() if not k.startswith("retrofit_")}
    cfg = fam.config_cls(**d)
    cfg._attn_implementation = looped.config._attn_implementation
    with torch.device("meta"):
        shell = fam.causal_lm_cls(cfg)
    shell.model = looped.model
    shell.lm_head = looped.lm_head
    shell.generation_config = looped.generation_config
    return shell.train(looped.training)
