"""Which tokens of a step run a depth (docs/looped-model.md): ``Pack`` gathers the running tokens into a
packed sub-batch (the cached step and the adaptive full-sequence forward), ``AllTokens`` runs every token
(static shapes, dense masks). The depth loop (``retrofit.model.loop``) and its KV backends
(``retrofit.model.backends``) share them.
"""

from __future__ import annotations

from functools import cached_property

import torch


class Pack:
    """Which tokens of a step run a depth, and where they sit in the packed sub-batch.

    The active tokens of row ``b`` are packed to the left of packed row ``r`` (``rows[r] = b``), in
    sequence order; rows without active tokens are dropped. With one token per row (decoding) this
    is a row selection. Index tensors are built on first use.

    Attributes:
        flat: ``[N]`` flat indices ``b * Tn + t`` of the active tokens.
        src_b, src_t: ``[N]`` their row and in-step position.
        dst_r, dst_i: ``[N]`` their packed row and packed position.
        rows: ``[B']`` rows present, or None when all ``B`` rows are present in order.
        n_max: packed length; full: every token of every row is active (no gather needed).
    """

    def __init__(self, act: torch.Tensor):
        self.act = act
        self.B, self.Tn = act.shape
        self.full = bool(act.all())
        if self.full:
            self.N, self.n_rows, self.n_max, self.rows = self.B * self.Tn, self.B, self.Tn, None
            return
        self.N = int(self.flat.numel())
        rows = self.present.nonzero().squeeze(1)
        self.n_rows = int(rows.numel())
        self.rows = None if self.n_rows == self.B else rows
        self.n_max = int(self.counts.max()) if self.N else 0

    @cached_property
    def counts(self) -> torch.Tensor:
        return self.act.sum(1)  # [B]

    @cached_property
    def present(self) -> torch.Tensor:
        return self.counts > 0

    @cached_property
    def flat(self) -> torch.Tensor:
        if self.full:
            return torch.arange(self.N, device=self.act.device)
        return self.act.reshape(-1).nonzero().squeeze(1)

    @cached_property
    def src_b(self) -> torch.Tensor:
        return self.flat // self.Tn

    @cached_property
    def src_t(self) -> torch.Tensor:
        return self.flat % self.Tn

    @cached_property
    def rank(self) -> torch.Tensor:
        """Position of each active token among its row's active tokens."""
        if self.full:
            return self.src_t
        return (self.act.long().cumsum(1) - 1).reshape(-1)[self.flat]

    @cached_property
    def dst_r(self) -> torch.Tensor:
        if self.full:
            return self.src_b
        return (torch.cumsum(self.present.long(), 0) - 1)[self.src_b]

    @property
    def dst_i(self) -> torch.Tensor:
        return self.rank

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Tn, ...]`` -> packed ``[B', n_max, ...]`` (unused slots are zeros)."""
        if self.full:
            return x
        flat = x.reshape(self.B * self.Tn, *x.shape[2:])[self.flat]
        if self.Tn == 1:
            return flat.unsqueeze(1)
        out = x.new_zeros(self.n_rows, self.n_max, *x.shape[2:])
        out[self.dst_r, self.dst_i] = flat
        return out

    def take(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed ``[B', n_max, ...]`` -> ``[N, ...]`` values of the active tokens (order of ``flat``)."""
        if self.full or self.Tn == 1:
            return packed.reshape(self.N, *packed.shape[2:])
        return packed[self.dst_r, self.dst_i]

    # -- the loop's view: a Run -------------------------------------------------------------------
    @property
    def idx(self) -> torch.Tensor:
        return self.flat

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Tn, ...]`` -> ``[N, ...]``: the running tokens' values."""
        flat = x.reshape(self.B * self.Tn, *x.shape[2:])
        return flat if self.full else flat[self.flat]

    def update(self, x: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, Tn, ...]`` with the running tokens' entries replaced by ``vals`` ``[N, ...]``."""
        if self.full:
            return vals.view_as(x)
        return x.reshape(self.B * self.Tn, *x.shape[2:]).index_copy(0, self.flat, vals).view_as(x)

    def expand(self, vals: torch.Tensor, fill) -> torch.Tensor:
        """``[N]`` per running token -> ``[B, Tn]``, ``fill`` elsewhere."""
        if self.full:
            return vals.view(self.B, self.Tn)
        out = torch.full((self.B * self.Tn,), fill, dtype=vals.dtype, device=vals.device)
        return out.index_copy(0, self.flat, vals).view(self.B, self.Tn)


class AllTokens:
    """Every token computes the depth (the full-sequence forward: static shapes, dense masks); only
    the ``active`` ones change their state (passthrough), the others are the lookahead or discarded."""

    def __init__(self, active: torch.Tensor):
        self.act = active
        self.B, self.Tn = active.shape
        self.N = self.B * self.Tn
        self.idx = None  # all tokens, in order

    def gather(self, x):
        return x

    def take(self, packed):
        return packed.reshape(self.N, *packed.shape[2:])

    def select(self, x):
        return x.reshape(self.N, *x.shape[2:])

    def update(self, x, vals):
        return torch.where(self.act[..., None], vals.view_as(x), x)

    def expand(self, vals, fill):
        return vals.view(self.B, self.Tn)
