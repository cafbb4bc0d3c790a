"""Teacher-forced passes: one forward on ``prompt + gold answer`` per batch of examples.

Deterministic, exact per-token depths, cheap. Per example and answer token ``j`` (``[m]`` arrays):

* ``correct``, ``nll``: next-token argmax correctness and loss at the *producing* position
  (the position before token j);
* looped models: ``tok_depth`` (exit depth at the position chosen by ``alignment``),
  ``tok_exp_depth`` (E[d] from ``depth_probs``; the exit depth for a method without a
  distribution) and ``pred_depth`` (exit depth at the producing position);
* with ``per_depth=True`` and D > 1, from one more forward with every token at depth D
  (``output_depth_logits``, ``output_depth_losses``): ``correct_d`` ``[m, D]``, ``nll_d``
  ``[m, D]`` and the exit signals ``kl`` / ``state`` ``[m, D-1]``, ``confidence`` ``[m, D]``.

Greedy exact match from one forward (``accuracy="teacher_forced_argmax"``). Greedy decoding emits
``argmax p(· | prefix)`` at every step, and every exit rule here (decider, ANIRA, kl, state, a
forced depth) is causal: a position's depth and logits depend only on the tokens up to it. So
when the generated prefix equals the gold prefix, the next generated token is the argmax of the
teacher-forced logits at that position; by induction the greedy output is exactly
``gold answer + stop token`` iff (1) every gold answer token is the teacher-forced argmax at its
producing position, (2) the argmax after the last answer token is a stop token
(:func:`~retrofit.evaluation.decoding.stop_rule`), (3) no gold token before it is itself a stop
token (greedy decoding would have stopped there) and (4) the budget has room: ``m + 1 <=
max_new_tokens``. :func:`argmax_pass` checks exactly that (``row_correct``), and tests compare it
with real greedy generation. It does not apply to sampling, or to a policy that looks at later
tokens (none does). The depths of the steps that would produce ``gold + stop`` are ``step_depths``
``[m + 1]`` (the producing positions, then the last answer position).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from . import analysis as A
from .models import ModelInfo, batched_passes, device, forward, pass_chunks
from .options import EvalOptions
from .rows import Example

__all__ = [
    "TFBatch",
    "argmax_pass",
    "batch_chunks",
    "forced_depths_argmax",
    "policy_pass",
    "teacher_forced",
    "tf_batch",
    "tf_passes",
]

# Upper bound for the [D, B, T, V] per-depth logits of one forced-depth forward.
_DEPTH_LOGITS_BUDGET = 512 * 2**20


class _CoreOutputs:
    """Collects the last core layer's output at every depth of one forward (the state h_d)."""

    def __init__(self, layer):
        self.outs: list[torch.Tensor] = []
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.outs.append((out[0] if isinstance(out, tuple) else out).detach())

    def close(self):
        self.handle.remove()


def tf_batch(examples: Sequence[Example], pad: int, dev):
    """Left-padded ``prompt + answer`` batch: ``(ids [B, T], mask [B, T], starts)``; ``starts[r]`` is
    the position of answer token 0 in row r."""
    from .models import pad_left

    seqs = [e.prompt_ids + e.answer_ids for e in examples]
    ids, mask = pad_left(seqs, pad, dev)
    L = ids.shape[1]
    starts = [L - len(s) + len(e.prompt_ids) for s, e in zip(seqs, examples)]
    return ids, mask, starts


class TFBatch(NamedTuple):
    """One batch of a teacher-forced pass (:func:`tf_passes`)."""

    index: int  #: batch number, in the order the batches run
    rows: list[int]  #: the example indices of its rows
    examples: list[Example]
    ids: torch.Tensor  #: [B, T] left-padded prompt + answer
    mask: torch.Tensor
    starts: list[int]  #: row r's answer token 0 is at position starts[r]
    keep: int  #: positions whose logits the pass reads (:func:`_logits_kept`)


def tf_passes(
    examples: Sequence[Example],
    pad: int,
    dev,
    batch_size: int,
    *,
    progress: bool = False,
    desc: str = "",
    order: str = "length",
    max_rows: Callable[[list[int]], int] | None = None,
) -> Iterator[TFBatch]:
    """The pass runner (:func:`~.models.batched_passes`) over ``prompt + gold answer``: every teacher-forced
    measurement iterates these batches (the same rows in the same batches for a given batch size)."""
    seqs = [e.prompt_ids + e.answer_ids for e in examples]
    for b, rows, ids, mask in batched_passes(
        seqs, pad, dev, batch_size, progress=progress, desc=desc, order=order, max_rows=max_rows
    ):
        exs = [examples[i] for i in rows]
        T = ids.shape[1]
        starts = [T - len(seqs[i]) + len(e.prompt_ids) for i, e in zip(rows, exs)]
        yield TFBatch(b, rows, exs, ids, mask, starts, _logits_kept(exs))


def batch_chunks(examples: Sequence[Example], batch_size: int) -> list[list[int]]:
    """The example indices of each batch, in the order :func:`tf_passes` runs them: batch ``b`` of
    :func:`argmax_pass`'s ``policy_for_batch(b, ...)`` hook holds ``examples[i]`` for ``i`` in
    ``batch_chunks(...)[b]``."""
    return pass_chunks([len(e.prompt_ids) + len(e.answer_ids) for e in examples], batch_size)


@torch.no_grad()
def teacher_forced(
    model,
    info: ModelInfo,
    examples: list[Example],
    pad: int,
    opts: EvalOptions,
    desc: str,
    per_depth: bool = True,
    is_stop=None,
    max_new_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """The adaptive forward (+ the depth-D forward when ``per_depth``) on prompt + gold answer.

    With ``is_stop`` (and ``max_new_tokens``) each example also gets :func:`argmax_pass`'s
    ``row_correct`` and ``step_depths`` from the same adaptive forward.

    Returns:
        Per example a dict of numpy arrays over its answer tokens (keys: module docstring).
    """
    dev = device(model)
    D = info.max_depth
    res: list[dict[str, np.ndarray] | None] = [None] * len(examples)
    for _, chunk, exs, ids, mask, starts, keep in tf_passes(
        examples, pad, dev, opts.batch_size, progress=opts.progress, desc=desc
    ):
        out = forward(model, info, ids, mask, logits_to_keep=keep)
        logits = out.logits.float()  # [B, keep, V]: positions T - keep .. T - 1
        off = ids.shape[1] - keep
        depths = out.depths if info.looped else None
        probs = out.depth_probs if info.looped else None
        for r, (i, e) in enumerate(zip(chunk, exs)):
            m = len(e.answer_ids)
            s = starts[r]
            pred = torch.arange(m, device=dev) + s - 1  # producing positions
            gold = torch.as_tensor(e.answer_ids, device=dev)
            lp = logits[r, pred - off].log_softmax(-1)
            d: dict[str, np.ndarray] = {
                "correct": (lp.argmax(-1) == gold).cpu().numpy(),
                "nll": (-lp.gather(-1, gold[:, None])[:, 0]).cpu().numpy(),
            }
            if info.looped:
                tok = torch.as_tensor(A.answer_positions(s, m, opts.alignment), device=dev)
                d["tok_depth"] = depths[r, tok].cpu().numpy()
                d["tok_exp_depth"] = A.expected_depth_or_exit(
                    probs[r, tok] if probs is not None else None, depths[r, tok]
                )
                d["pred_depth"] = depths[r, pred].cpu().numpy()
            if is_stop is not None:
                top = logits[r].argmax(-1)
                d.update(_argmax_row(top, off, depths[r] if info.looped else None, e, s, is_stop, max_new_tokens))
            res[i] = d
        if per_depth and info.looped and D > 1:
            T = ids.shape[1]
            V = logits.shape[-1]
            sub = max(1, int(_DEPTH_LOGITS_BUDGET // max(1, D * T * V * 4)))
            for j in range(0, len(chunk), sub):
                part = list(range(j, min(j + sub, len(chunk))))
                _forced_depth_pass(model, info, [exs[p] for p in part], [chunk[p] for p in part], pad, res)
    return res  # type: ignore[return-value]


def _forced_depth_pass(model, info: ModelInfo, exs, idxs, pad, res) -> None:
    """One forward with every token at depth D: per-depth NLL, correctness and exit signals."""
    dev = device(model)
    D = info.max_depth
    ids, mask, starts = tf_batch(exs, pad, dev)
    labels = torch.full_like(ids, -100)
    for r, (e, s) in enumerate(zip(exs, starts)):
        labels[r, s : s + len(e.answer_ids)] = torch.as_tensor(e.answer_ids, device=dev)
    hook = _CoreOutputs(model.core_layers[-1])
    try:
        out = forward(
            model, info, ids, mask, depth=D, labels=labels, output_depth_logits=True, output_depth_losses=True
        )
    finally:
        hook.close()
    states = torch.stack(hook.outs) if len(hook.outs) == D else None  # [D, B, T, H]
    for r, (i, e, s) in enumerate(zip(idxs, exs, starts)):
        m = len(e.answer_ids)
        pred = torch.arange(m, device=dev) + s - 1
        gold = torch.as_tensor(e.answer_ids, device=dev)
        z = out.depth_logits[:, r, pred].float()  # [D, m, V]
        d = res[i]
        d["correct_d"] = (z.argmax(-1) == gold[None]).transpose(0, 1).cpu().numpy()  # [m, D]
        # depth_nll[b, t, d] is the loss of predicting token t+1 (the label at t+1) at depth d
        d["nll_d"] = out.depth_nll[r, pred].float().cpu().numpy()  # [m, D]
        d["kl"] = A.kl_signals(z).cpu().numpy()
        d["confidence"] = A.confidence_signals(z).cpu().numpy()
        if states is not None:
            d["state"] = A.state_change_signals(states[:, r, pred]).cpu().numpy()


@torch.no_grad()
def policy_pass(model, info: ModelInfo, examples, pad, opts: EvalOptions, policy: str, threshold: float, desc: str):
    """Teacher-forced forward with an engine exit policy: per example ``(depth [m], correct [m])``."""
    dev = device(model)
    out_list: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(examples)
    for _, chunk, exs, ids, mask, starts, keep in tf_passes(
        examples, pad, dev, opts.batch_size, progress=opts.progress, desc=desc
    ):
        out = forward(model, info, ids, mask, exit_policy=policy, exit_threshold=threshold, logits_to_keep=keep)
        off = ids.shape[1] - keep
        for r, (i, e) in enumerate(zip(chunk, exs)):
            pred = torch.arange(len(e.answer_ids), device=dev) + starts[r] - 1
            gold = torch.as_tensor(e.answer_ids, device=dev)
            out_list[i] = (
                out.depths[r, pred].cpu().numpy(),
                (out.logits[r, pred - off].argmax(-1) == gold).cpu().numpy(),
            )
    return out_list


@torch.no_grad()
def argmax_pass(
    model,
    info: ModelInfo,
    examples: list[Example],
    pad: int,
    opts: EvalOptions,
    is_stop,
    max_new_tokens: int,
    desc: str,
    policy_for_batch: Callable[[int, list[int], list[int], int], Any] | None = None,
    **forward_kw,
) -> list[dict[str, Any]]:
    """Greedy exact match from one teacher-forced forward per batch (module docstring).

    Args:
        is_stop: ``token id -> bool``, the generation stop rule.
        max_new_tokens: the generation budget the result stands for.
        policy_for_batch: ``(batch index, starts, answer lengths, T) -> exit policy`` passed as this batch's
            ``exit_policy=``: a policy that needs the batch's layout (``RandomContinue`` with ``where`` = the
            answer steps, seeded per batch). ``starts[r]`` is row ``r``'s first answer position in the
            left-padded ``[B, T]`` batch (:func:`tf_batch`). Batches are numbered in the order they run.
        **forward_kw: exit control of the looped forward (``depth=``, ``exit_policy=``,
            ``exit_threshold=``, ``decider_threshold=``); ignored for a plain model.

    Returns:
        Per example ``{"row_correct": bool, "step_depths": [m + 1] int (1 for a plain model),
        "token_correct": [m] bool}``.
    """
    dev = device(model)
    res: list[dict[str, Any] | None] = [None] * len(examples)
    for b, chunk, exs, ids, mask, starts, keep in tf_passes(
        examples, pad, dev, opts.batch_size, progress=opts.progress, desc=desc
    ):
        kw = forward_kw
        if policy_for_batch is not None:
            kw = {
                **forward_kw,
                "exit_policy": policy_for_batch(b, starts, [len(e.answer_ids) for e in exs], ids.shape[1]),
            }
        out = forward(model, info, ids, mask, logits_to_keep=keep, **kw)
        top = out.logits.argmax(-1)  # [B, keep]: positions T - keep .. T - 1
        off = ids.shape[1] - keep
        for r, (i, e) in enumerate(zip(chunk, exs)):
            depths = out.depths[r] if info.looped else None
            res[i] = _argmax_row(top[r], off, depths, e, starts[r], is_stop, max_new_tokens)
    return res  # type: ignore[return-value]


@torch.no_grad()
def forced_depths_argmax(
    model,
    info: ModelInfo,
    examples: list[Example],
    pad: int,
    opts: EvalOptions,
    is_stop,
    max_new_tokens: int,
    desc: str,
    stop_ids: Collection[int] = (),
) -> dict[int, list[dict[str, Any]]]:
    """:func:`argmax_pass` with every token forced to depth ``d``, for every ``d`` in ``1 … D``, from one
    forward per batch at depth ``D`` that reads out every depth at the kept positions.

    Exact, not an approximation: with every token running depth ``d`` or more, a depth-``d`` state reads only
    depth-``j <= d`` keys of earlier tokens (both attention modes), and the depth-``d`` readout runs the coda
    over every token's depth-``d`` state, so depth ``d`` of the depth-``D`` forward is the depth-``d`` forward
    (``tests/evaluation/test_eval_runner.py`` compares it with separate passes). Saves ``D - 1`` forwards.

    Each row's dict also holds, at its ``m + 1`` answer steps, ``step_correct`` (the gold token is the argmax;
    at the stop step: the argmax is a stop token) and ``step_nll`` (the gold token's loss; at the stop step
    ``−log Σ_{s ∈ stop_ids} p(s)``, NaN without ``stop_ids``): the per-depth losses the oracle at equal compute
    ranks its gains by (:mod:`~retrofit.evaluation.oracle`).

    Returns:
        ``{d: per example argmax_pass's dict + step_correct [m + 1], step_nll [m + 1]}``.
    """
    dev = device(model)
    D = info.max_depth
    eos = torch.as_tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    res: dict[int, list] = {d: [None] * len(examples) for d in range(1, D + 1)}

    def max_rows(chunk: list[int]) -> int:
        # the [D, b, keep, V] depth logits stay under the budget: split the batch if they would not
        keep = _logits_kept([examples[i] for i in chunk])
        return int(_DEPTH_LOGITS_BUDGET // max(1, D * keep * model.config.vocab_size * 4))

    for _, part, exs, ids, mask, starts, k in tf_passes(
        examples, pad, dev, opts.batch_size, progress=opts.progress, desc=desc, max_rows=max_rows
    ):
        out = forward(model, info, ids, mask, logits_to_keep=k, depth=D, output_depth_logits=True)
        tops = out.depth_logits.argmax(-1)  # [D, b, k]: positions T - k .. T - 1
        off = ids.shape[1] - k
        for d in range(1, D + 1):
            depths = torch.full_like(out.depths, d)
            lp = out.depth_logits[d - 1].float().log_softmax(-1)  # [b, k, V]
            for r, (i, e) in enumerate(zip(part, exs)):
                row = _argmax_row(tops[d - 1, r], off, depths[r], e, starts[r], is_stop, max_new_tokens)
                m = len(e.answer_ids)
                steps = torch.arange(m + 1, device=dev) + starts[r] - 1 - off
                gold = torch.as_tensor(e.answer_ids, device=dev, dtype=torch.long)
                nll = -lp[r, steps[:m]].gather(-1, gold[:, None])[:, 0]
                stop_nll = -lp[r, steps[m], eos].logsumexp(0) if eos.numel() else lp.new_tensor(float("nan"))
                row["step_nll"] = torch.cat([nll, stop_nll.reshape(1)]).cpu().numpy()
                row["step_correct"] = np.append(row["token_correct"], is_stop(int(tops[d - 1, r, steps[m]])))
                res[d][i] = row
    return res


def _logits_kept(exs: Sequence[Example]) -> int:
    """Positions whose logits a teacher-forced pass reads: answers end the (left-padded) rows, so the
    last ``max m + 1`` positions hold every producing position and the one after the answer."""
    return max(len(e.answer_ids) for e in exs) + 1


def _argmax_row(top, off: int, depths, e: Example, start: int, is_stop, max_new_tokens: int) -> dict[str, Any]:
    """Greedy exact match of one row from its argmax tokens ``top`` (position ``t`` at ``top[t - off]``)
    and its depths ``[T]`` (None for a plain model)."""
    m = len(e.answer_ids)
    steps = torch.arange(m + 1, device=top.device) + start - 1  # producing positions, then the last answer position
    token_correct = (top[steps[:m] - off] == torch.as_tensor(e.answer_ids, device=top.device)).cpu().numpy()
    row = bool(
        token_correct.all()
        and is_stop(int(top[steps[m] - off]))
        and not any(is_stop(int(t)) for t in e.answer_ids)
        and m + 1 <= max_new_tokens
    )
    step_depths = depths[steps].cpu().numpy() if depths is not None else np.ones(m + 1, dtype=np.int64)
    return {"row_correct": row, "step_depths": step_depths, "token_correct": token_correct}
