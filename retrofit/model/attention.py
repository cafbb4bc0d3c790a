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

No query row is ever fully masked: a padding query sees itself (and nothing else), as a real one does.
Its output is never read by a real token (padding keys stay invisible to real queries), but a row with
no visible key is a kernel's corner case: an additive mask turns it into NaN (softmax of all -inf), and
a fused kernel may leave it as whatever its scratch held (docs/long-context.md, "padding rows"). A
self-visible row is an ordinary softmax on every kernel, so the padding positions' states stay finite
and the ``0 × value`` products of the real queries' masked keys stay 0.

``depth_key_visibility`` builds the whole ``[B, T, m·T]`` pattern (the dense reference);
``depth_rule`` states the same rule elementwise over per-token metadata (``last``, ``segment_ids``),
so the long-context kernels (``retrofit.model.depth_attention``) evaluate it one query block or one
flex-attention tile at a time without ever holding the whole pattern (docs/long-context.md).
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


def depth_rule(mode: str, m: int, t, s, j, last_s, seg_t, seg_s, valid_s) -> torch.Tensor:
    """Query ``(t, m)`` may attend to key ``(s, j)``: the rule of ``depth_key_visibility``, elementwise.

    Every argument but ``mode`` and ``m`` is a tensor; they broadcast against each other (a flex-attention
    ``mask_mod`` passes 0-d tensors, the chunked kernel ``[B, C, L, m]``-broadcastable ones).

    Args:
        mode: ``"duo-causal"`` or ``"same-depth"``.
        m: the query's depth (1-based).
        t, s: query and key positions (sequence indices); j: the key's depth (1-based, ``<= m``).
        last_s: the key token's last executed depth up to ``m`` (``min(m, d*_s)``; ``j <= last_s`` iff
            ``s`` executed ``j``).
        seg_t, seg_s: packed-sequence ids of query and key (``segment_ids``; equal everywhere when the
            row holds one sequence).
        valid_s: the key is a real token (not padding).
    """
    ok = (s <= t) & (seg_s == seg_t) & (valid_s | (s == t))  # a padding query sees itself: no empty row
    if mode == "duo-causal":
        # key (s, j) visible iff s executed j, or it is the query's own position (the lookahead row)
        return ok & ((j <= last_s) | (s == t))
    if mode == "same-depth":
        # each earlier token once, at its last executed depth; the query itself at depth m only
        return ok & torch.where(s == t, j == m, j == last_s)
    raise ValueError(f"unknown attention mode {mode!r}; allowed: 'duo-causal', 'same-depth'")


def segment_ids(position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """Packed-sequence id of every position ``[B, T]`` (long), or None when no row holds two sequences.

    A position id of 0 on a real token after a row's first real token starts a new sequence (TRL's
    ``packing=True``, padding-free batches), as in ``base_visibility``; padding is left out (its keys are
    invisible anyway), so the default position ids of a left-padded batch (0 on every padding token) are
    not a packing.

    Args:
        position_ids: ``[B, T]``.
        valid: ``[B, T]`` bool, False for padding.
    """
    B, T = valid.shape
    starts = (position_ids.expand(B, T) == 0) & valid
    first = valid.long().argmax(-1, keepdim=True)  # each row's first real token
    later = torch.arange(T, device=valid.device)[None] > first
    if T < 2 or not bool((starts & later).any()):
        return None
    return (starts & later).long().cumsum(-1)


def to_additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Tq, K]`` bool -> ``[B, 1, Tq, K]`` additive float mask (0 or the dtype's minimum).

    The minimum (not -inf) keeps a row finite even if it had no visible key (the patterns built here have
    none: a padding query sees itself).
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
            previous one (``segment_ids``).

    This is also the plain causal mask of the prelude and the coda. A padding query sees itself only (no
    row is empty: the module docstring).
    """
    pos = torch.arange(T, device=device)
    vis = (pos[None, :] <= pos[:, None])[None].expand(B, T, T)
    valid = torch.ones(B, T, dtype=torch.bool, device=device) if key_padding is None else key_padding.bool()
    if key_padding is not None:
        vis = vis & (valid[:, None, :] | (pos[None, :] == pos[:, None])[None])
    seg = segment_ids(position_ids, valid) if position_ids is not None else None
    if seg is not None:
        vis = vis & (seg[:, :, None] == seg[:, None, :])
    return vis
