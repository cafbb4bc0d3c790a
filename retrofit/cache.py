"""Depth-aware KV cache for incremental decoding of a looped model (METHODS.md §2).

A looped model runs its prelude and coda once per token but its core ``d*_t`` times, a different
number for every token. ``DepthKVCache`` stores:

- **core**: K/V per (core layer, depth) *only* for the (token, depth) pairs that were executed.
  Storage is compact: depth ``j`` has its own region (``cap_j`` slots) of the per-layer buffers
  ``[B, KVH, Σ_j cap_j, hd]``, whose slots hold, in arrival order, the tokens of that row that ran
  depth ``j``; each slot carries its
  sequence index ``seq`` and whether ``j`` is the token's ``last`` (exit) depth
  (``DepthKVCache.core.entries(layer, j, row)``). A row holds exactly ``Σ_t d*_t`` slots, so memory
  scales with executed work (``nbytes``), not with ``S · D``.
- **prelude / coda**: ordinary per-layer K/V, ``[B, KVH, S, hd]`` (every position runs them once).
- **coda readouts** (only for runs that read out every depth — TaH2's decider and mixture, or the KL
  exit — on a model with a coda): the reference forward's depth-``j`` readout runs the coda over every
  token's (passthrough) state at depth ``j``, so its coda K/V are kept per depth for every position.

Reads follow the attention mode of the core (``retrofit.attention``): a query token ``t`` at depth ``m``
sees, for each earlier (or same) position ``s``,

- **duo-causal**: every stored slot of ``s`` at depths ``j ≤ m`` (i.e. all executed depths
  ``j ≤ min(m, d*_s)``; the query's own earlier depths included);
- **same-depth**: the slot of ``s`` at depth ``min(m, d*_s)``: its depth-``m`` slot, or a slot of a depth
  ``< m`` marked ``last`` (``s`` exited there). The query's own earlier depths are not ``last``,
  hence invisible.

The decode backend (``retrofit.backends.CachedStep``) drives the cache: per step it calls
``begin_step``, for each depth ``core.begin_depth`` (slot planning + mask), hands the sub-stores to
the base decoder layers as their ``cache`` argument (they call ``update`` like on any transformers
cache), marks exits with ``core.mark_last``, and closes with ``end_step``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


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
            t.shape[0] * t.shape[1] * length * t.shape[3] * t.element_size() for t in (*self.k, *self.v) if t is not None
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
            pack: the active tokens (``retrofit.loop.Pack``).
            seq0: sequence index of the step's first token.
            dtype: mask dtype.

        Returns:
            ``[B', 1, n_max, span]`` additive mask over the span of regions read, or None when a
            single-token step sees every slot of the span.
        """
        st = self.slots(d)
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


class DepthKVCache(Cache):
    """A transformers ``Cache`` for looped models with per-token depth (see the module docstring).

    Create one from the looped model's config (``generate`` does it for you); pass it as ``cache=`` to
    ``LoopedForCausalLM.forward`` to decode incrementally.

    Args:
        config: a looped config (``LoopedLlamaConfig`` / ``LoopedQwen3Config``).

    Attributes:
        length: positions stored (padding included), ``S``.
        token_depths: ``[B, S]`` exit depth of every stored position (0 = padding).
        key_valid: ``[B, S]`` bool, False for padding.
        positions: ``[B, S]`` position ids.
    """

    def __init__(self, config):
        super().__init__(layers=[])
        self._config = config
        loop = config.loop_config
        pre, core, coda = loop.layer_ranges(config.num_hidden_layers)
        self.max_depth = loop.max_depth
        self.attention = loop.attention
        self.num_layers = config.num_hidden_layers
        self.prelude = DenseKV(pre)
        self.core = TaggedKV(core, loop.attention, loop.max_depth)
        self.coda = DenseKV(coda)  # coda on exit states (one pass per token)
        self._coda_ids = list(coda)
        self.coda_readout: dict[int, DenseKV] = {}  # depth -> coda K/V of that depth's readout
        self.readout_mode: bool | None = None
        self.length = 0
        self.batch: int | None = None
        self.cap = 0
        self._depths = self._valid = self._pos = None
        self.n_valid = None  # [B] real tokens so far (next position id)

    @property
    def token_depths(self) -> torch.Tensor | None:
        """``[B, S]`` exit depth of every stored position (0 = padding)."""
        return None if self._depths is None else self._depths[:, : self.length]

    @property
    def key_valid(self) -> torch.Tensor | None:
        """``[B, S]`` bool, False for padding."""
        return None if self._valid is None else self._valid[:, : self.length]

    @property
    def positions(self) -> torch.Tensor | None:
        """``[B, S]`` position ids."""
        return None if self._pos is None else self._pos[:, : self.length]

    # -- structure expected by generate ---------------------------------------------------------
    def __len__(self):
        return self.num_layers

    def __repr__(self):
        return (
            f"DepthKVCache(batch={self.batch}, length={self.length}, max_depth={self.max_depth}, "
            f"attention={self.attention!r}, core_pairs={0 if self.core.count is None else int(self.core.count.sum())})"
        )

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.batch is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.batch is None else self.batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise RuntimeError(
            "DepthKVCache is written by LoopedForCausalLM's decode path (retrofit.backends.CachedStep); "
            "it cannot serve as the cache of a plain transformers model"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DepthKVCache cannot be cropped (assisted/speculative decoding is not supported)")

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self, new_valid: torch.Tensor, position_ids: torch.Tensor, readout: bool) -> int:
        """Open a step of ``Tn`` new positions; returns their first sequence index ``S0``.

        Args:
            new_valid: ``[B, Tn]`` bool, False for padding.
            position_ids: ``[B, Tn]``.
            readout: the step reads out every depth (needs per-depth coda K/V when there is a coda).
        """
        B, Tn = new_valid.shape
        dev = new_valid.device
        if self.batch is None:
            self.batch = B
            self.core.init_rows(B, dev)
            self._depths = torch.zeros(B, 0, dtype=torch.long, device=dev)
            self._valid = torch.zeros(B, 0, dtype=torch.bool, device=dev)
            self._pos = torch.zeros(B, 0, dtype=torch.long, device=dev)
            self.n_valid = torch.zeros(B, dtype=torch.long, device=dev)
        elif B != self.batch:
            raise ValueError(f"this cache holds {self.batch} rows but the input has {B}; use batch_select_indices / "
                             "batch_repeat_interleave to change the batch")
        if self._coda_ids:
            if self.readout_mode is None:
                self.readout_mode = readout
            elif readout and not self.readout_mode:
                raise ValueError(
                    "this cache was filled without per-depth readouts; an exit policy that reads out every depth "
                    "(TaH2's decider, 'kl') on a model with a coda needs a fresh cache"
                )
            if readout and not self.coda_readout:
                self.coda_readout = {d: DenseKV(self._coda_ids) for d in range(1, self.max_depth + 1)}
        S0 = self.length
        S1 = S0 + Tn
        if S1 > self.cap:
            self.cap = _new_cap(S1, self.cap)
            self._depths = _grow(self._depths, self.cap, 1, 0)
            self._valid = _grow(self._valid, self.cap, 1, False)
            self._pos = _grow(self._pos, self.cap, 1, 0)
        self._valid[:, S0:S1] = new_valid
        self._pos[:, S0:S1] = position_ids
        for store in (self.prelude, self.coda, *self.coda_readout.values()):
            store.begin(S0, S1)
        return S0

    def dense_mask(self, S0: int, Tn: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``[B, 1, Tn, S0 + Tn]`` additive mask of prelude/coda layers (causal, no padding keys);
        None when every key is visible to every query."""
        S1 = S0 + Tn
        kv = self._valid[:, :S1]
        if Tn == 1 and bool(kv.all()):
            return None
        vis = kv[:, None, :].expand(-1, Tn, -1)
        if Tn > 1:
            q = torch.arange(S0, S1, device=kv.device)
            k = torch.arange(S1, device=kv.device)
            vis = vis & (k[None, :] <= q[:, None])[None]
        mask = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
        mask.masked_fill_(~vis, torch.finfo(dtype).min)
        return mask[:, None]

    def end_step(self, depths: torch.Tensor) -> None:
        """Close the step: record the new positions' exit depths ``[B, Tn]`` (0 for padding)."""
        Tn = depths.shape[1]
        S0 = self.length
        self._depths[:, S0 : S0 + Tn] = depths
        self.n_valid += self._valid[:, S0 : S0 + Tn].sum(1)
        self.length = S0 + Tn

    def next_position_ids(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Default position ids ``[B, Tn]``: real tokens count on from the row's last position."""
        base = self.n_valid if self.n_valid is not None else torch.zeros(new_valid.shape[0], dtype=torch.long, device=new_valid.device)
        return (base[:, None] + new_valid.long().cumsum(1) - 1).clamp_min(0)

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self, part: str | None = None) -> int:
        """Bytes of K/V held for stored entries.

        Args:
            part: ``"core"`` (executed (token, depth) pairs × bytes per pair), ``"prelude"``, ``"coda"``,
                ``"coda_readout"``, or None for the sum.
        """
        parts = {
            "core": lambda: self.core.nbytes(),
            "prelude": lambda: self.prelude.nbytes(self.length),
            "coda": lambda: self.coda.nbytes(self.length),
            "coda_readout": lambda: sum(s.nbytes(self.length) for s in self.coda_readout.values()),
        }
        if part is None:
            return sum(f() for f in parts.values())
        if part not in parts:
            raise ValueError(f"unknown part {part!r}; allowed: {', '.join(parts)} or None")
        return parts[part]()

    def allocated_nbytes(self) -> int:
        """Bytes of every buffer, growth headroom and row padding included."""
        return (
            self.core.allocated_nbytes()
            + self.prelude.allocated_nbytes()
            + self.coda.allocated_nbytes()
            + sum(s.allocated_nbytes() for s in self.coda_readout.values())
        )

    def executed_pairs(self) -> int:
        """Number of (token, depth) pairs stored in the core."""
        return 0 if self.core.count is None else int(self.core.count.sum())

    # -- batch manipulation (num_return_sequences, beam search) ---------------------------------
    def _map_rows(self, fn) -> None:
        if self.batch is None:
            return
        for store in (self.prelude, self.core, self.coda, *self.coda_readout.values()):
            store.map_rows(fn)
        self._depths, self._valid, self._pos, self.n_valid = (
            fn(t) for t in (self._depths, self._valid, self._pos, self.n_valid)
        )
        self.batch = self.n_valid.shape[0]
        self.core.B = self.batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        """Drop everything stored (the cache becomes as new)."""
        self.__init__(self._config)
