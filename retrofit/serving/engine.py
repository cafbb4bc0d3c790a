"""Continuous depth-wise batching of a looped model (``retrofit serve``'s engine).

A *row* is one token of one request at one depth. Each engine step:

1. **admits** waiting requests while sequence slots, row slots and the KV budget allow (each request
   reserves its worst case, ``retrofit.serving.kv``; one that does not fit waits in the queue);
2. runs the **prelude** on the rows *entering*: new prompts (all their tokens) and the token each running
   request sampled in the previous step; their output ``e`` is the core input;
3. applies the **core once to every row in flight**, whatever its request and its depth: the rows'
   core inputs (``e`` at depth 1, ``updater(e, h)`` deeper) go through the shared core layers in one call
   per layer; each row writes its K/V to its request's ``core[depth]`` stream and reads exactly the keys
   the model's own forward would (duo-causal or same-depth, ``PagedKV.core_keys``);
4. reads out (final norm + LM head, through the coda for a model with one) the rows whose exit rule or
   output needs it, and **decides** per row: continue to the next depth, or exit;
5. a row that exits **leaves at once**; when all tokens of a request's step have exited, the coda runs on
   their exit states (or TaH2's mixture is read), the next token is sampled and enters the next step —
   so the slot is refilled immediately, by that request or a waiting one.

The tokens of a prompt move depth by depth together (a token reads the keys of earlier prompt tokens at
its own depth); a request's later token enters after its previous token has exited, so every key a row
reads was written earlier in the step or before it. The tokens equal ``model.generate`` on each request
alone (``tests/test_serving_engine.py``).

``Engine.step()`` runs one step; ``Engine.start()`` runs steps in a background thread for the server.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..flops import cost_report
from .kv import KVBudgetError, PagedKV
from .layers import LayerRunner, layer_ops_for
from .methods import ExitSpec, MethodAdapter
from .sampling import SamplingParams, StopChecker, make_generator, sample

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request and its results (updated by the engine thread).

    Attributes:
        request_id: unique id.
        prompt: prompt token ids.
        params: sampling parameters.
        spec: exit control.
        on_event: called from the engine thread with each event: ``{"type": "token", "token", "text",
            "depth"}`` and finally ``{"type": "finish", "reason", "usage"}``.
        output: generated token ids; ``depths``: the exit depth of the step that produced each one.
        text: the answer text (stop strings cut); finish_reason: ``"stop"``, ``"length"`` or ``"cancelled"``.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    spec: ExitSpec
    on_event: Callable[[dict], None] | None = None
    output: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    position_depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    arrival: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a listener's failure must not stop the engine
                logger.exception("event listener of request %s failed", self.request_id)


class _Seq:
    """A running request: its sequence slot, KV reservation, next position, generator and stop checker."""

    def __init__(self, req: Request, slot: int, reservation, readout: bool, tok):
        self.req = req
        self.slot = slot
        self.res = reservation
        self.readout = readout
        self.n_pos = 0
        self.gen = make_generator(req.params.seed)
        self.stops = StopChecker(tok, req.params.stop)
        self.group: _Group | None = None


class _Group:
    """The tokens a request feeds in one step (its prompt, or one sampled token), moving depth by depth."""

    def __init__(self, seq: _Seq, rows: list[int], positions: list[int], tokens: list[int]):
        self.seq = seq
        self.rows = rows
        self.positions = positions
        self.tokens = tokens
        self.m = 1  # the depth the active tokens run next
        self.active = [True] * len(rows)
        self.exit_depth = [0] * len(rows)
        self.n_active = len(rows)


class Engine:
    """The continuous depth-wise batching engine (see the module docstring).

    Args:
        model: a looped model (``LoopedForCausalLM``), eval mode.
        tokenizer: for stop strings and text (optional: without it, token ids only).
        max_seqs: requests running at once (the batch size).
        max_model_len: longest prompt + answer (default: the model's context, at most 2048).
        kv_budget_bytes: memory for K/V (default 64 MiB).
        block_size: token slots per KV block.
        max_rows: row slots (tokens in flight, prompts included); default ``16 * max_seqs + max_model_len``
            (a prompt of the longest length always fits).
        default_exit: the exit arguments a request gets when it names none (``generate``'s keywords).
        eos_token_id: end-of-sequence id(s) (default: the model's generation config).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_seqs: int = 32,
        max_model_len: int | None = None,
        kv_budget_bytes: int = 64 << 20,
        block_size: int = 16,
        max_rows: int | None = None,
        default_exit: dict | None = None,
        eos_token_id=None,
    ):
        from ..modeling import LoopedForCausalLM

        if not isinstance(model, LoopedForCausalLM):
            raise TypeError(f"the engine serves looped models (LoopedForCausalLM); got {type(model).__name__}")
        self.model = model.eval()
        self.tok = tokenizer
        cfg = model.config
        self.D = model.loop.max_depth
        self.max_seqs = max_seqs
        self.max_len = int(max_model_len or min(getattr(cfg, "max_position_embeddings", 2048) or 2048, 2048))
        self.max_rows = int(max_rows or (16 * max_seqs + self.max_len))
        self.runner = LayerRunner(layer_ops_for(model))
        self.adapter = MethodAdapter(model, self.max_rows, max_seqs)
        self.kv = PagedKV(model, kv_budget_bytes, max_seqs, self.max_len, block_size)
        self.default_exit = dict(default_exit or {})
        self.default_spec = self.adapter.spec(**self.default_exit)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = cfg.eos_token_id
        self.eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        dev = model.lm_head.weight.device
        self.device = dev
        dtype = model.lm_head.weight.dtype
        H = cfg.hidden_size
        self.e = torch.zeros(self.max_rows, H, dtype=dtype, device=dev)
        self.h = torch.zeros(self.max_rows, H, dtype=dtype, device=dev)
        self.krow = torch.zeros(self.max_rows, dtype=torch.long, device=dev)  # core entry of the row's latest depth
        self.free_rows = list(range(self.max_rows - 1, -1, -1))
        self.free_seqs = list(range(max_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.seqs: dict[str, _Seq] = {}
        self.groups: list[_Group] = []  # in flight (some token still in the core)
        self.entering: list[_Group] = []  # enter at the next step
        self.ro_pending: list[tuple[_Group, list[int]]] = []  # coda readouts of deeper depths, next step
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"steps": 0, "tokens": 0, "depth_sum": 0, "core_rows": 0, "requests_finished": 0}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self.step_lock = threading.Lock()
        self.last_core: list[tuple[int, int]] = []
        # FLOPs of one token exiting at depth d (retrofit.flops; a per-token sum), with and without readouts
        self._flops = {}
        for ro in (False, True):
            reps = [cost_report(model, torch.tensor([d]), readout=ro) for d in range(1, self.D + 1)]
            self._flops[ro] = ([0.0] + [r["flops"] for r in reps], reps[0]["flops_fixed"])

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        on_event: Callable[[dict], None] | None = None,
        **exit_kwargs,
    ) -> Request:
        """Queue a request; returns it (``request.done`` is set when it ends).

        Args:
            prompt: prompt token ids (non-empty).
            params: sampling parameters (default ``SamplingParams()``: temperature 1, 16 tokens).
            exit_kwargs: ``exit_policy``, ``exit_threshold``, ``depth``, ``step_schedule`` (as ``generate``);
                none given: the engine's ``default_exit``.

        Raises:
            ValueError: an empty or too long prompt, bad parameters, or a request that can never fit in the
                KV budget (the message says what is allowed).
        """
        params = params or SamplingParams()
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a non-empty list of token ids")
        V = self.model.config.vocab_size
        if any(t < 0 or t >= V for t in prompt):
            raise ValueError(f"prompt token ids must lie in 0..{V - 1}")
        P = len(prompt)
        if P + params.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({P} tokens) + max_tokens ({params.max_tokens}) = {P + params.max_tokens} exceeds the context "
                f"of {self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        spec = (
            self.adapter.spec(**exit_kwargs) if any(v is not None for v in exit_kwargs.values()) else self.default_spec
        )
        need = self.kv.worst_case(P + params.max_tokens, self.adapter.needs_readout(spec))
        if not self.kv.fits_ever(need):
            raise KVBudgetError(
                f"this request needs up to {need} KV blocks but the budget holds "
                f"{ {p: pool.num_blocks for p, pool in self.kv.pools.items()} }; lower max_tokens or raise the budget"
            )
        if P > self.max_rows:
            raise ValueError(f"prompt of {P} tokens exceeds the engine's {self.max_rows} row slots")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, spec, on_event)
        with self._lock:
            self._inbox.append(req)
        self._wake.set()
        return req

    def cancel(self, request_id: str) -> None:
        """Stop a request (waiting or running); its rows and KV blocks are freed before the next step."""
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox) or bool(self._cancels)
        return pending or bool(self.waiting) or bool(self.seqs)

    # -- metrics -----------------------------------------------------------------------------------
    def metrics(self) -> dict:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        toks = sum(n for _, n in self._recent)
        span = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        return {
            "queue_length": len(self.waiting) + len(self._inbox),
            "running": len(self.seqs),
            "rows_in_flight": sum(g.n_active for g in self.groups),
            "tokens_per_second": toks / span if span > 0 else 0.0,
            "mean_depth": self.stats["depth_sum"] / self.stats["tokens"] if self.stats["tokens"] else 0.0,
            "kv_blocks_in_use": self.kv.blocks_in_use(),
            "kv_blocks_total": sum(p.num_blocks for p in self.kv.pools.values()),
            "kv_bytes_in_use": self.kv.bytes_in_use(),
            "tokens_total": self.stats["tokens"],
            "steps_total": self.stats["steps"],
            "requests_finished": self.stats["requests_finished"],
        }

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """One engine step; returns False when there was nothing to do."""
        with self.step_lock:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
            self.waiting.extend(inbox)
            for rid in cancels:
                self._cancel_now(rid)
            self._admit()
            entering, self.entering = self.entering, []
            if entering:
                self._prelude(entering)
                self.groups.extend(entering)
            if not self.groups:
                return bool(entering)
            self._core_step()
            self.stats["steps"] += 1
            return True

    def _admit(self) -> None:
        while self.waiting and self.free_seqs:
            req = self.waiting[0]
            P = len(req.prompt)
            if P > len(self.free_rows):
                break
            readout = self.adapter.needs_readout(req.spec)
            res = self.kv.try_reserve(self.kv.worst_case(P + req.params.max_tokens, readout))
            if res is None:
                break  # admission control: wait until running requests free their blocks
            self.waiting.popleft()
            seq = _Seq(req, self.free_seqs.pop(), res, readout, self.tok)
            self.seqs[req.request_id] = seq
            self._new_group(seq, list(req.prompt))

    def _new_group(self, seq: _Seq, tokens: list[int]) -> None:
        rows = [self.free_rows.pop() for _ in tokens]
        g = _Group(seq, rows, list(range(seq.n_pos, seq.n_pos + len(tokens))), tokens)
        seq.n_pos += len(tokens)
        seq.group = g
        self.entering.append(g)

    def _release_rows(self, g: _Group) -> None:
        self.free_rows.extend(g.rows)
        g.rows = []

    def _finish_seq(self, seq: _Seq, reason: str) -> None:
        req = seq.req
        self.seqs.pop(req.request_id, None)
        g = seq.group
        if g is not None:
            if g in self.groups:
                self.groups.remove(g)
            if g in self.entering:
                self.entering.remove(g)
            if g.rows:
                self._release_rows(g)
        keep = []
        for pg, js in self.ro_pending:
            if pg.seq is seq:
                self._release_rows(pg)
            else:
                keep.append((pg, js))
        self.ro_pending = keep
        self.kv.release(seq.slot, seq.res)
        self.free_seqs.append(seq.slot)
        req.finish_reason = reason
        req.text = seq.stops.text
        n_gen = len(req.output)
        per_depth, fixed = self._flops[seq.readout]
        flops = sum(per_depth[d] for d in req.position_depths)
        n_pos = len(req.position_depths)
        req.usage = {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": n_gen,
            "total_tokens": len(req.prompt) + n_gen,
            "mean_depth": (sum(req.depths) / len(req.depths)) if req.depths else None,
            "prompt_mean_depth": (sum(req.position_depths[: len(req.prompt)]) / len(req.prompt))
            if len(req.position_depths) >= len(req.prompt)
            else None,
            "flops": flops,
            "flops_vs_fixed_depth": flops / (n_pos * fixed) if n_pos else None,
        }
        self.stats["requests_finished"] += 1
        req._emit({"type": "finish", "reason": reason, "usage": req.usage, "text": req.text})
        req.done.set()

    def _cancel_now(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.request_id == rid:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                req.usage = {"prompt_tokens": len(req.prompt), "completion_tokens": 0, "total_tokens": len(req.prompt)}
                req._emit({"type": "finish", "reason": "cancelled", "usage": req.usage, "text": ""})
                req.done.set()
                return
        seq = self.seqs.get(rid)
        if seq is not None:
            self._finish_seq(seq, "cancelled")

    # -- prelude --------------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.model.model.rotary_emb(x[None], pos[None])
        return cos[0], sin[0]

    def _units(self, groups_rows: list[list[int]]):
        """Per unit ``(start, count)`` in the concatenated row order; single = every unit has one row."""
        out, start = [], 0
        for rows in groups_rows:
            out.append((start, len(rows)))
            start += len(rows)
        return out, all(n == 1 for _, n in out)

    def _prelude(self, groups: list[_Group]) -> None:
        dev = self.device
        rows = torch.tensor([r for g in groups for r in g.rows], device=dev)
        pos = torch.tensor([p for g in groups for p in g.positions], device=dev)
        tokens = torch.tensor([t for g in groups for t in g.tokens], device=dev)
        x = self.model.model.embed_tokens(tokens)
        if self.model.prelude_layers:
            cos, sin = self._rope(x, pos)
            s = torch.tensor([g.seq.slot for g in groups for _ in g.rows], device=dev)
            zero = torch.zeros_like(s)
            unit_rows, single = self._units([g.rows for g in groups])
            slots = self.kv.dense_write(
                self.kv.pre,
                s,
                zero,
                pos,
                [g.seq.slot for g in groups],
                [0] * len(groups),
                [g.positions[-1] + 1 for g in groups],
            )
            qmax = [g.positions[-1] for g in groups]
            keys = self.kv.dense_keys(
                self.kv.pre,
                torch.tensor([g.seq.slot for g in groups], device=dev),
                torch.zeros(len(groups), dtype=torch.long, device=dev),
                torch.tensor(qmax, device=dev),
                max(qmax) + 1,
                unit_rows,
                pos,
                single,
            )
            pool = self.kv.pools["pre"]
            for layer in self.model.prelude_layers:
                li = layer.self_attn.layer_idx
                x = self.runner.run(layer, x, cos, sin, pool.k[li], pool.v[li], slots, keys)
        self.e[rows] = x
        self.h[rows] = x
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
    def _core_step(self) -> None:
        dev = self.device
        D = self.D
        groups = self.groups
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

        e = self.e[rows_t]
        h_prev = self.h[rows_t]
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
        self.h[rows_t] = h_new
        self.krow[rows_t] = kidx

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
            idx = torch.tensor(idx_py, device=dev)
            zi = z[zpos[idx]] if (z is not None and self.adapter.needs_readout(spec)) else None
            c, sig = self.adapter.decide(rows_t[idx], d_t[idx], e[idx], h_new[idx], zi, spec)
            cont[idx] = c
            if sig is not None:
                signal[idx] = sig.float()
        stop = ~cont
        self.kv.mark_exit(s_t[stop], d_t[stop], kidx[stop])

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
        finished: list[_Group] = []
        still: list[_Group] = []
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
        self.groups = still
        if finished:
            self._finish_groups(finished)

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
        model = self.model
        if not self.kv.has_coda:
            y = h_new[torch.tensor(ro_run, device=dev)] if ro_run else None
        else:
            # coda units: (group rows, stream j)
            cu: list[tuple[_Group, int]] = [(groups[gi], groups[gi].m) for gi in ro_groups]
            pend, self.ro_pending = self.ro_pending, []
            for pg, js in pend:
                cu.extend((pg, j) for j in js)
            rows = torch.tensor([r for g, _ in cu for r in g.rows], device=dev)
            pos = torch.tensor([p for g, _ in cu for p in g.positions], device=dev)
            s = torch.tensor([g.seq.slot for g, _ in cu for _ in g.rows], device=dev)
            jt = torch.tensor([j for g, j in cu for _ in g.rows], device=dev)
            x = self.h[rows]
            cos, sin = self._rope(x, pos)
            unit_rows_c, single = self._units([g.rows for g, _ in cu])
            ends = [g.positions[-1] + 1 for g, _ in cu]
            slots = self.kv.dense_write(self.kv.coda, s, jt, pos, [g.seq.slot for g, _ in cu], [j for _, j in cu], ends)
            qmax = [e - 1 for e in ends]
            keys = self.kv.dense_keys(
                self.kv.coda,
                torch.tensor([g.seq.slot for g, _ in cu], device=dev),
                torch.tensor([j for _, j in cu], device=dev),
                torch.tensor(qmax, device=dev),
                max(qmax) + 1,
                unit_rows_c,
                pos,
                single,
            )
            pool = self.kv.pools["coda"]
            for layer in model.coda_layers:
                li = layer.self_attn.layer_idx
                x = self.runner.run(layer, x, cos, sin, pool.k[li], pool.v[li], slots, keys)
            for pg, _ in pend:
                if pg.rows:
                    self._release_rows(pg)
            # the active rows of the current readout groups, in run order
            take = []
            off = 0
            for g, _ in cu[: len(ro_groups)]:
                take.extend(off + i for i, a in enumerate(g.active) if a)
                off += len(g.rows)
            y = x[torch.tensor(take, device=dev)] if take else None
        z = model.lm_head(model.model.norm(y)) if y is not None else None
        return z, zpos

    def _finish_groups(self, finished: list[_Group]) -> None:
        """All tokens of these steps have exited: output logits, sample, emit, feed the next token."""
        dev = self.device
        model = self.model
        D = self.D
        seqs = torch.tensor([g.seq.slot for g in finished], device=dev)
        if self.adapter.output_from_readout:
            logits = self.adapter.combined_logits(seqs)
        else:
            last_rows = torch.tensor([g.rows[-1] for g in finished], device=dev)
            if self.kv.has_coda:
                rows = torch.tensor([r for g in finished for r in g.rows], device=dev)
                pos = torch.tensor([p for g in finished for p in g.positions], device=dev)
                s = torch.tensor([g.seq.slot for g in finished for _ in g.rows], device=dev)
                x = self.h[rows]
                cos, sin = self._rope(x, pos)
                unit_rows, single = self._units([g.rows for g in finished])
                ends = [g.positions[-1] + 1 for g in finished]
                zero = torch.zeros_like(s)
                slots = self.kv.dense_write(
                    self.kv.coda, s, zero, pos, [g.seq.slot for g in finished], [0] * len(finished), ends
                )
                qmax = [e - 1 for e in ends]
                keys = self.kv.dense_keys(
                    self.kv.coda,
                    seqs,
                    torch.zeros_like(seqs),
                    torch.tensor(qmax, device=dev),
                    max(qmax) + 1,
                    unit_rows,
                    pos,
                    single,
                )
                pool = self.kv.pools["coda"]
                for layer in model.coda_layers:
                    li = layer.self_attn.layer_idx
                    x = self.runner.run(layer, x, cos, sin, pool.k[li], pool.v[li], slots, keys)
                last = torch.tensor([start + n - 1 for start, n in unit_rows], device=dev)
                y = x[last]
            else:
                y = self.h[last_rows]
            logits = model.lm_head(model.model.norm(y))
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
                self._release_rows(g)
                self._finish_seq(seq, reason)
                continue
            if seq.readout and self.kv.has_coda and d_last < D:
                # later tokens may run deeper: their depth-j readout reads this step's tokens at depth j
                self.ro_pending.append((g, list(range(d_last + 1, D + 1))))
            else:
                self._release_rows(g)
            self._new_group(seq, [tok])
        self._recent.append((now, n_tok))

    # -- running -----------------------------------------------------------------------------------
    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        """Step until every queued request has finished (tests, benchmarks)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def start(self) -> None:
        """Run steps in a background thread until ``shutdown``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop():
            while not self._stop.is_set():
                try:
                    worked = self.step() if self.has_work() else False
                except Exception:  # keep serving: fail the running requests, not the server
                    logger.exception("engine step failed; cancelling the running requests")
                    for seq in list(self.seqs.values()):
                        self._finish_seq(seq, "error")
                    self.groups, self.entering, self.ro_pending = [], [], []
                    worked = False
                if not worked:
                    self._wake.wait(0.05)
                    self._wake.clear()

        self._thread = threading.Thread(target=loop, name="retrofit-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the background thread; running and waiting requests end with reason ``"cancelled"``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self.step_lock:
            for req in list(self.waiting) + self._inbox:
                req.finish_reason = "cancelled"
                req._emit({"type": "finish", "reason": "cancelled", "usage": None, "text": ""})
                req.done.set()
            self.waiting.clear()
            self._inbox = []
            for seq in list(self.seqs.values()):
                self._finish_seq(seq, "cancelled")
