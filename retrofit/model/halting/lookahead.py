"""TaH2's lookahead labels (docs/tah2.md, "lookahead labels"): the gain of one more iteration per decision, the
cutoff κ of the ρ rule (one per depth boundary, as the authors' release, or one over the batch), gathered over
data-parallel ranks, and the labels and cost weights the decider's loss (``retrofit.model.halting.tah2``) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def next_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: position ``t`` has a next-token target (``labels[:, t + 1] != -100``).

    The model's per-depth losses ``depth_nll[:, t]`` score the prediction made at ``t`` of token
    ``t + 1`` (the shift of causal LM training), and are 0, not NaN, where that label is -100.
    """
    return F.pad(labels[:, 1:], (0, 1), value=-100) != -100


def distributed() -> bool:
    """A ``torch.distributed`` process group is initialized (the collectives below then run)."""
    return dist.is_available() and dist.is_initialized()


def gather_gains(local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` values, concatenated in rank order (float64, ``[N_total]``); ``local`` itself
    without an initialized ``torch.distributed`` process group.

    The ranks hold different numbers of values: the sizes are gathered first, then every rank's values padded
    to the largest size, gathered and cut back. Every rank makes the same collective calls whatever it holds
    (none: size 0), so a caller that calls this a fixed number of times per forward keeps the ranks aligned;
    the second gather is skipped on every rank at once when no rank holds anything.
    """
    local = local.detach().double().flatten()
    if not distributed():
        return local
    world = dist.get_world_size()
    size = torch.tensor([local.numel()], dtype=torch.long, device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(n) for n in torch.cat(sizes).tolist()]
    longest = max(sizes)
    if longest == 0:
        return local
    padded = local.new_zeros(longest)
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def gain_cutoff(gains: torch.Tensor, rho: float, gather: bool = False) -> torch.Tensor:
    """The cutoff κ of the ρ rule (§3).

    Sort the positive gains in descending order and keep the smallest prefix whose sum reaches
    ``rho`` times the total positive gain; κ is the smallest kept gain.

    Args:
        gains: ``[N]`` gains δ of the candidate decisions (any sign).
        rho: share of the total positive gain to cover, in (0, 1].
        gather: pool the positive gains of every ``torch.distributed`` rank first (``gather_gains``; every
            rank must then call this the same number of times).

    Returns:
        Scalar float64 tensor. ``0`` when no gain is positive: then no decision is labeled
        "continue" (see ``lookahead_labels``).
    """
    pos = gains[gains > 0].double()
    if gather:
        pos = gather_gains(pos)
    if pos.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=gains.device)
    pos = pos.sort(descending=True).values
    cums = pos.cumsum(0)
    # cums is strictly increasing: the first index whose prefix sum reaches the target. Comparing
    # against cums[-1] (the same summation) makes rho = 1 land exactly on the last gain.
    idx = torch.searchsorted(cums, rho * cums[-1]).clamp_max(pos.numel() - 1)
    return pos[idx]


@dataclass
class LookaheadLabels:
    """Per-decision supervision of the TaH2 decider; ``K`` = number of decisions (≤ D - 1).

    Attributes:
        delta: ``[B, T, K]`` float64 gains ``δ^(d) = ℓ^(d) - ℓ^(d+1)``; NaN where no decision was made.
        decided: ``[B, T, K]`` bool: the decision at depth d was made (d ≤ d*, d < D) on a labeled
            position.
        labels: ``[B, T, K]`` float 0/1 targets ``y^(d)`` (1 = continue); 0 where not decided.
        weights: ``[B, T, K]`` cost-sensitive weights ``|δ - κ|`` of the candidate decisions; 0 elsewhere
            (``decider_loss`` clamps them to ``[cost_min, cost_max]``, so a decided non-candidate weighs
            exactly ``cost_min``).
        kappa: the cutoff: a float64 scalar (``scope="pooled"``) or ``[D - 1]``, one per depth boundary
            (``"per-boundary"``; 0 at a boundary without positive gains).
        candidate: ``[B, T, K]`` bool, the decisions whose gains entered the cutoff (every decided one when
            pooled; per boundary, the decisions of tokens labelled "continue" at the boundary before).
        n_boundaries: ``D - 1``, the decisions a forward can make (the size of collectives over ranks).
    """

    delta: torch.Tensor
    decided: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    kappa: torch.Tensor
    candidate: torch.Tensor | None = None
    n_boundaries: int | None = None


def lookahead_labels(
    depth_nll: torch.Tensor,
    token_mask: torch.Tensor,
    rho: float = 0.99,
    n_decisions: int | None = None,
    scope: str = "per-boundary",
    gather: bool = False,
) -> LookaheadLabels:
    """Lookahead labels for the TaH2 decider (docs/tah2.md, "lookahead labels").

    For each labeled token and each decision it made (depths ``d = 1 … min(d*, D - 1)``), the gain of
    one more iteration is ``δ^(d) = ℓ^(d) - ℓ^(d+1)``; ``ℓ^(d*+1)`` comes from the gradient-free
    lookahead iteration the model runs for halted tokens.

    ``scope="pooled"`` (retrofit < 0.3): with κ = ``gain_cutoff`` of all gains in the batch::

        y^(d) = 1  iff  δ^(d) ≥ κ  (and δ^(d) > 0, which only matters when no gain is positive)
        y^(d) = 0  for every d after the token's first 0 ("stop is absorbing");   weight |δ^(d) - κ|

    ``scope="per-boundary"`` (the release's ``finalize_posterior_labels``): boundary ``d = 1 … D - 1`` has its
    own cutoff over its candidates, the tokens labelled "continue" at ``d - 1`` (every labelled token at
    ``d = 1``) that executed depth ``d``::

        κ_d     = gain_cutoff(δ^(d) of the candidates)
        y^(d)   = 1  iff  candidate at d and δ^(d) ≥ κ_d (and δ^(d) > 0)
        weight  = |δ^(d) - κ_d| for a candidate; 0 otherwise (``decider_loss`` makes it ``cost_min``)

    so a token's label depth is 1 + the boundaries it continued at, and a decision after a stop is a "stop" at
    the smallest weight instead of a full-weight one. At ``D = 2`` the two scopes are the same.

    Args:
        depth_nll: ``[B, T, D]`` per-depth next-token losses; NaN where not computed (the model's
            ``outputs.depth_nll``).
        token_mask: ``[B, T]`` bool, positions with a next-token label (``next_token_mask``).
        rho: cutoff mass ρ (0.99; 1.0 keeps every positive gain).
        n_decisions: how many decisions the forward made (``halt_signals.shape[-1]``); default D - 1.
        scope: ``"per-boundary"`` or ``"pooled"`` (``TaH2Options.kappa_scope``).
        gather: pool every ``torch.distributed`` rank's candidate gains for each cutoff
            (``TaH2Options.kappa_gather``). Every rank makes the same calls: one cutoff (pooled) or ``D - 1``
            (per boundary, a boundary this rank made no decision at included).

    Returns:
        ``LookaheadLabels``.
    """
    if scope not in ("per-boundary", "pooled"):
        raise ValueError(f"scope must be 'per-boundary' or 'pooled', got {scope!r}")
    D = depth_nll.shape[-1]
    K = D - 1 if n_decisions is None else min(n_decisions, D - 1)
    nll = depth_nll.detach().double()
    delta = nll[..., :K] - nll[..., 1 : K + 1]  # NaN unless both depths were computed
    decided = torch.isfinite(delta) & token_mask[..., None].to(delta.device)
    delta = delta.masked_fill(~decided, float("nan"))
    if scope == "pooled":
        kappa = gain_cutoff(delta[decided], rho, gather)
        raw = decided & (delta >= kappa) & (delta > 0)
        labels = raw.long().cumprod(-1).bool() & decided  # absorbing stop
        weights = torch.where(decided, (delta - kappa).abs(), torch.zeros_like(delta))
        return LookaheadLabels(delta, decided, labels.to(delta.dtype), weights, kappa, decided, D - 1)
    labels = torch.zeros_like(decided)
    candidate = torch.zeros_like(decided)
    kappas = []
    cand = token_mask.to(delta.device).bool()
    for d in range(D - 1):  # every boundary, so that every rank makes the same collective calls
        if d < K:
            cand = cand & decided[..., d]
            kappa_d = gain_cutoff(delta[..., d][cand], rho, gather)
            hard = cand & (delta[..., d] >= kappa_d) & (delta[..., d] > 0)
            candidate[..., d], labels[..., d] = cand, hard
            cand = hard
        else:  # no decision here on this rank: an empty candidate set, for the collectives
            kappa_d = gain_cutoff(delta.new_zeros(0), rho, gather)
        kappas.append(kappa_d)
    kappa = torch.stack(kappas) if kappas else delta.new_zeros(0)
    weights = torch.where(candidate, (delta - kappa[:K]).abs(), torch.zeros_like(delta))
    return LookaheadLabels(delta, decided, labels.to(delta.dtype), weights, kappa, candidate, D - 1)
