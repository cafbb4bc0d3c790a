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
        defers_to_decider: ``check`` may keep the halting method's own decision for some tokens.
    """

    name: str = ""
    needs_logits: bool = False
    #: ``check`` reads ``state["decider_continue"]``, the halting method's own decision for the running tokens
    defers_to_decider: bool = False

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


def continue_rate_for_mean_depth(mean_depth: float, max_depth: int) -> float:
    """The per-depth continue probability ``q`` whose geometric exits have mean depth ``d̄``:
    ``E[d] = Σ_{k=0}^{D-1} q^k`` (``q = d̄ - 1`` at ``D = 2``), solved by bisection.

    Raises:
        ValueError: ``d̄`` outside ``[1, D]``.
    """
    D = int(max_depth)
    if not 1.0 <= mean_depth <= D:
        raise ValueError(f"mean depth {mean_depth!r} is outside 1..{D}")
    lo, hi = 0.0, 1.0
    for _ in range(80):
        q = (lo + hi) / 2
        if sum(q**k for k in range(D)) < mean_depth:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


class RandomContinue(ExitPolicy):
    """Random allocation, the baseline a learned decider must beat at equal compute: after each depth every
    selected token continues with probability ``rate`` (independent, seeded draws), so its depth is
    geometric with mean ``Σ_{k<D} rate^k`` (``continue_rate_for_mean_depth`` inverts that). Tokens outside
    ``where`` keep the model's own decision, so a comparison can randomize the answer tokens only and leave
    the prompt exactly as the decider ran it. The decider still runs (TaH2's mixture weights stay its own);
    only who continues changes.

    Args:
        rate: continue probability in ``[0, 1]``.
        seed: seed of the draws (the same seed gives the same draws for the same call).
        where: ``[B, T]`` bool, the positions whose depth is drawn; None = every position.
    """

    name = "random"
    defers_to_decider = True

    def __init__(self, rate: float, seed: int = 0, where: torch.Tensor | None = None):
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"the random exit's continue rate must lie in [0, 1], got {rate!r}")
        self.threshold = self.rate = float(rate)
        self.seed = int(seed)
        self.where = where

    def init(self, n_tokens):
        gen = torch.Generator().manual_seed(self.seed)
        return {"n": n_tokens, "gen": gen}

    def check(self, d, h, log_probs, state, idx):
        u = torch.rand(state["n"], generator=state["gen"], dtype=torch.float64)  # one draw per token and depth
        cont = (u[idx.cpu()] < self.rate).to(h.device)
        if self.where is not None:
            own = state.get("decider_continue")
            own = torch.ones_like(cont) if own is None else own.to(h.device)
            cont = torch.where(self.where.reshape(-1).to(h.device)[idx], cont, own)
        return ~cont

    def __repr__(self):
        return f"RandomContinue(rate={self.rate}, seed={self.seed})"


#: every training-free exit, by the name ``exit_policy=`` takes (STYLE.md habit 6); ``RandomContinue`` is
#: passed as an instance (it needs a rate, a seed and a position mask)
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
                "are the method options exit_threshold (TaH2), halt_threshold (ANIRA-O) and exit_q (Ouro)"
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
