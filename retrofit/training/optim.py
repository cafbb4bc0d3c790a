"""Optimizer parameter groups for the looped model's heads: the updater and the decider may train at their own
learning rate (``RetrofitSFTConfig.heads_lr_scale`` / ``decider_lr_scale``)."""

from __future__ import annotations

from collections.abc import Iterable


def add_head_groups(opt, named_parameters: Iterable, scales: dict[str, float]) -> None:
    """Move each head's parameters into parameter groups of their own, at the group's ``lr × scale``.

    Args:
        opt: the optimizer (its groups are edited in place).
        named_parameters: ``model.named_parameters()``.
        scales: ``{head name: lr scale}``; a parameter belongs to ``head`` when ``.<head>.`` is in its name.
            Scales of 1 keep their parameters where they are; each other scale gets one group per existing
            group (equal scales share it), with the existing group's settings.
    """
    scale_of = {}
    for n, p in named_parameters:
        for head, sc in scales.items():
            if f".{head}." in f".{n}" and sc != 1.0:
                scale_of[id(p)] = sc
    extra = []
    for g in opt.param_groups:
        for sc in dict.fromkeys(scale_of[id(p)] for p in g["params"] if id(p) in scale_of):
            params = [p for p in g["params"] if scale_of.get(id(p)) == sc]
            extra.append({**{k: v for k, v in g.items() if k != "params"}, "params": params, "lr": g["lr"] * sc})
        g["params"] = [p for p in g["params"] if id(p) not in scale_of]
    for g in extra:
        opt.add_param_group(g)
