"""Attention patterns across depths, as pure functions (docs/looped-model.md).

The full-sequence forward stacks the keys of every depth executed so far along the key axis:
key index ``(j - 1) * T + s`` holds position ``s`` at depth ``j``. A query is token ``t`` at the
current depth ``m``. ``active[j - 1, b, s]`` says whether token ``s`` executed depth ``j``
(``j <= d*_s``); during an on-policy forward it is known for every ``j <= m`` when depth ``m`` runs.

- duo-causal (TaH2): ``(t, m)`` sees ``(s, j)`` iff ``s <= t``, ``j <= m`` and ``s`` executed ``j``.
- same-depth (ANIRA): ``(t, m)`` sees each ``s <= t`` once, at depth ``min(m, d*_s)``.

A token always sees its own states at depths ``<= m`` (duo-causal) or ``m`` (same-depth), even
when it has already exited: that row is then the gradient-free *lookahead* iteration TaH2 needs
(§3), computed as if the token had continued. Rows of exited tokens beyond the lookahead are
discarded by passthrough, so what they see does not matter.
"""

from __future__ import annotations

import torch


def depth_key_visibility(active: torch.Tensor, depth: int, mode: str, base: torch.Tensor) -> torch.Tensor:
    """Boolean visibility of stacked keys for queries at ``depth``.

    Args:
        active: ``[Dm, B, T]`` bool, ``active[j-1, b, s]`` = token ``s`` of row ``b`` executed
            depth ``j``; only the first ``depth`` entries are read.
        depth: current depth ``m`` (1-based).
        mode: ``"duo-causal"`` or ``"same-depth"``.
        base: ``[B, T, T]`` bool position-level visibility (causal, padding, packed segments),
            from ``base_visibility``.

    Returns:
        ``[B, T, depth * T]`` bool; ``out[b, t, (j-1)*T + s]`` = query ``(t, m)`` may attend to key
        ``(s, j)``.
    """
    _, B, T = active.shape
    m = depth
    dev = active.device
    act = active[:m]  # [m, B, T]
    pos = torch.arange(T, device=dev)
    same = pos[None, :] == pos[:, None]
    if mode == "duo-causal":
        # key (s, j) visible iff executed, or it is the query's own position (lookahead row)
        vis = act[:, :, None, :] | same[None, None]  # [m, B, T, T]
    elif mode == "same-depth":
        # depth min(m, d*_s) is the last executed depth of s up to m
        nxt = torch.cat([act[1:], torch.zeros_like(act[:1])], 0)  # executed j+1 (False past m)
        last = act & ~nxt
        last[m - 1] = act[m - 1]
        own = torch.zeros(m, 1, 1, T, T, dtype=torch.bool, device=dev)
        own[m - 1] = same
        vis = last[:, :, None, :] | own[:, 0]
        # an exited query must not see its own earlier depths in same-depth mode: for s == t only
        # depth m counts (the lookahead row), handled by masking the diagonal of j < m below.
        if m > 1:
            diag_lower = torch.zeros(m, 1, T, T, dtype=torch.bool, device=dev)
            diag_lower[: m - 1] = same
            vis = vis & ~diag_lower
    else:
        raise ValueError(f"unknown attention mode {mode!r}; allowed: 'duo-causal', 'same-depth'")
    vis = vis & base[None]
    # [m, B, Tq, Tk] -> [B, Tq, m * Tk]
    return vis.permute(1, 2, 0, 3).reshape(B, T, m * T)


def to_additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Tq, K]`` bool -> ``[B, 1, Tq, K]`` additive float mask (0 or the dtype's minimum).

    The minimum (not -inf) keeps a fully masked row (a padding query) finite: it becomes a
    uniform average instead of NaN, and its output is never used.
    """
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def base_visibility(
    B: int, T: int, device, key_padding: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Position-level visibility ``[B, T, T]``: causal, no padding keys, same packed sequence.

    Args:
        key_padding: ``[B, T]`` bool/int, 1 for real tokens, 0 for padding; None = no padding.
        position_ids: ``[B, T]`` or ``[1, T]``; a reset to 0 inside a row starts a new packed
            sequence (TRL's ``packing=True``, padding-free batches), which must not see the
            previous one.

    This is also the plain causal mask of the prelude and the coda.
    """
    pos = torch.arange(T, device=device)
    vis = (pos[None, :] <= pos[:, None])[None].expand(B, T, T)
    if key_padding is not None:
        vis = vis & key_padding.bool()[:, None, :]
    if position_ids is not None and T > 1:
        starts = position_ids.expand(B, T) == 0
        if bool(starts[:, 1:].any()):
            seg = starts.long().cumsum(-1)
            vis = vis & (seg[:, :, None] == seg[:, None, :])
    return vis
