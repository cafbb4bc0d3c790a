"""Small heads added to a retrofitted model: the updater, the shared FFN of the deciders, and the
parameter budget report.

Every new path into the residual stream starts at zero, so a freshly converted model computes the
pretrained function (STYLE.md habit 2). Leaf ``nn.Linear`` layers carry a ``_retrofit_init`` tag
that ``LoopedForCausalLM._init_weights`` reads: transformers initializes leaf modules one by one,
and a rule aimed at a container module defined outside transformers would silently do nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tag_init(linear: nn.Linear, kind: str, bias: float | list[float] = 0.0, std: float | None = None) -> nn.Linear:
    """Mark how ``_init_weights`` should initialize ``linear``: ``"normal"`` (std ``std``, default the
    model's ``initializer_range``), ``"zeros"`` or ``"bias"`` (weight zero, bias = ``bias``, a scalar or
    one value per output)."""
    linear._retrofit_init = (kind, bias, std)
    return linear


def init_tagged(linear: nn.Linear, std: float) -> None:
    """Apply a ``tag_init`` rule with transformers' init helpers (they skip loaded weights)."""
    from transformers import initialization as init

    kind, bias, own_std = linear._retrofit_init
    if kind == "normal":
        init.normal_(linear.weight, mean=0.0, std=std if own_std is None else own_std)
    else:
        init.zeros_(linear.weight)
    if linear.bias is not None:
        value = torch.as_tensor(bias if kind == "bias" else 0.0, dtype=linear.bias.dtype, device=linear.bias.device)
        init.copy_(linear.bias, value.expand_as(linear.bias))


class Updater(nn.Module):
    """Maps the previous depth's core output back to the core's input space (docs/looped-model.md)::

        x_{d+1} = U(e, h_d) = e + W2 · act(W1 · [norm(e); norm(h_d)])

    ``W2`` starts at zero, so at init every depth re-reads ``e`` and a depth-1 exit reproduces the
    base model exactly; the gradient still reaches ``W2`` from the first step.

    Args:
        hidden_size: model width ``H``.
        inner: MLP width.
        eps: RMSNorm epsilon.
    """

    def __init__(self, hidden_size: int, inner: int, eps: float = 1e-6):
        super().__init__()
        self.norm_e = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_h = nn.RMSNorm(hidden_size, eps=eps)
        self.w1 = tag_init(nn.Linear(2 * hidden_size, inner, bias=False), "normal")
        self.w2 = tag_init(nn.Linear(inner, hidden_size, bias=False), "zeros")
        self.act = nn.SiLU()

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[..., H]`` -> next core input ``[..., H]``."""
        z = torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1)
        return e + self.w2(self.act(self.w1(z)))


class DeciderFFN(nn.Module):
    """A two-layer FFN ``in -> hidden -> out`` with a normalized input, the body of every decider.

    The output layer starts with zero weights and a bias chosen by the method, so each decider's
    first decision is a fixed, documented "go deep" (``LoopConfig.deep_init_logit``).
    """

    def __init__(self, in_features: int, hidden: int, out_features: int, out_bias: float | list[float] = 0.0):
        super().__init__()
        self.norm = nn.RMSNorm(in_features, eps=1e-6)
        self.fc1 = tag_init(nn.Linear(in_features, hidden), "normal")
        self.act = nn.SiLU()
        self.fc2 = tag_init(nn.Linear(hidden, out_features), "bias", out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


class SwiGLUDecider(nn.Module):
    """The TaH2 release's decider body (docs/tah2.md, "the decider")::

        x     = W_in · [norm_1(x_1); …; norm_k(x_k)]          each input part RMS-normed on its own
        score = w_s · norm_out(W_down · (SiLU(W_gate x) ⊙ W_up x))

    Normalizing each part apart keeps a small part (the top-K probabilities, which sum to at most 1)
    visible next to the hidden states; one norm over the concatenation would drown it. The score layer
    has no bias and starts at N(0, ``init_std``): every decision starts near p = 0.5.

    Args:
        parts: the width of each input part, e.g. ``[H, H, K]`` for ``[e; h; top-K probs]``.
        width: the projection and MLP width.
        out_features: number of scores.
        init_std: std of the score layer at init (the release: 0.01).
        eps: RMSNorm epsilon.
    """

    def __init__(self, parts: list[int], width: int, out_features: int = 1, init_std: float = 0.01, eps: float = 1e-6):
        super().__init__()
        self.parts = list(parts)
        self.norms = nn.ModuleList(nn.RMSNorm(n, eps=eps) for n in self.parts)
        self.input_proj = tag_init(nn.Linear(sum(self.parts), width, bias=False), "normal")
        self.gate_proj = tag_init(nn.Linear(width, width, bias=False), "normal")
        self.up_proj = tag_init(nn.Linear(width, width, bias=False), "normal")
        self.down_proj = tag_init(nn.Linear(width, width, bias=False), "normal")
        self.norm_out = nn.RMSNorm(width, eps=eps)
        self.score = tag_init(nn.Linear(width, out_features, bias=False), "normal", std=init_std)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        """``xs``: one ``[..., parts[i]]`` tensor per part -> ``[..., out_features]`` scores (logits)."""
        if len(xs) != len(self.parts):
            raise ValueError(f"SwiGLUDecider takes {len(self.parts)} input parts, got {len(xs)}")
        x = self.input_proj(torch.cat([n(x) for n, x in zip(self.norms, xs)], dim=-1))
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.score(self.norm_out(x))


def parameter_report(model: nn.Module) -> dict:
    """Count the heads' parameters against the base model's.

    Works on the ``meta`` device (no weights are read). Tied parameters are counted once.

    Returns:
        dict with ``base``, ``updater``, ``decider``, ``heads`` (updater + decider) and
        ``heads_share`` = heads / base.
    """
    seen: set[int] = set()

    def count(module: nn.Module | None) -> int:
        if module is None:
            return 0
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    updater = count(getattr(model, "updater", None))
    decider = count(getattr(model, "halting", None))
    base = count(model)  # what remains: embeddings, layers, norm, lm_head
    heads = updater + decider
    return {
        "base": base,
        "updater": updater,
        "decider": decider,
        "heads": heads,
        "heads_share": heads / base if base else float("nan"),
    }
