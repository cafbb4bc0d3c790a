"""Output classes of looped models: the forward's ``LoopedCausalLMOutput`` and ``generate``'s
``LoopedGenerateOutput`` (both ``ModelOutput`` dataclasses, as transformers' own outputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import ModelOutput


@dataclass
class LoopedCausalLMOutput(ModelOutput):
    """Output of ``LoopedForCausalLM.forward``.

    Attributes:
        loss: with labels: the next-token loss on ``logits`` (the mixture NLL for TaH2) plus
            ``config.router_aux_loss_coef × aux_loss`` (coefficient 1 by default), as
            mixture-of-experts models add their router loss.
        logits: ``[B, T, V]``. For a TaH2 mixture: ``log p_mix + logsumexp(z^(d*))``, i.e. the log
            mixture shifted per token by the exit depth's log-partition, so that a one-depth mixture
            returns that depth's raw logits and ``softmax(logits) = p_mix``. With
            ``labelled_logits_only=True``: ``[N, V]`` at the positions ``logits_rows`` only.
        depths: ``[B, T]`` long, each token's exit depth (1-based; 0 for padding of a cached step).
        depth_probs: ``[B, T, D]`` the method's halting distribution (TaH2: mixture weights π;
            ANIRA: q); None for ``fixed`` and under a forced depth (no decider runs).
        halt_signals: ``[B, T, k]`` per-depth decider outputs (TaH2: continue probabilities
            ``c^(1..k)``; ANIRA-O: halting probabilities ``α``); None otherwise.
        halt_logits: ``[B, T, k]`` the logits behind ``halt_signals`` when the method keeps them (TaH2: the
            continue logits, ``halt_signals = σ(halt_logits)``; its BCE reads them); else None.
        depth_logits_q: ``[B, T, D]`` ANIRA-E's raw depth logits (its q before softmax); else None.
        depth_ce: ``[D']`` with ``depth_supervision=True``: each executed depth's next-token loss (the same
            reduction as ``loss``), with gradient; ``loss`` is their mean.
        depth_ce_tokens: ``[B, T, D']`` each executed depth's per-token next-token loss with gradient (0 where the
            label is -100), for a method whose objective replaces the output's loss (``HaltingMethod.main_loss``).
        depth_nll: ``[B, T, D]`` next-token loss at each depth (position t predicts label t+1;
            TaH2's lookahead depth ``d*+1`` included); NaN where not computed. Present when the
            auxiliary loss needs it (TaH2 with labels) or ``output_depth_losses=True``.
        depth_logits: ``[D, B, T, V]`` per-depth logits (NaN beyond a token's lookahead) when
            ``output_depth_logits=True``.
        active: ``[D', B, T]`` bool, token executed depth d.
        cache: the depth-aware cache, when decoding with one.
        aux_loss: the halting method's weighted auxiliary loss (TaH2: ``α_D · L_D``; ANIRA:
            ``γ · L_C``; ``retrofit.model.halting``), when labels are given and the method has one.
        aux_metrics: detached scalars of the auxiliary loss to log (TaH2: ``decider_loss``,
            ``kappa``, …; ANIRA: ``kl_prior``, ``expected_depth_q``).
        logits_rows: ``[N]`` flat indices into ``B * T`` of the rows of ``logits`` under
            ``labelled_logits_only=True`` (the positions with a next-token label); else None.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    depth_probs: torch.Tensor | None = None
    halt_signals: torch.Tensor | None = None
    halt_logits: torch.Tensor | None = None
    depth_logits_q: torch.Tensor | None = None
    depth_nll: torch.Tensor | None = None
    depth_ce: torch.Tensor | None = None
    depth_ce_tokens: torch.Tensor | None = None
    depth_logits: torch.Tensor | None = None
    active: torch.Tensor | None = None
    cache: object | None = None
    aux_loss: torch.Tensor | None = None
    aux_metrics: dict | None = None
    logits_rows: torch.Tensor | None = None


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


def _halting_signals_finite(out: LoopedCausalLMOutput) -> bool:
    """The decider's outputs (``halt_signals``, ``depth_logits_q``) hold no NaN/inf (True when absent)."""
    for t in (out.halt_signals, out.halt_logits, out.depth_logits_q):
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
            return False
    return True
