"""What the evaluation needs to know about a model, and the batching helpers every pass shares.

A model is either a ``LoopedForCausalLM`` (depth statistics, forced depths, exit policies) or a
plain causal LM evaluated at its only depth (``max_depth`` 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .metrics import flops_ratio

__all__ = [
    "ModelInfo",
    "batches",
    "device",
    "flops_per_token",
    "forward",
    "model_info",
    "pad_id",
    "pad_left",
    "progress_bar",
]


@dataclass
class ModelInfo:
    """Shape facts of a model under evaluation.

    Attributes:
        looped: a ``LoopedForCausalLM``.
        max_depth: D (1 for a plain model).
        method: halting method name (None for a plain model).
        n_layers: decoder layers of the stack.
        prelude, core, coda: layer counts of the three ranges (a plain model: 0, n_layers, 0).
    """

    looped: bool
    max_depth: int
    method: str | None
    n_layers: int
    prelude: int
    core: int
    coda: int

    @property
    def has_decider(self) -> bool:
        """A looped model whose method decides depths (its ``decider_runs``; not the fixed loop)."""
        from retrofit.model import registry

        return self.looped and registry.method_class(self.method).has_decider()

    def layers(self, mean_depth: float) -> float:
        """Decoder-layer passes per token at mean core depth ``mean_depth`` (``flops_ratio``)."""
        return flops_ratio(mean_depth, self.max_depth, self.n_layers, self.prelude, self.core, self.coda)[
            "layers_adaptive"
        ]


def model_info(model) -> ModelInfo:
    """The :class:`ModelInfo` of a looped or plain causal LM."""
    from retrofit.model.modeling import LoopedForCausalLM

    cfg = model.config
    n_layers = int(
        cfg.get_text_config().num_hidden_layers if hasattr(cfg, "get_text_config") else cfg.num_hidden_layers
    )
    if isinstance(model, LoopedForCausalLM):
        loop = model.loop
        pre, core, coda = loop.layer_ranges(n_layers)
        return ModelInfo(True, loop.max_depth, loop.method, n_layers, len(pre), len(core), len(coda))
    return ModelInfo(False, 1, None, n_layers, 0, n_layers, 0)


def device(model) -> torch.device:
    return next(model.parameters()).device


def forward(model, info: ModelInfo, ids, mask, **kw):
    """One full-sequence forward with explicit positions (left padding) and no KV cache.

    Looped-only keywords (``depth``, ``exit_policy``, ...) are dropped for a plain model.
    """
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    if not info.looped:
        kw = {k: v for k, v in kw.items() if k == "logits_to_keep"}
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw)


def pad_left(seqs: Sequence[Sequence[int]], pad: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: ``(ids [B, T], mask [B, T])``."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, L - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, L - len(s) :] = 1
    return ids.to(dev), mask.to(dev)


def pad_id(tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else EOS, else 0."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


def batches(order: Sequence[int], size: int):
    """Consecutive chunks of ``order`` of at most ``size`` indices."""
    for i in range(0, len(order), size):
        yield list(order[i : i + size])


def pass_chunks(lengths: Sequence[int], batch_size: int, order: str = "length") -> list[list[int]]:
    """The row indices of each batch of :func:`batched_passes` (before any ``max_rows`` split)."""
    if order not in ("length", "input"):
        raise ValueError(f"order must be 'length' or 'input', got {order!r}")
    idx = list(range(len(lengths)))
    if order == "length":
        idx.sort(key=lambda i: (lengths[i], i))
    return list(batches(idx, batch_size))


def batched_passes(
    seqs: Sequence[Sequence[int]],
    pad: int,
    dev,
    batch_size: int,
    *,
    progress: bool = False,
    desc: str = "",
    order: str = "length",
    max_rows: Callable[[list[int]], int] | None = None,
):
    """The evaluation's one pass runner: every measurement's forwards go through it (teacher-forced passes,
    greedy decoding, decider decisions, the frontier's and the oracle's passes).

    Batches ``seqs`` (``order="length"``: shortest first, ties in input order, so a batch pads little;
    ``"input"``: as given), left-pads each batch and shows one progress bar. ``max_rows(indices)`` may split a
    batch into parts of at most that many rows (a memory budget that depends on the batch's lengths).

    Yields:
        ``(batch index, row indices, ids [B, T], mask [B, T])``, batches numbered in the order they run.
    """
    b = 0
    chunks = pass_chunks([len(q) for q in seqs], batch_size, order)
    for chunk in progress_bar(chunks, progress, desc=desc, unit="batch"):
        step = len(chunk) if max_rows is None else max(1, int(max_rows(chunk)))
        for j in range(0, len(chunk), step):
            part = chunk[j : j + step]
            ids, mask = pad_left([seqs[i] for i in part], pad, dev)
            yield b, part, ids, mask
            b += 1


def progress_bar(iterable, enabled: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, leave=False, dynamic_ncols=True, **kw)


def flops_per_token(model, info: ModelInfo, depths, decider: bool = True) -> float:
    """Matmul FLOPs per token at the given exit depths (mean over them).

    Looped models: ``retrofit.model.flops.cost_report`` (decoder layers, updater, decider, LM head as
    the method runs them). Plain models: every decoder layer and the LM head once per token. Both
    count 2 FLOPs per multiply-add of every linear map and leave out attention scores, which grow
    with context length (a few percent of a layer at these lengths).

    Args:
        depths: ``[n]`` exit depths (ignored for a plain model).
        decider: the method's decider ran (and, for TaH2, every executed depth was read out); False
            for a forced depth (``depth=d``), which runs no decider and reads out the exit state only.
    """
    if info.looped:
        from retrofit.model.flops import cost_report

        d = torch.as_tensor(depths).reshape(-1).long()
        if d.numel() == 0:
            return float("nan")
        rep = cost_report(model, d, decider=decider)
        return float(rep["flops"]) / rep["n_tokens"]
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * float(layers + model.get_output_embeddings().weight.numel())
