"""``LossConfig``: the weights and switches of the halting methods' auxiliary losses (docs/tah2.md, docs/anira.md).

``retrofit.model.config.LoopConfig`` inherits these fields (keyword-only), so a model computes its own auxiliary
loss from its loop spec and any trainer optimizes the method's objective; they are declared, defaulted, helped and
validated here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DECIDER_LOSS_NORMS = ("tokens", "weights")
KAPPA_SCOPES = ("per-boundary", "pooled")
DECIDER_LOSS_SCOPES = ("global", "local")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(kw_only=True)
class LossConfig:
    """Weights and switches of the methods' auxiliary training losses (docs/tah2.md, docs/anira.md).

    ``LoopConfig`` inherits these fields (keyword-only, so its own come first positionally): the
    weights are declared, defaulted and validated here only.

    Args:
        alpha_d: TaH2's decider-loss weight ``α_D`` in ``L = L_NTP + α_D · L_D`` (§3: 0.05).
        rho: TaH2's cutoff mass ``ρ``: the kept positive gains cover this share of the batch's total
            positive gain (§3: 0.99). ``1.0`` keeps every positive gain (the seed's "ρ = 1" ablation).
        decider_weighting: TaH2's BCE weights: ``"distance"`` = ``|δ - κ|`` (cost-sensitive, §3) or
            ``"uniform"`` (the seed's ablation, −3.6 points).
        gamma: ANIRA's weight ``γ`` of the KL-to-prior term ``L_C`` (§4). The seed tunes it by grid
            search (ANIRA Appendix Table 5, values not in the seed); 0.01 is our default.
        prior_base: ANIRA's prior ``p(d) ∝ b^(-d)``; ``b = 1`` leaves only the entropy term (§4).
        dyn_pos_weight: TaH2 release: the BCE's ``pos_weight`` at each decision depth is the batch's
            negative/positive label ratio there (summed over data-parallel ranks), clamped to
            ``[0.02, 50]`` (1 when either class is absent), so "continue" and "stop" weigh the same in
            total whatever their frequency. ``False``: the static ``pos_weight``.
        pos_weight: the static ``pos_weight`` when ``dyn_pos_weight`` is off (1 = plain BCE).
        cost_min, cost_max: TaH2 release: the cost-sensitive weights ``|δ - κ|`` are clamped to
            ``[cost_min, cost_max]`` (``1e-6``, ``1``), so a few decisions with huge gains or losses
            cannot dominate the loss; ``cost_max=None`` leaves them unbounded (retrofit < 0.2).
        decider_loss_norm: ``"tokens"``: ``L_D = Σ w · BCE / N`` with ``N`` the labelled tokens (the
            release divides by ``num_items_in_batch``); ``"weights"``: ``Σ w · BCE / Σ w`` (retrofit < 0.2),
            which makes ``L_D`` independent of the gains' scale.
        bce_margin: TaH2 release: BCE on ``logit - m·(2y - 1)``: positives are pushed above ``+m``
            and negatives below ``-m`` in logit space (0 = plain BCE).
        kappa_scope: TaH2's cutoff κ at ``max_depth >= 3`` (docs/tah2.md, "lookahead labels"):
            ``"per-boundary"`` (the release): one κ per depth boundary ``d``, over the tokens labelled
            "continue" at ``d - 1`` that executed depth ``d``; the other decisions at ``d`` are "stop" with
            weight ``cost_min``. ``"pooled"`` (retrofit < 0.3): one κ over every decision of the batch, every
            decision at weight ``|δ - κ|``. The two are identical at ``max_depth = 2``.
        kappa_gather: TaH2 release: under ``torch.distributed`` the candidates' positive gains are gathered
            from every rank, so every rank labels with the same κ; ``False``: κ per process.
        decider_loss_scope: ``N`` of ``decider_loss_norm="tokens"``: ``"global"`` (the release) = the forward's
            ``num_items_in_batch`` (every rank's and accumulation step's labelled tokens), the trainer then
            scaling the auxiliary loss like the LM loss; ``"local"`` (retrofit < 0.3) = this micro-batch's
            labelled tokens, the trainer dividing by the accumulation steps.
    """

    alpha_d: float = field(default=0.05, metadata={"help": "TaH2: weight α_D of the decider loss."})
    rho: float = field(
        default=0.99,
        metadata={"help": "TaH2: cutoff mass ρ of the lookahead labels; 1.0 = every positive gain."},
    )
    decider_weighting: str = field(
        default="distance",
        metadata={"help": "TaH2: BCE weights, 'distance' = |δ - κ| or 'uniform' (ablation)."},
    )
    gamma: float = field(default=0.01, metadata={"help": "ANIRA: weight γ of the KL-to-prior loss L_C."})
    prior_base: float = field(
        default=2.0, metadata={"help": "ANIRA: base b of the depth prior p(d) ∝ b^(-d); 1 = entropy term only."}
    )
    dyn_pos_weight: bool = field(
        default=True,
        metadata={
            "help": (
                "TaH2: BCE pos_weight = the batch's negative/positive label ratio per depth, clamped to "
                "(the authors' release); false = the static --pos_weight."
            )
        },
    )
    pos_weight: float = field(
        default=1.0, metadata={"help": "TaH2: static BCE pos_weight when --dyn_pos_weight false."}
    )
    cost_min: float = field(default=1e-6, metadata={"help": "TaH2: lower clamp of the cost-sensitive weights |δ - κ|."})
    cost_max: float | None = field(
        default=1.0, metadata={"help": "TaH2: upper clamp of the cost-sensitive weights; inf = unbounded."}
    )
    decider_loss_norm: str = field(
        default="tokens",
        metadata={"help": ("TaH2: L_D = Σ w·BCE / labelled tokens ('tokens', the release) or / Σ w ('weights').")},
    )
    bce_margin: float = field(
        default=0.0, metadata={"help": "TaH2: BCE margin m in logit space (the release's bce_margin)."}
    )
    kappa_scope: str = field(
        default="per-boundary",
        metadata={
            "help": (
                "TaH2 at max_depth >= 3: 'per-boundary' = one cutoff κ per depth boundary over the tokens "
                "labelled continue at the boundary before, the others' later decisions at weight cost_min "
                "(the release); 'pooled' = one κ over every decision. Identical at max_depth 2."
            )
        },
    )
    kappa_gather: bool = field(
        default=True,
        metadata={
            "help": (
                "TaH2: gather the cutoff's gains from every data-parallel rank, so all ranks use one κ (the"
                " release); false = κ per process."
            )
        },
    )
    decider_loss_scope: str = field(
        default="global",
        metadata={
            "help": (
                "TaH2: 'global' = divide L_D by num_items_in_batch (labelled tokens of every rank and "
                "accumulation step) and scale it like the LM loss (the release); 'local' = divide by the "
                "micro-batch's labelled tokens and by the accumulation steps."
            )
        },
    )

    def __post_init__(self):
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must lie in (0, 1], got {self.rho!r}")
        if self.decider_weighting not in ("distance", "uniform"):
            raise ValueError(f"decider_weighting must be 'distance' or 'uniform', got {self.decider_weighting!r}")
        if self.alpha_d < 0 or self.gamma < 0:
            raise ValueError(f"alpha_d and gamma must be >= 0, got alpha_d={self.alpha_d!r}, gamma={self.gamma!r}")
        if self.prior_base <= 0:
            raise ValueError(f"prior_base (b in p(d) ∝ b^(-d)) must be > 0, got {self.prior_base!r}")
        if not isinstance(self.dyn_pos_weight, bool):
            raise ValueError(f"dyn_pos_weight must be true or false, got {self.dyn_pos_weight!r}")
        if not _is_number(self.pos_weight) or not self.pos_weight > 0:
            raise ValueError(f"pos_weight must be a number > 0, got {self.pos_weight!r}")
        if not _is_number(self.cost_min) or self.cost_min < 0:
            raise ValueError(f"cost_min must be a number >= 0, got {self.cost_min!r}")
        if self.cost_max is not None and (not _is_number(self.cost_max) or not self.cost_max > self.cost_min):
            raise ValueError(f"cost_max must be None (no upper clamp) or a number > cost_min, got {self.cost_max!r}")
        if self.decider_loss_norm not in DECIDER_LOSS_NORMS:
            raise ValueError(
                f"decider_loss_norm must be one of {', '.join(DECIDER_LOSS_NORMS)}, got {self.decider_loss_norm!r}"
            )
        if not _is_number(self.bce_margin) or self.bce_margin < 0:
            raise ValueError(f"bce_margin must be a number >= 0, got {self.bce_margin!r}")
        if self.kappa_scope not in KAPPA_SCOPES:
            raise ValueError(f"kappa_scope must be one of {', '.join(KAPPA_SCOPES)}, got {self.kappa_scope!r}")
        if not isinstance(self.kappa_gather, bool):
            raise ValueError(f"kappa_gather must be true or false, got {self.kappa_gather!r}")
        if self.decider_loss_scope not in DECIDER_LOSS_SCOPES:
            raise ValueError(
                f"decider_loss_scope must be one of {', '.join(DECIDER_LOSS_SCOPES)}, got {self.decider_loss_scope!r}"
            )


LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig))
