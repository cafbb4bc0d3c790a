"""TRL integration: serve TRL's fused LM head from the real looped forward (not bundled by export).

TRL 1.x trainers (SFT, DPO, GRPO, RLOO, KTO) call ``add_fused_lm_head(model)``, which assigns
``model.forward = _fused_forward``: ``model(..., labels=, fused_lm_head=True)`` then runs only
``model.base_model`` (the base backbone, once, all layers) and applies ``lm_head`` itself. For a
looped model that trains the plain base and never the heads. ``LoopedForCausalLM.__setattr__``
hands such an assignment to ``intercept``, which installs ``looped_fused_forward`` instead: the
same contract, computed from the real looped logits, plus the halting method's auxiliary loss in
``aux_loss`` when TRL asks for it with ``output_router_logits=True`` (it does when the config
declares ``output_router_logits``, and adds ``router_aux_loss_coef × aux_loss`` to its loss, as for a
mixture-of-experts router loss).

``retrofit export`` leaves this module out of the bundled remote code: an exported folder loaded
without retrofit needs no TRL; ``retrofit.model.modeling`` imports it by name only when TRL replaces a
looped model's ``forward``.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import ModelOutput


def is_trl_fused_forward(value) -> bool:
    """``value`` is the ``_fused_forward`` TRL binds to a model."""
    # functools.wraps copies the model's forward's name and module onto TRL's function: look at its code
    code = getattr(getattr(value, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and f"{os.sep}trl{os.sep}" in code.co_filename


@dataclass
class LoopedFusedLMOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput``."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_outputs_from_logits(
    logits, labels, shift_labels=None, temperature=1.0, num_items_in_batch=None, outputs=("log_probs",)
):
    """TRL's ``FusedCausalLMOutput`` from full logits ``[B, T, V]`` (TaH2: the mixture logits).

    ``labels`` ``[B, T]`` are unshifted (position t is scored on label t+1; -100 ignored), or
    ``shift_labels`` ``[B, T]`` already shifted. Per-token fields are ``[B, T-1]`` (``[B, T]`` with
    ``shift_labels``), zero where ignored; the logits are divided by ``temperature``.
    """
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    mask = labels != -100
    z = logits.float() / temperature
    logp = z.log_softmax(-1)
    tgt = labels.clamp(min=0)
    log_probs = logp.gather(-1, tgt[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
    entropy = log_sum_sq = mean_logits = is_top1 = None
    if "entropy" in outputs:
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
    if "log_sum_sq_probs" in outputs:
        log_sum_sq = torch.logsumexp(2 * logp.detach(), -1).masked_fill(~mask, 0.0)
    if "mean_logits" in outputs:
        mean_logits = z.detach().mean(-1).masked_fill(~mask, 0.0)
    if "is_top1" in outputs:
        is_top1 = (z.detach().argmax(-1) == tgt) & mask
    n = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return LoopedFusedLMOutput(
        loss=-log_probs.sum() / n,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
    )


def looped_fused_forward(original, temperature: float = 1.0, outputs=("log_probs",)):
    """A ``forward`` that serves ``fused_lm_head=True`` from ``original`` (the looped forward)."""

    @functools.wraps(original)  # generate() validates its kwargs against the signature
    def forward(
        self,
        *args,
        fused_lm_head=False,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        output_router_logits=None,
        **kwargs,
    ):
        if not fused_lm_head:
            extra = (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
                ("output_router_logits", output_router_logits),
            )
            kwargs.update({k: v for k, v in extra if v is not None})
            return original(self, *args, **kwargs)
        kwargs["use_cache"] = False
        if output_router_logits:
            # the auxiliary loss needs the unshifted labels (TaH2's per-depth losses)
            full = labels
            if full is None and shift_labels is not None:
                full = torch.nn.functional.pad(shift_labels[:, :-1], (1, 0), value=-100)
            out = original(self, *args, labels=full, output_router_logits=True, **kwargs)
        else:
            out = original(self, *args, **kwargs)  # no labels: no loss computed here
        fused = fused_outputs_from_logits(out.logits, labels, shift_labels, temperature, num_items_in_batch, outputs)
        fused.aux_loss = (
            out.aux_loss if out.aux_loss is not None else (out.logits.new_zeros(()) if output_router_logits else None)
        )
        return fused

    return forward


def intercept(model, value):
    """What ``model.forward = value`` should install: the looped fused forward for TRL's, else ``value``."""
    if not is_trl_fused_forward(value):
        return value
    nonlocals = inspect.getclosurevars(value.__func__).nonlocals
    fwd = looped_fused_forward(
        type(model).forward, nonlocals.get("temperature", 1.0), tuple(nonlocals.get("outputs", ("log_probs",)))
    )
    return types.MethodType(fwd, model)
