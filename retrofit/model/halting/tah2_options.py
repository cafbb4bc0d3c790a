"""TaH2's options (``LoopConfig.options`` when ``method="tah2"``; docs/tah2.md, "the options of the release"): its
decider's inputs, body and init, its exit threshold and output, its training decisions and the weights and switches
of its decider loss, declared once here; ``retrofit.model.halting.tah2`` is the method that reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..config import _is_int, _is_number

DECIDER_LOSS_NORMS = ("tokens", "weights")
KAPPA_SCOPES = ("per-boundary", "pooled")
DECIDER_LOSS_SCOPES = ("global", "local")
TRAIN_DECISIONS = ("threshold", "sample")
DECIDER_ARCHS = ("swiglu", "ffn")
DECIDER_INITS = ("torch", "normal")


@dataclass
class TaH2Options:
    """TaH2's own options (``LoopConfig.options`` when ``method="tah2"``; docs/tah2.md): its output, its training
    decisions and the weights and switches of its decider loss. The defaults are the authors' release.

    Args:
        alpha_d: the decider-loss weight ``α_D`` in ``L = L_NTP + α_D · L_D`` (§3: 0.05).
        rho: the cutoff mass ``ρ``: the kept positive gains cover this share of the batch's total
            positive gain (§3: 0.99). ``1.0`` keeps every positive gain (the seed's "ρ = 1" ablation).
        decider_weighting: the BCE weights: ``"distance"`` = ``|δ - κ|`` (cost-sensitive, §3) or
            ``"uniform"`` (the seed's ablation, −3.6 points).
        dyn_pos_weight: the release: the BCE's ``pos_weight`` at each decision depth is the batch's
            negative/positive label ratio there (summed over data-parallel ranks), clamped to
            ``[0.02, 50]`` (1 when either class is absent), so "continue" and "stop" weigh the same in
            total whatever their frequency. ``False``: the static ``pos_weight``.
        pos_weight: the static ``pos_weight`` when ``dyn_pos_weight`` is off (1 = plain BCE).
        cost_min, cost_max: the release: the cost-sensitive weights ``|δ - κ|`` are clamped to
            ``[cost_min, cost_max]`` (``1e-6``, ``1``), so a few decisions with huge gains or losses
            cannot dominate the loss; ``cost_max=None`` leaves them unbounded (retrofit < 0.2).
        decider_loss_norm: ``"tokens"``: ``L_D = Σ w · BCE / N`` with ``N`` the labelled tokens (the
            release divides by ``num_items_in_batch``); ``"weights"``: ``Σ w · BCE / Σ w`` (retrofit < 0.2),
            which makes ``L_D`` independent of the gains' scale.
        bce_margin: the release: BCE on ``logit - m·(2y - 1)``: positives are pushed above ``+m``
            and negatives below ``-m`` in logit space (0 = plain BCE).
        kappa_scope: the cutoff κ at ``max_depth >= 3`` (docs/tah2.md, "lookahead labels"):
            ``"per-boundary"`` (the release): one κ per depth boundary ``d``, over the tokens labelled
            "continue" at ``d - 1`` that executed depth ``d``; the other decisions at ``d`` are "stop" with
            weight ``cost_min``. ``"pooled"`` (retrofit < 0.3): one κ over every decision of the batch, every
            decision at weight ``|δ - κ|``. The two are identical at ``max_depth = 2``.
        kappa_gather: the release: under ``torch.distributed`` the candidates' positive gains are gathered
            from every rank, so every rank labels with the same κ; ``False``: κ per process.
        decider_loss_scope: ``N`` of ``decider_loss_norm="tokens"``: ``"global"`` (the release) = the forward's
            ``num_items_in_batch`` (every rank's and accumulation step's labelled tokens), the trainer then
            scaling the auxiliary loss like the LM loss; ``"local"`` (retrofit < 0.3) = this micro-batch's
            labelled tokens, the trainer dividing by the accumulation steps.
        decider_top_k: how many top next-token probabilities the decider reads (§3). ``None`` = the hidden size
            (the release normalizes them with an ``RMSNorm(hidden)``, so it reads ``H`` of them: 2,048 for
            Qwen3-1.7B; the converted model stores the number). ``0``: no probability features — the decider
            reads ``e`` and ``s`` only, and with ``mixture_output=False`` inference then reads out the exit depth
            only (no LM head or coda per depth: docs/tah2.md, "what a continue costs").
        decider_topk_grad: the top-K probabilities enter the decider with gradient (the release), so ``α_D ·
            L_D`` also shapes the LM distribution through them; ``False``: detached features.
        decider_arch: ``"swiglu"`` (the authors' release: each input part RMS-normed on its own, an input
            projection, a SwiGLU MLP, an output norm and a bias-free score layer drawn from
            N(0, ``decider_init_std``), so p ≈ 0.5 at the start) or ``"ffn"`` (retrofit < 0.2: one RMSNorm over
            the concatenated input, ``fc2(SiLU(fc1(·)))``, score bias ``deep_init_logit``).
        decider_init_std: std of the ``"swiglu"`` decider's score layer at init (release: 0.01).
        decider_init: the ``"swiglu"`` decider's inner layers at init: ``"torch"`` (PyTorch's default, as the
            release) or ``"normal"`` (N(0, ``initializer_range``), retrofit < 0.3).
        exit_threshold: ``τ_exit``: a token stops at the first depth whose continue probability is below it (§3:
            0.5), in training (on-policy) and at inference; the frontier and calibration move it.
        mixture_output: TaH2's output = the halting-weighted mixture of the per-depth distributions (§3);
            ``False`` is the seed's "final-depth prediction only" ablation.
        train_decisions: the training-time depth choice: ``"threshold"`` (on-policy, the inference rule, §3) or
            ``"sample"`` (Bernoulli on the continue probability, the seed's ablation).
    """

    #: what a checkpoint written before an option existed was trained with (``LoopConfig.from_dict``): retrofit
    #: < 0.2 had none of the release's loss guards, < 0.3 one pooled κ per process and a per-micro-batch normalizer
    LEGACY_VALUES: ClassVar[dict] = {
        "decider_arch": "ffn",
        "decider_topk_grad": False,
        "decider_init": "normal",
        "dyn_pos_weight": False,
        "cost_min": 0.0,
        "cost_max": None,
        "decider_loss_norm": "weights",
        "kappa_scope": "pooled",
        "kappa_gather": False,
        "decider_loss_scope": "local",
    }

    alpha_d: float = field(default=0.05, metadata={"help": "weight α_D of the decider loss."})
    rho: float = field(
        default=0.99,
        metadata={"help": "cutoff mass ρ of the lookahead labels; 1.0 = every positive gain."},
    )
    decider_weighting: str = field(
        default="distance",
        metadata={"help": "BCE weights, 'distance' = |δ - κ| or 'uniform' (ablation)."},
    )
    dyn_pos_weight: bool = field(
        default=True,
        metadata={
            "help": (
                "BCE pos_weight = the batch's negative/positive label ratio per depth, clamped to "
                "(the authors' release); false = the static --pos_weight."
            )
        },
    )
    pos_weight: float = field(default=1.0, metadata={"help": "static BCE pos_weight when --dyn_pos_weight false."})
    cost_min: float = field(default=1e-6, metadata={"help": "lower clamp of the cost-sensitive weights |δ - κ|."})
    cost_max: float | None = field(
        default=1.0, metadata={"help": "upper clamp of the cost-sensitive weights; inf = unbounded."}
    )
    decider_loss_norm: str = field(
        default="tokens",
        metadata={"help": ("L_D = Σ w·BCE / labelled tokens ('tokens', the release) or / Σ w ('weights').")},
    )
    bce_margin: float = field(default=0.0, metadata={"help": "BCE margin m in logit space (the release's bce_margin)."})
    kappa_scope: str = field(
        default="per-boundary",
        metadata={
            "help": (
                "At max_depth >= 3: 'per-boundary' = one cutoff κ per depth boundary over the tokens "
                "labelled continue at the boundary before, the others' later decisions at weight cost_min "
                "(the release); 'pooled' = one κ over every decision. Identical at max_depth 2."
            )
        },
    )
    kappa_gather: bool = field(
        default=True,
        metadata={
            "help": (
                "Gather the cutoff's gains from every data-parallel rank, so all ranks use one κ (the"
                " release); false = κ per process."
            )
        },
    )
    decider_loss_scope: str = field(
        default="global",
        metadata={
            "help": (
                "'global' = divide L_D by num_items_in_batch (labelled tokens of every rank and "
                "accumulation step) and scale it like the LM loss (the release); 'local' = divide by the "
                "micro-batch's labelled tokens and by the accumulation steps."
            )
        },
    )

    decider_top_k: int | None = field(
        default=None,
        metadata={
            "help": (
                "Top-K next-token probabilities the decider reads; None = the hidden size (the release: its "
                "RMSNorm(hidden) over them reads H of them); 0 = none."
            )
        },
    )
    decider_topk_grad: bool = field(
        default=True,
        metadata={
            "help": (
                "The top-K probabilities enter the decider with gradient, so the decider loss also shapes the LM "
                "distribution (the release); false = detached."
            )
        },
    )
    decider_arch: str = field(
        default="swiglu",
        metadata={
            "help": (
                "The decider's body: 'swiglu' (the authors' release: per-part norms, SwiGLU MLP, bias-free score "
                "at N(0, 0.01)) or 'ffn' (retrofit < 0.2, starts at deep_init_logit)."
            )
        },
    )
    decider_init_std: float = field(
        default=0.01, metadata={"help": "'swiglu' decider: std of the score layer at init (release: 0.01)."}
    )
    decider_init: str = field(
        default="torch",
        metadata={
            "help": (
                "'swiglu' decider's inner layers at init: 'torch' (PyTorch's default, the release) or 'normal' "
                "(N(0, initializer_range))."
            )
        },
    )
    exit_threshold: float = field(
        default=0.5, metadata={"help": "τ_exit: a token stops at the first depth whose continue probability is < τ."}
    )
    mixture_output: bool = field(
        default=True, metadata={"help": "mixture of per-depth outputs; false = final depth only (ablation)."}
    )
    train_decisions: str = field(
        default="threshold", metadata={"help": "'threshold' (on-policy) or 'sample' (ablation)."}
    )

    def __post_init__(self):
        if not _is_number(self.rho) or not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must lie in (0, 1], got {self.rho!r}")
        if self.decider_weighting not in ("distance", "uniform"):
            raise ValueError(f"decider_weighting must be 'distance' or 'uniform', got {self.decider_weighting!r}")
        if not _is_number(self.alpha_d) or self.alpha_d < 0:
            raise ValueError(f"alpha_d must be a number >= 0, got {self.alpha_d!r}")
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
        if self.decider_top_k is not None and (not _is_int(self.decider_top_k) or self.decider_top_k < 0):
            raise ValueError(
                "decider_top_k must be None (the hidden size) or an integer >= 0 (0 = no probability features), "
                f"got {self.decider_top_k!r}"
            )
        if not isinstance(self.decider_topk_grad, bool):
            raise ValueError(f"decider_topk_grad must be true or false, got {self.decider_topk_grad!r}")
        if self.decider_arch not in DECIDER_ARCHS:
            raise ValueError(f"decider_arch must be one of {', '.join(DECIDER_ARCHS)}, got {self.decider_arch!r}")
        if not _is_number(self.decider_init_std) or not self.decider_init_std >= 0:
            raise ValueError(f"decider_init_std must be a number >= 0, got {self.decider_init_std!r}")
        if self.decider_init not in DECIDER_INITS:
            raise ValueError(f"decider_init must be one of {', '.join(DECIDER_INITS)}, got {self.decider_init!r}")
        if not _is_number(self.exit_threshold) or not 0.0 < self.exit_threshold < 1.0:
            raise ValueError(f"exit_threshold must be a number strictly between 0 and 1, got {self.exit_threshold!r}")
        if not isinstance(self.mixture_output, bool):
            raise ValueError(f"mixture_output must be true or false, got {self.mixture_output!r}")
        if self.train_decisions not in TRAIN_DECISIONS:
            raise ValueError(
                f"train_decisions must be one of {', '.join(TRAIN_DECISIONS)}, got {self.train_decisions!r}"
            )
