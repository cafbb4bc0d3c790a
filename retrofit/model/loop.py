"""The depth loop: one loop over core iterations for every way a looped model runs (docs/looped-model.md).

``run_depth_loop`` is the only place that iterates the core. The full-sequence forward (training,
scoring, prefill without a cache) and incremental decoding with a ``DepthKVCache`` call it with a
different **KV backend** (``retrofit.model.backends``); what decides each token's exit is an **exit rule**
(``DeciderExit``: the halting method's own decider; ``ForcedExit``: ``depth=``, which runs no
decider at all; ``PolicyExit``: a training-free exit, ``retrofit.model.halting.training_free``); the core
update is relaxed by a **step schedule** (``retrofit.model.schedulers``: unit or TAPS).

Per depth ``d`` (``h`` = every token's passthrough state, ``e`` = the core input)::

    run   = backend.begin_depth(d, active, la)      which tokens compute, and the attention mask
    x     = e | updater(e, s)                        core input (``core_input``; ``s`` of depth ``d - 1``)
    raw   = backend.core(d, x, run)                  the shared core layers: ``F(h)``
    h_new = schedule.step(d, h_run, raw, ...)        relaxed step (unit: ``raw``)
    h     = run.update(h, h_new)                     passthrough: only running tokens change
    s     = loop_state(model, h)                     what the updater and decider read (``decider_state``)
    z     = backend.readout(d, h, h_new, run, ...)   next-token logits (when anything reads them)
    cont  = rule.decide(d, method.step(d, e, s, ...), ...)   who continues to ``d + 1``
    combiner.add(d, z, ...)                          the method's output combination (TaH2 mixture)

With ``LoopConfig.padding_stops`` padding positions (``backend.real`` false) never continue past depth 1 and
get no lookahead iteration.

Per-depth primitives, for a serving engine (``retrofit.serving``) that batches rows of *different*
depths into one core call: every primitive is elementwise over tokens, so it applies to any set of
tokens gathered from several requests, each at its own depth:

- **core input**: ``core_input(updater, e, s, first)`` with ``first`` ``[N]`` bool (tokens at depth 1
  read ``e``; the others ``updater(e, s)``, ``s = loop_state(model, h)`` of their previous depth);
- **core**: the base decoder layers, called with a cache object whose ``update(k, v, layer_idx,
  kwargs=...)`` stores and returns the keys each query may see (``retrofit.model.cache.TaggedKV`` does so
  for one depth per call; an engine's backend keys its K/V by (token, depth) the same way);
- **step schedule**: ``schedule.step(d, h_prev [N, H], raw [N, H], state, idx [N])``, per-token
  statistics kept in ``state`` under flat token ids ``idx`` (so tokens at other depths may be mixed in
  one call only if the schedule is the unit step, or if calls are grouped by depth);
- **readout**: ``model.lm_head(model.model.norm(h))`` (plus the coda for a model with one);
- **decider**: ``method.step(d, e, s, probs, ctx)`` on any token set (TaH2's ``continue_prob``,
  ANIRA-O's ``halt_prob``); per-token state lives in ``ctx`` (one ``HaltContext`` per request);
- **exit rule**: ``rule.decide(d, cont, ...)``; ``ForcedExit`` and ``DeciderExit`` are elementwise,
  ``PolicyExit`` keeps per-token memory under flat ids;
- **combination**: ``method.combiner(ctx).add(d, z, logp, active, stop, signal)`` keeps per-token
  state (``retrofit.model.halting.tah2.DepthMixture``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import validate_depth
from .schedulers import UnitStep
from .token_sets import AllTokens, Pack  # noqa: F401  (their home is token_sets; kept importable from here)


# ------------------------------------------------------------------------------------------------
# Exit rules
# ------------------------------------------------------------------------------------------------
class ExitRule:
    """Who decides, after depth ``d``, which tokens continue.

    Attributes:
        runs_decider: the halting method's decider runs (its ``plan``/``step``/``combiner``/
            ``distribution``); False for a forced depth.
        needs_logits: ``decide`` reads the depth's next-token log-probabilities.
        needs_states: ``decide`` reads the running tokens' states.
    """

    runs_decider = True
    needs_logits = False
    needs_states = False
    last_depth: int | None = None  # the deepest depth any token can reach, when known

    def start(self, n_tokens: int, planned: torch.Tensor | None) -> None:
        """Called once before the loop (``planned``: the method's planned exit depths, or None)."""

    def decide(self, d: int, cont: torch.Tensor | None, act: torch.Tensor, run, h_run, z_run) -> torch.Tensor:
        """``[B, T]`` bool: continue to ``d + 1`` (read for tokens active at ``d``).

        Args:
            cont: the decider's answer ``[B, T]`` (None when it made none).
            act: ``[B, T]`` tokens active at ``d``.
            run: the running tokens (``Pack`` / ``AllTokens``); ``h_run`` ``[N, H]`` their states,
                ``z_run`` ``[N, V]`` their logits (None unless ``needs_logits``).
        """
        raise NotImplementedError


def decider_continue(planned: torch.Tensor | None, d: int, cont: torch.Tensor | None, act: torch.Tensor):
    """The halting method's own answer after depth ``d`` ``[B, T]``: its planned depth (ANIRA-E), else its
    step's answer, else go on."""
    if planned is not None:
        return planned > d
    return cont if cont is not None else torch.ones_like(act)


class DeciderExit(ExitRule):
    """The halting method decides (``decider_continue``)."""

    def start(self, n_tokens, planned):
        self.planned = planned

    def decide(self, d, cont, act, run, h_run, z_run):
        return decider_continue(self.planned, d, cont, act)


class ForcedExit(ExitRule):
    """Every token exits at a given depth (``depth=``); no decider runs."""

    runs_decider = False

    def __init__(self, depths: torch.Tensor):
        self.depths = depths
        self.last_depth = int(depths.max())

    def decide(self, d, cont, act, run, h_run, z_run):
        return self.depths > d


class PolicyExit(ExitRule):
    """A training-free exit (``ExitPolicy``: ``kl``, ``state``). The decider still runs: its signals
    feed the method's output combination (TaH2's mixture) and ``depth_probs``."""

    needs_states = True

    def __init__(self, policy):
        self.policy = policy
        self.needs_logits = policy.needs_logits

    def start(self, n_tokens, planned):
        self.state = self.policy.init(n_tokens)
        self.planned = planned

    def decide(self, d, cont, act, run, h_run, z_run):
        idx = run.idx if run.idx is not None else torch.arange(run.N, device=h_run.device)
        lp = z_run.float().log_softmax(-1) if self.needs_logits else None
        if self.policy.defers_to_decider:  # its own answer for the running tokens, what DeciderExit would decide
            self.state["decider_continue"] = run.select(decider_continue(self.planned, d, cont, act))
        stop = self.policy.check(d, h_run, lp, self.state, idx)
        return run.expand(~stop, True)


def forced_depths(depth, B: int, T: int, device, max_depth: int) -> torch.Tensor | None:
    """Validate ``depth=`` -> ``[B, T]`` long on ``device`` (None stays None).

    ``depth``: None, an int, or a ``[B, T]`` tensor of an integer dtype, each in ``1 … max_depth``
    (``retrofit.model.config.validate_depth``: a float tensor such as 1.7 is a ``DepthError``, never truncated).
    """
    depth = validate_depth(depth, B, T, max_depth)
    return None if depth is None else depth.to(device)


def exit_rule_for(depth: torch.Tensor | None, policy) -> ExitRule:
    """The exit rule of a call: forced depths ``[B, T]``, a training-free policy, or the decider."""
    if depth is not None:
        return ForcedExit(depth)
    if policy is not None:
        return PolicyExit(policy)
    return DeciderExit()


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------
def core_input(updater, e: torch.Tensor, h: torch.Tensor | None, first: bool | torch.Tensor) -> torch.Tensor:
    """The core's input: ``e`` at depth 1, ``updater(e, h)`` after (``first``: a bool, or ``[N]`` per token);
    ``h`` is the previous depth's state as the updater reads it (``loop_state``)."""
    if isinstance(first, bool):
        return e if first else updater(e, h)
    return torch.where(first[..., None], e, updater(e, h))


def loop_state(model, h: torch.Tensor) -> torch.Tensor:
    """The state ``s_d`` the updater and the decider read after depth ``d`` (``LoopConfig.decider_state``):
    ``model.model.norm(h)`` under ``"final_norm"`` (the TaH2 release's ``hidden_states[-1]``; with a coda, the
    final norm of the core output, before the coda) or ``h`` itself under ``"core"``. ``h``: ``[..., H]``."""
    return model.model.norm(h) if model.loop.decider_state == "final_norm" else h


@dataclass
class LoopResult:
    """What ``run_depth_loop`` returns (fields of ``LoopedCausalLMOutput``)."""

    logits: torch.Tensor
    depths: torch.Tensor  # [B, T] (0 for padding that never ran)
    active: torch.Tensor  # [D', B, T]
    depth_probs: torch.Tensor | None = None
    halt_signals: torch.Tensor | None = None
    halt_logits: torch.Tensor | None = None
    depth_logits_q: torch.Tensor | None = None
    depth_nll: torch.Tensor | None = None
    depth_ce_sum: torch.Tensor | None = None
    depth_ce_tokens: torch.Tensor | None = None
    depth_logits: torch.Tensor | None = None


def run_depth_loop(
    model,
    e,
    backend,
    rule: ExitRule,
    schedule,
    *,
    shift_labels=None,
    output_depth_logits=False,
    backprop_depth: int | None = None,
    logits_to_keep=0,
    loss_rows: torch.Tensor | None = None,
    decider_threshold: float | None = None,
    depth_cap: int | None = None,
    supervise_depths: bool = False,
    depth_ce_tokens: bool = False,
) -> LoopResult:
    """Run the core ``1 … max_depth`` times on the core input ``e`` ``[B, T, H]``.

    Args:
        model: the ``LoopedForCausalLM`` (its updater, halting method and loop config).
        e: ``[B, T, H]`` the prelude's output.
        backend: a ``retrofit.model.backends`` backend (full-sequence store, or a ``DepthKVCache`` step).
        rule: the exit rule (``exit_rule_for``).
        schedule: a ``StepSchedule``.
        shift_labels: ``[B, T]`` next-token labels (-100 ignored): also compute ``depth_nll``, with the
            gradient-free lookahead iteration ``d* + 1`` of every exited token (TaH2 §3). Full backend only.
        output_depth_logits: also return every depth's logits ``[D, B, T, V]`` (NaN where not computed;
            ``[D, N, V]`` with ``loss_rows``).
        backprop_depth: truncated backprop: iterations ``d ≤ n - k`` run without autograd.
        logits_to_keep: as in ``forward``.
        loss_rows: ``[N]`` flat indices (into ``B * T``) of the positions with a next-token label: the
            vocabulary-wide work of the loss path (LM head, log-softmax, TaH2's mixture, ``depth_nll``)
            runs on those positions only, and ``logits`` is ``[N, V]`` for them, in that order. Every
            other output is as without it. Full-sequence backend only; not with an exit rule that reads
            logits.
        decider_threshold: this call's decision threshold for the method's decider (``HaltContext.threshold``).
        depth_cap: no token runs deeper than this (a depth curriculum); the decider decides after depths
            ``< depth_cap`` only, and tokens reaching the cap exit there with no lookahead beyond it.
        supervise_depths: with ``shift_labels``, also return ``depth_ce_sum`` ``[D']``: each executed depth's
            summed next-token cross-entropy *with* gradient (deep supervision; the caller forces every token
            through every depth).
        depth_ce_tokens: with ``shift_labels``, also return ``depth_ce_tokens`` ``[B, T, D']``: each executed
            depth's per-token next-token cross-entropy *with* gradient, 0 where the label is -100 (the main-loss
            hook of ``HaltingMethod.main_loss``: Ouro's expected loss over its exit distribution).
    """
    method, loop = model.halting, model.loop
    D = loop.max_depth
    D_run = D if depth_cap is None else max(1, min(D, int(depth_cap)))
    B, T, H = e.shape
    ctx = method.new_context(model.training, decider_threshold)
    planned = method.plan(e, ctx) if rule.runs_decider else None
    rule.start(B * T, planned)
    combiner = method.combiner(ctx) if (rule.runs_decider and method.needs_depth_readout) else None
    lookahead = shift_labels is not None and backend.supports_lookahead
    readout = combiner is not None or output_depth_logits or shift_labels is not None or rule.needs_logits
    unit = isinstance(schedule, UnitStep)
    sstate = schedule.init(B * T)
    if backprop_depth is not None and (not isinstance(backprop_depth, int) or backprop_depth < 1):
        raise ValueError(f"backprop_depth must be None or an int >= 1, got {backprop_depth!r}")
    n_unroll = min(rule.last_depth or D, D_run)
    if (supervise_depths or depth_ce_tokens) and shift_labels is None:
        raise ValueError("supervise_depths and depth_ce_tokens need shift_labels")
    depth_ce: list[torch.Tensor] = []
    token_ce: list[torch.Tensor] = []
    rows = loss_rows
    if rows is not None and (rule.needs_logits or not hasattr(backend, "readout_rows")):
        raise ValueError("loss_rows needs the full-sequence backend and no logit-reading exit")
    pick = (lambda t: t.reshape(-1).index_select(0, rows)) if rows is not None else (lambda t: t)

    act = backend.first_active(B, T)
    # padding never continues (LoopConfig.padding_stops): it runs depth 1 only and gets no lookahead row
    real = backend.real if loop.padding_stops and not bool(backend.real.all()) else None
    topk_grad = contextlib.nullcontext if method.readout_grad else torch.no_grad
    # active[j]: token executed depth j + 1; a list, since tensors saved for backward must not be
    # modified in place
    active = [act]
    h = e
    s = None  # the state the updater and the decider read (loop_state)
    states: list[torch.Tensor] = []
    depth_nll = torch.full((B, T, D), float("nan"), device=e.device) if shift_labels is not None else None
    depth_logits = [] if output_depth_logits else None
    d_last = 0
    for d in range(1, D_run + 1):
        run = backend.begin_depth(d, active, lookahead)
        if run is None:  # no token runs this depth
            break
        d_last = d
        no_grad = backprop_depth is not None and d <= n_unroll - backprop_depth
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            x = core_input(model.updater, run.gather(e), None if d == 1 else run.gather(s), d == 1)
            raw = run.take(backend.core(d, x, run))  # [N, H]
        h_new = raw if (d == 1 or unit) else schedule.step(d, run.select(h), raw, sstate, run.idx)
        h = run.update(h, h_new)
        states.append(h)
        if d < D_run:
            s = loop_state(model, h)

        la = (~act) & active[d - 2] if (lookahead and d >= 2) else None  # exited at d - 1: lookahead rows
        if la is not None and real is not None:
            la = la & real
        z_run = z_full = z_loss = logp = None
        if readout:
            if rows is None:
                z_run, z_full = backend.readout(d, h, raw, run, la, separate_lookahead=depth_logits is not None)
                z_loss = z_full
            else:  # the decider's features need every token's logits; the loss path only the labelled ones
                z_full, z_loss = backend.readout_rows(d, h, raw, la, rows, full=combiner is not None and d < D)
            keep = act if la is None else (act | la)
            if depth_logits is not None:
                z_d, keep_d = (z_full, keep) if rows is None else (z_loss, pick(keep))
                depth_logits.append(z_d.masked_fill(~keep_d[..., None], float("nan")))
            # the mixture's log-softmax doubles as the source of the per-depth losses
            logp = z_loss.float().log_softmax(-1) if (combiner is not None and combiner.needs_log_probs) else None
            if depth_nll is not None:
                # = F.cross_entropy(z, shift_labels, reduction="none"), bitwise, without autograd
                with torch.no_grad():
                    src = logp if logp is not None else z_loss.float().log_softmax(-1)
                    target = pick(shift_labels)
                    nll = -src.gather(-1, target.clamp_min(0)[..., None]).squeeze(-1)
                    nll = nll.masked_fill(target == -100, 0.0)
                    if rows is not None:  # unlabelled positions: 0, as masked above
                        nll = nll.new_zeros(B * T).index_copy(0, rows, nll).view(B, T)
                depth_nll[..., d - 1] = torch.where(keep, nll, torch.full_like(nll, float("nan")))
            if supervise_depths or depth_ce_tokens:  # this depth's own next-token loss, with gradient
                target = pick(shift_labels).reshape(-1)
                zf = z_loss.reshape(target.numel(), -1).float()
                if supervise_depths:  # deep supervision
                    depth_ce.append(F.cross_entropy(zf, target, reduction="sum"))
                if depth_ce_tokens:  # [B, T] (0 where unlabelled), the rows scattered back when loss_rows
                    ce = F.cross_entropy(zf, target, reduction="none")
                    if rows is not None:
                        ce = ce.new_zeros(B * T).index_put((rows,), ce)
                    token_ce.append(ce.view(B, T))

        # decide who continues to depth d + 1
        if d < D_run:
            cont = None
            if rule.runs_decider:
                probs = None
                if combiner is not None:
                    with topk_grad():  # decider features; with gradient into the LM under decider_topk_grad
                        probs = z_full.float().softmax(-1)
                cont = method.step(d, e, s, probs, ctx)
            nxt = act & rule.decide(d, cont, act, run, run.select(h) if rule.needs_states else None, z_run)
            if real is not None:
                nxt = nxt & real
        else:
            nxt = torch.zeros_like(act)
        stop = act & ~nxt
        backend.end_depth(d, run, stop)
        if combiner is not None:
            signal = ctx.signals[d - 1] if d <= len(ctx.signals) else None
            combiner.add(d, z_loss, logp, pick(act), pick(stop), pick(signal) if signal is not None else None)
        if d < D_run:
            active.append(nxt)
        act = nxt
        more = d < D_run and (bool(nxt.any()) or (lookahead and bool(stop.any())) or loop.fixed_graph)
        if not more:
            break

    active_t = torch.stack(active)
    depths = active_t.long().sum(0)
    depth_probs = st = None
    if rule.runs_decider:
        depth_probs, st = method.distribution(ctx, depths.clamp_min(1))

    if combiner is not None:
        if d_last == 0:  # no real token in the step
            shape = (B, T) if rows is None else (rows.numel(),)
            logits = e.new_zeros(*shape, model.config.vocab_size)
        else:
            logits = combiner.logits(pick(depths))
        logits = _keep(logits, logits_to_keep) if rows is None else logits
    else:
        final = h
        if st is not None:
            while len(states) < D:
                states.append(states[-1])
            final = sum(st[..., k, None].to(e.dtype) * states[k] for k in range(D))
        if rows is None:
            logits = backend.final_readout(final, logits_to_keep)
        else:
            logits = backend.final_readout_rows(final, rows)
    backend.finish(d_last, h, depths)

    return LoopResult(
        logits=logits,
        depths=depths,
        active=active_t,
        depth_probs=depth_probs,
        halt_signals=torch.stack(ctx.signals, -1) if ctx.signals else None,
        halt_logits=torch.stack(ctx.extra["halt_logits"], -1) if ctx.extra.get("halt_logits") else None,
        depth_logits_q=ctx.extra.get("q_logits"),
        depth_nll=depth_nll,
        depth_ce_sum=torch.stack(depth_ce) if depth_ce else None,
        depth_ce_tokens=torch.stack(token_ce, -1) if token_ce else None,
        depth_logits=torch.stack(depth_logits) if depth_logits else None,
    )


def _keep(logits: torch.Tensor, logits_to_keep) -> torch.Tensor:
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        return logits[:, -logits_to_keep:]
    if isinstance(logits_to_keep, torch.Tensor):
        return logits[:, logits_to_keep]
    return logits


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` labels -> next-token targets ``[B, T]`` (position t is scored on label t + 1)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def _kept_positions(logits_to_keep, T: int, device) -> torch.Tensor | None:
    """The positions ``[K]`` (in ``0 … T-1``, in the given order) that ``logits_to_keep`` keeps; None for all."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep <= 0 or logits_to_keep >= T:
            return None
        return torch.arange(T - logits_to_keep, T, device=device)
    if (
        isinstance(logits_to_keep, torch.Tensor)
        and logits_to_keep.dim() == 1
        and not logits_to_keep.is_floating_point()
    ):
        return logits_to_keep.to(device).long() % T
    return None
