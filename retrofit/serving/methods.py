"""The one place where the serving engine calls method-specific code: core input, step schedule, decider,
exit rule and the output combination (TaH2's mixture).

The engine batches rows of many sequences, each at its own depth, into one core call; every primitive
here is elementwise over tokens, so it applies to any set of rows (METHODS.md §1–6):

- **core input**: ``x = e`` at depth 1, ``updater(e, h)`` after;
- **step schedule**: ``schedule.step(d, h_prev, raw, state, idx)`` per depth (TAPS keeps per-token
  statistics under the engine's row slots, reset when a slot takes a new token);
- **decider**: the halting method's own ``plan`` (ANIRA-E, on the prelude output) and ``step`` (TaH2's
  continue probability from ``[e; h; top-K probs]``, ANIRA-O's halting probability with its cumulative
  mass kept per row);
- **exit rule**: a forced depth (``depth=k``), a training-free policy (``kl``/``state``,
  ``retrofit.halting.training_free``, per-token memory under row slots), or the decider;
- **output**: TaH2's streaming mixture ``log Σ_d π_d softmax(z_d)`` (kept per sequence for its last
  token), or the exit depth's readout.

Each rule reproduces the looped model's cached decode (``retrofit.loop.run_depth_loop``) token by token:
under a training-free exit TaH2's decider still runs, because its continue probabilities weight the
mixture; under a forced depth no decider runs and the output is the exit depth's readout.

After ``loop`` is merged, the ``retrofit.loop`` primitives replace the bodies here one for one
(``core_input``, ``ForcedExit``/``DeciderExit``/``PolicyExit``, ``method.combiner`` / ``DepthMixture``);
the engine does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..halting.training_free import ExitPolicy, resolve_exit_policy
from ..schedulers import TAPS, build_step_schedule


@dataclass(frozen=True)
class ExitSpec:
    """A request's exit control (validated).

    Attributes:
        rule: ``"decider"``, ``"forced"`` or ``"policy"``.
        depth: the forced depth (``rule == "forced"``).
        policy: ``"kl"`` / ``"state"`` (``rule == "policy"``).
        threshold: the policy's threshold.
        schedule: ``"unit"`` or ``"taps"``.
    """

    rule: str = "decider"
    depth: int | None = None
    policy: str | None = None
    threshold: float | None = None
    schedule: str = "unit"


class MethodAdapter:
    """Method-specific calls of the engine, over rows identified by slots ``0 … max_rows - 1``.

    Args:
        model: the looped model (eval mode).
        max_rows: row slots of the engine (tokens in flight).
        max_seqs: sequence slots (one output combination each).
    """

    def __init__(self, model, max_rows: int, max_seqs: int):
        self.model = model
        self.method = model.halting
        self.loop = model.loop
        self.D = self.loop.max_depth
        dev = model.lm_head.weight.device
        self.device = dev
        # ANIRA-O: per-row cumulative halting mass, remaining mass and the inference quantile u
        self.cdf = torch.zeros(max_rows, device=dev)
        self.remain = torch.ones(max_rows, device=dev)
        self.planned = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.max_rows = max_rows
        self.taps = TAPS()
        self.taps_state = self.taps.init(max_rows)
        self.policy_state: dict[str, dict] = {}  # one per policy name; keyed by row slot
        # output combination of each sequence's last token
        V = model.config.vocab_size
        self.V = V
        self.mixture = self.method.needs_depth_readout and self.method.mixture_output
        self._mix = None
        self.max_seqs = max_seqs

    # -- request settings ------------------------------------------------------------------------
    def spec(self, exit_policy=None, exit_threshold=None, depth=None, step_schedule=None) -> ExitSpec:
        """Validate a request's exit arguments (the same rules as ``generate``)."""
        if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= self.D):
            raise ValueError(f"depth must be an integer in 1..{self.D} (max_depth), got {depth!r}")
        if isinstance(exit_policy, ExitPolicy):
            raise TypeError("pass exit_policy by name ('decider', 'fixed', 'kl', 'state')")
        d, policy = resolve_exit_policy(exit_policy, exit_threshold, depth)
        sched = build_step_schedule(step_schedule)
        sname = "taps" if isinstance(sched, TAPS) else "unit"
        if policy is not None:
            return ExitSpec("policy", policy=policy.name, threshold=policy.threshold, schedule=sname)
        if d is not None:
            return ExitSpec("forced", depth=int(d), schedule=sname)
        return ExitSpec("decider", schedule=sname)

    def needs_readout(self, spec: ExitSpec) -> bool:
        """The request reads out every executed depth (TaH2's decider and mixture, the ``kl`` exit)."""
        return self.method.needs_depth_readout or (spec.rule == "policy" and spec.policy == "kl")

    @property
    def output_from_readout(self) -> bool:
        """The output logits come from the per-depth readouts (TaH2), not one readout of the exit state."""
        return self.method.needs_depth_readout

    def runs_decider(self, spec: ExitSpec) -> bool:
        """The decider must run: it decides the exit, or (TaH2, under a training-free exit) its signal
        weights the mixture. A forced depth runs no decider (``retrofit.loop.ForcedExit``)."""
        return spec.rule == "decider" or (spec.rule == "policy" and self.method.needs_depth_readout)

    def mixes(self, spec: ExitSpec) -> bool:
        """The output is TaH2's mixture; else the exit depth's readout (a forced depth, or ``mixture_output=False``)."""
        return self.mixture and spec.rule != "forced"

    # -- rows entering -------------------------------------------------------------------------------
    def enter(self, rows: torch.Tensor, e: torch.Tensor, spec: ExitSpec) -> None:
        """New tokens take row slots ``rows`` with core input ``e`` ``[n, H]``: reset per-row state, plan."""
        self.cdf[rows] = 0.0
        self.remain[rows] = 1.0
        if "m" in self.taps_state:
            self.taps_state["m"][rows] = 0.0
            self.taps_state["S"][rows] = 0.0
        if spec.rule == "forced":
            self.planned[rows] = spec.depth
        elif spec.rule == "decider":
            ctx = self.method.new_context(False)
            plan = self.method.plan(e[:, None], ctx)
            self.planned[rows] = 0 if plan is None else plan[:, 0].to(torch.long)
        else:
            self.planned[rows] = 0

    def core_input(self, e: torch.Tensor, h: torch.Tensor, first: torch.Tensor, any_first: bool, all_first: bool):
        """``e`` at depth 1, ``updater(e, h)`` after: ``[n, H]`` (``first`` ``[n]`` bool)."""
        if all_first:
            return e
        x = self.model.updater(e, h)
        return torch.where(first[:, None], e, x) if any_first else x

    def relax(
        self,
        rows: torch.Tensor,
        depth: torch.Tensor,
        h_prev: torch.Tensor,
        raw: torch.Tensor,
        taps_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """The state after this depth: ``raw`` (unit step), or the TAPS step for rows in ``taps_rows``
        (a bool ``[n]``), one call per depth since TAPS' statistics depend on the depth."""
        if taps_rows is None or not bool(taps_rows.any()):
            return raw
        out = raw.clone()
        for d in depth[taps_rows & (depth > 1)].unique().tolist():
            sel = taps_rows & (depth == d)
            out[sel] = self.taps.step(d, h_prev[sel], raw[sel], self.taps_state, rows[sel])
        return out

    # -- decisions -------------------------------------------------------------------------------------
    def decide(
        self,
        rows: torch.Tensor,
        depth: torch.Tensor,
        e: torch.Tensor,
        h: torch.Tensor,
        z: torch.Tensor | None,
        spec: ExitSpec,
    ):
        """Who continues after this depth, for rows of one exit spec.

        Args:
            rows: ``[n]`` row slots; ``depth`` ``[n]`` the depth each just ran (``< D``).
            e, h: ``[n, H]`` core input and state; ``z``: ``[n, V]`` their logits at this depth (when read out).
            spec: the rows' exit spec.

        Returns:
            ``(cont [n] bool, signal [n] float or None)``; ``signal`` is TaH2's continue probability.
        """
        cont = None
        signal = None
        if self.runs_decider(spec):
            ctx = self.method.new_context(False)
            probs = None
            if self.method.needs_depth_readout:
                probs = z.float().softmax(-1)[:, None]
            if self.method.name == "anira-o":
                ctx.extra["cdf"], ctx.extra["remain"] = self.cdf[rows][:, None], self.remain[rows][:, None]
                ctx.extra["u"] = torch.full_like(ctx.extra["cdf"], self.loop.halt_threshold)
            c = self.method.step(0, e[:, None], h[:, None], probs, ctx)  # (d is unused by the methods' step)
            if self.method.name == "anira-o":
                self.cdf[rows] = ctx.extra["cdf"][:, 0]
                self.remain[rows] = ctx.extra["remain"][:, 0]
            if ctx.signals and self.method.needs_depth_readout:
                signal = ctx.signals[-1][:, 0]
            if c is not None:
                cont = c[:, 0]
        if spec.rule == "forced":
            cont = self.planned[rows] > depth
        elif spec.rule == "policy":
            cont = self._policy(rows, depth, h, z, spec)
        else:
            planned = self.planned[rows]
            if self.method.name == "anira-e":
                cont = planned > depth
            elif cont is None:
                cont = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        return cont, signal

    def _policy(self, rows, depth, h, z, spec: ExitSpec) -> torch.Tensor:
        _, policy = resolve_exit_policy(spec.policy, spec.threshold, None)
        state = self.policy_state.setdefault(spec.policy, policy.init(self.max_rows))
        stop = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        lp_all = z.float().log_softmax(-1) if policy.needs_logits else None
        for d in depth.unique().tolist():  # the policies compare with the previous depth: one call per depth
            sel = depth == d
            lp = lp_all[sel] if lp_all is not None else None
            stop[sel] = policy.check(d, h[sel], lp, state, rows[sel])
        return ~stop

    # -- output combination (per sequence slot) ------------------------------------------------------
    def _mix_state(self, dtype):
        if self._mix is None:
            S, V = self.max_seqs, self.V
            self._mix = {
                "survive": torch.ones(S, device=self.device),
                "log_mix": torch.zeros(S, V, device=self.device),
                "lse_exit": torch.zeros(S, device=self.device),
                "z_exit": torch.zeros(S, V, dtype=dtype, device=self.device),
                "first": torch.zeros(S, dtype=torch.bool, device=self.device),
                "mix": torch.zeros(S, dtype=torch.bool, device=self.device),
            }
        return self._mix

    def combine_add(
        self, seqs: torch.Tensor, depth: torch.Tensor, z: torch.Tensor, stop: torch.Tensor, signal: torch.Tensor | None,
        mix: bool | None = None,
    ) -> None:
        """Depth ``depth`` of each sequence's last token: logits ``z`` ``[n, V]``, ``stop`` ``[n]`` (exits
        here), ``signal`` ``[n]`` TaH2's continue probability (None at ``D``, or NaN where not decided);
        ``mix``: these sequences' output is the mixture (``mixes(spec)``; default ``self.mixture``)."""
        st = self._mix_state(z.dtype)
        mix = self.mixture if mix is None else (mix and self.mixture)
        st["mix"][seqs] = mix
        first = depth == 1
        if bool(first.any()):
            s1 = seqs[first]
            st["survive"][s1] = 1.0
            st["log_mix"][s1] = float("-inf")
        if not mix:  # a forced depth, or TaH2's "final-depth prediction only" ablation: the exit depth's logits
            st["z_exit"][seqs[stop]] = z[stop]
            return
        survive = st["survive"][seqs]
        c = signal
        pi = survive if c is None else torch.where(stop | torch.isnan(c), survive, survive * (1 - c))
        logp = z.float().log_softmax(-1)
        term = pi.clamp_min(1e-30).log()[:, None] + logp
        st["log_mix"][seqs] = torch.logaddexp(st["log_mix"][seqs], term)
        if bool(stop.any()):
            st["lse_exit"][seqs[stop]] = z[stop].float().logsumexp(-1)
        # a token that exits at depth 1 returns its raw depth-1 logits (the shifted log-mixture equals
        # them only up to rounding)
        st["z_exit"][seqs[first]] = z[first]
        st["first"][seqs] = False
        st["first"][seqs[first & stop]] = True
        if c is not None:
            st["survive"][seqs] = torch.where(torch.isnan(c), survive, survive * c)

    def combined_logits(self, seqs: torch.Tensor) -> torch.Tensor:
        """The output logits ``[n, V]`` of the sequences' last tokens (after their exit)."""
        st = self._mix_state(None)
        if not self.mixture:
            return st["z_exit"][seqs]
        mixed = (st["log_mix"][seqs] + st["lse_exit"][seqs][:, None]).to(st["z_exit"].dtype)
        exit_only = st["first"][seqs] | ~st["mix"][seqs]
        return torch.where(exit_only[:, None], st["z_exit"][seqs], mixed)


__all__ = ["ExitSpec", "MethodAdapter"]
