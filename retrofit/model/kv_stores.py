"""The core's K/V for incremental decoding: one slot per executed (token, depth) pair (docs/looped-model.md).

``TaggedKV`` is the ``core`` store of ``retrofit.model.cache.DepthKVCache``: per core layer one buffer
split into a region per depth, each region holding, per row, the tokens that ran that depth (their
sequence index and whether it was their exit depth). ``DenseKV`` holds the prelude's and coda's K/V
(every position once). Both are handed to the base decoder layers as their ``cache`` argument.
"""

from __future__ import annotations

import torch


def _grow(t: torch.Tensor | None, cap: int, dim: int, fill=0) -> torch.Tensor | None:
    """Copy ``t`` into a larger buffer with ``cap`` entries along ``dim`` (new entries = ``fill``)."""
    if t is None or t.shape[dim] >= cap:
        return t
    shape = list(t.shape)
    shape[dim] = cap
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _new_cap(needed: int, cap: int) -> int:
    # doubling keeps appends amortized O(1); small models start at 64 slots
    return max(needed, 2 * cap, 64)


class DenseKV:
    """K/V of layers every position runs once: ``[B, KVH, cap, hd]`` per layer, positions in order.

    ``update`` is called by the base attention with the step's ``[B, KVH, Tn, hd]`` keys/values and
    returns all positions so far; the window ``[start, start + Tn)`` is set by ``begin``.
    """

    def __init__(self, layer_ids):
        self.index = {li: i for i, li in enumerate(layer_ids)}
        self.k: list[torch.Tensor | None] = [None] * len(self.index)
        self.v: list[torch.Tensor | None] = [None] * len(self.index)
        self.cap = 0
        self.start = 0
        self.stop = 0

    def begin(self, start: int, stop: int) -> None:
        if stop > self.cap:
            self.cap = _new_cap(stop, self.cap)
            self.k = [_grow(t, self.cap, 2) for t in self.k]
            self.v = [_grow(t, self.cap, 2) for t in self.v]
        self.start, self.stop = start, stop

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        i = self.index[layer_idx]
        if self.k[i] is None:
            B, KVH, _, hd = key_states.shape
            self.k[i] = key_states.new_zeros(B, KVH, self.cap, hd)
            self.v[i] = value_states.new_zeros(B, KVH, self.cap, value_states.shape[-1])
        self.k[i][:, :, self.start : self.stop] = key_states
        self.v[i][:, :, self.start : self.stop] = value_states
        return self.k[i][:, :, : self.stop], self.v[i][:, :, : self.stop]

    def nbytes(self, length: int) -> int:
        return sum(
            t.shape[0] * t.shape[1] * length * t.shape[3] * t.element_size()
            for t in (*self.k, *self.v)
            if t is not None
        )

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def map_rows(self, fn) -> None:
        self.k = [None if t is None else fn(t) for t in self.k]
        self.v = [None if t is None else fn(t) for t in self.v]


class _DepthSlots:
    """Slot metadata of one depth ``j``: row ``b`` holds ``count[b]`` pairs in arrival order;
    ``seq [B, cap]`` sequence index, ``last [B, cap]`` the token exited at ``j``. The K/V live in
    the depth's region ``[off, off + cap)`` of the per-layer buffers of ``TaggedKV``."""

    def __init__(self, B: int, device):
        self.cap = 0
        self.off = 0
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.seq = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.last = torch.zeros(B, 0, dtype=torch.bool, device=device)
        self.n_last = 0  # exits marked at this depth (an upper bound after row selection)
        self.uniform: int | None = 0  # every row holds this many pairs (None once rows differ)

    def map_rows(self, fn) -> None:
        self.count, self.seq, self.last = fn(self.count), fn(self.seq), fn(self.last)


class TaggedKV:
    """Compact K/V of the core, keyed by (core layer, depth): one slot per executed (token, depth) pair.

    Per core layer, K and V are ``[B, KVH, total, hd]`` buffers split into one region per depth,
    in depth order; region ``j`` holds, per row, the tokens that ran depth ``j`` (``_DepthSlots``).
    The slot metadata is shared by all core layers (they store the same pairs). A query at depth ``m``
    reads one contiguous span of regions:

    - duo-causal: regions ``1 … m``, every stored slot;
    - same-depth: region ``m`` plus the ``last`` slots of the regions below (tokens that exited
      there); while no token has exited below ``m`` (e.g. at a fixed depth) that is region ``m`` alone.

    The span is a view of the buffers when every row runs the depth, else one row gather. Unused
    capacity inside the span is masked.
    """

    def __init__(self, layer_ids, mode: str, max_depth: int):
        self.index = {li: i for i, li in enumerate(layer_ids)}
        self.mode = mode
        self.max_depth = max_depth
        self.k: list[torch.Tensor | None] = [None] * len(self.index)
        self.v: list[torch.Tensor | None] = [None] * len(self.index)
        self.total = 0
        self.depths: dict[int, _DepthSlots] = {}
        self.B: int | None = None
        self.device = None
        # per-depth plan, shared by the core layers of this depth
        self._d = 0
        self._slot: int | None = None  # the write slot of a uniform one-token step (``_begin_uniform``)
        self._span = (0, 0)
        self._gather_slots = self._gather = None
        self._rows = None
        self._src = None
        self._dst_b = self._dst_s = None
        self._flat_dst = None
        self._kvh: int | None = None

    def init_rows(self, B: int, device) -> None:
        self.B, self.device = B, device

    def slots(self, d: int) -> _DepthSlots:
        if d not in self.depths:
            self.depths[d] = _DepthSlots(self.B, self.device)
            self._layout({})
        return self.depths[d]

    @property
    def count(self) -> torch.Tensor | None:
        """``[B]`` pairs stored per row (all depths)."""
        if self.B is None:
            return None
        total = torch.zeros(self.B, dtype=torch.long, device=self.device)
        for st in self.depths.values():
            total = total + st.count
        return total

    def _layout(self, new_caps: dict[int, int]) -> None:
        """Set region capacities (``new_caps`` overrides) and move the buffers' content."""
        old = {j: (st.off, st.cap) for j, st in self.depths.items()}
        off = 0
        for j in sorted(self.depths):
            st = self.depths[j]
            if j in new_caps:
                st.cap = new_caps[j]
                st.seq = _grow(st.seq, st.cap, 1, 0)
                st.last = _grow(st.last, st.cap, 1, False)
            st.off = off
            off += st.cap
        total = off
        moved = any(old[j] != (self.depths[j].off, self.depths[j].cap) for j in old)
        if total != self.total or moved:
            for bufs in (self.k, self.v):
                for i, t in enumerate(bufs):
                    if t is None:
                        continue
                    new = t.new_zeros(t.shape[0], t.shape[1], total, t.shape[3])
                    for j, (o, c) in old.items():
                        st = self.depths[j]
                        new[:, :, st.off : st.off + c] = t[:, :, o : o + c]
                    bufs[i] = new
            self.total = total

    def begin_depth(self, d: int, pack, seq0: int, dtype: torch.dtype) -> torch.Tensor:
        """Reserve slots for the active tokens at depth ``d`` and build their attention mask.

        Args:
            d: depth (1-based).
            pack: the active tokens (``retrofit.model.token_sets.Pack``).
            seq0: sequence index of the step's first token.
            dtype: mask dtype.

        Returns:
            ``[B', 1, n_max, span]`` additive mask over the span of regions read, or None when a
            single-token step sees every slot of the span.
        """
        st = self.slots(d)
        read = self._uniform_read(d) if (pack.full and pack.Tn == 1) else None
        if read is not None:
            return self._begin_uniform(d, st, read, seq0, dtype)
        st.uniform = st.uniform + pack.Tn if (pack.full and st.uniform is not None) else None
        self._slot = None
        b = pack.src_b
        slots = st.count[b] + pack.rank
        st.count += pack.counts
        needed = int(st.count.max())
        if needed > st.cap:
            # grow by half: unused capacity of lower regions is read (masked) at deeper depths
            self._layout({d: max(needed, st.cap + st.cap // 2, 32)})
        st.seq[b, slots] = seq0 + pack.src_t
        st.last[b, slots] = False
        rows = pack.rows
        self._d = d
        self._dst_b, self._dst_s = b, slots
        self._flat_dst = self._flat_index(st) if self._kvh is not None else None
        # packed tokens -> rows of [B' * n_max]; None when the packed order is already the write order
        self._src = None if (pack.full or pack.Tn == 1) else pack.dst_r * pack.n_max + pack.dst_i
        self._rows = rows

        if self.mode == "duo-causal":
            read = [j for j in sorted(self.depths) if j <= d]
        else:
            below = [j for j in sorted(self.depths) if j < d and self.depths[j].n_last > 0]
            read = [j for j in sorted(self.depths) if (below and below[0] <= j < d)] + [d]
        cnt_d = st.count if rows is None else st.count[rows]
        L_d = int(cnt_d.max())
        if rows is None:
            # every row runs this depth: read a view of the contiguous span (unused capacity masked)
            widths = {j: (L_d if j == d else self.depths[j].cap) for j in read}
            self._span = (self.depths[read[0]].off, st.off + L_d)
            self._gather_slots = None
        else:
            # a subset of rows: gather exactly the used slots of each region, in one index_select
            widths = {}
            for j in read:
                sj = self.depths[j]
                widths[j] = L_d if j == d else int(sj.count[rows].max())
            self._gather_slots = torch.cat(
                [self.depths[j].off + torch.arange(widths[j], device=b.device) for j in read]
            )
        self._gather = None
        q_seq = None
        if pack.Tn > 1:
            # causality inside the step: a slot of a later token of the same step stays hidden
            q_seq = torch.full((pack.n_rows, pack.n_max), -1, dtype=torch.long, device=b.device)
            q_seq[pack.dst_r, pack.dst_i] = seq0 + pack.src_t
        pieces = []
        for j in read:
            sj = self.depths[j]
            width = widths[j]
            cnt = sj.count if rows is None else sj.count[rows]
            vis = torch.arange(width, device=b.device)[None, :] < cnt[:, None]  # [B', width]
            if self.mode == "same-depth" and j < d:
                vis = vis & (sj.last[:, :width] if rows is None else sj.last[rows, :width])
            vis = vis[:, None, :]
            if q_seq is not None:
                seq = sj.seq[:, :width] if rows is None else sj.seq[rows, :width]
                vis = vis & (seq[:, None, :] <= q_seq[:, :, None])
            pieces.append(vis.expand(-1, pack.n_max, -1))
        vis = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)
        if pack.Tn == 1 and bool(vis.all()):
            return None  # nothing to hide (e.g. a fixed depth without padding): sdpa's unmasked path
        mask = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
        mask.masked_fill_(~vis, torch.finfo(dtype).min)
        return mask[:, None]

    def _uniform_read(self, d: int) -> list[int] | None:
        """The regions a depth-``d`` query reads when each holds the same pairs in every row (the fast
        path of one-token steps at a shared depth, e.g. fixed-depth decoding); else None."""
        if self.mode == "duo-causal":
            read = [j for j in sorted(self.depths) if j <= d]
        elif any(st.n_last > 0 for j, st in self.depths.items() if j < d):
            return None  # same-depth reads of exited tokens below: per-row slots
        else:
            read = [d]
        return read if all(self.depths[j].uniform is not None for j in read) else None

    def _begin_uniform(self, d: int, st: _DepthSlots, read: list[int], seq0: int, dtype) -> torch.Tensor | None:
        """``begin_depth`` when every row runs depth ``d`` for one token and the regions read are uniform:
        the slot is the same in every row (written by slicing in ``update``), and the span needs a mask
        only over the unused capacity of lower regions."""
        c = st.uniform
        if c + 1 > st.cap:
            self._layout({d: max(c + 1, st.cap + st.cap // 2, 32)})
        st.seq[:, c] = seq0
        st.last[:, c] = False
        st.count += 1
        st.uniform = c + 1
        self._d, self._slot, self._rows = d, st.off + c, None
        self._gather_slots = self._gather = None
        lo = self.depths[read[0]].off
        self._span = (lo, st.off + c + 1)
        slack = [(sj.off + sj.uniform, sj.off + sj.cap) for sj in (self.depths[j] for j in read[:-1])]
        slack = [(a, b) for a, b in slack if a < b]
        if not slack:
            return None
        mask = torch.zeros(1, 1, 1, self._span[1] - lo, dtype=dtype, device=self.device)
        for a, b in slack:
            mask[..., a - lo : b - lo] = torch.finfo(dtype).min
        return mask

    def _flat_index(self, st: _DepthSlots) -> torch.Tensor:
        # buffers are viewed as [B * KVH * total, hd] and the step's K/V as [N * KVH, hd]: one
        # index_copy_ per tensor (advanced indexing across the head axis is slow on CPU)
        heads = torch.arange(self._kvh, device=self._dst_b.device)
        slot = st.off + self._dst_s
        return ((self._dst_b[:, None] * self._kvh + heads[None, :]) * self.total + slot[:, None]).reshape(-1)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the active tokens' K/V (``[B', KVH, n_max, hd]``) into their depth's region; return
        the span the mask of ``begin_depth`` covers."""
        i = self.index[layer_idx]
        Bp, KVH, n_max, hd = key_states.shape
        if self.k[i] is None:
            self.k[i] = key_states.new_zeros(self.B, KVH, self.total, hd)
            self.v[i] = value_states.new_zeros(self.B, KVH, self.total, value_states.shape[-1])
        if self._slot is not None:  # uniform one-token step: the same slot in every row
            (lo, hi), j = self._span, self._slot
            self.k[i][:, :, j : j + 1] = key_states
            self.v[i][:, :, j : j + 1] = value_states
            return self.k[i][:, :, lo:hi], self.v[i][:, :, lo:hi]
        if self._flat_dst is None:
            self._kvh = KVH
            self._flat_dst = self._flat_index(self.depths[self._d])
        if self._gather_slots is not None and self._gather is None:
            heads = torch.arange(KVH, device=self._rows.device)
            base = (self._rows[:, None] * KVH + heads[None, :]) * self.total  # [B', KVH]
            self._gather = (base[:, :, None] + self._gather_slots[None, None, :]).reshape(-1)
        out = []
        for buf, new in ((self.k[i], key_states), (self.v[i], value_states)):
            hd_ = new.shape[-1]
            vals = new.transpose(1, 2).reshape(Bp * n_max, KVH, hd_)
            if self._src is not None:
                vals = vals.index_select(0, self._src)
            flat = buf.view(-1, hd_)
            flat.index_copy_(0, self._flat_dst, vals.reshape(-1, hd_))
            if self._gather is None:
                lo, hi = self._span
                out.append(buf[:, :, lo:hi])
            else:
                out.append(flat.index_select(0, self._gather).view(Bp, KVH, -1, hd_))
        return out[0], out[1]

    def mark_last(self, stop: torch.Tensor) -> None:
        """Mark the slots just written at this depth whose token exited here. ``stop``: ``[N]`` bool."""
        st = self.depths[self._d]
        if self._slot is not None:
            st.last[:, self._slot - st.off] = stop
        else:
            st.last[self._dst_b[stop], self._dst_s[stop]] = True
        st.n_last += int(stop.sum())

    def entries(self, layer_idx: int, depth: int, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored pairs of ``depth`` in ``row``: ``(seq [n], K [KVH, n, hd], V [KVH, n, hd])``."""
        i = self.index[layer_idx]
        st = self.depths.get(depth)
        if st is None:
            return torch.zeros(0, dtype=torch.long), None, None
        n = int(st.count[row])
        return st.seq[row, :n], self.k[i][row][:, st.off : st.off + n], self.v[i][row][:, st.off : st.off + n]

    def exits(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq [n], depth [n])`` of the slots marked as exits in ``row``."""
        seqs, ds = [], []
        for j, st in sorted(self.depths.items()):
            n = int(st.count[row])
            m = st.last[row, :n]
            seqs.append(st.seq[row, :n][m])
            ds.append(torch.full((int(m.sum()),), j, dtype=torch.long))
        return torch.cat(seqs), torch.cat(ds)

    def pair_nbytes(self) -> int:
        """Bytes of one (token, depth) pair over all core layers (K and V)."""
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def nbytes(self) -> int:
        c = self.count
        return 0 if c is None else int(c.sum()) * self.pair_nbytes()

    def allocated_nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)
        for st in self.depths.values():
            total += sum(t.numel() * t.element_size() for t in (st.seq, st.last))
        return total

    def map_rows(self, fn) -> None:
        self.k = [None if t is None else fn(t) for t in self.k]
        self.v = [None if t is None else fn(t) for t in self.v]
        for st in self.depths.values():
            st.map_rows(fn)
