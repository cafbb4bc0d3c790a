"""Step execution of the serving engine: prelude, core over every row in flight, readout, decisions, sampling.

``StepExecutor`` runs points 2–5 of the engine's step (``retrofit.serving.engine``). The engine builds it with
everything the step touches, each named in its constructor: model, paged K/V, method adapter, layer runner,
row buffers (``RowBuffers``: ``e``, ``h``, ``krow``), counters, EOS ids, and ``StepHooks``, the scheduling
actions a step triggers (implemented by ``Engine``). The engine passes the groups in flight to each call and
keeps the scheduling state (groups in flight and entering, free row and sequence slots, admission,
cancellation); the executor's only state across steps is the coda readouts deferred to the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from .kv import PagedKV
from .layers import LayerRunner
from .methods import ExitSpec, MethodAdapter
from .requests import SeqState, TokenGroup
from .sampling import sample

# CPU: LM head inputs of LM_HEAD_PAD_FROM .. LM_HEAD_PAD_ROWS - 1 rows are padded (StepExecutor.logits)
LM_HEAD_PAD_FROM, LM_HEAD_PAD_ROWS = 7, 16


class StepHooks(Protocol):
    """The scheduling actions a step triggers (``Engine`` implements them). The executor looks each one up on
    the engine when it calls it, so a hook replaced on the engine instance (tests, benchmarks) is the one run.
    """

    def _new_group(self, seq: SeqState, tokens: list[int]) -> None:
        """Put ``tokens`` (the token ``seq`` just sampled) on free row slots; they enter at the next step."""

    def _release_rows(self, g: TokenGroup) -> None:
        """Return ``g``'s row slots to the free list (``g.rows`` becomes empty)."""

    def _finish_seq(self, seq: SeqState, reason: str) -> None:
        """End ``seq``'s request: free its slots, rows, deferred readouts and KV blocks; emit ``finish``."""

    def _record_tokens(self, now: float, n: int) -> None:
        """Count ``n`` tokens sampled at ``now`` (``time.monotonic``) for ``Engine.metrics``' tokens/s."""


@dataclass
class RowBuffers:
    """Per-row tensors of the tokens in flight, indexed by row slot (``0 .. max_rows - 1``).

    Attributes:
        e: ``[max_rows, H]`` the row's prelude output (core input at depth 1; ``updater``'s ``e`` deeper).
        h: ``[max_rows, H]`` the row's state after its latest depth (the prelude output before depth 1).
        krow: ``[max_rows]`` long, the core K/V entry the row wrote at its latest depth.
    """

    e: torch.Tensor
    h: torch.Tensor
    krow: torch.Tensor


class StepExecutor:
    """The tensor work of one engine step (see the module docstring). Per step the engine calls
    ``prelude(entering)``, then ``core(groups)`` -> ``(still, finished)``, then ``finish_groups(finished)``.

    Args:
        model: the looped model (eval mode); ``max_depth`` is ``model.loop.max_depth``.
        kv: the engine's paged K/V (prelude, coda: ``dense_write``, ``dense_keys``; core: ``core_*``, ``mark_exit``).
        adapter: the method adapter (core input, ``relax``, ``decide``, the output combination).
        runner: runs a base decoder layer on flat rows over paged keys, and the LM head (``linear``).
        buffers: the row buffers, read and written at the step's rows; ``device`` is theirs.
        stats: the engine's counters; the step adds to ``"core_rows"``, ``"tokens"`` and ``"depth_sum"``.
        eos: end-of-sequence token ids.
        hooks: the scheduling actions the step triggers (``StepHooks``: the engine).

    Attributes:
        ro_pending: ``(group, depths)``: coda readouts at the deeper ``depths`` of groups that finished in the
            previous step (their rows are held until the readout runs, ``_readout``).
        last_core: ``(sequence slot, depth)`` of each row of the latest core call (tests, diagnostics).
    """

    def __init__(
        self,
        model,
        kv: PagedKV,
        adapter: MethodAdapter,
        runner: LayerRunner,
        buffers: RowBuffers,
        stats: dict[str, int],
        eos: set[int],
        hooks: StepHooks,
    ):
        self.model = model
        self.max_depth: int = model.loop.max_depth
        self.kv = kv
        self.adapter = adapter
        self.runner = runner
        self.buffers = buffers
        self.device = buffers.e.device
        self.stats = stats
        self.eos = eos
        self.hooks = hooks
        self.ro_pending: list[tuple[TokenGroup, list[int]]] = []
        self.last_core: list[tuple[int, int]] = []

    def drop_pending(self, seq: SeqState) -> list[TokenGroup]:
        """Remove ``seq``'s deferred readouts; returns their groups (the caller frees their rows), in order."""
        dropped = [pg for pg, _ in self.ro_pending if pg.seq is seq]
        self.ro_pending = [(pg, js) for pg, js in self.ro_pending if pg.seq is not seq]
        return dropped

    # -- prelude --------------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.model.model.rotary_emb(x[None], pos[None])
        return cos[0], sin[0]

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of exit states ``y`` ``[n, H]`` -> ``[n, V]``.

        On CPU, 7 to 15 rows are padded with zero rows to ``LM_HEAD_PAD_ROWS`` (16), where the head runs
        as ``W @ y.T`` (``retrofit.serving.layers.linear``): for the head's wide output, MKL's fp32 GEMM
        is slow below 16 rows in the ``F.linear`` layout (one thread, 32000 × 512 head, median ms: 1 row
        6.6, 4 rows 13.9, 7 rows 20.9, 10 rows 27.6, 15 rows 34.3, 16 rows 14.2; 2 threads, 16 rows as
        ``W @ y.T``: 6.6). It matters because a mixed-depth step reads out the ~B / d̄ rows that exit at
        *every* step, where a fixed-depth batch reads out all B rows every D-th step. A row's logits do
        not depend on the padding rows."""
        n = y.shape[0]
        if y.device.type == "cpu" and LM_HEAD_PAD_FROM <= n < LM_HEAD_PAD_ROWS:
            # a zero row stays zero through the RMS norm, and rows do not mix
            y = torch.cat([y, y.new_zeros(LM_HEAD_PAD_ROWS - n, y.shape[1])])
        return self.runner.linear(self.model.lm_head, self.model.model.norm(y))[:n]

    def _units(self, groups_rows: list[list[int]]):
        """Per unit ``(start, count)`` in the concatenated row order; single = every unit has one row."""
        out, start = [], 0
        for rows in groups_rows:
            out.append((start, len(rows)))
            start += len(rows)
        return out, all(n == 1 for _, n in out)

    def prelude(self, groups: list[TokenGroup]) -> None:
        """Embed and run the prelude on the entering ``groups`` (their K/V written); their output goes to
        ``e`` and ``h`` at their rows, and the adapter's per-row state starts (``enter``)."""
        dev = self.device
        rows = torch.tensor([r for g in groups for r in g.rows], device=dev)
        tokens = torch.tensor([t for g in groups for t in g.tokens], device=dev)
        x = self.model.model.embed_tokens(tokens)
        if self.model.prelude_layers:
            x = self._dense("pre", x, [(g, 0) for g in groups])[0]
        self.buffers.e[rows] = x
        self.buffers.h[rows] = x
        by_spec: dict[ExitSpec, list[int]] = {}  # one call per exit spec (usually one for the whole step)
        start = 0
        for g in groups:
            by_spec.setdefault(g.seq.req.spec, []).extend(range(start, start + len(g.rows)))
            start += len(g.rows)
        for spec, idx in by_spec.items():
            if len(idx) == len(rows):
                self.adapter.enter(rows, x, spec)
            else:
                it = torch.tensor(idx, device=dev)
                self.adapter.enter(rows[it], x[it], spec)

    # -- core, readout, decisions -----------------------------------------------------------------
    def core(self, groups: list[TokenGroup]) -> tuple[list[TokenGroup], list[TokenGroup]]:
        """One core call over the active rows of ``groups`` (each at its depth ``g.m``), readouts, decisions;
        marks the exits. Returns ``(still, finished)``: the groups with rows still running (``g.m`` advanced)
        and those whose rows have all exited (``finish_groups``, once ``still`` are the groups in flight)."""
        dev = self.device
        D = self.max_depth
        buf = self.buffers
        run_rows: list[int] = []
        run_d: list[int] = []
        run_s: list[int] = []
        run_rank: list[int] = []
        run_pos: list[int] = []
        run_gi: list[int] = []  # index of the row in its group
        unit_rows = []
        units = []
        for g in groups:
            start = len(run_rows)
            k = 0
            for i, (r, a) in enumerate(zip(g.rows, g.active)):
                if a:
                    run_rows.append(r)
                    run_pos.append(g.positions[i])
                    run_gi.append(i)
                    run_rank.append(k)
                    k += 1
            run_d.extend([g.m] * k)
            run_s.extend([g.seq.slot] * k)
            unit_rows.append((start, k))
            units.append((g.seq.slot, g.m, k, run_pos[-1]))
        N = len(run_rows)
        single = all(n == 1 for _, n in unit_rows)
        rows_t = torch.tensor(run_rows, device=dev)
        d_t = torch.tensor(run_d, device=dev)
        s_t = torch.tensor(run_s, device=dev)
        pos_t = torch.tensor(run_pos, device=dev)
        rank_t = torch.tensor(run_rank, device=dev)
        self.stats["core_rows"] += N
        self.last_core = list(zip(run_s, run_d))  # (sequence slot, depth) of each row of this step's core call

        e = buf.e[rows_t]
        h_prev = buf.h[rows_t]
        n_first = sum(1 for d in run_d if d == 1)
        x = self.adapter.core_input(e, h_prev, d_t == 1, n_first > 0, n_first == N)
        slots, kidx = self.kv.core_write([(s, m, n) for s, m, n, _ in units], s_t, d_t, rank_t, pos_t)
        u_s = torch.tensor([u[0] for u in units], device=dev)
        u_m = torch.tensor([u[1] for u in units], device=dev)
        u_q = torch.tensor([u[3] for u in units], device=dev)
        keys = self.kv.core_keys(u_s, u_m, u_q, unit_rows, pos_t, single)
        cos, sin = self._rope(x, pos_t)
        pool = self.kv.pools["core"]
        for layer in self.model.core_layers:
            li = layer.self_attn.layer_idx
            x = self.runner.run(layer, x, cos, sin, pool.k[li], pool.v[li], slots, keys)
        taps = None
        flags = [g.seq.req.spec.schedule == "taps" for g in groups]
        if any(flags):
            taps = torch.tensor([f for f, (_, n) in zip(flags, unit_rows) for _ in range(n)], device=dev)
        h_new = self.adapter.relax(rows_t, d_t, h_prev, x, taps)
        buf.h[rows_t] = h_new
        buf.krow[rows_t] = kidx

        # -- readout of the rows that need it -----------------------------------------------------
        ro_groups = [gi for gi, g in enumerate(groups) if g.seq.readout]
        z = None
        zpos = None
        if ro_groups or self.ro_pending:
            z, zpos = self._readout(groups, ro_groups, unit_rows, rows_t, h_new, N)

        # -- decisions ---------------------------------------------------------------------------------
        cont = torch.zeros(N, dtype=torch.bool, device=dev)
        signal = torch.full((N,), float("nan"), device=dev)
        by_spec: dict[ExitSpec, list[int]] = {}
        for g, (start, n) in zip(groups, unit_rows):
            if g.m < D and n:
                by_spec.setdefault(g.seq.req.spec, []).extend(range(start, start + n))
        for spec, idx_py in by_spec.items():
            if len(idx_py) == N:  # one spec, every row below depth D (common): no gathers of the step's rows
                zi = z[zpos] if (z is not None and self.adapter.needs_readout(spec)) else None
                c, sig = self.adapter.decide(rows_t, d_t, e, h_new, zi, spec)
                cont.copy_(c)
                if sig is not None:
                    signal.copy_(sig.float())
                continue
            idx = torch.tensor(idx_py, device=dev)
            zi = z[zpos[idx]] if (z is not None and self.adapter.needs_readout(spec)) else None
            c, sig = self.adapter.decide(rows_t[idx], d_t[idx], e[idx], h_new[idx], zi, spec)
            cont[idx] = c
            if sig is not None:
                signal[idx] = sig.float()
        stop = ~cont
        self.kv.mark_exit(s_t[stop], kidx[stop])

        # TaH2: the output combination of each request's last token
        if self.adapter.output_from_readout:
            last_by_mix: dict[bool, list[int]] = {}
            for g, (start, n) in zip(groups, unit_rows):
                if n and g.active[-1] and run_gi[start + n - 1] == len(g.rows) - 1:
                    last_by_mix.setdefault(self.adapter.mixes(g.seq.req.spec), []).append(start + n - 1)
            for mix, last_idx in last_by_mix.items():  # a forced depth: the exit depth's logits, no mixture
                li_t = torch.tensor(last_idx, device=dev)
                sig = signal[li_t]
                self.adapter.combine_add(
                    s_t[li_t], d_t[li_t], z[zpos[li_t]], stop[li_t], None if bool(torch.isnan(sig).all()) else sig, mix
                )

        # -- bookkeeping: exits, finished steps, sampling ------------------------------------------
        cont_py = cont.tolist()
        finished: list[TokenGroup] = []
        still: list[TokenGroup] = []
        for g, (start, n) in zip(groups, unit_rows):
            for j in range(start, start + n):
                i = run_gi[j]
                if not cont_py[j]:
                    g.active[i] = False
                    g.exit_depth[i] = g.m
                    g.n_active -= 1
            if g.n_active == 0:
                finished.append(g)
            else:
                g.m += 1
                still.append(g)
        return still, finished

    def _readout(self, groups, ro_groups, unit_rows, rows_t, h_new, N):
        """Logits of the active rows of requests that read out every depth; ``zpos[j]`` is the row of
        ``z`` for run row ``j``. With a coda, its readout runs over every token of the step at the
        step's depth (exited tokens with their passthrough state) plus the deeper readouts of steps
        that finished in the previous step."""
        dev = self.device
        ro_run = [j for gi in ro_groups for j in range(unit_rows[gi][0], unit_rows[gi][0] + unit_rows[gi][1])]
        zpos = torch.zeros(N, dtype=torch.long, device=dev)
        if ro_run:
            zpos[torch.tensor(ro_run, device=dev)] = torch.arange(len(ro_run), device=dev)
        if not self.kv.has_coda:
            y = h_new[torch.tensor(ro_run, device=dev)] if ro_run else None
        else:
            # coda units: (group rows, stream j)
            cu: list[tuple[TokenGroup, int]] = [(groups[gi], groups[gi].m) for gi in ro_groups]
            pend, self.ro_pending = self.ro_pending, []
            for pg, js in pend:
                cu.extend((pg, j) for j in js)
            x, _ = self._coda(cu)
            for pg, _ in pend:
                if pg.rows:
                    self.hooks._release_rows(pg)
            # the active rows of the current readout groups, in run order
            take = []
            off = 0
            for g, _ in cu[: len(ro_groups)]:
                take.extend(off + i for i, a in enumerate(g.active) if a)
                off += len(g.rows)
            y = x[torch.tensor(take, device=dev)] if take else None
        z = self.logits(y) if y is not None else None
        return z, zpos

    def _coda(self, units: list[tuple[TokenGroup, int]]) -> tuple[torch.Tensor, list]:
        """The coda layers over coda units ``(group, stream j)`` from the groups' rows of ``h`` (``_dense``)."""
        x = self.buffers.h[torch.tensor([r for g, _ in units for r in g.rows], device=self.device)]
        return self._dense("coda", x, units)

    def _dense(self, part: str, x: torch.Tensor, units: list[tuple[TokenGroup, int]]) -> tuple[torch.Tensor, list]:
        """The layers of ``part`` (``"pre"``: the prelude, ``"coda"``) over units ``(group, stream j)`` with input
        ``x`` ``[rows, H]`` (units in order, each group's rows in order): each group's rows at its positions,
        written to and reading stream ``j`` of that part's KV (positions ``0 …`` its last). Returns the output
        ``[rows, H]`` and the units' ``(start, count)`` rows."""
        dev = self.device
        table = self.kv.pre if part == "pre" else self.kv.coda
        layers = self.model.prelude_layers if part == "pre" else self.model.coda_layers
        pos = torch.tensor([p for g, _ in units for p in g.positions], device=dev)
        s = torch.tensor([g.seq.slot for g, _ in units for _ in g.rows], device=dev)
        jt = torch.tensor([j for g, j in units for _ in g.rows], device=dev)
        cos, sin = self._rope(x, pos)
        unit_rows, single = self._units([g.rows for g, _ in units])
        seq_py, j_py = [g.seq.slot for g, _ in units], [j for _, j in units]
        ends = [g.positions[-1] + 1 for g, _ in units]
        slots = self.kv.dense_write(table, s, jt, pos, seq_py, j_py, ends)
        qmax = [e - 1 for e in ends]
        keys = self.kv.dense_keys(
            table,
            torch.tensor(seq_py, device=dev),
            torch.tensor(j_py, device=dev),
            torch.tensor(qmax, device=dev),
            max(qmax) + 1,
            unit_rows,
            pos,
            single,
        )
        pool = self.kv.pools[part]
        for layer in layers:
            li = layer.self_attn.layer_idx
            x = self.runner.run(layer, x, cos, sin, pool.k[li], pool.v[li], slots, keys)
        return x, unit_rows

    def finish_groups(self, finished: list[TokenGroup]) -> None:
        """All tokens of these groups have exited: output logits, sample, emit; then per request, finish it
        (``hooks._finish_seq``) or feed the sampled token (``hooks._new_group``)."""
        dev = self.device
        D = self.max_depth
        if self.adapter.output_from_readout:
            seqs = torch.tensor([g.seq.slot for g in finished], device=dev)
            depths = torch.tensor([g.exit_depth[-1] for g in finished], device=dev)
            logits = self.adapter.combined_logits(seqs, depths)
        elif self.kv.has_coda:  # each group's last row after the coda (stream 0: the output depth)
            x, unit_rows = self._coda([(g, 0) for g in finished])
            logits = self.logits(x[torch.tensor([start + n - 1 for start, n in unit_rows], device=dev)])
        else:
            logits = self.logits(self.buffers.h[torch.tensor([g.rows[-1] for g in finished], device=dev)])
        greedy = [g.seq.req.params.greedy for g in finished]
        argmax = logits.argmax(-1).tolist() if any(greedy) else None
        now = time.monotonic()
        n_tok = 0
        for i, g in enumerate(finished):
            seq = g.seq
            req = seq.req
            req.position_depths.extend(g.exit_depth)
            d_last = max(g.exit_depth)
            tok = argmax[i] if greedy[i] else sample(logits[i], req.params, seq.gen)
            depth = g.exit_depth[-1]
            req.output.append(tok)
            req.depths.append(depth)
            self.stats["tokens"] += 1
            self.stats["depth_sum"] += depth
            n_tok += 1
            is_eos = tok in self.eos and not req.params.ignore_eos
            text, hit_stop = ("", False) if is_eos else seq.stops.push(tok)
            req._emit({"type": "token", "token": tok, "text": text, "depth": depth})
            reason = None
            if is_eos or hit_stop:
                reason = "stop"
            elif len(req.output) >= req.params.max_tokens:
                reason = "length"
            if reason is not None:
                if not hit_stop:
                    tail = seq.stops.flush()
                    if tail:
                        req._emit({"type": "token", "token": None, "text": tail, "depth": None})
                seq.group = None
                self.hooks._release_rows(g)
                self.hooks._finish_seq(seq, reason)
                continue
            if seq.readout and self.kv.has_coda and d_last < D:
                # later tokens may run deeper: their depth-j readout reads this step's tokens at depth j
                self.ro_pending.append((g, list(range(d_last + 1, D + 1))))
            else:
                self.hooks._release_rows(g)
            self.hooks._new_group(seq, [tok])
        self.hooks._record_tokens(now, n_tok)
