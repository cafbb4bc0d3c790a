"""Small heads added to a retrofitted model: the updaters, the deciders' bodies, and the parameter budget
(the width rule of the release's decider and the report).

A freshly converted model computes the pretrained function whenever every token exits at depth 1
(STYLE.md habit 2): the heads only feed depths >= 2. The residual updater also starts at zero (every depth
re-reads ``e``); the TaH2 release's updater does not (docs/tah2.md, "updater"). Leaf ``nn.Linear`` layers
carry a ``_retrofit_init`` tag that ``LoopedForCausalLM._init_weights`` reads: transformers initializes leaf
modules one by one, and a rule aimed at a container module defined outside transformers would silently do
nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: the heads' parameter budget: updater + decider below this share of the base model's parameters
#: (docs/tah2.md, "heads budget": TaH2 reports < 3%)
HEADS_BUDGET = 0.03

INIT_KINDS = ("normal", "zeros", "bias", "torch")


def tag_init(linear: nn.Linear, kind: str, bias: float | list[float] = 0.0, std: float | None = None) -> nn.Linear:
    """Mark how ``_init_weights`` should initialize ``linear``: ``"normal"`` (std ``std``, default the
    model's ``initializer_range``), ``"zeros"``, ``"bias"`` (weight zero, bias = ``bias``, a scalar or
    one value per output) or ``"torch"`` (PyTorch's own ``nn.Linear`` init: kaiming-uniform weights with
    ``a = √5``, i.e. U(±1/√fan_in), and a U(±1/√fan_in) bias)."""
    if kind not in INIT_KINDS:
        raise ValueError(f"unknown init kind {kind!r}; allowed: {', '.join(INIT_KINDS)}")
    linear._retrofit_init = (kind, bias, std)
    return linear


def init_tagged(linear: nn.Linear, std: float) -> None:
    """Apply a ``tag_init`` rule with transformers' init helpers (they skip loaded weights)."""
    from transformers import initialization as init

    kind, bias, own_std = linear._retrofit_init
    if kind == "torch":  # what nn.Linear.reset_parameters does
        init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
        if linear.bias is not None:
            bound = 1 / math.sqrt(linear.in_features) if linear.in_features > 0 else 0.0
            init.uniform_(linear.bias, -bound, bound)
        return
    if kind == "normal":
        init.normal_(linear.weight, mean=0.0, std=std if own_std is None else own_std)
    else:
        init.zeros_(linear.weight)
    if linear.bias is not None:
        value = torch.as_tensor(bias if kind == "bias" else 0.0, dtype=linear.bias.dtype, device=linear.bias.device)
        init.copy_(linear.bias, value.expand_as(linear.bias))


class Updater(nn.Module):
    """The residual updater (``LoopConfig.updater="residual"``): maps the previous depth's state back to the
    core's input space (docs/looped-model.md)::

        x_{d+1} = U(e, s_d) = e + W2 · act(W1 · [norm(e); norm(s_d)])

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


class SwiGLUUpdater(nn.Module):
    """The TaH2 release's updater (``LoopConfig.updater="release"``; docs/tah2.md, "updater")::

        p        = W_p · [norm_e(e); norm_h(s_d)]                       W_p: 2H -> H, no bias
        x_{d+1}  = norm_out(W_down · (SiLU(W_gate q) ⊙ W_up q)),  q = norm_mid(p)

    ``e`` is the core input of depth 1 (the prelude output, or the token embeddings), ``s_d`` the state after
    depth ``d`` (``LoopConfig.decider_state``). The output *replaces* the core input (no residual to ``e``);
    ``norm_out`` sets its scale, since the core's first layer reads it as it reads ``e``. Every linear layer
    has PyTorch's default init (``tag_init(..., "torch")``), so depth 2 is not depth 1 at init; depth-1 exits
    still reproduce the base model (the updater only feeds depths >= 2).

    Args:
        hidden_size: model width ``H``.
        inner: the SwiGLU MLP's intermediate width (the release: ``H``).
        eps: RMSNorm epsilon (the base model's ``rms_norm_eps``).
    """

    def __init__(self, hidden_size: int, inner: int, eps: float = 1e-6):
        super().__init__()
        self.norm_e = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_h = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = tag_init(nn.Linear(2 * hidden_size, hidden_size, bias=False), "torch")
        self.norm_mid = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_proj = tag_init(nn.Linear(hidden_size, inner, bias=False), "torch")
        self.up_proj = tag_init(nn.Linear(hidden_size, inner, bias=False), "torch")
        self.down_proj = tag_init(nn.Linear(inner, hidden_size, bias=False), "torch")
        self.norm_out = nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[..., H]`` -> next core input ``[..., H]``."""
        q = self.norm_mid(self.proj(torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1)))
        return self.norm_out(self.down_proj(F.silu(self.gate_proj(q)) * self.up_proj(q)))


#: ``LoopConfig.updater`` -> the updater class
UPDATER_CLASSES: dict[str, type[nn.Module]] = {"release": SwiGLUUpdater, "residual": Updater}


def build_updater(kind: str, hidden_size: int, inner: int, eps: float = 1e-6) -> nn.Module:
    """The updater of ``LoopConfig.updater`` (``"release"`` / ``"residual"``)."""
    try:
        cls = UPDATER_CLASSES[kind]
    except KeyError:
        raise ValueError(f"unknown updater {kind!r}; allowed: {', '.join(UPDATER_CLASSES)}") from None
    return cls(hidden_size, inner, eps=eps)


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
        init: the inner layers' init (``tag_init`` kind): ``"torch"`` (PyTorch's default, the release) or
            ``"normal"`` (the model's ``initializer_range``; ``TaH2Options.decider_init``).
    """

    def __init__(
        self,
        parts: list[int],
        width: int,
        out_features: int = 1,
        init_std: float = 0.01,
        eps: float = 1e-6,
        init: str = "normal",
    ):
        super().__init__()
        self.parts = list(parts)
        self.norms = nn.ModuleList(nn.RMSNorm(n, eps=eps) for n in self.parts)
        self.input_proj = tag_init(nn.Linear(sum(self.parts), width, bias=False), init)
        self.gate_proj = tag_init(nn.Linear(width, width, bias=False), init)
        self.up_proj = tag_init(nn.Linear(width, width, bias=False), init)
        self.down_proj = tag_init(nn.Linear(width, width, bias=False), init)
        self.norm_out = nn.RMSNorm(width, eps=eps)
        self.score = tag_init(nn.Linear(width, out_features, bias=False), "normal", std=init_std)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        """``xs``: one ``[..., parts[i]]`` tensor per part -> ``[..., out_features]`` scores (logits)."""
        if len(xs) != len(self.parts):
            raise ValueError(f"SwiGLUDecider takes {len(self.parts)} input parts, got {len(xs)}")
        x = self.input_proj(torch.cat([n(x) for n, x in zip(self.norms, xs)], dim=-1))
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.score(self.norm_out(x))


def swiglu_decider_parameters(parts: list[int], width: int, out_features: int = 1) -> int:
    """Parameters of a ``SwiGLUDecider(parts, width, out_features)``: the part norms, the input projection,
    the SwiGLU MLP, the output norm and the score layer."""
    n_in = sum(parts)
    return n_in + n_in * width + 3 * width * width + width + width * out_features


def release_decider_width(hidden_size: int, top_k: int, updater_params: int, base_params: int) -> int:
    """The decider width of ``LoopConfig.decider_width_rule="release"`` (docs/tah2.md, "heads budget").

    The release's decider is as wide as the model (``H``; with the updater, ``~11 H²`` parameters). That fits
    the heads' budget (``HEADS_BUDGET``, 3% of the base model) at Qwen3-1.7B, 4B, 8B and SmolLM2-135M, but not
    at a wide, shallow model such as Llama-3.2-1B (3.7%). The rule: the first of ``H``, ``H / 2``, ``H / 4`` at
    which updater + decider (reading ``[e; s; top-K]``) stay under the budget; ``H / 4`` (retrofit's older width)
    when none does, which only happens for toy models.

    Args:
        hidden_size: ``H``.
        top_k: the decider's top-K probability features (0: none).
        updater_params: the updater's parameters.
        base_params: the base model's parameters (tied weights counted once).

    Returns:
        The width (at least 1).
    """
    parts = [hidden_size, hidden_size] + ([top_k] if top_k else [])
    widths = [max(1, hidden_size // k) for k in (1, 2, 4)]
    for w in widths:
        if updater_params + swiglu_decider_parameters(parts, w) < HEADS_BUDGET * base_params:
            return w
    return widths[-1]


def parameter_count(*modules: nn.Module | None) -> int:
    """Parameters of ``modules`` together, shared (tied) parameters counted once; works on ``meta``."""
    seen: set[int] = set()
    n = 0
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


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
