"""What a :class:`~.model.RetrofitLM` run computed: the exit depths of its tokens per task, and their d̄ and FLOPs.

Depth and compute (:class:`DepthMeter`), per task, over the tokens the model actually ran:

* ``answer_tokens``: the positions that produced a scored continuation token (``loglikelihood``) or
  a generated token (``generate_until``, up to and including the stop token) — the depth that
  produced the token, ``retrofit eval``'s ``gen_mean_depth`` for generation tasks.
* ``all_tokens``: every position run once: context and answer (left padding, and positions after a
  row stopped, excluded).

For each: ``n_tokens``, ``mean_depth`` d̄, ``flops_per_token`` (matmul FLOPs, ``retrofit.model.flops``:
decoder layers, updater, decider and LM head as the run uses them; attention scores left out),
``layers_per_token`` and, for looped models, ``flops_vs_fixed`` (every token at depth D) and
``flops_vs_base`` (the pretrained stack). They land in lm-eval's results JSON under
``config.retrofit`` (lm-eval calls :meth:`RetrofitLM.get_model_info` after the run) and
``retrofit lm-eval`` prints them after lm-eval's table. Requests answered from lm-eval's
``--use_cache`` are not run, so they are not counted.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch

__all__ = ["NO_TASK", "DepthMeter", "plain_flops_per_token", "token_stats"]

#: the task name of requests lm-eval sends without one
NO_TASK = "(no task)"


def plain_flops_per_token(model) -> float:
    """Matmul FLOPs per token of a plain causal LM: every decoder layer and the LM head once (2 per multiply-add)."""
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * float(layers + model.get_output_embeddings().weight.numel())


class DepthMeter:
    """Exit depths of the tokens a :class:`~.model.RetrofitLM` ran, per task (module docstring).

    Attributes:
        answer: ``{task: [arrays of depths]}`` of the answer positions.
        all: ``{task: [arrays of depths]}`` of every position run.
        requests: ``{task: Counter(request type)}``.
    """

    def __init__(self):
        self.answer: dict[str, list[np.ndarray]] = defaultdict(list)
        self.all: dict[str, list[np.ndarray]] = defaultdict(list)
        self.requests: dict[str, Counter] = defaultdict(Counter)

    def add(self, task: str | None, request_type: str, answer_depths, all_depths) -> None:
        """Record one request's ``[n]`` answer-position depths and ``[m]`` all-position depths."""
        task = task or NO_TASK
        self.answer[task].append(np.asarray(answer_depths, dtype=np.int64).reshape(-1))
        self.all[task].append(np.asarray(all_depths, dtype=np.int64).reshape(-1))
        self.requests[task][request_type] += 1

    def tasks(self) -> list[str]:
        return sorted(self.requests)

    def depths(self, which: str, task: str | None = None) -> np.ndarray:
        """Concatenated depths of ``which`` (``"answer"`` or ``"all"``) for one task (None = every task)."""
        store = self.answer if which == "answer" else self.all
        parts = [a for t in ([task] if task is not None else self.tasks()) for a in store.get(t, [])]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def report(self, model, info, readout: bool | None) -> dict[str, Any]:
        """``{"tasks": {task: {requests, answer_tokens, all_tokens}}, "total": {answer_tokens, all_tokens}}``:
        :func:`token_stats` of the recorded depths (``readout``: as ``retrofit.model.flops.cost_report``)."""
        out: dict[str, Any] = {"tasks": {}}
        for task in self.tasks():
            out["tasks"][task] = {
                "requests": dict(self.requests[task]),
                "answer_tokens": token_stats(model, info, self.depths("answer", task), readout),
                "all_tokens": token_stats(model, info, self.depths("all", task), readout),
            }
        out["total"] = {
            "answer_tokens": token_stats(model, info, self.depths("answer"), readout),
            "all_tokens": token_stats(model, info, self.depths("all"), readout),
        }
        return out


def token_stats(model, info, depths: np.ndarray, readout: bool | None) -> dict[str, Any]:
    """d̄ and FLOPs of tokens with exit ``depths`` ``[n]``."""
    n = int(depths.size)
    if n == 0:
        return {"n_tokens": 0}
    if not info.looped:
        return {
            "n_tokens": n,
            "mean_depth": 1.0,
            "flops_per_token": plain_flops_per_token(model),
            "layers_per_token": float(info.n_layers),
        }
    from retrofit.model.flops import cost_report

    rep = cost_report(model, torch.as_tensor(depths), readout=readout)
    return {
        "n_tokens": n,
        "mean_depth": rep["mean_depth"],
        "flops_per_token": rep["flops"] / n,
        "layers_per_token": info.layers(rep["mean_depth"]),
        "flops_vs_fixed": rep["flops_vs_fixed"],
        "flops_vs_base": rep["flops_vs_base"],
    }
