"""Placing a decider by compute: the threshold at which a chosen share of answer steps stops at depth 1.

A decider's probabilities need not spread over ``[0, 1]``: a TaH2 decider trained on the main job's budget
puts every continue probability of the answer steps in a band a few hundredths wide, so a sweep of fixed
thresholds (0.1 … 0.9) lands every point at ``d̄ = 1`` or ``d̄ = M`` and says nothing between them.
A *stop share* names the operating point by what it buys instead: the threshold at which a share ``s`` of
the first decisions (after depth 1) at the answer steps says stop. At ``M = 2`` that is ``d̄ = 2 − s``
exactly (up to ties); at ``M > 2`` the deeper decisions use the same threshold.

The threshold rule per method (``forward(decider_threshold=)``, ``c`` = the probability to continue after
depth 1, :func:`~.frontier.continue_probabilities`):

* TaH2: continue iff ``c >= τ`` — ``τ`` is the midpoint between the ``k``-th and ``(k+1)``-th smallest ``c``,
  ``k = round(s · n)``;
* ANIRA-O and ANIRA-E: continue iff the cumulative halting mass after depth 1 is below ``u``, i.e. iff
  ``c > 1 − u`` — ``u = 1 −`` that midpoint.

Two uses (docs/evaluation.md):

* the frontier (``EvalOptions.frontier_stop_shares``) places its sweep at stop shares of the frontier rows
  themselves: a description of the frontier, never the model's operating point;
* the recipes' ``--calibrate_stop_share s`` sets the model's own threshold (TaH2's ``exit_threshold``,
  ANIRA-O's ``halt_threshold``) after training from the **training rows** — a compute budget the user
  chooses, fixed before any test row is seen, saved in the checkpoint's config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrofit.model import registry

from .models import ModelInfo, device, forward, model_info, pad_id
from .options import EvalOptions
from .rows import Example


def threshold_kind(method: str | None) -> str | None:
    """What a method's decider threshold means (``forward(decider_threshold=)``; its ``threshold_meaning``), or
    None for a method without a decider (or a plain model)."""
    if method is None:
        return None
    return registry.method_class(method).threshold_meaning or None


def _rule(method: str) -> str:
    """The method's threshold rule (``HaltingMethod.threshold_rule``); an error for a method without one."""
    rule = registry.method_class(method).threshold_rule
    if rule is None:
        with_rule = [n for n in registry.names() if registry.method_class(n).threshold_rule]
        raise ValueError(f"method {method!r} has no decider threshold; allowed: {', '.join(with_rule)}")
    return rule


def answer_steps_mask(starts: Sequence[int], lengths: Sequence[int], T: int, dev=None) -> torch.Tensor:
    """``[B, T]`` bool: row ``r``'s answer steps, positions ``starts[r] − 1 … starts[r] + lengths[r] − 1``
    (the producing positions of its ``m`` answer tokens, then the stop step)."""
    mask = torch.zeros(len(starts), T, dtype=torch.bool, device=dev)
    for r, (s, m) in enumerate(zip(starts, lengths)):
        mask[r, max(0, s - 1) : s + m] = True
    return mask


def continue_probabilities(out, info: ModelInfo) -> torch.Tensor:
    """The decider's probability to continue after depth ``d`` ``[B, T, k]`` (column ``d − 1``, ``k <= D − 1``)
    from a forward's outputs, as the method reads it (``HaltingMethod.continue_probabilities``: TaH2 ``c^(d)``,
    ANIRA-O ``1 − α^(d)``, ANIRA-E ``P(d* > d) = 1 − Σ_{j<=d} q_j``, Ouro ``1 − λ_d``)."""
    if info.method is None:
        raise ValueError("a plain model has no decider, hence no continue probability")
    return registry.method_class(info.method).continue_probabilities(out, info.max_depth)


#: how far past the extreme probability a share of 0 or 1 puts the threshold: more than float32 rounding
_MARGIN = 1e-6


def threshold_for_stop_share(continue_prob: Any, share: float, method: str) -> float:
    """The decider threshold at which a share ``share`` of these first decisions stops (module docstring).

    Args:
        continue_prob: ``[n]`` probabilities to continue after depth 1 (at least one).
        share: in ``[0, 1]``: 0 = every decision continues, 1 = every one stops.
        method: ``tah2``, ``anira-o`` or ``anira-e``.

    Raises:
        ValueError: an empty ``continue_prob``, a share outside ``[0, 1]`` or a method without a decider.
    """
    c = np.sort(np.asarray(continue_prob, dtype=np.float64).reshape(-1))
    c = c[np.isfinite(c)]
    if c.size == 0:
        raise ValueError("no decisions to place a threshold on (no answer steps)")
    if not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"a stop share must lie in [0, 1], got {share!r}")
    rule = _rule(method)
    k = int(round(float(share) * c.size))  # decisions that stop
    if k == 0:
        cut = -np.inf  # below every c
    elif k >= c.size:
        cut = np.inf
    else:
        cut = 0.5 * (c[k - 1] + c[k])
    if rule == "continue_at_or_above":  # stop iff c < τ: τ just above the k smallest
        if k >= c.size:  # above every c by more than float32 rounding (the forward compares in float32)
            return float(min(1.0, c[-1] + _MARGIN))
        return float(min(1.0, max(0.0, cut)))
    # "halt_mass" (ANIRA, Ouro): continue iff c > 1 − u, stop iff c <= 1 − u
    if k == 0:
        return float(min(1.0, 1.0 - c[0] + _MARGIN))
    return float(min(1.0, max(0.0, 1.0 - min(cut, 1.0))))


@torch.no_grad()
def first_decisions(model, examples: Sequence[Example], pad: int, batch_size: int = 16, progress: bool = False):
    """The decider's probability to continue after depth 1 at every answer step of ``examples`` (teacher
    forced: the producing positions of the answer tokens, then the stop step), one adaptive forward per batch.

    Returns:
        ``[n]`` float64 over the answer steps, rows in order.
    """
    from .teacher_forced import tf_passes

    info = model_info(model)
    if not info.has_decider:
        raise ValueError("this model has no decider (a plain model or the fixed loop): nothing to place")
    dev = device(model)
    parts = []
    for _, _, exs, ids, mask, starts, _ in tf_passes(
        examples, pad, dev, batch_size, progress=progress, desc="decider decisions", order="input"
    ):
        out = forward(model, info, ids, mask)
        c = continue_probabilities(out, info)[..., 0]  # [B, T]
        steps = answer_steps_mask(starts, [len(e.answer_ids) for e in exs], ids.shape[1], dev)
        parts.append(c[steps].double().cpu().numpy())
    return np.concatenate(parts) if parts else np.zeros(0)


def realized_stop_share(continue_prob: Any, threshold: float, method: str) -> float:
    """The share of these first decisions that stop at ``threshold`` (the rule of the module docstring)."""
    c = np.asarray(continue_prob, dtype=np.float64).reshape(-1)
    stop = c < threshold if _rule(method) == "continue_at_or_above" else c <= 1.0 - threshold
    return float(stop.mean()) if c.size else float("nan")


def calibrate_stop_share(
    model,
    tokenizer,
    rows: Sequence[Mapping[str, Any]],
    share: float,
    *,
    chat: bool = False,
    batch_size: int = 16,
    progress: bool = True,
) -> dict[str, Any]:
    """Set the model's own decision threshold so that a share ``share`` of the answer steps of ``rows``
    (``prompt``/``answer``/``difficulty``; the training rows in the recipes) stops after depth 1.

    Sets the threshold with ``model.set_decider_threshold`` (the config and the deciding module).
    Returns ``{"method", "field", "stop_share", "threshold", "previous_threshold", "realized_stop_share",
    "n_rows", "n_decisions"}``.

    Raises:
        ValueError: a method without a persisted threshold (ANIRA-E decides by the argmax of ``q``; its
            frontier takes ``frontier_stop_shares``), or no rows.
    """
    from .rows import prepare

    info: ModelInfo = model_info(model)
    cls = registry.method_class(info.method) if info.method is not None else None
    if cls is None or cls.threshold_field is None:
        allowed = [n for n in registry.names() if registry.method_class(n).threshold_field]
        raise ValueError(
            f"--calibrate_stop_share sets a decider's own threshold; method {info.method!r} has none "
            f"(allowed: {', '.join(allowed)})"
        )
    if not rows:
        raise ValueError("--calibrate_stop_share needs rows to calibrate on; got none")
    was_training = model.training
    model.eval()
    try:
        exs = prepare(list(rows), tokenizer, EvalOptions(chat=chat))
        c = first_decisions(model, exs, pad_id(tokenizer), batch_size=batch_size, progress=progress)
    finally:
        model.train(was_training)
    tau = threshold_for_stop_share(c, share, info.method)
    previous = cls.get_threshold(model.loop)
    field = model.set_decider_threshold(tau)
    return {
        "method": info.method,
        "field": field,
        "stop_share": float(share),
        "threshold": tau,
        "previous_threshold": previous,
        "realized_stop_share": realized_stop_share(c, tau, info.method),
        "n_rows": len(exs),
        "n_decisions": int(c.size),
    }


def write_threshold(folder: str | Path, field: str, value: float) -> bool:
    """Set the decision threshold ``field`` (the method's ``threshold_field``: a ``loop`` key, or one of its
    ``loop["options"]``) in a saved checkpoint's ``config.json`` (atomically). False if the folder has no looped
    config (a LoRA adapter folder, say)."""
    from ..hub.atomic_io import write_json_atomic

    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    if not isinstance(cfg.get("loop"), dict):
        return False
    cls = registry.method_class(cfg["loop"].get("method", "tah2"))
    if cls.threshold_field != field:
        raise ValueError(f"method {cls.name!r} keeps its threshold in {cls.threshold_field!r}, not {field!r}")
    cfg["loop"] = cls.with_threshold(cfg["loop"], value)
    write_json_atomic(path, cfg)
    return True
