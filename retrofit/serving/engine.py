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
alone (``tests/serving/test_serving_engine.py``).

``Engine.step()`` runs one step; ``Engine.start()`` runs steps in a background thread for the server. The engine
schedules (point 1, freeing, cancellation); its ``StepExecutor`` (``retrofit.serving.step``) does the tensor
work of points 2–5 and calls back the engine's ``StepHooks`` (``_new_group``, ``_release_rows``,
``_finish_seq``, ``_record_tokens``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ..model.flops import cost_report
from .kv import KVBudgetError, PagedKV
from .layers import LayerRunner, layer_ops_for
from .methods import MethodAdapter
from .requests import Request, SeqState, TokenGroup
from .sampling import SamplingParams
from .step import RowBuffers, StepExecutor

logger = logging.getLogger(__name__)


class Engine:
    """The continuous depth-wise batching engine (see the module docstring).

    Args:
        model: a looped model (``LoopedForCausalLM``), eval mode.
        tokenizer: for stop strings and text (optional: without it, token ids only).
        max_seqs: requests running at once (the batch size).
        max_model_len: longest prompt + answer (default: the model's context, at most 2048).
        kv_budget_bytes: memory for K/V (default 64 MiB).
        block_size: token slots per KV block of the prelude and coda layers.
        core_block_size: (token, depth) entry slots per KV block of the core layers (default 1: allocated
            core K/V follows executed (token, depth) pairs exactly; ``retrofit.serving.kv``).
        max_rows: row slots (tokens in flight, prompts included); default ``16 * max_seqs + max_model_len``
            (a prompt of the longest length always fits).
        default_exit: the exit arguments a request gets when it names none (``generate``'s keywords).
        eos_token_id: end-of-sequence id(s) (default: the model's generation config).
        small_gemm: on CPU, compute linears of 16-63 rows as ``W @ x.T``, MKL's faster layout there
            (``retrofit.serving.layers.SMALL_GEMM_ROWS``); False runs every module as it is.
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
        core_block_size: int = 1,
        max_rows: int | None = None,
        default_exit: dict | None = None,
        eos_token_id=None,
        small_gemm: bool = True,
    ):
        from ..model.modeling import LoopedForCausalLM

        if not isinstance(model, LoopedForCausalLM):
            raise TypeError(f"the engine serves looped models (LoopedForCausalLM); got {type(model).__name__}")
        self.model = model.eval()
        self.tok = tokenizer
        cfg = model.config
        self.D = model.loop.max_depth
        self.max_seqs = max_seqs
        self.max_len = int(max_model_len or min(getattr(cfg, "max_position_embeddings", 2048) or 2048, 2048))
        self.max_rows = int(max_rows or (16 * max_seqs + self.max_len))
        self.runner = LayerRunner(layer_ops_for(model), small_gemm=small_gemm)
        self.adapter = MethodAdapter(model, self.max_rows, max_seqs)
        self.kv = PagedKV(model, kv_budget_bytes, max_seqs, self.max_len, block_size, core_block_size=core_block_size)
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
        self.free_rows = list(range(self.max_rows - 1, -1, -1))
        self.free_seqs = list(range(max_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.seqs: dict[str, SeqState] = {}
        self.groups: list[TokenGroup] = []  # in flight (some token still in the core)
        self.entering: list[TokenGroup] = []  # enter at the next step
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
        buffers = RowBuffers(
            torch.zeros(self.max_rows, H, dtype=dtype, device=dev),
            torch.zeros(self.max_rows, H, dtype=dtype, device=dev),
            torch.zeros(self.max_rows, dtype=torch.long, device=dev),
        )
        self.executor = StepExecutor(model, self.kv, self.adapter, self.runner, buffers, self.stats, self.eos, self)
        # FLOPs of one token exiting at depth d (retrofit.model.flops; a per-token sum), with and without readouts
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

    @property
    def last_core(self) -> list[tuple[int, int]]:
        """``(sequence slot, depth)`` of each row of the latest step's core call (``StepExecutor.last_core``)."""
        return self.executor.last_core

    @last_core.setter
    def last_core(self, value: list[tuple[int, int]]) -> None:
        self.executor.last_core = value

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
                self.executor.prelude(entering)
                self.groups.extend(entering)
            if not self.groups:
                return bool(entering)
            self.groups, finished = self.executor.core(self.groups)
            if finished:
                self.executor.finish_groups(finished)
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
            seq = SeqState(req, self.free_seqs.pop(), res, readout, self.tok)
            self.seqs[req.request_id] = seq
            self._new_group(seq, list(req.prompt))

    # -- step hooks (retrofit.serving.step.StepHooks) --------------------------------------------------
    def _new_group(self, seq: SeqState, tokens: list[int]) -> None:
        rows = [self.free_rows.pop() for _ in tokens]
        g = TokenGroup(seq, rows, list(range(seq.n_pos, seq.n_pos + len(tokens))), tokens)
        seq.n_pos += len(tokens)
        seq.group = g
        self.entering.append(g)

    def _release_rows(self, g: TokenGroup) -> None:
        self.free_rows.extend(g.rows)
        g.rows = []

    def _finish_seq(self, seq: SeqState, reason: str) -> None:
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
        for pg in self.executor.drop_pending(seq):
            self._release_rows(pg)
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

    def _record_tokens(self, now: float, n: int) -> None:
        self._recent.append((now, n))

    # -- cancellation ------------------------------------------------------------------------------
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
                    self.groups, self.entering, self.executor.ro_pending = [], [], []
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
