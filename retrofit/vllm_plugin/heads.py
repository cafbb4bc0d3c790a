"""The looped model's heads for vLLM, rebuilt from a checkpoint's weights with vLLM layers under the same
parameter names (``updater.*``, ``halting.decider.*``), so ``AutoWeightsLoader`` fills them as is
(docs/looped-model.md, docs/tah2.md, docs/anira.md; the HF modules are ``retrofit/model/heads.py``)."""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear

from .config import LoopSpec


class Updater(nn.Module):
    """``x_{d+1} = e + W2 · SiLU(W1 · [norm_e(e); norm_h(h)])`` (docs/looped-model.md)."""

    def __init__(self, hidden: int, inner: int, eps: float, prefix: str):
        super().__init__()
        self.norm_e = RMSNorm(hidden, eps=eps)
        self.norm_h = RMSNorm(hidden, eps=eps)
        self.w1 = ReplicatedLinear(2 * hidden, inner, bias=False, prefix=f"{prefix}.w1")
        self.w2 = ReplicatedLinear(inner, hidden, bias=False, prefix=f"{prefix}.w2")

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[N, H]`` -> ``[N, H]``."""
        z, _ = self.w1(torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1))
        out, _ = self.w2(nn.functional.silu(z))
        return e + out


class ReleaseUpdater(nn.Module):
    """The TaH2 release's updater (``retrofit.model.heads.SwiGLUUpdater``, ``LoopConfig.updater="release"``)::

        q = norm_mid(proj([norm_e(e); norm_h(s)])),    x_{d+1} = norm_out(down(SiLU(gate q) * up q))

    It replaces the core input (no residual to ``e``)."""

    def __init__(self, hidden: int, inner: int, eps: float, prefix: str):
        super().__init__()
        self.norm_e = RMSNorm(hidden, eps=eps)
        self.norm_h = RMSNorm(hidden, eps=eps)
        self.proj = ReplicatedLinear(2 * hidden, hidden, bias=False, prefix=f"{prefix}.proj")
        self.norm_mid = RMSNorm(hidden, eps=eps)
        self.gate_proj = ReplicatedLinear(hidden, inner, bias=False, prefix=f"{prefix}.gate_proj")
        self.up_proj = ReplicatedLinear(hidden, inner, bias=False, prefix=f"{prefix}.up_proj")
        self.down_proj = ReplicatedLinear(inner, hidden, bias=False, prefix=f"{prefix}.down_proj")
        self.norm_out = RMSNorm(hidden, eps=eps)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[N, H]`` -> ``[N, H]``."""
        p, _ = self.proj(torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1))
        q = self.norm_mid(p)
        g, _ = self.gate_proj(q)
        u, _ = self.up_proj(q)
        y, _ = self.down_proj(nn.functional.silu(g) * u)
        return self.norm_out(y)


#: ``LoopConfig.updater`` -> the updater rebuilt from vLLM layers (the same parameter names as retrofit's)
UPDATERS = {"residual": Updater, "release": ReleaseUpdater}


class DeciderFFN(nn.Module):
    """``fc2(SiLU(fc1(norm(x))))``, the body of every decider (``retrofit.model.heads.DeciderFFN``)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, prefix: str):
        super().__init__()
        self.norm = RMSNorm(in_features, eps=1e-6)
        self.fc1 = ReplicatedLinear(in_features, hidden, bias=True, prefix=f"{prefix}.fc1")
        self.fc2 = ReplicatedLinear(hidden, out_features, bias=True, prefix=f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, _ = self.fc1(self.norm(x))
        out, _ = self.fc2(nn.functional.silu(z))
        return out


class SwiGLUDecider(nn.Module):
    """The TaH2 release's decider (``retrofit.model.heads.SwiGLUDecider``): each input part RMS-normed on its own,
    ``score(norm_out(down(SiLU(gate x) * up x)))`` with ``x = input_proj([norm_i(x_i)])``."""

    def __init__(self, parts: list[int], width: int, prefix: str):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(n, eps=1e-6) for n in parts)
        self.input_proj = ReplicatedLinear(sum(parts), width, bias=False, prefix=f"{prefix}.input_proj")
        self.gate_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.gate_proj")
        self.up_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.up_proj")
        self.down_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.down_proj")
        self.norm_out = RMSNorm(width, eps=1e-6)
        self.score = ReplicatedLinear(width, 1, bias=False, prefix=f"{prefix}.score")

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        x, _ = self.input_proj(torch.cat([n(x) for n, x in zip(self.norms, xs)], dim=-1))
        g, _ = self.gate_proj(x)
        u, _ = self.up_proj(x)
        y, _ = self.down_proj(nn.functional.silu(g) * u)
        out, _ = self.score(self.norm_out(y))
        return out


class Halting(nn.Module):
    """Holds ``decider`` (so weight names match ``halting.decider.*``); None for ``fixed``."""

    def __init__(self, spec: LoopSpec, hidden: int, prefix: str):
        super().__init__()
        H, D = hidden, spec.max_depth
        if spec.method == "tah2" and spec.decider_arch == "swiglu":
            parts = [H, H] + ([spec.top_k] if spec.top_k else [])
            self.decider = SwiGLUDecider(parts, spec.decider_hidden, f"{prefix}.decider")
            return
        in_out = {
            "tah2": (2 * H + spec.top_k, 1),
            "anira-e": (H, D),
            "anira-o": (H, 1),
        }.get(spec.method)
        self.decider = (
            None if in_out is None else DeciderFFN(in_out[0], spec.decider_hidden, in_out[1], f"{prefix}.decider")
        )
