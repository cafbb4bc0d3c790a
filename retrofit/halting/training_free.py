"""Training-free exits for any looped model (docs/exits.md).

These replace the model's learned decider at inference time; they need no training and serve as the
baselines learned deciders are compared against at equal compute.

- ``kl`` (Huginn): stop after depth ``d ≥ 2`` when ``KL(p_d ‖ p_{d-1}) < T``, with ``p_d`` the
  next-token distribution read out at depth ``d`` (``Σ_v p_d(v) (log p_d(v) - log p_{d-1}(v))``, the
  direction Huginn's ``kl_div(prev, new, log_target=True)`` computes).
- ``state`` (fixed-point halting): stop after depth ``d ≥ 2`` when
  ``‖h_d - h_{d-1}‖ / ‖h_{d-1}‖ < T`` (per token, 2-norms over the hidden size).

Depth 1 never stops under either rule: there is no earlier depth to compare with. A fixed depth is
not a policy object: pass ``depth=k`` to ``forward``/``generate``.

Interface (``init``/``check``, the shape of Huginn's exit evaluators): ``state = policy.init(B * T)``;
after each depth ``d < D``, ``stop = policy.check(d, h, log_probs, state, idx)`` for the tokens still
running, where ``idx`` are their flat indices (``b * T + t``) so per-token memory lives in ``state``.
"""

from __future__ import annotations

import torch


class ExitPolicy:
    """Base class of training-free exits.

    Attributes:
        name: key in ``EXIT_POLICIES``.
        needs_logits: ``check`` reads the depth's next-token log-probabilities (the caller then reads
            out every executed depth).
    """

    name: str = ""
    needs_logits: bool = False

    def __init__(self, threshold: float):
        if threshold is None or not float(threshold) > 0:
            raise ValueError(f"exit_policy={self.name!r} needs exit_threshold > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def init(self, n_tokens: int) -> dict:
        """Per-call state for ``n_tokens`` flat tokens (``B * T``)."""
        return {"n": n_tokens}

    def check(
        self, d: int, h: torch.Tensor, log_probs: torch.Tensor | None, state: dict, idx: torch.Tensor
    ) -> torch.Tensor:
        """Decide after depth ``d`` for ``n`` running tokens.

        Args:
            d: the depth just computed (1-based).
            h: ``[n, H]`` their core states at depth ``d``.
            log_probs: ``[n, V]`` log next-token distributions at depth ``d`` (when ``needs_logits``).
            state: the dict from ``init`` (updated in place).
            idx: ``[n]`` flat token indices, stable across depths.

        Returns:
            ``[n]`` bool, True = stop at depth ``d``.
        """
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(threshold={self.threshold})"


def _remember(state: dict, key: str, idx: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """Store ``value [n, ...]`` for tokens ``idx``; return what was stored for them before (None the
    first time)."""
    buf = state.get(key)
    if buf is None:
        state[key] = buf = value.new_zeros(state["n"], *value.shape[1:])
        prev = None
    else:
        prev = buf[idx]  # advanced indexing copies
    buf[idx] = value
    return prev


class KLExit(ExitPolicy):
    """Stop when the next-token distribution stops changing: ``KL(p_d ‖ p_{d-1}) < threshold``."""

    name = "kl"
    needs_logits = True

    def check(self, d, h, log_probs, state, idx):
        if log_probs is None:
            raise ValueError("the 'kl' exit needs the depth's log-probabilities")
        lp = log_probs.float()
        prev = _remember(state, "log_probs", idx, lp)
        if d == 1 or prev is None:
            return torch.zeros(lp.shape[0], dtype=torch.bool, device=lp.device)
        kl = (lp.exp() * (lp - prev)).sum(-1)
        state["last_kl"] = kl
        return kl < self.threshold


class StateChangeExit(ExitPolicy):
    """Stop near a fixed point: ``‖h_d - h_{d-1}‖ / ‖h_{d-1}‖ < threshold``."""

    name = "state"

    def check(self, d, h, log_probs, state, idx):
        hf = h.float()
        prev = _remember(state, "h", idx, hf)
        if d == 1 or prev is None:
            return torch.zeros(hf.shape[0], dtype=torch.bool, device=hf.device)
        rel = (hf - prev).norm(dim=-1) / prev.norm(dim=-1).clamp_min(1e-12)
        state["last_change"] = rel
        return rel < self.threshold


#: every training-free exit, by the name ``exit_policy=`` takes (STYLE.md habit 6)
EXIT_POLICIES: dict[str, type[ExitPolicy]] = {
    "kl": KLExit,
    "state": StateChangeExit,
}

#: values ``exit_policy=`` accepts: the model's own decider, a fixed depth, or a training-free exit
EXIT_POLICY_NAMES = ("decider", "fixed", *EXIT_POLICIES)


def resolve_exit_policy(exit_policy, exit_threshold, depth):
    """Turn the call-time exit arguments into ``(depth, policy)``.

    Args:
        exit_policy: None or ``"decider"`` (the model's halting method), ``"fixed"`` (needs ``depth``),
            a key of ``EXIT_POLICIES``, or an ``ExitPolicy`` instance.
        exit_threshold: the training-free policy's threshold ``T``.
        depth: None, an int or a ``[B, T]`` tensor of forced exit depths.

    Returns:
        ``(depth, policy)``: at most one of them is not None.

    Raises:
        ValueError: unknown policy, missing or conflicting arguments.
    """
    if isinstance(exit_policy, ExitPolicy):
        if depth is not None:
            raise ValueError("pass either depth= or an exit policy, not both")
        return None, exit_policy
    if exit_policy is None or exit_policy == "decider":
        if exit_threshold is not None:
            raise ValueError(
                "exit_threshold applies to the training-free exits ('kl', 'state'); the decider's own thresholds "
                "are LoopConfig.exit_threshold (TaH2) and LoopConfig.halt_threshold (ANIRA-O)"
            )
        if exit_policy == "decider" and depth is not None:
            raise ValueError("exit_policy='decider' lets the model decide; drop depth= or use exit_policy='fixed'")
        return depth, None
    if exit_policy == "fixed":
        if depth is None:
            raise ValueError("exit_policy='fixed' needs depth=k")
        if exit_threshold is not None:
            raise ValueError("exit_policy='fixed' takes no exit_threshold")
        return depth, None
    if exit_policy not in EXIT_POLICIES:
        raise ValueError(f"unknown exit_policy {exit_policy!r}; allowed: {', '.join(EXIT_POLICY_NAMES)}")
    if depth is not None:
        raise ValueError(f"exit_policy={exit_policy!r} decides the depth itself; drop depth=")
    return None, EXIT_POLICIES[exit_policy](exit_threshold)
