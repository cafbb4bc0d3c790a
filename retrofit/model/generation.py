"""``generate`` for looped models: adaptive depth with a depth-aware KV cache.

Each decoding step is one call of ``LoopedForCausalLM.forward`` with a ``DepthKVCache``
(``retrofit.model.backends.CachedStep`` around the one depth loop, ``retrofit.model.loop``).

``looped_generate`` wraps ``GenerationMixin.generate`` (``LoopedForCausalLM.generate`` calls it):
everything ``generate`` does works — greedy, sampling, ``num_return_sequences``, beam search,
``TextStreamer``, left-padded batches — plus call-time exit control:

- ``exit_policy="decider"`` (default): the model's halting method;
- ``depth=k`` (or ``exit_policy="fixed", depth=k``): every token runs ``k`` iterations;
- ``exit_policy="kl", exit_threshold=T`` / ``exit_policy="state", exit_threshold=T``: training-free
  exits (``retrofit.model.halting.training_free``);
- ``step_schedule="taps"``: relaxed core steps (``retrofit.model.schedulers.taps``), with any exit.

With ``return_dict_in_generate=True`` the output is a ``LoopedGenerateOutput``: the usual fields plus
``depths`` ``[B * num_return_sequences, new_tokens]`` — entry ``i`` is the exit depth of the step
that *produced* generated token ``i`` (the depth at the position before it), 0 after the row's
end-of-sequence token — and ``cache``, the ``DepthKVCache`` (``cache.token_depths`` ``[B, S]`` has
the depth of every position fed, prompt included). Beam search works but returns transformers' beam
output unchanged (beams are reordered every step, so per-step depths do not map to returned rows).
``retrofit.model.flops.generate_cost(model, out)`` turns an output into Cost_exec, d̄ and FLOPs ratios.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import DepthKVCache
from .halting.training_free import resolve_exit_policy
from .outputs import LoopedGenerateOutput
from .schedulers import build_step_schedule

_CALL_KWARGS = ("exit_policy", "exit_threshold", "step_schedule", "depth")


def looped_generate(model, parent_generate, inputs=None, generation_config=None, **kwargs):
    """``generate`` of a looped model (see the module docstring); ``parent_generate`` is
    ``GenerationMixin.generate`` bound to ``model``."""
    depth = kwargs.get("depth")
    if depth is not None and not (isinstance(depth, int) and not isinstance(depth, bool)):
        raise TypeError(f"generate(depth=...) takes an int in 1..{model.loop.max_depth}, got {type(depth).__name__}")
    resolve_exit_policy(kwargs.get("exit_policy"), kwargs.get("exit_threshold"), depth)  # fail before prefill
    build_step_schedule(kwargs.get("step_schedule"))
    gc = generation_config if generation_config is not None else model.generation_config
    if kwargs.get("use_cache", getattr(gc, "use_cache", True)) is False or model.training:
        # the cached path is inference-only; TRL's GRPO generates in train mode and may switch the
        # cache off inside generation_config: decode with full-sequence forwards instead (the same
        # tokens for deterministic depth rules: TaH2's threshold, fixed, forced depths)
        kwargs["use_cache"] = False
        return parent_generate(inputs, generation_config=generation_config, **kwargs)
    cache = kwargs.pop("cache", None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if cache is None:
        cache = DepthKVCache(model.config)
    kwargs["cache"] = cache
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    out = parent_generate(inputs, generation_config=generation_config, **kwargs)
    want_dict = kwargs.get("return_dict_in_generate", getattr(gc, "return_dict_in_generate", False))
    if not want_dict or not isinstance(out, GenerateDecoderOnlyOutput) or prompt is None:
        return out
    P = prompt.shape[1]
    seqs = out.sequences
    N = seqs.shape[1] - P
    depths = None
    num_beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
    # cache positions are sequence positions; the last generated token was never fed back
    if num_beams == 1 and N > 0 and cache.batch == seqs.shape[0] and cache.length == P + N - 1:
        depths = cache.token_depths[:, P - 1 : P - 1 + N].clone()
        eos = kwargs.get("eos_token_id", getattr(gc, "eos_token_id", None))
        if eos is not None:
            eos_ids = torch.as_tensor(eos, device=seqs.device).reshape(-1)
            is_eos = torch.isin(seqs[:, P:], eos_ids)
            after = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
            depths = depths.masked_fill(after, 0)
    fields = {k: v for k, v in out.items()}
    return LoopedGenerateOutput(**fields, depths=depths, prompt_length=P)
