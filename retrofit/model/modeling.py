"""The looped model: prelude → core × depth → coda around a pretrained backbone (docs/looped-model.md).

This module holds the configs and the family classes (what an export's ``auto_map`` names); the class
they share, ``LoopedForCausalLM``, is defined in ``retrofit.model.causal_lm`` and importable from here.

``LoopedForCausalLM`` wraps the base model's own modules by reference — ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head`` keep their names, so base
checkpoints load into it and its checkpoints look like the base's plus two heads (``updater.*``,
``halting.*``). No modeling file of transformers is copied (STYLE.md habit 1).

``forward`` is thin setup around the one depth loop (``retrofit.model.loop``): it picks the KV backend
(``retrofit.model.backends``: the full-sequence stacked store, or a ``DepthKVCache`` step when decoding),
the exit rule (the method's decider, a forced ``depth=``, or a training-free ``exit_policy``) and
the step schedule, then adds the loss. Per token ``i`` the exit depth ``d*_i`` is either forced or
decided; a token past its exit is *passed through*: its state is kept, its later keys are invisible
to everyone else, and the coda sees its exit-depth state.

With ``labels`` the loss is the next-token loss plus the halting method's weighted auxiliary loss
(``aux_loss``; ``retrofit.model.halting``), the convention of mixture-of-experts models and their router
loss: any trainer (``transformers.Trainer``, TRL's SFT/DPO/GRPO) optimizes the method's objective.
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import GenerationMixin, LlamaConfig, Qwen3Config

from .causal_lm import (  # noqa: F401  (LoopedForCausalLM is importable from here too; the version check runs there)
    LoopedForCausalLM,
    _from_installed_package,
    _trl_integration,
)
from .config import LoopConfig
from .families import FAMILIES
from .outputs import LoopedCausalLMOutput  # noqa: F401  (importable from here, as before the split)


# ------------------------------------------------------------------------------------------------
# Configs: flat subclasses of the base configs, plus the loop spec as one dict field.
# ------------------------------------------------------------------------------------------------
class _LoopedConfigMixin:
    """What a looped config adds to its base config:

    - ``loop``: the ``LoopConfig`` as a dict (``loop_config`` parses it);
    - ``output_router_logits`` / ``router_aux_loss_coef``: with labels, the forward computes the halting
      method's auxiliary loss and adds ``router_aux_loss_coef ×`` it to ``loss``; the names and meaning
      of mixture-of-experts configs, which TRL's trainers read (they then add ``aux_loss`` themselves).
    """

    # TRL's create_model_from_path reads `config.auto_map` for architectures outside transformers
    # and transformers tests `name in config.auto_map`: {} until a config.json sets one (exports do).
    @property
    def auto_map(self) -> dict:
        return self.__dict__.get("auto_map", {})

    @auto_map.setter
    def auto_map(self, value):
        self.__dict__["auto_map"] = value

    @property
    def loop_config(self) -> LoopConfig:
        """The ``LoopConfig`` stored in ``self.loop`` (validated on every read)."""
        return LoopConfig.from_dict(self.loop or {})

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        # loading an export with trust_remote_code=True where retrofit is installed returns retrofit's
        # own classes (see retrofit.hub.export) and transformers then registers them for remote code,
        # which would make every later save_pretrained copy package files: retrofit's classes are
        # registered with the Auto classes on import instead
        if _from_installed_package(cls):
            return
        return super().register_for_auto_class(auto_class)


@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class LoopedLlamaConfig(_LoopedConfigMixin, LlamaConfig):
    """``LlamaConfig`` plus the looped fields (see ``_LoopedConfigMixin``)."""

    model_type = "looped_llama"
    loop: dict | None = None
    output_router_logits: bool = True
    router_aux_loss_coef: float = 1.0


@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class LoopedQwen3Config(_LoopedConfigMixin, Qwen3Config):
    """``Qwen3Config`` plus the looped fields (see ``_LoopedConfigMixin``)."""

    model_type = "looped_qwen3"
    loop: dict | None = None
    output_router_logits: bool = True
    router_aux_loss_coef: float = 1.0


class LoopedLlamaForCausalLM(LoopedForCausalLM, GenerationMixin):
    config_class = LoopedLlamaConfig
    family = FAMILIES["llama"]
    _no_split_modules = ["LlamaDecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


class LoopedQwen3ForCausalLM(LoopedForCausalLM, GenerationMixin):
    config_class = LoopedQwen3Config
    family = FAMILIES["qwen3"]
    _no_split_modules = ["Qwen3DecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


LOOPED_CLASSES: dict[str, tuple[type, type]] = {
    "llama": (LoopedLlamaConfig, LoopedLlamaForCausalLM),
    "qwen3": (LoopedQwen3Config, LoopedQwen3ForCausalLM),
}
