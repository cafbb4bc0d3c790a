"""Depth-aware KV cache for incremental decoding of a looped model (docs/looped-model.md).

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

Reads follow the attention mode of the core (``retrofit.model.attention``): a query token ``t`` at depth ``m``
sees, for each earlier (or same) position ``s``,

- **duo-causal**: every stored slot of ``s`` at depths ``j ≤ m`` (i.e. all executed depths
  ``j ≤ min(m, d*_s)``; the query's own earlier depths included);
- **same-depth**: the slot of ``s`` at depth ``min(m, d*_s)``: its depth-``m`` slot, or a slot of a depth
  ``< m`` marked ``last`` (``s`` exited there). The query's own earlier depths are not ``last``,
  hence invisible.

The stores live in ``retrofit.model.kv_stores``. The decode backend (``retrofit.model.backends.CachedStep``) drives the
cache: per step it calls
``begin_step``, for each depth ``core.begin_depth`` (slot planning + mask), hands the sub-stores to
the base decoder layers as their ``cache`` argument (they call ``update`` like on any transformers
cache), marks exits with ``core.mark_last``, and closes with ``end_step``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .kv_stores import DenseKV, TaggedKV, _grow, _new_cap


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
            "DepthKVCache is written by LoopedForCausalLM's decode path (retrofit.model.backends.CachedStep); "
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
            raise ValueError(
                f"this cache holds {self.batch} rows but the input has {B}; use batch_select_indices / "
                "batch_repeat_interleave to change the batch"
            )
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
        """``[B, 1, Tn, S0 + Tn]`` additive mask of prelude/coda layers (causal, no padding keys; a padding
        query sees itself, so no row is empty: ``retrofit.model.attention``); None when every key is visible
        to every query."""
        S1 = S0 + Tn
        kv = self._valid[:, :S1]
        if Tn == 1 and bool(kv.all()):
            return None
        q = torch.arange(S0, S1, device=kv.device)
        k = torch.arange(S1, device=kv.device)
        vis = kv[:, None, :] | (k[None, :] == q[:, None])[None]  # [B, Tn, S1]
        if Tn > 1:
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
        base = (
            self.n_valid
            if self.n_valid is not None
            else torch.zeros(new_valid.shape[0], dtype=torch.long, device=new_valid.device)
        )
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
