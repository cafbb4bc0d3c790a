"""retrofit: post-train pretrained Hugging Face LLMs into looped transformers with token-level
adaptive depth (TaH2, ANIRA-E/O, fixed), plus training-free exits and TAPS.

    >>> import retrofit
    >>> looped = retrofit.convert(base_model, retrofit.LoopConfig(prelude=2, core=4, max_depth=3, method="tah2"))
    >>> out = looped(input_ids)          # out.logits, out.depths ([B, T], 1-based)
"""

from .model.versions import check_versions

check_versions()  # fail early on an untested transformers / TRL / PEFT (RETROFIT_SKIP_VERSION_CHECK=1 skips)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from .model.config import ATTENTION_MODES, LoopConfig, LoopConfigError
from .model.convert import convert, looped_config_for
from .model.families import FAMILIES, UnsupportedArchitectureError
from .model.heads import parameter_report
from .model.modeling import (
    LoopedForCausalLM,
    LoopedLlamaConfig,
    LoopedLlamaForCausalLM,
    LoopedQwen3Config,
    LoopedQwen3ForCausalLM,
)
from .model.outputs import LoopedCausalLMOutput

__version__ = "0.1.0"


def __getattr__(name):
    if name == "METHODS":  # the registered halting methods (retrofit.model.registry), read when asked
        from .model import registry

        return registry.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _cfg, _model in ((LoopedLlamaConfig, LoopedLlamaForCausalLM), (LoopedQwen3Config, LoopedQwen3ForCausalLM)):
    AutoConfig.register(_cfg.model_type, _cfg, exist_ok=True)
    AutoModelForCausalLM.register(_cfg, _model, exist_ok=True)

__all__ = [
    "ATTENTION_MODES",
    "FAMILIES",
    "METHODS",
    "LoopConfig",
    "LoopConfigError",
    "LoopedCausalLMOutput",
    "LoopedForCausalLM",
    "LoopedLlamaConfig",
    "LoopedLlamaForCausalLM",
    "LoopedQwen3Config",
    "LoopedQwen3ForCausalLM",
    "UnsupportedArchitectureError",
    "convert",
    "looped_config_for",
    "parameter_report",
]
