"""Batched greedy decoding with each generated token's exit depth.

Two backends give the same tokens and depths (tests/evaluation/test_eval_runner.py checks it):

* ``"generate"``: the model's own ``generate`` (KV cache; for looped models the depth-aware cache
  of ``retrofit.model.generation``, whose ``depths`` output gives the producing step's depth).
* ``"loop"``: a reference loop that runs the full sequence every step (no cache), so the exit
  decisions are by construction those of the model's full forward. Rows that finished are
  dropped from later steps.

Stopping (both backends, and :func:`stop_rule` is what the teacher-forced accuracy checks too): a
row stops at the first generated token that is an end-of-sequence id (the tokenizer's and the
generation config's) or whose text contains a newline; the stop token is kept in ``ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .models import ModelInfo, batched_passes, device, forward, model_info, pad_id
from .options import DEFAULT_BATCH_SIZE, GENERATION_BACKENDS

__all__ = ["greedy_generate", "stop_ids", "stop_rule"]


def stop_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids of the tokenizer and of the model's generation config."""
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if v is None:
            continue
        ids.update([int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)])
    return ids


def stop_rule(model, tokenizer, stop_on_newline: bool = True) -> Callable[[int], bool]:
    """``is_stop(token_id)``: an end-of-sequence id, or (``stop_on_newline``) a token whose text has a newline."""
    stops = stop_ids(model, tokenizer)
    newline: dict[int, bool] = {}

    def is_stop(t: int) -> bool:
        if t in stops:
            return True
        if not stop_on_newline:
            return False
        if t not in newline:
            newline[t] = "\n" in tokenizer.decode([t])
        return newline[t]

    return is_stop


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
    """Greedy decoding of tokenized prompts, with each generated token's exit depth.

    ``"auto"`` = ``"generate"``. With ``alignment="input"`` (or the loop backend) depths come from
    one final forward over prompt + generation; the depth rules are causal, so they equal the
    depths at decode time.

    Args:
        model: a looped or plain causal LM (eval mode).
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
        (1 for a plain model)}``.
    """
    if backend not in GENERATION_BACKENDS:
        raise ValueError(f"unknown generation backend {backend!r}; allowed: {', '.join(GENERATION_BACKENDS)}")
    info = model_info(model)
    if backend == "auto":
        backend = "generate"
    dev = device(model)
    pad = pad_id(tokenizer)
    stops = stop_ids(model, tokenizer)
    is_stop = stop_rule(model, tokenizer, stop_on_newline)
    kw: dict[str, Any] = {}
    if info.looped:
        if depth is not None:
            kw["depth"] = int(depth)
        if exit_policy is not None:
            kw.update(exit_policy=exit_policy, exit_threshold=exit_threshold)
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    for _, chunk, ids, mask in batched_passes(prompts, pad, dev, batch_size, progress=progress, desc=desc):
        P = ids.shape[1]
        if backend == "generate":
            gen, gen_depths, ids, mask = _decode_with_generate(
                model, info, ids, mask, max_new_tokens, pad, stops, is_stop, kw
            )
        else:
            gen, ids, mask = _decode_loop(model, info, ids, mask, max_new_tokens, pad, is_stop, kw)
            gen_depths = None
        if info.looped and any(gen) and (gen_depths is None or alignment == "input"):
            full = forward(model, info, ids, mask, logits_to_keep=1, **kw).depths.cpu()
            shift = -1 if alignment == "predict" else 0
            gen_depths = [[int(full[r, P + j + shift]) for j in range(len(g))] for r, g in enumerate(gen)]
        for r, i in enumerate(chunk):
            g = gen[r]
            d = [1] * len(g) if not info.looped else list(gen_depths[r]) if gen_depths is not None else []
            results[i] = {"ids": g, "text": tokenizer.decode(g, skip_special_tokens=True), "depths": d}
    return results  # type: ignore[return-value]


def _decode_loop(model, info: ModelInfo, ids, mask, max_new_tokens, pad, is_stop, kw):
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
        out = forward(model, info, ids[li], mask[li], logits_to_keep=1, **kw)
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


def _decode_with_generate(model, info: ModelInfo, ids, mask, max_new_tokens, pad, stops, is_stop, kw):
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
    gen: list[list[int]] = []
    for row in seqs[:, P:].tolist():
        g = []
        for t in row:
            g.append(int(t))
            if is_stop(int(t)):
                break
        gen.append(g)
    gen_depths = None
    if info.looped and getattr(out, "depths", None) is not None:
        dep = out.depths.cpu()
        gen_depths = [[int(dep[r, j]) for j in range(len(g))] for r, g in enumerate(gen)]
    # rebuild the mask of the generated part (tokens after a row's stop are padding)
    gmask = torch.zeros((seqs.shape[0], seqs.shape[1] - P), dtype=mask.dtype, device=mask.device)
    for r, g in enumerate(gen):
        gmask[r, : len(g)] = 1
    return gen, gen_depths, seqs, torch.cat([mask, gmask], 1)
