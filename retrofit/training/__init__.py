"""Training: the SFT trainer and its config (``trainer``), checkpoints (``checkpointing``), SFT data
(``sft_data``), model setup (``model_setup``: ``LoopArgs``, LoRA, freezing, the identity check).

Imports ``retrofit.model`` and ``retrofit.hub``; never ``recipe``, ``evaluation`` or ``cli``. The names
``retrofit.training`` exported when it was one module stay importable from here.
"""

from __future__ import annotations

from ..model.lazy import lazy_exports

# name -> the module that defines it (imported on first use, so that importing one submodule stays light)
_EXPORTS = {
    "NonFiniteLossError": ".trainer",
    "RetrofitSFTConfig": ".trainer",
    "RetrofitSFTTrainer": ".trainer",
    "LORA_MODULES_TO_SAVE": ".model_setup",
    "LORA_TARGETS": ".model_setup",
    "LoopArgs": ".model_setup",
    "apply_lora": ".model_setup",
    "build_looped_model": ".model_setup",
    "deepspeed_enabled": ".model_setup",
    "freeze_prelude": ".model_setup",
    "fsdp_enabled": ".model_setup",
    "identity_check": ".model_setup",
    "lora_layers_after_prelude": ".model_setup",
    "prepare_model": ".model_setup",
    "sharded_training": ".model_setup",
    "zero3_enabled": ".model_setup",
    "BadDataError": ".sft_data",
    "drop_bad_rows": ".sft_data",
    "format_sft_dataset": ".sft_data",
    "no_eval_without_eval_set": ".sft_data",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
