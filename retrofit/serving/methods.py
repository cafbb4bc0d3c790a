"""The one place where the serving engine calls method-specific code: core input, step schedule, decider,
exit rule and the output combination (TaH2's mixture).

The engine batches rows of many sequences, each at its own depth, into one core call; every primitive of
the depth loop is elementwise over tokens, so the engine calls the loop's own pieces (docs/):

- **core input**: ``retrofit.model.loop.core_input`` (``e`` at depth 1, ``updater(e, s)`` after, ``s`` the
  state of ``retrofit.model.loop.loop_state``);
- **step schedule**: ``schedule.step(d, h_prev, raw, state, idx)`` per depth, its state from
  ``schedule.init`` under the engine's row slots (TAPS' statistics are reset when a slot takes a new token);
- **decider**: the halting method's own ``new_context`` / ``plan`` / ``step`` (ANIRA-E's plan on the
  prelude output, TaH2's continue probability, ANIRA-O's halting probability); the method's per-token
  context (``ctx.extra``: ANIRA-O's cumulative mass and quantile) is kept under row slots (``SlotStore``);
- **exit rule**: ``retrofit.model.loop.ForcedExit`` (``depth=k``), ``PolicyExit`` (``kl``/``state``, its
  per-token memory keyed by row slot) or ``DeciderExit``;
- **output**: the method's ``combiner(ctx)`` (TaH2's ``DepthMixture``), or ``ExitLogits`` for a forced
  depth, kept per sequence slot for its last token (``SlotCombiners``).

Thin adapters, and why they exist: the loop keeps a call's per-token state in Python objects that live
for one forward over a fixed ``[B, T]`` token set; the engine's tokens enter and leave row slots at every
step and reach each depth in different steps. ``SlotStore`` keeps such per-token tensors under slots
between calls; ``Rows`` is the loop's ``Run`` view of a set of engine rows (what ``PolicyExit`` reads).
The loop's rules and schedules take one depth ``d`` per call, so rows are grouped by depth where a
primitive compares with the previous depth (TAPS, training-free policies, the combiners).

Not shared, on purpose: the engine's KV layout (``retrofit.serving.kv``: paged pools keyed by
(sequence, depth) slots, written by many sequences at once) and its layer calls (``layers.py``) do not fit
the loop's ``backends`` (one ``[B, T]`` batch per call, a ``DepthKVCache`` per batch); and the engine
drives its own iteration over depths (one depth per row per step), so it does not call ``run_depth_loop``.

Each rule reproduces the looped model's cached decode (``retrofit.model.loop.run_depth_loop``) token by token:
under a training-free exit TaH2's decider still runs, because its continue probabilities weight the
mixture; under a forced depth no decider runs and the output is the exit depth's readout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.halting.base import ExitLogits
from ..model.halting.training_free import ExitPolicy, resolve_exit_policy
from ..model.loop import DeciderExit, ForcedExit, PolicyExit, core_input, loop_state
from ..model.schedulers import TAPS, build_step_schedule


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


class SlotStore:
    """Per-token tensors kept under engine slots between calls (each buffer ``[n_slots, ...]``).

    Exists because the loop's per-token state (a ``HaltContext``'s ``extra``, a ``DepthCombiner``'s
    attributes) lives for one forward over fixed tokens, while an engine token keeps its slot across steps.
    """

    def __init__(self, n_slots: int, device):
        self.n, self.device = n_slots, device
        self.bufs: dict[str, torch.Tensor] = {}

    def save(self, slots: torch.Tensor, values: dict) -> None:
        """Store the tensor entries of ``values`` (leading dim = ``slots``) under ``slots``."""
        for k, v in values.items():
            if not isinstance(v, torch.Tensor):
                continue
            buf = self.bufs.get(k)
            if buf is None:
                buf = self.bufs[k] = v.new_zeros(self.n, *v.shape[1:])
            buf[slots] = v

    def load(self, slots: torch.Tensor) -> dict:
        """What was stored for ``slots``, by name."""
        return {k: b[slots] for k, b in self.bufs.items()}


class Rows:
    """The loop's ``Run`` view of engine rows: ``idx`` (row slots: stable per token), one value per row."""

    def __init__(self, idx: torch.Tensor):
        self.idx, self.N = idx, int(idx.numel())

    def expand(self, vals: torch.Tensor, fill) -> torch.Tensor:
        return vals


class SlotCombiners:
    """The output combination of each sequence's last token, kept under sequence slots.

    Per call the combiner (the method's ``combiner(ctx)`` when the output mixes, else ``ExitLogits``) is
    rebuilt over the given slots from its stored state (fresh at depth 1), called, and its state stored
    back: the math is the combiner's own (``retrofit.model.halting.tah2.DepthMixture``).
    """

    def __init__(self, method, n_slots: int, device):
        self.method = method
        self.kind = torch.zeros(n_slots, dtype=torch.bool, device=device)  # True: the method's combiner
        self.stores = {True: SlotStore(n_slots, device), False: SlotStore(n_slots, device)}

    def _new(self, mix: bool):
        return self.method.combiner(self.method.new_context(False)) if mix else ExitLogits()

    def _load(self, mix: bool, slots: torch.Tensor):
        comb = self._new(mix)
        for k, v in self.stores[mix].load(slots).items():
            setattr(comb, k, v)
        return comb

    def add(self, seqs, depth, z, stop, signal, mix: bool) -> None:
        """Depth ``depth [n]`` of sequences ``seqs [n]``: logits ``z [n, V]``, ``stop [n]``, ``signal [n]``
        (the decider's continue probability; NaN where it made no decision, e.g. at ``D``), one call of the
        combiner per depth."""
        self.kind[seqs] = mix
        for d in depth.unique().tolist():
            sel = depth == d
            s = seqs[sel]
            comb = self._new(mix) if d == 1 else self._load(mix, s)
            sig = None if signal is None else signal[sel]
            if sig is not None and bool(torch.isnan(sig).all()):
                sig = None
            comb.add(d, z[sel], None, torch.ones_like(stop[sel]), stop[sel], sig)
            self.stores[mix].save(s, vars(comb))

    def logits(self, seqs: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` output logits of the sequences' last tokens, given their exit depths ``[n]``."""
        kind = self.kind[seqs]
        out = None
        for mix in (True, False):
            sel = kind == mix
            if not bool(sel.any()):
                continue
            part = self._load(mix, seqs[sel]).logits(depths[sel])
            if out is None:
                out = part.new_empty(seqs.shape[0], part.shape[-1])
            out[sel] = part
        return out


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
        self.max_rows = max_rows
        self.planned = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.plans = False  # the method plans its exit depth before the loop (ANIRA-E)
        self.ctx_rows = SlotStore(max_rows, dev)  # the method's per-token context (ctx.extra)
        self.taps = TAPS()
        self.taps_state = self.taps.init(max_rows)
        self.policies: dict[tuple[str, float], PolicyExit] = {}  # per-token memory keyed by row slot
        self.mixture = self.method.needs_depth_readout and self.method.mixture_output
        self.combiners = SlotCombiners(self.method, max_seqs, dev)

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
        weights the mixture. A forced depth runs no decider (``retrofit.model.loop.ForcedExit``)."""
        return spec.rule == "decider" or (spec.rule == "policy" and self.method.needs_depth_readout)

    def mixes(self, spec: ExitSpec) -> bool:
        """The output is TaH2's mixture; else the exit depth's readout (a forced depth, or ``mixture_output=False``)."""
        return self.mixture and spec.rule != "forced"

    # -- rows entering -------------------------------------------------------------------------------
    def enter(self, rows: torch.Tensor, e: torch.Tensor, spec: ExitSpec) -> None:
        """New tokens take row slots ``rows`` with core input ``e`` ``[n, H]``: reset per-row state, plan."""
        if "m" in self.taps_state:
            self.taps_state["m"][rows] = 0.0
            self.taps_state["S"][rows] = 0.0
        self.planned[rows] = spec.depth if spec.rule == "forced" else 0
        if self.runs_decider(spec):
            ctx = self.method.new_context(False)
            plan = self.method.plan(e[:, None], ctx)  # [n, 1] tokens: the loop's [B, T] with T = 1
            if plan is not None:
                self.plans = True
                self.planned[rows] = plan[:, 0].to(torch.long)
            self.ctx_rows.save(rows, ctx.extra)

    def core_input(self, e: torch.Tensor, h: torch.Tensor, first: torch.Tensor, any_first: bool, all_first: bool):
        """``e`` at depth 1, ``updater(e, s)`` after (``s = loop_state(h)``): ``[n, H]`` (``first`` ``[n]`` bool)."""
        if all_first:
            return e
        return core_input(self.model.updater, e, loop_state(self.model, h), first if any_first else False)

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
        cont = signal = None
        if self.runs_decider(spec):
            ctx = self.method.new_context(False)
            ctx.extra.update(self.ctx_rows.load(rows))
            probs = z.float().softmax(-1)[:, None] if self.method.needs_depth_readout else None
            state = loop_state(self.model, h)  # what the decider reads (LoopConfig.decider_state)
            c = self.method.step(0, e[:, None], state[:, None], probs, ctx)  # (d is unused by the methods' step)
            self.ctx_rows.save(rows, ctx.extra)
            if ctx.signals and self.method.needs_depth_readout:
                signal = ctx.signals[-1][:, 0]
            if c is not None:
                cont = c[:, 0]
        act = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        if spec.rule == "forced":
            # elementwise in the depth: ``depth`` [n] compares per row
            return ForcedExit(self.planned[rows]).decide(depth, None, act, None, None, None), signal
        if spec.rule == "policy":
            return self._policy(rows, depth, h, z, spec), signal
        rule = DeciderExit()
        rule.start(rows.shape[0], self.planned[rows] if self.plans else None)
        return rule.decide(depth, cont, act, None, None, None), signal

    def _policy(self, rows, depth, h, z, spec: ExitSpec) -> torch.Tensor:
        rule = self.policies.get((spec.policy, spec.threshold))
        if rule is None:
            rule = PolicyExit(resolve_exit_policy(spec.policy, spec.threshold, None)[1])
            rule.start(self.max_rows, None)
            self.policies[(spec.policy, spec.threshold)] = rule
        cont = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        for d in depth.unique().tolist():  # the policies compare with the previous depth: one call per depth
            sel = depth == d
            zs = z[sel] if rule.needs_logits else None
            cont[sel] = rule.decide(d, None, cont[sel], Rows(rows[sel]), h[sel], zs)
        return cont

    # -- output combination (per sequence slot) ------------------------------------------------------
    def combine_add(
        self,
        seqs: torch.Tensor,
        depth: torch.Tensor,
        z: torch.Tensor,
        stop: torch.Tensor,
        signal: torch.Tensor | None,
        mix: bool | None = None,
    ) -> None:
        """Depth ``depth`` of each sequence's last token: logits ``z`` ``[n, V]``, ``stop`` ``[n]`` (exits
        here), ``signal`` ``[n]`` TaH2's continue probability (None at ``D``, or NaN where not decided);
        ``mix``: these sequences' output is the mixture (``mixes(spec)``; default ``self.mixture``)."""
        mix = self.mixture if mix is None else (mix and self.mixture)
        self.combiners.add(seqs, depth, z, stop, signal, bool(mix))

    def combined_logits(self, seqs: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """The output logits ``[n, V]`` of the sequences' last tokens, given their exit depths ``[n]``."""
        return self.combiners.logits(seqs, depths)


__all__ = ["ExitSpec", "MethodAdapter", "Rows", "SlotCombiners", "SlotStore"]
