"""Adaptive-depth inference: incremental decoding with a depth-aware cache, and ``generate``.

``cached_forward`` is one decoding step of ``LoopedForCausalLM`` (``forward`` dispatches to it when it
gets a cache or ``use_cache=True``): the step's new tokens — the whole prompt at prefill, one token
per row afterwards — run the prelude once, then the core depth by depth. At depth ``d`` only the
tokens still running are gathered (packed per row), run through the shared core, and scattered
back; a token that exited is not computed at deeper depths and writes no K/V there
(``retrofit.cache``). The result equals the full-sequence forward on the whole sequence with the
same per-token depths (tests/test_generation.py), and a row's result does not depend on the other
rows of the batch.

``looped_generate`` wraps ``GenerationMixin.generate`` (``LoopedForCausalLM.generate`` calls it):
everything ``generate`` does works — greedy, sampling, ``num_return_sequences``, beam search,
``TextStreamer``, left-padded batches — plus call-time exit control:

- ``exit_policy="decider"`` (default): the model's halting method;
- ``depth=k`` (or ``exit_policy="fixed", depth=k``): every token runs ``k`` iterations;
- ``exit_policy="kl", exit_threshold=T`` / ``exit_policy="state", exit_threshold=T``: training-free
  exits (``retrofit.halting.training_free``);
- ``step_schedule="taps"``: relaxed core steps (``retrofit.schedulers.taps``), with any exit.

With ``return_dict_in_generate=True`` the output is a ``LoopedGenerateOutput``: the usual fields plus
``depths`` ``[B * num_return_sequences, new_tokens]`` — entry ``i`` is the exit depth of the step
that *produced* generated token ``i`` (the depth at the position before it), 0 after the row's
end-of-sequence token — and ``cache``, the ``DepthKVCache`` (``cache.token_depths`` ``[B, S]`` has
the depth of every position fed, prompt included). Beam search works but returns transformers' beam
output unchanged (beams are reordered every step, so per-step depths do not map to returned rows).
``retrofit.flops.generate_cost(model, out)`` turns an output into Cost_exec, d̄ and FLOPs ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import DepthKVCache, _Pack
from .halting.training_free import resolve_exit_policy
from .schedulers import UnitStep, build_step_schedule


def _layer(layer, x, mask, pe, pos, store):
    return layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=store, use_cache=True)


def _readout_head(model, h):
    return model.lm_head(model.model.norm(h))


def cached_forward(
    model,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    labels=None,
    depth=None,
    logits_to_keep=0,
    output_depth_logits=False,
    exit_policy=None,
    exit_threshold=None,
    step_schedule=None,
):
    """One incremental step of a looped model with a ``DepthKVCache``.

    Args:
        model: a ``LoopedForCausalLM`` in eval mode.
        input_ids: ``[B, Tn]`` the new tokens (or ``inputs_embeds`` ``[B, Tn, H]``).
        attention_mask: ``[B, S + Tn]`` (past and new) or ``[B, Tn]`` padding mask; None = no padding.
        position_ids: ``[B, Tn]``; default: each row's real tokens count on from its last position.
        cache: the ``DepthKVCache`` (None: a new one).
        depth: forced exit depths of the new tokens (int or ``[B, Tn]``).
        logits_to_keep: as in ``forward``.
        output_depth_logits: also return ``depth_logits`` ``[D, B, Tn, V]`` (NaN where not executed).
        exit_policy, exit_threshold, step_schedule: see ``LoopedForCausalLM.forward``.

    Returns:
        ``LoopedCausalLMOutput`` with ``logits``, ``depths`` ``[B, Tn]`` (0 for padding), ``active``
        ``[D', B, Tn]``, ``depth_probs``/``halt_signals`` when the method has them, and
        ``cache``.
    """
    from .modeling import LoopedCausalLMOutput

    if model.training:
        raise RuntimeError("incremental decoding with a cache is inference-only; call model.eval() first")
    if labels is not None:
        raise ValueError("labels are not supported with a cache; run the full-sequence forward (no cache) for a loss")
    if cache is None:
        cache = DepthKVCache(model.config)
    if not isinstance(cache, DepthKVCache):
        raise TypeError(
            f"a looped model needs a retrofit.cache.DepthKVCache, got {type(cache).__name__}; "
            "pass cache=DepthKVCache(model.config) or let generate() create it"
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    x = model.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    B, Tn, H = x.shape
    dev, dtype = x.device, x.dtype
    loop = model.loop
    D = loop.max_depth
    halting = model.halting

    depth, policy = resolve_exit_policy(exit_policy, exit_threshold, depth)
    sched = build_step_schedule(step_schedule)
    forced = model._forced_depths(depth, B, Tn, dev)

    S0 = cache.get_seq_length()
    if attention_mask is None:
        new_valid = torch.ones(B, Tn, dtype=torch.bool, device=dev)
    elif attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
    elif attention_mask.shape[1] == S0 + Tn:
        new_valid = attention_mask[:, S0:].bool()
    elif attention_mask.shape[1] == Tn:
        new_valid = attention_mask.bool()
    else:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[1]} columns; expected past + new = {S0} + {Tn} or new = {Tn}"
        )
    if position_ids is None:
        position_ids = cache.next_position_ids(new_valid) if cache.batch is not None else (
            (new_valid.long().cumsum(1) - 1).clamp_min(0)
        )
    else:
        position_ids = position_ids.expand(B, Tn)

    readout = halting.needs_depth_readout or output_depth_logits or (policy is not None and policy.needs_logits)
    has_coda = len(model._ranges[2]) > 0
    S0 = cache.begin_step(new_valid, position_ids, readout)
    dense_mask = cache.dense_mask(S0, Tn, dtype)
    pe = model.model.rotary_emb(x, position_ids)

    for layer in model.prelude_layers:
        x = _layer(layer, x, dense_mask, pe, position_ids, cache.prelude)
    e = x

    ctx = halting.new_context(False)
    planned = halting.plan(e, ctx)
    exit_at = forced if forced is not None else (planned if policy is None else None)
    sstate = sched.init(B * Tn)
    pstate = policy.init(B * Tn) if policy is not None else None
    unit = isinstance(sched, UnitStep)

    act = new_valid.clone()  # padding never enters the core
    active = [act]
    depths = torch.zeros(B, Tn, dtype=torch.long, device=dev)
    h = e.clone()  # passthrough state [B, Tn, H]
    h_flat = h.view(B * Tn, H)
    cos, sin = pe
    z_full = None  # [B, Tn, V] latest readout per token
    depth_logits = [] if output_depth_logits else None
    mixture = halting.mixture_output
    log_mix = lse_exit = z_exit = None
    survive = torch.ones(B, Tn, device=dev)
    d_last = 0

    for d in range(1, D + 1):
        pack = _Pack(act)
        if pack.N == 0:
            break
        d_last = d
        if d == 1:
            x_in = pack.gather(e)
        else:
            x_in = model.updater(pack.gather(e), pack.gather(h))
        pe_p = (pack.gather(cos), pack.gather(sin))
        pos_p = pack.gather(position_ids)
        mask = cache.core.begin_depth(d, pack, S0, dtype)
        for layer in model.core_layers:
            x_in = _layer(layer, x_in, mask, pe_p, pos_p, cache.core)
        raw = pack.take(x_in)  # [N, H]
        if d == 1 or unit:
            h_new = raw
        else:
            h_new = sched.step(d, h_flat[pack.flat], raw, sstate, pack.flat)
        h_flat[pack.flat] = h_new

        z_act = None
        if readout:
            if has_coda:
                # the reference readout runs the coda over every token's (passthrough) state at depth d
                y = h
                for layer in model.coda_layers:
                    y = _layer(layer, y, dense_mask, pe, position_ids, cache.coda_readout[d])
                z_act = model.lm_head(model.model.norm(y.reshape(B * Tn, H)[pack.flat]))
            else:
                z_act = _readout_head(model, h_new)
            if z_full is None:
                z_full = z_act.new_zeros(B * Tn, z_act.shape[-1])
            z_full[pack.flat] = z_act
            if depth_logits is not None:
                zl = torch.full_like(z_full, float("nan"))
                zl[pack.flat] = z_act
                depth_logits.append(zl.view(B, Tn, -1))

        # decide who continues to depth d + 1
        if d < D:
            z3 = z_full.view(B, Tn, -1) if z_full is not None else None
            probs = z3.float().softmax(-1) if (z3 is not None and halting.needs_depth_readout) else None
            cont = halting.step(d, e, h, probs, ctx)
            if exit_at is not None:
                cont = exit_at > d
            elif policy is not None:
                lp = z_act.float().log_softmax(-1) if policy.needs_logits else None
                stop = policy.check(d, h_new, lp, pstate, pack.flat)
                cont = torch.ones(B * Tn, dtype=torch.bool, device=dev)
                cont[pack.flat] = ~stop
                cont = cont.view(B, Tn)
            elif cont is None:
                cont = torch.ones_like(act)
            nxt = act & cont
        else:
            nxt = torch.zeros_like(act)
        stop_here = act & ~nxt
        depths[stop_here] = d
        cache.core.mark_last(stop_here.view(-1)[pack.flat])

        if readout and halting.needs_depth_readout:
            z = z_full.view(B, Tn, -1)
            if mixture:
                c = ctx.signals[d - 1] if d <= len(ctx.signals) else None
                pi = survive if c is None else torch.where(stop_here, survive, survive * (1 - c))
                log_pi = torch.where(act, pi.clamp_min(1e-30).log(), torch.full_like(pi, float("-inf")))
                term = log_pi[..., None] + z.float().log_softmax(-1)
                log_mix = term if log_mix is None else torch.logaddexp(log_mix, term)
                lse = z.float().logsumexp(-1)
                lse_exit = lse if lse_exit is None else torch.where(stop_here, lse, lse_exit)
                if c is not None:
                    survive = survive * c
            z_exit = z.clone() if z_exit is None else torch.where(stop_here[..., None], z, z_exit)

        if d < D:
            active.append(nxt)
        act = nxt
        if not bool(act.any()):
            break

    if readout and has_coda:
        # later tokens may run deeper: their depth-j readout sees this step's tokens at depth j
        for j in range(d_last + 1, D + 1):
            y = h
            for layer in model.coda_layers:
                y = _layer(layer, y, dense_mask, pe, position_ids, cache.coda_readout[j])

    active_t = torch.stack(active)
    depth_probs, _ = halting.distribution(ctx, depths.clamp_min(1))

    if halting.needs_depth_readout:
        if z_exit is None:  # no real token in the step
            z_exit = torch.zeros(B, Tn, model.config.vocab_size, dtype=dtype, device=dev)
        logits = z_exit
        if mixture and log_mix is not None:
            mixed = (log_mix + lse_exit[..., None]).to(z_exit.dtype)
            logits = torch.where((depths <= 1)[..., None], z_exit, mixed)
    else:
        y = h
        for layer in model.coda_layers:
            y = _layer(layer, y, dense_mask, pe, position_ids, cache.coda)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            y = y[:, -logits_to_keep:]
            logits_to_keep = 0
        logits = _readout_head(model, y)

    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        logits = logits[:, -logits_to_keep:]
    elif isinstance(logits_to_keep, torch.Tensor):
        logits = logits[:, logits_to_keep]

    cache.end_step(depths)
    signals = torch.stack(ctx.signals, -1) if ctx.signals else None
    return LoopedCausalLMOutput(
        logits=logits,
        depths=depths,
        depth_probs=depth_probs,
        halt_signals=signals,
        depth_logits_q=ctx.extra.get("q_logits"),
        depth_logits=torch.stack(depth_logits) if depth_logits else None,
        active=active_t,
        cache=cache,
    )


# ------------------------------------------------------------------------------------------------
@dataclass
class LoopedGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)`` of a looped model.

    Attributes (besides ``sequences``, ``scores``, ``logits``, ``cache`` … of transformers):
        depths: ``[B', N]`` long, ``B' = B * num_return_sequences``, ``N`` new tokens: the exit depth
            of the step that produced each generated token; 0 after the row's end-of-sequence token.
        prompt_length: columns of ``sequences`` that are prompt.
    """

    depths: torch.Tensor | None = None
    prompt_length: int | None = None


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
