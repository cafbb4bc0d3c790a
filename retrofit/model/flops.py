"""Compute accounting for adaptive-depth runs (docs/looped-model.md, docs/evaluation.md; ANIRA §3.2.5).

For a forward or a ``generate`` call: executed core token-iterations ``Cost_exec = Σ_d |A_d|`` (the sum
of exit depths), core-layer passes (``Cost_exec`` × core layers), the mean depth ``d̄``, and the
FLOPs of the adaptive run relative to

- the **fixed-max-depth** model: the same loop with every token at ``D`` and no decider or per-depth
  readout (the plain Huginn/Ouro-style baseline);
- the **base** model: the pretrained stack, once per token.

Two measures are reported. ``layers_*`` counts decoder-layer passes per token
(``retrofit.model.depth_cost.flops_ratio``). ``flops_*`` counts matmul FLOPs per token (2 per
multiply-add) of every linear map actually run: decoder layers, updater, decider, LM head (once, or
once per executed depth when the run reads out every depth — TaH2, the ``kl`` exit — plus the
coda at every depth when a model with a coda reads out every depth, as the decode path does).
Attention-score FLOPs, which grow with context length, are left out of both; at short and medium
contexts they are a few percent of a layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .depth_cost import cost_exec, flops_ratio


def _linear_params(module: nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def model_costs(model) -> dict[str, int]:
    """Matmul parameters (multiply-adds per token) of each part of a looped model."""
    pre, core, coda = model._ranges
    layers = model.model.layers
    return {
        "prelude": sum(_linear_params(layers[i]) for i in pre),
        "core": sum(_linear_params(layers[i]) for i in core),
        "coda": sum(_linear_params(layers[i]) for i in coda),
        "all_layers": sum(_linear_params(layer) for layer in layers),
        "head": model.lm_head.weight.numel(),
        "updater": _linear_params(model.updater),
        "decider": _linear_params(model.halting),
    }


def _per_token_flops(model, d: torch.Tensor, readout: bool, decider_runs: str) -> torch.Tensor:
    """FLOPs ``[n]`` of tokens with exit depths ``d`` ``[n]`` (float64)."""
    c = model_costs(model)
    D = model.loop.max_depth
    d = d.double()
    f = c["prelude"] + d * c["core"] + (d - 1) * c["updater"]
    if readout:
        f = f + d * c["head"] + (D * c["coda"] if c["coda"] else 0.0)
    else:
        f = f + c["head"] + c["coda"]
    if decider_runs == "per_depth":
        f = f + torch.clamp(d, max=D - 1) * c["decider"]
    elif decider_runs == "once":
        f = f + c["decider"]
    return 2.0 * f


def cost_report(model, depths, mask=None, readout: bool | None = None, decider: bool = True) -> dict[str, Any]:
    """Cost of a run with exit depths ``depths``.

    Args:
        model: the ``LoopedForCausalLM``.
        depths: ``[...]`` exit depths (1-based) of the tokens run (tensor, array or list).
        mask: ``[...]`` bool, valid tokens (default: depths > 0).
        readout: the run read out every executed depth (TaH2, the ``kl`` exit). Default: the
            method's own need (``model.halting.needs_depth_readout``) when its decider ran.
        decider: the method's decider ran; False for a forced depth (``depth=``), which runs no
            decider and reads out only the exit state.

    Returns:
        dict: ``n_tokens``, ``max_depth``, ``cost_exec`` (Σ exit depths), ``core_layer_passes``,
        ``mean_depth``, ``saving`` (d̄ / D), ``active_per_depth``, ``layers_adaptive_vs_fixed``,
        ``layers_adaptive_vs_base``, ``flops`` (total), ``flops_fixed``, ``flops_base``,
        ``flops_vs_fixed``, ``flops_vs_base``.
    """
    d = torch.as_tensor(depths).detach().cpu().long()
    m = (d > 0) if mask is None else torch.as_tensor(mask).detach().cpu().bool()
    D = model.loop.max_depth
    pre, core, coda = (len(r) for r in model._ranges)
    ce = cost_exec(d.numpy(), m.numpy(), max_depth=D)
    out: dict[str, Any] = {
        "n_tokens": ce["n_tokens"],
        "max_depth": D,
        "cost_exec": ce["cost_exec"],
        "core_layer_passes": ce["cost_exec"] * core,
        "mean_depth": ce["mean_depth"],
        "saving": ce["saving"],
        "active_per_depth": ce["active_per_depth"],
    }
    if ce["n_tokens"] == 0:
        return out
    fr = flops_ratio(ce["mean_depth"], D, model.config.num_hidden_layers, pre, core, coda)
    out["layers_adaptive_vs_fixed"] = fr["adaptive_vs_fixed"]
    out["layers_adaptive_vs_base"] = fr["adaptive_vs_base"]
    if readout is None:
        readout = decider and model.halting.needs_depth_readout
    runs = (model.halting.decider_runs or "none") if decider else "none"
    dv = d[m]
    flops = float(_per_token_flops(model, dv, readout, runs).sum())
    c = model_costs(model)
    n = dv.numel()
    fixed = 2.0 * n * (c["prelude"] + D * c["core"] + (D - 1) * c["updater"] + c["coda"] + c["head"])
    base = 2.0 * n * (c["all_layers"] + c["head"])
    out.update(
        flops=flops, flops_fixed=fixed, flops_base=base, flops_vs_fixed=flops / fixed, flops_vs_base=flops / base
    )
    return out


def forward_cost(
    model, output, attention_mask=None, readout: bool | None = None, decider: bool = True
) -> dict[str, Any]:
    """``cost_report`` of a forward output (``output.depths`` ``[B, T]``; padding excluded)."""
    mask = None if attention_mask is None else attention_mask.bool()
    if mask is None:
        mask = output.depths > 0
    return cost_report(model, output.depths, mask, readout, decider)


def generate_cost(
    model, gen_output, include_prompt: bool = False, readout: bool | None = None, decider: bool = True
) -> dict[str, Any]:
    """``cost_report`` of ``generate(..., return_dict_in_generate=True)``.

    Args:
        gen_output: a ``retrofit.model.generation.LoopedGenerateOutput``.
        include_prompt: also count the prompt's (prefill) tokens, from the cache's per-position
            depths; by default only the decode steps (one per generated token).
        readout, decider: as in ``cost_report`` (``decider=False`` for ``generate(depth=k)``).
    """
    if getattr(gen_output, "depths", None) is None:
        raise ValueError(
            "this output has no per-token depths: call generate(..., return_dict_in_generate=True) without beam search"
        )
    if include_prompt:
        cache = gen_output.cache
        d = cache.token_depths[:, : cache.length]
        return cost_report(model, d, d > 0, readout, decider)
    return cost_report(model, gen_output.depths, gen_output.depths > 0, readout, decider)


def break_even_mean_depth(model) -> dict[str, Any]:
    """The mean depth d̄ at which the adaptive model costs as much per token as the same loop at fixed depth.

    The reference is ``cost_report``'s ``flops_fixed``: the same loop with every token at ``D`` and no
    decider or per-depth readout (what the ``fixed`` control runs). The adaptive model pays for its
    decider and, where the method reads out every depth (TaH2), an LM head per executed depth and the
    coda at every depth, so it breaks even below ``D``: at ``d̄`` under the break-even it is cheaper.

    Per token, FLOPs are piecewise linear in the exit depth ``d`` (``_per_token_flops``: linear in ``d``,
    with a kink at ``D − 1`` where a per-depth decider stops running). This solves ``f(x) = flops_fixed``
    on the linear interpolation of ``f`` between integer depths. The cost of a run with mean depth ``d̄``
    is the mean of ``f`` over its tokens, which equals ``f(d̄)`` when ``D = 2`` (no kink inside
    ``[1, 2]``) or when every token's depth lies in ``1 … D − 1``; otherwise ``f`` is concave so the mean
    is at most ``f(d̄)``, and the run at this d̄ is no dearer than the fixed loop.

    Args:
        model: a ``LoopedForCausalLM`` whose method has a decider.

    Returns:
        ``{"mean_depth": x | None, "max_depth": D, "flops_fixed_per_token", "flops_at_depth": {d: f(d)},
        "reason": str | None}``: ``mean_depth`` is None (with the reason) when even ``d̄ = 1`` costs
        more than the fixed loop, and ``D`` when even ``d̄ = D`` costs no more.
    """
    D = model.loop.max_depth
    c = model_costs(model)
    fixed = 2.0 * (c["prelude"] + D * c["core"] + (D - 1) * c["updater"] + c["coda"] + c["head"])
    readout = model.halting.needs_depth_readout
    runs = model.halting.decider_runs or "none"
    f = _per_token_flops(model, torch.arange(1, D + 1), readout, runs).tolist()
    out: dict[str, Any] = {
        "mean_depth": None,
        "max_depth": D,
        "flops_fixed_per_token": fixed,
        "flops_at_depth": {d: f[d - 1] for d in range(1, D + 1)},
        "reason": None,
    }
    if f[0] > fixed:
        out["reason"] = (
            f"even every token at depth 1 costs more ({f[0]:.4g} FLOPs per token) than the loop at fixed depth "
            f"{D} ({fixed:.4g}): the decider and per-depth readouts cost more than the core iterations they save"
        )
        return out
    if f[-1] <= fixed:
        out["mean_depth"] = float(D)
        out["reason"] = f"even every token at depth {D} costs no more than the fixed loop"
        return out
    for d in range(1, D):  # f[d - 1] <= fixed < f[d]: the crossing lies in [d, d + 1]
        if f[d - 1] <= fixed < f[d]:
            out["mean_depth"] = d + (fixed - f[d - 1]) / (f[d] - f[d - 1])
            break
    return out
