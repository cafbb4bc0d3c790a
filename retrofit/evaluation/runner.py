"""``retrofit eval``: complexity-controlled evaluation of a looped (or base) checkpoint (METHODS.md §7).

One call evaluates a model on task generators (``data_prep.tasks``: MANO, BREVO, LANO, CLRS, GSM,
reasoning-gym tasks) at chosen difficulty levels and writes ``results.json`` (the schema of
:mod:`retrofit.evaluation.report`), ``report.md``, PNG plots and ``samples.html``.

Example::

    retrofit eval --model out/looped --compare smollm2 --task mano --levels 3,5,8,12,16,20 --n 50 --out eval/

    from retrofit.evaluation import evaluate
    results = evaluate(looped, tok, ["mano"], levels=[3, 5, 8], n=50, compare=(base, tok),
                       name="looped", compare_name="base", out_dir="eval/")

What is measured, and how
-------------------------
Input format. By default the prompt is continued raw: the model sees ``prompt`` (with the
tokenizer's own special tokens, e.g. BOS) and the gold answer text is ``answer_sep + answer``
(``answer_sep`` defaults to one space: ``"+ 3 4 =" → " 7"``). With ``chat=True`` (``--chat``) the
prompt is the user turn of the tokenizer's chat template with the generation prompt appended, and
the answer follows directly. Match the format the model was trained with.

Evaluation rows. ``build_dataset(task, levels, n, derive_seed(seed, "retrofit-eval"))``: fresh
instances from a stream distinct from ``build_splits``' training stream (which uses ``seed``
itself). They are not de-duplicated against a training set; pass ``rows=`` (e.g. the
``eval``/``eval_interp``/``eval_extrap`` splits of ``build_splits``) for held-out instances.

Two kinds of measurement:

* **Generation** (greedy, batched, left-padded; the model's own cached ``generate`` — for looped
  models the depth-aware cache of ``retrofit.generation`` — or, with ``backend="loop"``, a
  reference loop that reruns the full forward every step; both give the same tokens and depths,
  which the tests check): the level ``accuracy`` is exact
  match with the task's scorer (``Task.score``) on the generated text, which stops at EOS or at
  the first token containing a newline, or after ``max_new_tokens`` (default: the longest gold
  answer in tokens + 2). The same is done at every forced depth ``1 … D``
  (``forced_depth_accuracy``, the test-time scaling curve) and, when the engine provides them,
  under the training-free exits at the calibrated threshold. ``gen_mean_depth`` is the mean
  depth over generated tokens.
* **Teacher forcing** (one forward on ``prompt + gold answer``; deterministic, exact per-token
  depths, cheap): the level ``mean_depth`` d̄, ``cost_exec`` (Σ_d |A_d|) and ``saving`` (d̄ / D)
  over the gold answer's content tokens (whitespace-only tokens excluded), the expected depth
  E[d] (from ``depth_probs``; the exit depth for a method without a distribution), next-token
  ``token_accuracy``, the LANO Spearman and BREVO regression, and — from one more forward with
  every token at depth D (``output_depth_logits``, ``output_depth_losses``) — per-depth token
  accuracy, the first-vs-last depth loss change (METHODS.md §3) and the exit-policy comparison.

A token's depth (``alignment``): ``"predict"`` (default) attributes to answer token j the depth of
the position that produced it (the position before it), ``"input"`` the depth of its own position
(ANIRA's convention); see :mod:`retrofit.evaluation.analysis`. Losses, token accuracies and exit
policies are always measured at the producing positions (they are next-token predictions).

Exit policies at equal compute (teacher-forced, on the gold answers' producing positions): the
learned ``decider`` (the model's own adaptive forward) against the training-free exits ``kl``,
``state`` and ``confidence``, each with the threshold whose mean depth is closest to the
decider's d̄ (for a ``fixed`` model without a decider: (1 + D) / 2). Thresholds are calibrated in
the *full-context* frame (one depth-D forward; ``analysis`` module docstring); when the engine
implements a policy (``retrofit.halting.training_free``: ``kl``, ``state``) its accuracy and d̄
are then re-measured exactly with ``forward(exit_policy=..., exit_threshold=τ)`` and it is also
generated with (``generation_accuracy``). ``frame`` says which. ``accuracy`` in
``exit_policies`` is teacher-forced next-token accuracy on answer tokens.

A base (non-looped) model is evaluated at its only depth (D = 1): accuracy, token accuracy and
layer counts, no depth statistics.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import analysis as A
from .metrics import accuracy_by_level, cost_exec, flops_ratio, loss_change_stats, spearman

logger = logging.getLogger(__name__)

__all__ = [
    "add_arguments",
    "evaluate",
    "evaluate_task",
    "greedy_generate",
    "run",
    "task_rows",
    "write_artifacts",
]

DEFAULT_N = 20
DEFAULT_BATCH_SIZE = 8
# Upper bound for the [D, B, T, V] per-depth logits of one forced-depth forward.
_DEPTH_LOGITS_BUDGET = 512 * 2**20


# ----------------------------------------------------------------------------------------------
# options and model facts
# ----------------------------------------------------------------------------------------------


@dataclass
class _Options:
    max_new_tokens: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    chat: bool = False
    answer_sep: str = " "
    alignment: str = "predict"
    forced_generation: bool = True
    policy_generation: bool = True
    html_samples: int = 2
    progress: bool = True
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in GENERATION_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(GENERATION_BACKENDS)}, got {self.backend!r}")
        if self.alignment not in A.ALIGNMENTS:
            raise ValueError(f"alignment must be one of {', '.join(A.ALIGNMENTS)}, got {self.alignment!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be None (automatic) or a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.html_samples, int) or self.html_samples < 0:
            raise ValueError(f"html_samples must be an int >= 0, got {self.html_samples!r}")


@dataclass
class _ModelInfo:
    """What the runner needs to know about a model."""

    looped: bool
    max_depth: int
    method: str | None
    n_layers: int
    prelude: int
    core: int
    coda: int

    @property
    def has_decider(self) -> bool:
        return self.looped and self.method != "fixed"

    def layers(self, mean_depth: float) -> float:
        """Decoder-layer passes per token at mean core depth ``mean_depth`` (``flops_ratio``)."""
        return flops_ratio(mean_depth, self.max_depth, self.n_layers, self.prelude, self.core, self.coda)[
            "layers_adaptive"
        ]


def _model_info(model) -> _ModelInfo:
    from retrofit.modeling import LoopedForCausalLM

    cfg = model.config
    n_layers = int(cfg.get_text_config().num_hidden_layers if hasattr(cfg, "get_text_config") else cfg.num_hidden_layers)
    if isinstance(model, LoopedForCausalLM):
        loop = model.loop
        pre, core, coda = loop.layer_ranges(n_layers)
        return _ModelInfo(True, loop.max_depth, loop.method, n_layers, len(pre), len(core), len(coda))
    return _ModelInfo(False, 1, None, n_layers, 0, n_layers, 0)


def _engine_exit_policies() -> tuple[str, ...]:
    """Training-free exits the looped forward implements (``exit_policy=``), if any."""
    try:
        from retrofit.halting.training_free import EXIT_POLICIES
    except ImportError:  # older engine: the full-context estimate is all there is
        return ()
    return tuple(EXIT_POLICIES)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _forward(model, info: _ModelInfo, ids, mask, **kw):
    """One full-sequence forward with explicit positions (left padding) and no KV cache."""
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    if not info.looped:
        kw = {k: v for k, v in kw.items() if k == "logits_to_keep"}
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw)


def _pad_left(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, L - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, L - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


def _batches(order: Sequence[int], size: int):
    for i in range(0, len(order), size):
        yield list(order[i : i + size])


def _tqdm(iterable, enabled: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, leave=False, dynamic_ncols=True, **kw)


# ----------------------------------------------------------------------------------------------
# greedy generation
# ----------------------------------------------------------------------------------------------


def _stop_ids(model, tokenizer) -> set[int]:
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if v is None:
            continue
        ids.update([int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)])
    return ids


GENERATION_BACKENDS = ("auto", "generate", "loop")


def _has_looped_generate() -> bool:
    """Whether the engine decodes looped models with a depth-aware cache (``retrofit.generation``)."""
    try:
        import retrofit.generation  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def greedy_generate(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    depth: int | None = None,
    exit_policy: str | None = None,
    exit_threshold: float | None = None,
    alignment: str = "predict",
    stop_on_newline: bool = True,
    backend: str = "auto",
    progress: bool = False,
    desc: str = "generate",
) -> list[dict[str, Any]]:
    """Greedy decoding of a batch of tokenized prompts, with each generated token's exit depth.

    Two backends give the same tokens (tests/test_eval_runner.py checks it):

    * ``"generate"``: the model's own ``generate`` (KV cache; for looped models the depth-aware
      cache of ``retrofit.generation``, whose ``depths`` output gives the producing step's depth).
    * ``"loop"``: a reference loop that runs the full sequence every step (no cache), so the exit
      decisions are by construction those of the model's full forward. Rows that finished are
      dropped from later steps.

    ``"auto"`` = ``"generate"`` when available (always for base models; for looped models when
    ``retrofit.generation`` exists), else ``"loop"``. With ``alignment="input"`` (or the loop
    backend) depths come from one final forward over prompt + generation; the depth rules are
    causal, so they equal the depths at decode time.

    Args:
        model: a looped or base causal LM (eval mode).
        tokenizer: its tokenizer (pad, EOS, decoding).
        prompts: ``[N]`` token id lists.
        max_new_tokens: generation budget per prompt.
        batch_size: prompts per forward.
        depth: force every token to this depth (looped models).
        exit_policy, exit_threshold: a training-free exit of the engine (``"kl"``, ``"state"``).
        alignment: ``"predict"`` or ``"input"`` (whose depth a generated token gets).
        stop_on_newline: stop a row at the first token whose text contains a newline.
        backend: ``"auto"``, ``"generate"`` or ``"loop"``.
        progress: show a progress bar.
        desc: progress-bar label.

    Returns:
        Per prompt (input order): ``{"ids": [g] generated ids (stop token included), "text":
        decoded text without special tokens, "depths": [g] exit depth of each generated token
        (1 for a base model)}``.
    """
    if backend not in GENERATION_BACKENDS:
        raise ValueError(f"unknown generation backend {backend!r}; allowed: {', '.join(GENERATION_BACKENDS)}")
    info = _model_info(model)
    if backend == "auto":
        backend = "generate" if (not info.looped or _has_looped_generate()) else "loop"
    dev = _device(model)
    pad = _pad_id(tokenizer)
    stops = _stop_ids(model, tokenizer)
    newline: dict[int, bool] = {}

    def is_stop(t: int) -> bool:
        if t in stops:
            return True
        if not stop_on_newline:
            return False
        if t not in newline:
            newline[t] = "\n" in tokenizer.decode([t])
        return newline[t]

    kw: dict[str, Any] = {}
    if info.looped:
        if depth is not None:
            kw["depth"] = int(depth)
        if exit_policy is not None:
            kw.update(exit_policy=exit_policy, exit_threshold=exit_threshold)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    batches = list(_batches(order, batch_size))
    for chunk in _tqdm(batches, progress, desc=desc, unit="batch"):
        ids, mask = _pad_left([prompts[i] for i in chunk], pad, dev)
        P = ids.shape[1]
        if backend == "generate":
            gen, gen_depths, ids, mask = _decode_with_generate(model, info, ids, mask, max_new_tokens, pad, stops, is_stop, kw)
        else:
            gen, ids, mask = _decode_loop(model, info, ids, mask, max_new_tokens, pad, is_stop, kw)
            gen_depths = None
        if info.looped and any(gen) and (gen_depths is None or alignment == "input"):
            full = _forward(model, info, ids, mask, logits_to_keep=1, **kw).depths.cpu()
            shift = -1 if alignment == "predict" else 0
            gen_depths = [[int(full[r, P + j + shift]) for j in range(len(g))] for r, g in enumerate(gen)]
        for r, i in enumerate(chunk):
            g = gen[r]
            d = [1] * len(g) if not info.looped else list(gen_depths[r]) if gen_depths is not None else []
            results[i] = {"ids": g, "text": tokenizer.decode(g, skip_special_tokens=True), "depths": d}
    return results  # type: ignore[return-value]


def _decode_loop(model, info, ids, mask, max_new_tokens, pad, is_stop, kw):
    """Reference greedy loop: the full sequence every step, finished rows dropped."""
    dev = ids.device
    B = ids.shape[0]
    gen: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, dtype=bool)
    for _ in range(max_new_tokens):
        live = np.flatnonzero(~done)
        if live.size == 0:
            break
        li = torch.as_tensor(live, device=dev)
        out = _forward(model, info, ids[li], mask[li], logits_to_keep=1, **kw)
        nxt = out.logits[:, -1].argmax(-1)
        col = torch.full((B, 1), pad, dtype=torch.long, device=dev)
        mcol = torch.zeros((B, 1), dtype=torch.long, device=dev)
        col[li, 0] = nxt
        mcol[li, 0] = 1
        ids = torch.cat([ids, col], 1)
        mask = torch.cat([mask, mcol], 1)
        for r, t in zip(live.tolist(), nxt.tolist()):
            gen[r].append(int(t))
            if is_stop(int(t)):
                done[r] = True
    return gen, ids, mask


def _decode_with_generate(model, info, ids, mask, max_new_tokens, pad, stops, is_stop, kw):
    """Greedy ``model.generate``; returns per row the ids up to the first stop token, their
    producing-step depths (looped models) and the padded sequences with their mask."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _StopToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([is_stop(int(t)) for t in input_ids[:, -1]], dtype=torch.bool, device=input_ids.device)

    P = ids.shape[1]
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        eos_token_id=sorted(stops) if stops else None,
        stopping_criteria=StoppingCriteriaList([_StopToken()]),
        return_dict_in_generate=True,
        **kw,
    )
    seqs = out.sequences
    new = seqs[:, P:].tolist()
    gen: list[list[int]] = []
    for row in new:
        g = []
        for t in row:
            g.append(int(t))
            if is_stop(int(t)):
                break
        gen.append(g)
    gen_depths = None
    if info.looped and out.depths is not None:
        dep = out.depths.cpu()
        gen_depths = [[int(dep[r, j]) for j in range(len(g))] for r, g in enumerate(gen)]
    # rebuild the mask of the generated part (tokens after a row's stop are padding)
    gmask = torch.zeros((seqs.shape[0], seqs.shape[1] - P), dtype=mask.dtype, device=mask.device)
    for r, g in enumerate(gen):
        gmask[r, : len(g)] = 1
    return gen, gen_depths, seqs, torch.cat([mask, gmask], 1)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def _parse_levels_for(task, levels) -> list[int] | None:
    if levels is None:
        return None
    if isinstance(levels, Mapping):
        levels = levels.get(task.name)
        if levels is None:
            return None
    return [int(x) for x in levels]


def task_rows(task, levels=None, n: int = DEFAULT_N, seed: int = 0, limit: int | None = None) -> list[dict]:
    """The evaluation rows of one task (see the module docstring for the seed).

    Args:
        task: registry key or ``data_prep`` Task.
        levels: difficulty levels; default: the task's default levels (train + held out).
        n: examples per level.
        seed: base seed.
        limit: at most this many rows in total, spread round-robin over the levels (evenly
            spaced levels when ``limit`` is below the number of levels), for quick looks.

    Returns:
        Rows with ``prompt``, ``answer``, ``difficulty``, ``task`` (+ ``token_features`` JSON).
    """
    from data_prep.common import derive_seed
    from data_prep.tasks import build_dataset, get_task

    task = get_task(task)
    levels = task.default_levels if levels is None else list(levels)
    if not levels:
        raise ValueError(f"{task.name}: no levels to evaluate")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (examples per level) must be a positive int, got {n!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or a positive int, got {limit!r}")
    levels = sorted(set(levels))
    if limit is not None and limit < len(levels):
        keep = np.unique(np.round(np.linspace(0, len(levels) - 1, limit)).astype(int))
        levels = [levels[i] for i in keep]
    per_level = n if limit is None else min(n, math.ceil(limit / len(levels)))
    rows = build_dataset(task, levels, per_level, derive_seed(seed, "retrofit-eval")).to_list()
    if limit is not None and len(rows) > limit:
        by_level: dict[int, list[dict]] = {}
        for r in rows:
            by_level.setdefault(r["difficulty"], []).append(r)
        picked: list[dict] = []
        k = 0
        while len(picked) < limit:
            for lvl in levels:
                if k < len(by_level.get(lvl, [])) and len(picked) < limit:
                    picked.append(by_level[lvl][k])
            k += 1
        rows = sorted(picked, key=lambda r: levels.index(r["difficulty"]))
    return rows


@dataclass
class _Example:
    """One row, tokenized: ``prompt_ids`` then ``answer_ids`` (the gold answer segment)."""

    row: dict
    level: Any
    prompt_ids: list[int]
    answer_ids: list[int]
    segment: str  # the answer text as tokenized (answer_sep + answer, or the answer in chat mode)
    owner: np.ndarray  # [m] answer word owning each answer token, -1 = whitespace only
    first_tok: np.ndarray  # [n_words]
    features: list[dict] | None

    @property
    def content(self) -> np.ndarray:
        return self.owner >= 0


def _prepare(rows: Sequence[Mapping[str, Any]], tokenizer, opts: _Options) -> list[_Example]:
    from data_prep.tasks import decode_features

    out = []
    for i, row in enumerate(rows):
        for key in ("prompt", "answer", "difficulty"):
            if key not in row:
                raise ValueError(f"row {i} has no {key!r} column; rows need prompt, answer and difficulty")
        prompt, answer = str(row["prompt"]), str(row["answer"])
        if opts.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            segment = answer
        else:
            prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
            segment = opts.answer_sep + answer
        if not prompt_ids:
            raise ValueError(f"row {i}: the prompt tokenizes to nothing")
        ids, offsets = A.encode_with_offsets(tokenizer, segment)
        owner = A.token_word_owner(segment, offsets)
        if not (owner >= 0).any():
            raise ValueError(f"row {i}: the answer {answer!r} has no non-whitespace token")
        feats = decode_features(dict(row))
        n_words = len(A.word_spans(answer))
        if feats is not None and len(feats) != n_words:
            raise ValueError(f"row {i}: {len(feats)} token_features for {n_words} answer words")
        out.append(
            _Example(
                row=dict(row),
                level=row["difficulty"],
                prompt_ids=prompt_ids,
                answer_ids=list(ids),
                segment=segment,
                owner=owner,
                first_tok=A.first_tokens_of_words(segment, offsets),
                features=feats,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# teacher-forced passes
# ----------------------------------------------------------------------------------------------


class _CoreOutputs:
    """Collects the last core layer's output at every depth of one forward (the state h_d)."""

    def __init__(self, layer):
        self.outs: list[torch.Tensor] = []
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.outs.append((out[0] if isinstance(out, tuple) else out).detach())

    def close(self):
        self.handle.remove()


def _tf_batch(examples: Sequence[_Example], pad: int, dev):
    seqs = [e.prompt_ids + e.answer_ids for e in examples]
    ids, mask = _pad_left(seqs, pad, dev)
    L = ids.shape[1]
    # position of answer token 0 in each padded row
    starts = [L - len(s) + len(e.prompt_ids) for s, e in zip(seqs, examples)]
    return ids, mask, starts


@torch.no_grad()
def _teacher_forced(model, info: _ModelInfo, examples: list[_Example], pad: int, opts: _Options, desc: str):
    """Adaptive forward (+ a depth-D forward for looped models) on prompt + gold answer.

    Returns per example a dict of numpy arrays over its answer tokens ``[m]`` (see keys below).
    """
    dev = _device(model)
    D = info.max_depth
    res: list[dict[str, np.ndarray] | None] = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].answer_ids))
    for chunk in _tqdm(list(_batches(order, opts.batch_size)), opts.progress, desc=desc, unit="batch"):
        exs = [examples[i] for i in chunk]
        ids, mask, starts = _tf_batch(exs, pad, dev)
        out = _forward(model, info, ids, mask)
        logits = out.logits.float()
        depths = out.depths if info.looped else None
        probs = out.depth_probs if info.looped else None
        for r, (i, e) in enumerate(zip(chunk, exs)):
            m = len(e.answer_ids)
            s = starts[r]
            pred = torch.arange(m, device=dev) + s - 1  # producing positions
            gold = torch.as_tensor(e.answer_ids, device=dev)
            lp = logits[r, pred].log_softmax(-1)
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
            res[i] = d
        if info.looped and D > 1:
            T = ids.shape[1]
            V = logits.shape[-1]
            sub = max(1, int(_DEPTH_LOGITS_BUDGET // max(1, D * T * V * 4)))
            for j in range(0, len(chunk), sub):
                part = list(range(j, min(j + sub, len(chunk))))
                _forced_depth_pass(model, info, [exs[p] for p in part], [chunk[p] for p in part], pad, res)
    return res


def _forced_depth_pass(model, info: _ModelInfo, exs, idxs, pad, res) -> None:
    """One forward with every token at depth D: per-depth NLL, correctness and exit signals."""
    dev = _device(model)
    D = info.max_depth
    ids, mask, starts = _tf_batch(exs, pad, dev)
    labels = torch.full_like(ids, -100)
    for r, (e, s) in enumerate(zip(exs, starts)):
        labels[r, s : s + len(e.answer_ids)] = torch.as_tensor(e.answer_ids, device=dev)
    hook = _CoreOutputs(model.core_layers[-1])
    try:
        out = _forward(
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
def _policy_pass(model, info, examples, pad, opts, policy: str, threshold: float, desc: str):
    """Teacher-forced forward with an engine exit policy: per example (depth [m], correct [m])."""
    dev = _device(model)
    out_list: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].answer_ids))
    for chunk in _tqdm(list(_batches(order, opts.batch_size)), opts.progress, desc=desc, unit="batch"):
        exs = [examples[i] for i in chunk]
        ids, mask, starts = _tf_batch(exs, pad, dev)
        out = _forward(model, info, ids, mask, exit_policy=policy, exit_threshold=threshold)
        for r, (i, e) in enumerate(zip(chunk, exs)):
            pred = torch.arange(len(e.answer_ids), device=dev) + starts[r] - 1
            gold = torch.as_tensor(e.answer_ids, device=dev)
            out_list[i] = (
                out.depths[r, pred].cpu().numpy(),
                (out.logits[r, pred].argmax(-1) == gold).cpu().numpy(),
            )
    return out_list


# ----------------------------------------------------------------------------------------------
# one task
# ----------------------------------------------------------------------------------------------


def _split_of(level, train_levels: Sequence[int]) -> str:
    if level in train_levels:
        return "train"
    if train_levels and min(train_levels) < level < max(train_levels):
        return "interp"
    return "extrap"


def _cat(tf, key, examples, content_only=True):
    parts = [t[key][e.content] if content_only else t[key] for t, e in zip(tf, examples)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _seq_acc(correct_per_example: Sequence[np.ndarray]) -> float:
    return float(np.mean([bool(c.all()) for c in correct_per_example])) if correct_per_example else float("nan")


def _mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if x.size else float("nan")


def _token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([int(t)]) for t in ids]


def evaluate_task(
    model,
    tokenizer,
    task,
    levels=None,
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    rows=None,
    limit: int | None = None,
    train_levels=None,
    max_new_tokens: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    chat: bool = False,
    answer_sep: str = " ",
    alignment: str = "predict",
    forced_generation: bool = True,
    policy_generation: bool = True,
    exit_target_depth: float | None = None,
    html_samples: int = 2,
    progress: bool = True,
    backend: str = "auto",
    name: str = "model",
) -> dict[str, Any]:
    """Evaluate one model on one task (what is measured: module docstring).

    Args:
        model: looped or base causal LM (put in eval mode here).
        tokenizer: its tokenizer.
        task: registry key (``data_prep.tasks.TASKS``) or Task.
        levels: difficulty levels; default the task's default levels.
        n: examples per level.
        seed: data seed.
        rows: evaluate these rows instead of generating (a ``datasets.Dataset`` or dicts with
            ``prompt``, ``answer``, ``difficulty`` and, for BREVO/LANO, ``token_features``).
        limit: cap on the rows (quick looks; :func:`task_rows`).
        train_levels: levels marked as training levels; default ``task.default_train_levels``.
        max_new_tokens: generation budget; default longest gold answer (tokens) + 2.
        batch_size: sequences per forward.
        chat: wrap the prompt in the tokenizer's chat template.
        answer_sep: text between a raw prompt and its answer (ignored with ``chat``).
        alignment: ``"predict"`` or ``"input"`` (which position's depth an answer token gets).
        forced_generation: also generate at every forced depth 1 … D (test-time scaling).
        policy_generation: also generate under the engine's training-free exits.
        exit_target_depth: d̄ the exit policies are calibrated to; default the decider's d̄.
        html_samples: generations per level kept for ``samples.html``.
        progress: tqdm progress bars.
        backend: generation backend, ``"auto"``, ``"generate"`` or ``"loop"`` (:func:`greedy_generate`).
        name: model name used in sample titles.

    Returns:
        The per-task entry of the results schema (:mod:`retrofit.evaluation.report`) plus
        ``knob``, ``method``, ``train_levels``, ``overall``, ``forced_depth_token_accuracy``,
        ``samples`` (for ``samples.html``) and ``notes``.
    """
    from data_prep.tasks import get_task

    opts = _Options(
        max_new_tokens, batch_size, chat, answer_sep, alignment, forced_generation, policy_generation, html_samples,
        progress, backend,
    )
    task = get_task(task)
    train = list(task.default_train_levels if train_levels is None else train_levels)
    if rows is None:
        rows = task_rows(task, levels, n, seed, limit)
    else:
        import datasets

        rows = rows.to_list() if isinstance(rows, datasets.Dataset) else list(rows)
    if not rows:
        raise ValueError(f"{task.name}: no rows to evaluate")
    was_training = model.training
    model.eval()
    try:
        return _evaluate_task(model, tokenizer, task, rows, train, opts, exit_target_depth, name)
    finally:
        model.train(was_training)


def _evaluate_task(model, tokenizer, task, rows, train, opts: _Options, exit_target_depth, name) -> dict[str, Any]:
    info = _model_info(model)
    D = info.max_depth
    pad = _pad_id(tokenizer)
    examples = _prepare(rows, tokenizer, opts)
    notes: list[str] = []
    max_new = opts.max_new_tokens or max(len(e.answer_ids) for e in examples) + 2
    prompts = [e.prompt_ids for e in examples]
    tag = f"{name}/{task.name}"

    def generate(desc, **kw):
        return greedy_generate(
            model, tokenizer, prompts, max_new, batch_size=opts.batch_size, alignment=opts.alignment,
            backend=opts.backend, progress=opts.progress, desc=f"{tag} {desc}", **kw,
        )

    def score(gens) -> np.ndarray:
        return np.array([task.score(g["text"], e.row["answer"]) for g, e in zip(gens, examples)], dtype=bool)

    # --- generation with the model's own exits ------------------------------------------------
    gens = generate("generate")
    correct = score(gens)
    tf = _teacher_forced(model, info, examples, pad, opts, f"{tag} teacher-forced")
    levels_sorted = sorted({e.level for e in examples})

    # --- per level ----------------------------------------------------------------------------
    records = [{"level": e.level, "correct": bool(c)} for e, c in zip(examples, correct)]
    by_level = accuracy_by_level(records)
    level_entries: dict[Any, dict[str, Any]] = {}
    for lvl in levels_sorted:
        idx = [i for i, e in enumerate(examples) if e.level == lvl]
        exs = [examples[i] for i in idx]
        tfs = [tf[i] for i in idx]
        entry = {
            "n": by_level[lvl]["n"],
            "accuracy": by_level[lvl]["accuracy"],
            "accuracy_se": by_level[lvl]["accuracy_se"],
            "split": _split_of(lvl, train),
            "token_accuracy": _mean(_cat(tfs, "correct", exs)),
            "sequence_accuracy_tf": _seq_acc([t["correct"][e.content] for t, e in zip(tfs, exs)]),
        }
        if info.looped:
            c = cost_exec(_cat(tfs, "tok_depth", exs), max_depth=D)
            per_ex = [float(t["tok_depth"][e.content].mean()) for t, e in zip(tfs, exs)]
            entry.update(
                mean_depth=c["mean_depth"],
                mean_depth_se=float(np.std(per_ex, ddof=1) / math.sqrt(len(per_ex))) if len(per_ex) > 1 else float("nan"),
                cost_exec=c["cost_exec"],
                saving=c["saving"],
                depth_histogram=c["depth_histogram"],
                expected_depth=_mean(_cat(tfs, "tok_exp_depth", exs)),
                gen_mean_depth=_mean(np.concatenate([np.asarray(gens[i]["depths"], dtype=float) for i in idx])),
            )
        level_entries[lvl] = entry

    result: dict[str, Any] = {
        "knob": task.knob,
        "description": task.description,
        "max_depth": D,
        "method": info.method,
        "looped": info.looped,
        "alignment": opts.alignment,
        "train_levels": train,
        "levels": level_entries,
    }

    # --- overall, compute ----------------------------------------------------------------------
    overall: dict[str, Any] = {
        "n": len(examples),
        "accuracy": float(correct.mean()),
        "token_accuracy": _mean(_cat(tf, "correct", examples)),
        "layers_base": float(info.n_layers),
    }
    if info.looped:
        c = cost_exec(_cat(tf, "tok_depth", examples), max_depth=D)
        gen_depth = _mean(np.concatenate([np.asarray(g["depths"], dtype=float) for g in gens]))
        overall.update(
            mean_depth=c["mean_depth"],
            saving=c["saving"],
            cost_exec=c["cost_exec"],
            expected_depth=_mean(_cat(tf, "tok_exp_depth", examples)),
            gen_mean_depth=gen_depth,
            flops=flops_ratio(c["mean_depth"], D, info.n_layers, info.prelude, info.core, info.coda),
            gen_layers_per_token=info.layers(gen_depth) if math.isfinite(gen_depth) else float("nan"),
        )
    else:
        overall["gen_layers_per_token"] = float(info.n_layers)
    if info.looped and len(levels_sorted) > 1:
        # does depth follow difficulty? rank correlation of each example's mean answer depth
        # (teacher-forced exit depths) with its difficulty level
        ex_depth = [float(t["tok_depth"][e.content].mean()) for t, e in zip(tf, examples)]
        overall["depth_difficulty_spearman"] = spearman([e.level for e in examples], ex_depth)
    result["overall"] = overall

    # --- forced depths (test-time scaling) -------------------------------------------------------
    compute_points: list[tuple[float, float, Any]] = []
    if info.looped:
        forced_acc: dict[int, float] = {}
        forced_by_level: dict[int, dict[Any, float]] = {}
        if opts.forced_generation:
            for d in range(1, D + 1):
                g_d = generate(f"depth {d}", depth=d)
                c_d = score(g_d)
                forced_acc[d] = float(c_d.mean())
                forced_by_level[d] = {
                    lvl: float(np.mean([c for c, e in zip(c_d, examples) if e.level == lvl])) for lvl in levels_sorted
                }
                compute_points.append((info.layers(d), forced_acc[d], d))
            result["forced_depth_accuracy"] = forced_acc
            result["forced_depth_accuracy_by_level"] = forced_by_level
            for lvl in levels_sorted:
                level_entries[lvl]["forced_accuracy"] = {d: forced_by_level[d][lvl] for d in forced_by_level}
        if math.isfinite(overall["gen_mean_depth"]):
            compute_points.append((overall["gen_layers_per_token"], overall["accuracy"], "adaptive"))
    else:
        compute_points.append((float(info.n_layers), overall["accuracy"], "base"))

    if info.looped and D > 1:
        result["forced_depth_token_accuracy"] = {
            d: _mean(_cat(tf, "correct_d", examples)[:, d - 1]) for d in range(1, D + 1)
        }
        # --- loss change, first vs last depth (METHODS.md §3) ------------------------------------
        nll = _cat(tf, "nll_d", examples)
        result["loss_change"] = loss_change_stats(nll[:, 0], nll[:, D - 1])
        # --- exit policies at equal compute -------------------------------------------------------
        result["exit_policies"] = _exit_policies(
            model, tokenizer, info, examples, tf, gens, correct, pad, opts, exit_target_depth, generate, score,
            compute_points, notes,
        )
    elif info.looped:
        notes.append("max_depth = 1: no forced-depth sweep, loss change or exit policies")

    # --- depth vs difficulty features ----------------------------------------------------------
    if info.looped and task.name in ("lano", "brevo"):
        key = "tok_exp_depth" if task.name == "lano" else "tok_depth"
        word_depths = [A.word_values(t[key], e.first_tok) for t, e in zip(tf, examples)]
        feats = [e.features for e in examples]
        if any(f is None for f in feats):
            notes.append(f"{task.name}: rows without token_features; correlation analysis skipped")
        elif task.name == "lano":
            # ANIRA Table 1 correlates the per-token EXPECTED depth with the parser proxies
            result["spearman"] = A.lano_spearman(word_depths, feats)
        else:
            regs = {}
            for label, k in (("exit_depth", "tok_depth"), ("expected_depth", "tok_exp_depth")):
                wd = [A.word_values(t[k], e.first_tok) for t, e in zip(tf, examples)]
                try:
                    regs[label] = A.brevo_regression(wd, feats, [e.level for e in examples])
                except ValueError as err:
                    notes.append(f"brevo regression on {label} skipped: {err}")
            if regs:
                result["regression"] = regs
        n_unaligned = sum(int((e.first_tok < 0).sum()) for e in examples)
        if n_unaligned:
            notes.append(f"{n_unaligned} answer words share a token with the previous word and were dropped")

    result["compute_points"] = [list(p) for p in compute_points]

    # --- samples for samples.html ------------------------------------------------------------
    samples = []
    for lvl in levels_sorted:
        idx = [i for i, e in enumerate(examples) if e.level == lvl][: opts.html_samples]
        for i in idx:
            e, g = examples[i], gens[i]
            samples.append(
                {
                    "title": (
                        f"{name} · {task.name} {task.knob}={lvl} · gold {e.row['answer']!r} · "
                        f"generated {g['text'].strip()!r} · {'correct' if correct[i] else 'wrong'}"
                    ),
                    "tokens": _token_texts(tokenizer, e.prompt_ids) + _token_texts(tokenizer, g["ids"]),
                    "depths": [0] * len(e.prompt_ids) + list(g["depths"]),
                    "max_depth": D,
                }
            )
    result["samples"] = samples
    result["notes"] = notes
    return result


def _exit_policies(model, tokenizer, info, examples, tf, gens, correct, pad, opts, target, generate, score, points, notes):
    """Learned decider vs training-free exits at equal compute (module docstring)."""
    D = info.max_depth
    pred_depth = _cat(tf, "pred_depth", examples).astype(np.int64)
    dec_correct = _cat(tf, "correct", examples)
    per_depth = _cat(tf, "correct_d", examples)
    ex_id = np.concatenate([np.full(int(e.content.sum()), i) for i, e in enumerate(examples)])

    def seq_acc(tok_correct: np.ndarray) -> float:
        return _seq_acc([tok_correct[ex_id == i] for i in range(len(examples))])

    policies: dict[str, dict[str, Any]] = {}
    decider_depth = float(pred_depth.mean())
    if info.has_decider:
        policies["decider"] = {
            "accuracy": float(dec_correct.mean()),
            "sequence_accuracy": seq_acc(dec_correct),
            "mean_depth": decider_depth,
            "saving": decider_depth / D,
            "frame": "exact",
            "generation_accuracy": float(correct.mean()),
            "generation_mean_depth": _mean(np.concatenate([np.asarray(g["depths"], float) for g in gens])),
            "n_tokens": int(pred_depth.size),
        }
        # The decider's depths read in the same full-context frame as the training-free exits.
        c = A.policy_correct(per_depth, pred_depth)
        policies["decider (full-context)"] = {
            "accuracy": float(c.mean()),
            "sequence_accuracy": seq_acc(c),
            "mean_depth": decider_depth,
            "saving": decider_depth / D,
            "frame": "full-context",
        }
    goal = float(target) if target is not None else (decider_depth if info.has_decider else (1 + D) / 2)
    engine = _engine_exit_policies()
    for pname, (first, rule) in A.POLICIES.items():
        if pname == "state" and any("state" not in t for t in tf):
            notes.append("state-change exit skipped: the core's per-depth states could not be captured")
            continue
        signal = _cat(tf, pname, examples)
        tau, _ = A.calibrate_threshold(signal, first, goal, rule)
        depth = A.exit_depths(signal, tau, first, rule)
        c = A.policy_correct(per_depth, depth)
        entry = {
            "accuracy": float(c.mean()),
            "sequence_accuracy": seq_acc(c),
            "mean_depth": float(depth.mean()),
            "saving": float(depth.mean()) / D,
            "threshold": tau,
            "target_mean_depth": goal,
            "frame": "full-context",
            "n_tokens": int(depth.size),
        }
        if pname in engine and math.isfinite(tau) and tau > 0:
            entry["full_context"] = {"accuracy": entry["accuracy"], "mean_depth": entry["mean_depth"]}
            exact = _policy_pass(model, info, examples, pad, opts, pname, tau, f"{pname} exit")
            d_ex = np.concatenate([d[e.content] for (d, _), e in zip(exact, examples)])
            c_ex = np.concatenate([k[e.content] for (_, k), e in zip(exact, examples)])
            entry.update(
                accuracy=float(c_ex.mean()),
                sequence_accuracy=seq_acc(c_ex),
                mean_depth=float(d_ex.mean()),
                saving=float(d_ex.mean()) / D,
                frame="exact",
            )
            if opts.policy_generation:
                g = generate(f"{pname} exit", exit_policy=pname, exit_threshold=tau)
                entry["generation_accuracy"] = float(score(g).mean())
                entry["generation_mean_depth"] = _mean(np.concatenate([np.asarray(x["depths"], float) for x in g]))
                if math.isfinite(entry["generation_mean_depth"]):
                    points.append((info.layers(entry["generation_mean_depth"]), entry["generation_accuracy"], pname))
        elif pname in engine:
            notes.append(
                f"{pname} exit: the threshold matching d̄ = {goal:.3g} is {tau} (no token can exit early), which the "
                "engine does not take; the full-context numbers are reported"
            )
        policies[pname] = entry
    return policies


# ----------------------------------------------------------------------------------------------
# several tasks and models, artifacts
# ----------------------------------------------------------------------------------------------


def _as_list(tasks) -> list:
    if isinstance(tasks, str):
        return [t for t in (s.strip() for s in tasks.split(",")) if t]
    if not isinstance(tasks, (list, tuple)):
        return [tasks]
    return list(tasks)


def evaluate(
    model,
    tokenizer,
    tasks="mano",
    levels=None,
    n: int = DEFAULT_N,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    *,
    name: str = "model",
    compare=None,
    compare_name: str = "compare",
    rows: Mapping[str, Any] | None = None,
    limit: int | None = None,
    train_levels=None,
    max_new_tokens: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    chat: bool = False,
    answer_sep: str = " ",
    alignment: str = "predict",
    forced_generation: bool = True,
    policy_generation: bool = True,
    html_samples: int = 2,
    progress: bool = True,
    backend: str = "auto",
    print_summary: bool = False,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate a model (and optionally a second one on the same rows) on several tasks.

    Args:
        model: looped or base causal LM.
        tokenizer: its tokenizer.
        tasks: a task key, a comma-separated string or a list of keys / Tasks.
        levels: ``None`` (each task's defaults), a list (all tasks) or ``{task: levels}``.
        n: examples per level.
        seed: data seed.
        out_dir: when given, write every artifact there (:func:`write_artifacts`).
        name: the model's name in the results.
        compare: a second model evaluated the same way (e.g. the base): a model (same
            tokenizer) or ``(model, tokenizer)``. A looped model made by ``retrofit.convert``
            shares its modules with the base object, so pass a separate copy of the base.
        compare_name: its name.
        rows: ``{task: rows}`` to evaluate given rows instead of generated ones.
        limit, train_levels, max_new_tokens, batch_size, chat, answer_sep, alignment,
            forced_generation, policy_generation, html_samples, progress, backend: see
            :func:`evaluate_task` (``train_levels`` may also be ``{task: levels}``).
        print_summary: print the rich summary table.
        config: extra entries for ``results["config"]``.

    Returns:
        The results dict (schema: :mod:`retrofit.evaluation.report`).
    """
    from data_prep.tasks import get_task

    task_objs = [get_task(t) for t in _as_list(tasks)]
    if not task_objs:
        raise ValueError("no task given")
    models = [(name, model, tokenizer)]
    if compare is not None:
        c_model, c_tok = compare if isinstance(compare, tuple) else (compare, tokenizer)
        if compare_name == name:
            compare_name = f"{compare_name} (compare)"
        models.append((compare_name, c_model, c_tok))
    results: dict[str, Any] = {
        "config": {
            "tasks": [t.name for t in task_objs],
            "models": [m[0] for m in models],
            "n_per_level": n,
            "seed": seed,
            "limit": limit,
            "batch_size": batch_size,
            "max_new_tokens": max_new_tokens if max_new_tokens is not None else "auto (longest answer + 2)",
            "input_format": "chat template" if chat else f"raw continuation, answer separator {answer_sep!r}",
            "depth_alignment": alignment,
            "accuracy": "exact match (task scorer) of greedy generation, stop at EOS or newline",
            "depth_statistics": "teacher-forced on the gold answer's content tokens",
            "exit_policies": "teacher-forced next-token accuracy on answer tokens; thresholds calibrated to "
            "the decider's mean depth (full-context frame, re-measured exactly where the engine implements the exit)",
            **dict(config or {}),
        },
        "models": {},
    }
    # one row set per task, shared by every model (side-by-side comparisons see the same instances)
    task_data = {}
    for t in task_objs:
        t_rows = rows.get(t.name) if rows is not None else None
        task_data[t.name] = task_rows(t, _parse_levels_for(t, levels), n, seed, limit) if t_rows is None else t_rows
    for mname, m, tok in models:
        entry = {"tasks": {}}
        for t in task_objs:
            tl = _parse_levels_for(t, train_levels)
            entry["tasks"][t.name] = evaluate_task(
                m, tok, t, rows=task_data[t.name], train_levels=tl, max_new_tokens=max_new_tokens, batch_size=batch_size,
                chat=chat, answer_sep=answer_sep, alignment=alignment, forced_generation=forced_generation,
                policy_generation=policy_generation, html_samples=html_samples, progress=progress, backend=backend,
                name=mname,
            )
        info = _model_info(m)
        entry["max_depth"] = info.max_depth
        entry["method"] = info.method
        entry["looped"] = info.looped
        results["models"][mname] = entry
    if out_dir is not None:
        write_artifacts(results, out_dir)
    if print_summary:
        from rich.console import Console

        from .report import summary_table

        Console().print(summary_table(results))
    return results


def write_artifacts(results: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json``, the PNG plots, ``samples.html`` and ``report.md`` into ``out_dir``.

    Everything is drawn from ``results`` alone, so a saved ``results.json`` can be re-rendered.
    Per task: ``{task}_depth_vs_difficulty.png`` (looped models only), ``{task}_accuracy_vs_difficulty.png``
    (training levels shaded), ``{task}_accuracy_vs_compute.png`` (x = decoder-layer passes per
    generated token: prelude + core·d + coda) and ``{task}_loss_change.png`` (looped, D > 1).

    Returns:
        ``{artifact: path}``.
    """
    from .html import write_depth_html
    from .plots import (
        plot_accuracy_vs_compute,
        plot_accuracy_vs_difficulty,
        plot_depth_vs_difficulty,
        plot_loss_change_histogram,
    )
    from .report import write_json, write_markdown_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {"results": write_json(results, out / "results.json")}
    plots: dict[str, str] = {}
    models = results.get("models", {})
    task_names = list(dict.fromkeys(t for m in models.values() for t in m.get("tasks", {})))
    all_samples = []
    max_d = 1
    for task in task_names:
        per = {mn: m["tasks"][task] for mn, m in models.items() if task in m.get("tasks", {})}
        any_t = next(iter(per.values()))
        knob = any_t.get("knob", "level")
        xlabel = f"{task} difficulty ({knob})"
        train = any_t.get("train_levels", [])
        looped = {mn: t for mn, t in per.items() if t.get("looped")}
        if looped:
            D = max(int(t.get("max_depth", 1)) for t in looped.values())
            max_d = max(max_d, D)
            p = plot_depth_vs_difficulty(
                {mn: {lvl: e.get("mean_depth") for lvl, e in t["levels"].items()} for mn, t in looped.items()},
                out / f"{task}_depth_vs_difficulty.png",
                max_depth=D,
                title=f"{task}: mean depth d̄ over answer tokens vs difficulty",
                xlabel=xlabel,
            )
            plots[f"{task}: d̄ vs difficulty"] = p
        p = plot_accuracy_vs_difficulty(
            {mn: {lvl: e.get("accuracy") for lvl, e in t["levels"].items()} for mn, t in per.items()},
            out / f"{task}_accuracy_vs_difficulty.png",
            train_levels=train,
            title=f"{task}: exact-match accuracy vs difficulty",
            xlabel=xlabel,
        )
        plots[f"{task}: accuracy vs difficulty"] = p
        p = plot_accuracy_vs_compute(
            {mn: [tuple(x) for x in t.get("compute_points", [])] for mn, t in per.items()},
            out / f"{task}_accuracy_vs_compute.png",
            title=f"{task}: accuracy vs compute (lines: forced depth; stars: adaptive)",
            xlabel="decoder-layer passes per generated token",
        )
        plots[f"{task}: accuracy vs compute"] = p
        lc = {mn: t["loss_change"] for mn, t in per.items() if t.get("loss_change") and t["loss_change"].get("n")}
        if lc:
            p = plot_loss_change_histogram(
                next(iter(lc.values())) if len(lc) == 1 else lc,
                out / f"{task}_loss_change.png",
                title=f"{task}: loss change Δ = ℓ(D) − ℓ(1), teacher-forced answer tokens",
            )
            plots[f"{task}: first-vs-last depth loss change"] = p
        for t in per.values():
            all_samples += t.get("samples", [])
            max_d = max(max_d, int(t.get("max_depth", 1)))
    paths.update({f"plot:{k}": str(v) for k, v in plots.items()})
    if all_samples:
        paths["samples"] = write_depth_html(
            [{k: s[k] for k in ("title", "tokens", "depths")} for s in all_samples],
            out / "samples.html",
            max_depth=max_d,
            page_title="Sample generations, coloured by each token's exit depth (grey: prompt)",
        )
    paths["report"] = write_markdown_report(results, out / "report.md", plots=plots)
    return paths


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    """``"3,4,8-10"`` -> ``[3, 4, 8, 9, 10]``."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError(f"empty range {part!r}")
            out += list(range(lo, hi + 1))
        else:
            out.append(int(part))
    return out


def _levels_arg(values: list[str] | None, what: str):
    """``["3,4,8-10"]`` -> list for all tasks; ``["mano=3,4", "brevo=5"]`` -> ``{task: list}``."""
    if not values:
        return None
    common: list[int] | None = None
    per: dict[str, list[int]] = {}
    for v in values:
        try:
            if "=" in v:
                t, lv = v.split("=", 1)
                per[t.strip()] = _int_list(lv)
            else:
                common = (common or []) + _int_list(v)
        except ValueError as e:
            raise ValueError(f"{what}: cannot parse {v!r} ({e}); use e.g. '3,4,8-12' or 'mano=3,4,8-12'") from None
    if per and common is not None:
        raise ValueError(f"{what}: use either one list for all tasks or TASK=LIST entries, not both")
    return per if per else common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``retrofit eval``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  retrofit eval --model out/looped --task mano --levels 3-8,12,16,20 --n 50 --out eval/\n"
        "  retrofit eval --model out/looped --compare smollm2 --task mano,brevo --limit 40\n"
        "  retrofit eval --model tiny-llama --task lano --levels lano=8,12 --n 5 --out /tmp/ev\n"
        "Tasks: mano, brevo, lano, clrs_sorting, clrs_string_matching, clrs_max_subarray, clrs_bfs, gsm,\n"
        "rg_chain_sum, rg_maze, rg_sudoku, rg_path_star (data_prep.tasks.TASKS)."
    )
    parser.add_argument("--model", required=True, help="checkpoint: a folder (looped or base), a .gguf, 'smollm2', 'tiny-llama', 'tiny-qwen3' or a hub id")
    parser.add_argument("--task", "--tasks", dest="tasks", action="append", default=None,
                        help="task key(s), repeatable or comma-separated (default: mano)")
    parser.add_argument("--levels", action="append", default=None,
                        help="difficulty levels, e.g. '3,4,8-12' for every task or 'mano=3,4' per task (repeatable); default: the task's train + held-out levels")
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"examples per level (default {DEFAULT_N})")
    parser.add_argument("--seed", type=int, default=0, help="data seed (eval rows use a stream derived from it)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples per task, spread over the levels (quick look)")
    parser.add_argument("--out", default="retrofit_eval", help="output folder (default ./retrofit_eval)")
    parser.add_argument("--train-levels", action="append", default=None,
                        help="levels to mark as training levels on plots, same syntax as --levels (default: the task's default_train_levels)")
    parser.add_argument("--compare", default=None, help="a second model (e.g. the base) evaluated the same way, side by side")
    parser.add_argument("--name", default=None, help="name of --model in the report (default: its folder/file name)")
    parser.add_argument("--compare-name", default=None, help="name of --compare in the report")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="generation budget (default: longest gold answer + 2 tokens)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help=f"sequences per forward (default {DEFAULT_BATCH_SIZE}; lower it if memory is short)")
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template (default: raw prompt continuation)")
    parser.add_argument("--answer-sep", default=" ", help="text between a raw prompt and its answer (default: one space)")
    parser.add_argument("--alignment", choices=A.ALIGNMENTS, default="predict",
                        help="depth of an answer token: of the position that produced it (predict, default) or its own (input)")
    parser.add_argument("--no-forced-generation", action="store_true", help="skip generating at every forced depth 1..D (saves D generation passes)")
    parser.add_argument("--no-policy-generation", action="store_true", help="skip generating under the training-free exits")
    parser.add_argument("--generation-backend", choices=GENERATION_BACKENDS, default="auto",
                        help="'generate' (the model's cached generate), 'loop' (reference: full forward per step, no cache) or 'auto' (generate when available)")
    parser.add_argument("--html-samples", type=int, default=2, help="generations per level shown in samples.html (default 2)")
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', ...")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="load dtype (default: as stored)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _spec_name(spec: str) -> str:
    p = Path(spec)
    return p.stem if p.suffix == ".gguf" else (p.name or spec)


def _load(spec: str, device: str, dtype):
    from retrofit.loading import load_model

    model, tok = load_model(spec, dtype=getattr(torch, dtype) if dtype else None)
    return model.to(device).eval(), tok


def run(args: argparse.Namespace) -> int:
    """Entry point of ``retrofit eval``."""
    from rich.console import Console

    from .report import summary_table

    console = Console(stderr=False)
    try:
        tasks = [t for v in (args.tasks or ["mano"]) for t in _as_list(v)]
        levels = _levels_arg(args.levels, "--levels")
        train_levels = _levels_arg(args.train_levels, "--train-levels")
        from data_prep.tasks import get_task

        for t in tasks:
            get_task(t)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        name = args.name or _spec_name(args.model)
        model, tok = _load(args.model, device, args.dtype)
        compare = None
        compare_name = args.compare_name or (_spec_name(args.compare) if args.compare else "compare")
        if args.compare:
            compare = _load(args.compare, device, args.dtype)
        results = evaluate(
            model, tok, tasks, levels=levels, n=args.n, seed=args.seed, out_dir=args.out, name=name,
            compare=compare, compare_name=compare_name, limit=args.limit, train_levels=train_levels,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, chat=args.chat,
            answer_sep=args.answer_sep, alignment=args.alignment,
            forced_generation=not args.no_forced_generation, policy_generation=not args.no_policy_generation,
            html_samples=args.html_samples, progress=not args.quiet, backend=args.generation_backend,
            config={"model": args.model, "compare": args.compare, "device": device},
        )
    except (ValueError, OSError) as e:
        print(f"retrofit eval: error: {e}", file=sys.stderr)
        return 2
    console.print(summary_table(results, title=f"retrofit eval → {args.out}"))
    console.print(f"wrote {args.out}/results.json, report.md, samples.html and the plots")
    return 0
