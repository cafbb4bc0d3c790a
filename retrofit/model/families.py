"""Supported base families: one entry each, one explicit table (STYLE.md habit 6).

A family names the base model's classes and whatever differs between architectures. Adding a
family (say Mistral) means one entry here, a looped config/model pair in ``modeling.py`` and the
shared contract tests: the looped forward only uses what every entry provides — ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb`` and ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, Qwen3Config, Qwen3ForCausalLM, Qwen3Model


@dataclass(frozen=True)
class Family:
    """A supported base architecture.

    Attributes:
        name: short name used in messages and model cards.
        base_model_type: the base config's ``model_type``.
        looped_model_type: ``model_type`` of the looped config subclass.
        config_cls / backbone_cls / causal_lm_cls: the base model's own transformers classes.
    """

    name: str
    base_model_type: str
    looped_model_type: str
    config_cls: type
    backbone_cls: type
    causal_lm_cls: type


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama", "looped_llama", LlamaConfig, LlamaModel, LlamaForCausalLM),
    "qwen3": Family("qwen3", "qwen3", "looped_qwen3", Qwen3Config, Qwen3Model, Qwen3ForCausalLM),
}


class UnsupportedArchitectureError(ValueError):
    """The base model is not a supported family."""


def family_for(config) -> Family:
    """Look a config up in ``FAMILIES`` by its ``model_type`` (base or looped)."""
    model_type = getattr(config, "model_type", None)
    for fam in FAMILIES.values():
        if model_type in (fam.base_model_type, fam.looped_model_type):
            return fam
    supported = ", ".join(f"{f.base_model_type} ({f.causal_lm_cls.__name__})" for f in FAMILIES.values())
    raise UnsupportedArchitectureError(
        f"unsupported architecture {model_type!r} ({type(config).__name__}); supported are: {supported}"
    )
