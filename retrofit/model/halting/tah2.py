"""TaH2: a token-level iteration decider trained with lookahead depth supervision (docs/tah2.md).

Decider (after each depth ``d < D``)::

    c_t^(d) = σ(decider(e_t, h_t^(d), top-K of softmax(z_t^(d))))      continue probability

``decider`` is the release's ``SwiGLUDecider`` (each part RMS-normed on its own; score layer N(0, 0.01),
so p ≈ 0.5 at init) or the older ``DeciderFFN`` (``TaH2Options.decider_arch``).

A token stops at the first ``d`` with ``c < τ_exit`` (0.5), else runs to ``D``. The rule is the same
in training (on-policy); the seed's "sampled decisions" ablation draws Bernoulli(c) instead.

Output mixture: ``π_1 = 1 - c^(1)``, ``π_2 = c^(1)(1 - c^(2))``, …; the last executed depth absorbs
the remaining mass ``Π_{j<d*} c^(j)``; ``p_t = Σ_d π_d softmax(z^(d))``. ``DepthMixture`` computes it
streaming, depth by depth, for the full-sequence forward and the decode path alike; ``mixture_weights``
gives the weights ``π`` for a finished loop.

The decider reads ``e`` (the core input of depth 1), the state ``s_d`` (``LoopConfig.decider_state``: after
the final norm, as the release's ``hidden_states[-1]``, or the core output) and the top-K probabilities,
with gradient (``decider_topk_grad``, the release: ``α_D · L_D`` then also shapes the LM distribution) or
detached.

Training loss (§3, "lookahead depth supervision")::

    L = L_NTP(mixture) + α_D · L_D,     α_D = 0.05

``L_NTP`` is the model's own ``outputs.loss`` (NLL of the mixture). ``L_D`` is a cost-sensitive BCE
on the continue logits against lookahead labels built by ``lookahead_labels`` from the
per-token loss gains ``δ^(d) = ℓ^(d) - ℓ^(d+1)``; see that function for the exact rule, and
``decider_loss`` for the weighting and the guards of the authors' release (dynamic ``pos_weight``,
clamped costs, normalization by tokens, a logit margin).

The cutoff κ (``gain_cutoff``) is one per depth boundary (``kappa_scope="per-boundary"``, the release) or one
over all decisions (``"pooled"``); under ``torch.distributed`` its inputs are gathered from every rank
(``kappa_gather``, the release: ``gather_gains``, a fixed number of collectives per forward whatever a rank
holds), so every rank labels with the same κ. With gradient accumulation each micro-batch still has its own κ
(the release's too). ``L_D`` is divided by the forward's ``num_items_in_batch`` (every rank's and accumulation
step's labelled tokens) under ``decider_loss_scope="global"``, so a trainer scales it like the LM loss.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import LoopConfig
from ..heads import DeciderFFN, SwiGLUDecider, release_decider_width
from .base import AuxLoss, DepthCombiner, ExitLogits, HaltContext, HaltingMethod

# the lookahead labels live in their own module; importable from here as before
from .lookahead import (  # noqa: F401
    LookaheadLabels,
    distributed,
    gain_cutoff,
    gather_gains,
    lookahead_labels,
    next_token_mask,
)
from .tah2_options import (  # noqa: F401  (TaH2's settings: their own module, importable from here)
    DECIDER_ARCHS,
    DECIDER_INITS,
    DECIDER_LOSS_NORMS,
    DECIDER_LOSS_SCOPES,
    KAPPA_SCOPES,
    TRAIN_DECISIONS,
    TaH2Options,
)


class TaH2(HaltingMethod):
    name = "tah2"
    description = (
        "TaH2, a token-level iteration decider; the output is the halting-weighted mixture of the depths' predictions"
    )
    default_attention = "duo-causal"
    threshold_field = "exit_threshold"
    threshold_meaning = "τ_exit (continue iff c >= τ)"
    threshold_rule = "continue_at_or_above"
    Options = TaH2Options
    decider_runs = "per_depth"
    vllm_supported = True
    #: the release's behaviour for the model-side fields a LoopConfig leaves None (docs/tah2.md)
    loop_defaults = {
        "updater": "release",
        "decider_state": "final_norm",
        "decider_width_rule": "release",
        "padding_stops": True,
    }

    @classmethod
    def reads_every_depth(cls, loop) -> bool:
        o = loop.method_options
        return o.decider_top_k is None or o.decider_top_k > 0 or o.mixture_output

    @classmethod
    def card_rows(cls, loop) -> list[tuple[str, str]]:
        return [
            ("exit threshold τ", str(loop.method_options.exit_threshold)),
            ("mixture output", str(loop.method_options.mixture_output)),
        ]

    @classmethod
    def resolve_shapes(cls, loop, hidden_size: int, updater_params: int, base_params: int) -> dict:
        """The decider's top-K (``None``: the hidden size) and its ``"release"`` width (``heads.release_decider_width``:
        the hidden size, halved until the heads fit the budget; it counts the base model's parameters)."""
        top_k = loop.method_options.decider_top_k
        resolved = {}
        if top_k is None:
            top_k = hidden_size
            resolved["options"] = {"decider_top_k": top_k}
        if loop.decider_hidden is None and loop.decider_width_rule == "release":
            resolved["decider_hidden"] = release_decider_width(hidden_size, top_k, updater_params, base_params)
        return resolved

    @classmethod
    def continue_probabilities(cls, out, max_depth: int) -> torch.Tensor:
        """``c^(d)``: the decider's own continue probabilities (``halt_signals``)."""
        return out.halt_signals.float()

    def __init__(self, hidden_size: int, loop: LoopConfig):
        super().__init__(hidden_size, loop)
        o = loop.method_options
        self.top_k = hidden_size if o.decider_top_k is None else o.decider_top_k
        self.arch = o.decider_arch
        if self.arch == "swiglu":
            parts = [hidden_size, hidden_size] + ([self.top_k] if self.top_k else [])
            self.decider = SwiGLUDecider(parts, self.decider_hidden, 1, o.decider_init_std, init=o.decider_init)
        else:  # "ffn": starts deep, continue logit = +deep_init_logit for every token
            self.decider = DeciderFFN(2 * hidden_size + self.top_k, self.decider_hidden, 1, loop.deep_init_logit)

    @property
    def options(self) -> TaH2Options:
        """This model's ``TaH2Options`` (read from ``self.loop``, which the model may replace)."""
        return self.loop.method_options

    @property
    def mixture_output(self) -> bool:
        return self.options.mixture_output

    @property
    def readout_grad(self) -> bool:
        """The decider's probability features keep their gradient (``decider_topk_grad``)."""
        return self.options.decider_topk_grad

    @property
    def needs_depth_readout(self) -> bool:
        """The decider reads the depth's top-K probabilities, or the output mixes every depth."""
        return self.top_k > 0 or self.options.mixture_output

    def continue_logit(self, e: torch.Tensor, h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """``e``, ``h``: ``[..., H]`` (``h``: the state ``s_d`` of ``LoopConfig.decider_state``); ``probs``:
        ``[..., V]`` (None when ``decider_top_k == 0``; its gradient is kept under ``decider_topk_grad``) -> the
        continue logit ``[...]`` (float32)."""
        parts = [e, h]
        if self.top_k:
            k = min(self.top_k, probs.shape[-1])
            top = (probs if self.options.decider_topk_grad else probs.detach()).topk(k, dim=-1).values
            if k < self.top_k:
                top = F.pad(top, (0, self.top_k - k))
            parts.append(top.to(h.dtype))
        if self.arch == "swiglu":
            return self.decider(*parts).squeeze(-1).float()
        return self.decider(torch.cat(parts, dim=-1)).squeeze(-1).float()

    def continue_prob(self, e: torch.Tensor, h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """``σ(continue_logit)``: the probability to continue ``[...]``."""
        return torch.sigmoid(self.continue_logit(e, h, probs))

    def step(self, d, e, h, probs, ctx: HaltContext):
        logit = self.continue_logit(e, h, probs)
        c = torch.sigmoid(logit)
        ctx.signals.append(c)
        ctx.extra.setdefault("halt_logits", []).append(logit)
        if ctx.training and self.options.train_decisions == "sample":
            return torch.bernoulli(c.detach()).bool()
        tau = self.options.exit_threshold if ctx.threshold is None else ctx.threshold
        return c >= tau

    def combiner(self, ctx: HaltContext) -> DepthCombiner:
        """The mixture of the per-depth distributions (or, as the ablation, the exit depth's logits)."""
        return DepthMixture() if self.mixture_output else ExitLogits()

    def distribution(self, ctx: HaltContext, depths: torch.Tensor):
        """π ``[B, T, D]`` from the continue probabilities, given exit depths ``[B, T]``."""
        return mixture_weights(ctx.signals, depths, ctx.max_depth), None

    # -- training ------------------------------------------------------------------------------
    needs_depth_losses = True

    def train_forward_kwargs(self, cfg, step: int = 0) -> dict:
        """The release's threshold warm-up (``cfg.threshold_warmup_steps`` = its ``base_warmup_steps``):
        during the first ``W`` optimizer steps the training decisions use ``τ · step / W`` instead of
        ``τ``, so early on (nearly) every token continues and every depth gets trained."""
        w = getattr(cfg, "threshold_warmup_steps", 0) or 0
        if w > 0 and step < w:
            return {"decider_threshold": self.options.exit_threshold * step / w}
        return {}

    def aux_loss_per_item(self, cfg: TaH2Options) -> bool:
        """``L_D`` is divided by the forward's ``num_items_in_batch`` (``decider_loss_scope="global"``)."""
        return cfg.decider_loss_norm == "tokens" and cfg.decider_loss_scope == "global"

    def loss(self, outputs, labels, cfg: TaH2Options, attention_mask=None, num_items_in_batch=None) -> AuxLoss | None:
        """``α_D · L_D`` (§3) from ``outputs.depth_nll`` and the decider's logits ``outputs.halt_logits``.

        Only positions with a next-token label (``labels[:, t + 1] != -100``) get decider labels:
        the gain ``δ`` is undefined elsewhere. ``attention_mask`` is not needed (padding has
        label -100). ``N`` of ``decider_loss_norm="tokens"`` is ``num_items_in_batch`` under
        ``decider_loss_scope="global"`` when given, else this batch's labelled tokens; the logged
        ``decider_loss`` is always per labelled token of this batch.
        """
        if outputs.halt_signals is None:  # max_depth == 1 (or a depth cap of 1): no decision was made
            return None
        if outputs.depth_nll is None:
            raise ValueError(
                "TaH2's decider loss needs outputs.depth_nll: call the model with labels= and the auxiliary loss "
                "on (output_router_logits, default config.output_router_logits), or with output_depth_losses=True"
            )
        mask = next_token_mask(labels)
        lab = lookahead_labels(
            outputs.depth_nll,
            mask,
            cfg.rho,
            n_decisions=outputs.halt_signals.shape[-1],
            scope=cfg.kappa_scope,
            gather=cfg.kappa_gather,
        )
        logits = outputs.halt_logits
        if logits is None:  # a caller that kept only the probabilities
            c = outputs.halt_signals.float().clamp(1e-7, 1 - 1e-7)
            logits = c.log() - (-c).log1p()
        n_local = mask.sum()
        per_item = self.aux_loss_per_item(cfg) and num_items_in_batch is not None
        n = num_items_in_batch if per_item else n_local
        l_d, metrics = decider_loss(logits, lab, cfg, n_tokens=n, exit_threshold=cfg.exit_threshold)
        if per_item:  # log the per-token loss of this batch, whatever the normalizer
            n_global = torch.as_tensor(n, device=l_d.device).float()
            metrics["decider_loss"] = l_d.detach() * n_global / n_local.clamp_min(1)
        return AuxLoss(cfg.alpha_d * l_d, metrics)

    def decider_phase_loss(self, outputs, labels, cfg: TaH2Options, num_items_in_batch=None) -> AuxLoss | None:
        """The decider-only phase: ``L_D`` alone (unweighted), the BCE against the lookahead labels on the frozen
        backbone (the first TaH paper's second stage, with TaH2's labels)."""
        return self.loss(outputs, labels, dataclasses.replace(cfg, alpha_d=1.0), num_items_in_batch=num_items_in_batch)


class DepthMixture(DepthCombiner):
    """TaH2's output, streaming: ``log Σ_d π_d softmax(z^(d))``, with ``π_d`` known right after depth
    ``d``'s decision (the token's survival ``Π_{j<d} c^(j)`` times ``1 - c^(d)``, or the whole survival
    at its exit depth).

    The returned logits are ``log p_mix + logsumexp(z^(d*))``: the log-mixture shifted per token by the
    exit depth's log-partition, so that a one-depth mixture returns that depth's raw logits and
    ``softmax(logits) = p_mix``. A token that exits at depth 1 gets its depth-1 logits exactly (the
    shifted log-mixture equals them only up to rounding). The shift carries no gradient: a per-token
    constant leaves every softmax and NLL unchanged, so its gradient is 0 in exact arithmetic, and
    skipping it saves vocabulary-wide backward passes.

    Per-token state: ``survive`` ``[...]``, ``log_mix`` ``[..., V]``, ``lse_exit`` ``[...]`` and the
    depth-1 logits.
    """

    def __init__(self):
        self.log_mix = self.lse_exit = self.z_first = None
        self.survive = None

    @property
    def needs_log_probs(self) -> bool:
        return True

    def add(self, d, z, logp, active, stop, signal):
        if logp is None:
            logp = z.float().log_softmax(-1)
        survive = torch.ones_like(logp[..., 0]) if self.survive is None else self.survive
        pi = survive if signal is None else torch.where(stop, survive, survive * (1 - signal))
        # clamp: a saturated c (= 1.0 in fp32) must not give log(0), whose backward is NaN
        log_pi = torch.where(active, pi.clamp_min(1e-30).log(), torch.full_like(pi, float("-inf")))
        term = log_pi[..., None] + logp
        self.log_mix = term if self.log_mix is None else torch.logaddexp(self.log_mix, term)
        with torch.no_grad():  # only a per-token shift of the output (see the class docstring)
            lse = z.float().logsumexp(-1)
        self.lse_exit = lse if self.lse_exit is None else torch.where(stop, lse, self.lse_exit)
        if signal is not None:
            survive = survive * signal
        self.survive = survive
        if self.z_first is None:
            self.z_first = z

    def logits(self, depths):
        first = depths <= 1
        if bool(first.all()):  # (skip vocabulary-wide work that selects nothing)
            return self.z_first
        mixed = (self.log_mix + self.lse_exit[..., None]).to(self.z_first.dtype)
        return torch.where(first[..., None], self.z_first, mixed) if bool(first.any()) else mixed


def mixture_weights(cont: list[torch.Tensor], depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Halting weights of the output mixture.

    Args:
        cont: continue probabilities ``c^(1) … c^(k)``, each ``[B, T]`` (k may be < D - 1 when the
            loop stopped early; depths never exceed ``k + 1`` then).
        depths: exit depths ``[B, T]`` (1-based).
        max_depth: ``D``.

    Returns:
        ``[B, T, D]``: ``π_d = (1 - c^(d)) Π_{j<d} c^(j)`` for ``d < d*``, ``Π_{j<d*} c^(j)`` at ``d*``
        (the last executed depth absorbs the remaining mass), 0 beyond. Rows sum to 1.
    """
    B, T = depths.shape
    out = []
    survive = torch.ones(B, T, dtype=torch.float32, device=depths.device)
    for d in range(1, max_depth + 1):
        is_last = depths == d
        if d <= len(cont):
            c = cont[d - 1].float()
            w = torch.where(is_last, survive, survive * (1 - c))
            next_survive = survive * c
        else:
            w = torch.where(is_last, survive, torch.zeros_like(survive))
            next_survive = survive
        w = torch.where(depths >= d, w, torch.zeros_like(w))
        out.append(w)
        survive = next_survive
    return torch.stack(out, dim=-1)


DYN_POS_WEIGHT_RANGE = (0.02, 50.0)  # the release's clamp of the dynamic pos_weight


def dynamic_pos_weight(y: torch.Tensor, decided: torch.Tensor, n_slots: int | None = None) -> torch.Tensor:
    """The release's BCE ``pos_weight`` per decision depth: ``#negatives / #positives`` among the decisions
    made there, clamped to ``[0.02, 50]``; 1 where either class is absent.

    Args:
        y: ``[..., K]`` 0/1 labels; decided: ``[..., K]`` bool, the decision was made.
        n_slots: the all-reduce's size (``D - 1``, the same on every rank even where a rank made fewer
            decisions); default ``K``.

    Returns:
        ``[K]`` float32. Under ``torch.distributed`` the counts are summed over all ranks first (one
        fixed-size all-reduce), as the release does, so every rank weighs the same.
    """
    K = y.shape[-1]
    yf, m = y.reshape(-1, K).float(), decided.reshape(-1, K)
    pos = (yf * m).sum(0)
    neg = ((1 - yf) * m).sum(0)
    counts = torch.stack([pos, neg])
    if distributed():
        counts = F.pad(counts, (0, max(K, n_slots or K) - K))
        dist.all_reduce(counts)
        counts = counts[:, :K]
    pos, neg = counts
    ratio = (neg / pos.clamp_min(1)).clamp(*DYN_POS_WEIGHT_RANGE)
    return torch.where((pos > 0) & (neg > 0), ratio, torch.ones_like(ratio))


def decider_loss(
    logits: torch.Tensor,
    lab: LookaheadLabels,
    cfg: TaH2Options | None = None,
    n_tokens: torch.Tensor | int | None = None,
    exit_threshold: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cost-sensitive BCE of the continue logits against the lookahead labels (§3, and the release's guards).

    Per decision ``(t, d)`` made on a labelled token (the tokens that executed depth ``d``, on-policy)::

        w    = clamp(|δ - κ_d|, cost_min, cost_max)          (weighting "distance"; 1 for "uniform"); a decision
                                                           that was no cutoff candidate weighs cost_min
        ℓ    = BCE_with_logits(s - m·(2y - 1), y; pos_weight_d)   s = the continue logit, m = bce_margin
        L_D  = Σ w · ℓ / N                                     N = n_tokens ("tokens", the release)
             = Σ w · ℓ / Σ w                                   ("weights", retrofit < 0.2)

    ``pos_weight_d`` is ``dynamic_pos_weight`` of the depth-``d`` decisions (``dyn_pos_weight``) or the
    static ``pos_weight``. A batch with nothing to normalize by gives 0.

    Args:
        logits: ``[B, T, k]`` continue logits (``outputs.halt_logits``; ``σ`` of them is ``halt_signals``).
        lab: ``lookahead_labels`` output (the common prefix of its ``K`` and ``k`` decisions is used).
        cfg: the loss switches (``TaH2Options``; default: its defaults, the release's).
        n_tokens: ``N`` of the ``"tokens"`` normalization: the labelled tokens of this batch, or the global
            ``num_items_in_batch`` (``TaH2.loss`` under ``decider_loss_scope="global"``); default: the number of
            tokens that made at least one decision.
        exit_threshold: τ_exit, only for the logged decision accuracy.

    Returns:
        ``(L_D scalar with grad, metrics)``; metrics are detached scalars: ``decider_loss``,
        ``kappa`` (the first boundary's; ``kappa_2`` … the later ones per boundary), ``continue_label_rate``,
        ``decider_accuracy``, ``decisions``, ``pos_weight``.
    """
    cfg = TaH2Options() if cfg is None else cfg
    K = min(logits.shape[-1], lab.labels.shape[-1])
    s = logits[..., :K].float()
    m = lab.decided[..., :K]
    y = lab.labels[..., :K].float()
    if cfg.decider_weighting == "distance":
        w = lab.weights[..., :K].float().clamp(min=cfg.cost_min, max=cfg.cost_max)
    else:
        w = torch.ones_like(s)
    w = torch.where(m, w, torch.zeros_like(w))
    if cfg.dyn_pos_weight:
        pw = dynamic_pos_weight(y, m, lab.n_boundaries)
    else:
        pw = torch.full((K,), float(cfg.pos_weight), device=s.device)
    shifted = s - cfg.bce_margin * (2 * y - 1) if cfg.bce_margin else s
    bce = F.binary_cross_entropy_with_logits(shifted, y, pos_weight=pw.to(s.device), reduction="none")
    bce = torch.where(m, bce, torch.zeros_like(bce))  # masked positions may hold anything
    if cfg.decider_loss_norm == "weights":
        denom = w.sum()
    elif n_tokens is not None:
        denom = torch.as_tensor(n_tokens, device=s.device).float()
    else:
        denom = m.any(-1).sum().float()
    loss = (w * bce).sum() / denom.clamp_min(1e-12)
    with torch.no_grad():
        n = m.sum()
        d = n.clamp_min(1).float()
        c = torch.sigmoid(s)
        kappa = lab.kappa.float().reshape(-1)
        metrics = {
            "decider_loss": loss.detach(),
            "kappa": kappa[0] if kappa.numel() else kappa.new_zeros(()),
            **{f"kappa_{j + 1}": kappa[j] for j in range(1, kappa.numel())},  # boundaries 2, 3, … (per-boundary)
            "continue_label_rate": (y * m).sum() / d,
            "decider_accuracy": (((c >= exit_threshold).float() == y) & m).sum() / d,
            "decisions": n.float(),
            "pos_weight": pw.float().mean(),
        }
    return loss, metrics
