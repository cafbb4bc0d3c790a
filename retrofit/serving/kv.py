"""Paged K/V storage of the serving engine: fixed-size blocks per layer group, from a memory budget.

Keys and values live in one pool per *layer group* (prelude, core, coda): per layer, K and V are
``[num_blocks * block_size, KVH, hd]`` tensors; a block is ``block_size`` slots (``core_block_size``
in the core pool) in every layer of its group. A sequence owns *streams* of entries, each a list of
blocks (a block table):

- ``pre`` (prelude layers) and ``coda`` (coda layers, the exit state): one entry per position;
- ``core`` (core layers): **one stream per sequence** holding every depth's entries, one per
  *executed* (token, depth) pair, in arrival order, each tagged with its depth, its position and whether
  that depth is the token's exit depth (``last``). A token that exits at ``d*`` writes ``d*`` entries,
  and only the stream's last block is partly filled, so a sequence's core blocks are
  ``⌈entries / core_block_size⌉``: allocated bytes follow the executed pairs. (One stream per depth
  would leave ``D`` partly filled blocks per sequence, which for short requests costs as much as the
  entries themselves.) Core blocks are sized apart from the dense streams' (``core_block_size``, default
  one entry): reads gather slot by slot whatever the block size, so a finer core block costs no read
  work, only one pool ``alloc`` per entry and a block table as wide as the entries' own metadata
  (``[S, max_len · D]``); with blocks of one entry, allocated core bytes equal executed ones, while
  ``block_size``-entry blocks still waste up to a block per sequence (``benchmarks/serve.py``,
  ``kv_bytes.by_core_block_size``);
- ``ro[j]`` (coda layers; only for runs that read out every depth on a model with a coda — TaH2's
  decider, the ``kl`` exit): the reference forward's depth-``j`` readout runs the coda over every
  token's passthrough state at depth ``j`` (docs/looped-model.md; ``retrofit.model.cache``), one entry per position.

Reads (``core_keys``) follow the model's attention mode: a query at depth ``m`` and position ``t`` sees,
for each earlier (or same) position ``s``, every executed depth ``j ≤ m`` of ``s`` (duo-causal), or the
one entry of ``s`` at depth ``min(m, d*_s)`` (same-depth: depth ``m``, or a lower depth marked ``last``).
Visible keys are ordered depth-major (by depth, then arrival), the order of one stream per depth, so the
attention sums in the same order whatever the storage layout. Key lists are built once per engine step
for all rows (vectorized over sequences) and shared by every layer of the group, since all layers of a
group store the same entries.

Admission reserves each request's worst case (every position at every depth: ``⌈n · D / core_block_size⌉``
core blocks) so that a running request never runs out of blocks; blocks are *allocated* lazily, as
entries are written, and returned when the request ends (``blocks_in_use``, ``bytes_in_use``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layers import KeyList


class KVBudgetError(ValueError):
    """A request can never fit in the KV budget."""


class BlockPool:
    """K/V blocks of one layer group.

    Args:
        layer_ids: the model's layer indices in this group.
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        kv_heads, head_dim: the layers' K/V shape.
        dtype, device: of the pools.
    """

    def __init__(self, layer_ids, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        self.layer_ids = list(layer_ids)
        self.num_blocks = num_blocks
        self.block_size = block_size
        n = num_blocks * block_size
        # zeros, not empty: padded key slots are masked, but 0 × NaN garbage would still poison V
        self.k = {li: torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device) for li in self.layer_ids}
        self.v = {li: torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device) for li in self.layer_ids}
        self.free = list(range(num_blocks - 1, -1, -1))
        self.reserved = 0
        self.bytes_per_block = 2 * len(self.layer_ids) * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def in_use(self) -> int:
        return self.num_blocks - len(self.free)

    def alloc(self) -> int:
        if not self.free:  # admission reserves the worst case, so this is a bug, not a full budget
            raise RuntimeError("KV block pool exhausted despite reservation")
        return self.free.pop()

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


class StreamTable:
    """Block tables of ``n_streams`` streams for each sequence slot of one pool.

    ``blocktab [S, n_streams, MB]`` maps an entry ``k`` of stream ``(s, j)`` to its physical slot
    ``blocktab[s, j, k // bs] * bs + k % bs``; Python lists mirror it for allocation and freeing.

    Args:
        pool: the pool the blocks come from (its ``block_size`` is the tables' granularity).
        max_seqs: sequence slots.
        n_streams: streams per sequence.
        max_entries: most entries one stream can hold.
        device: of the block table.
    """

    def __init__(self, pool: BlockPool, max_seqs: int, n_streams: int, max_entries: int, device):
        self.pool = pool
        self.bs = pool.block_size
        self.n_streams = n_streams
        self.device = device
        self.blocktab = torch.zeros(
            max_seqs, n_streams, math.ceil(max_entries / self.bs) + 1, dtype=torch.long, device=device
        )
        self.blocks: list[list[list[int]]] = [[[] for _ in range(n_streams)] for _ in range(max_seqs)]

    def ensure(self, s: int, j: int, n_entries: int) -> None:
        """Allocate blocks so that entries ``0 … n_entries - 1`` of stream ``(s, j)`` have slots."""
        self.ensure_many([(s, j, n_entries)])

    def ensure_many(self, needs) -> None:
        """``ensure`` for every ``(s, j, n_entries)`` of ``needs``, with one write of the block table."""
        new_s, new_j, new_i, new_b = [], [], [], []
        for s, j, n in needs:
            bl = self.blocks[s][j]
            need = -(-n // self.bs)
            while len(bl) < need:
                b = self.pool.alloc()
                new_s.append(s)
                new_j.append(j)
                new_i.append(len(bl))
                new_b.append(b)
                bl.append(b)
        if new_b:
            idx = torch.tensor([new_s, new_j, new_i], device=self.device)
            self.blocktab[idx[0], idx[1], idx[2]] = torch.tensor(new_b, device=self.device)

    def slots(self, s: torch.Tensor, j, k: torch.Tensor) -> torch.Tensor:
        """Physical slots of entries ``k`` of streams ``(s, j)`` (broadcasting long tensors; ``j`` may be an int)."""
        return self.blocktab[s, j, k // self.bs] * self.bs + k % self.bs

    def free_seq(self, s: int) -> None:
        for j in range(self.n_streams):
            self.pool.release(self.blocks[s][j])
            self.blocks[s][j] = []

    def blocks_of(self, s: int) -> int:
        return sum(len(b) for b in self.blocks[s])


@dataclass
class Reservation:
    """Blocks reserved for one request, per pool name."""

    blocks: dict[str, int]


class PagedKV:
    """All K/V of the engine (see the module docstring).

    Args:
        model: the looped model (its layer ranges, attention mode, max depth, K/V shapes).
        budget_bytes: memory for K/V, split among the pools in proportion to a request's worst case.
        max_seqs: sequence slots (concurrent requests).
        max_len: longest sequence (prompt + generated tokens).
        block_size: token slots per block of the prelude and coda pools.
        core_block_size: entry slots per block of the core pool (default 1: one slot per executed
            (token, depth) pair, so allocated core bytes equal executed ones; see the module docstring).
        readout_coda: allocate ``ro[j]`` streams (some request may read out every depth on a model with
            a coda).

    Raises:
        ValueError: a block size below 1.
    """

    def __init__(
        self,
        model,
        budget_bytes: int,
        max_seqs: int,
        max_len: int,
        block_size: int = 16,
        readout_coda: bool = True,
        core_block_size: int = 1,
    ):
        cfg = model.config
        dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        pre, core, coda = model._ranges
        self.D = model.loop.max_depth
        self.mode = model.loop.attention
        for name, v in (("block_size", block_size), ("core_block_size", core_block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
        self.bs = block_size
        self.core_bs = core_block_size
        self.max_len = max_len
        self.device = dev
        kvh = cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.has_coda = len(coda) > 0
        self.readout_coda = readout_coda and self.has_coda
        # worst-case slots per position for each pool: prelude 1, core D, coda 1 (+ D readout streams)
        coda_streams = 1 + (self.D if self.readout_coda else 0)
        per_pos = {"pre": len(pre) * 1, "core": len(core) * self.D, "coda": len(coda) * coda_streams}
        total = sum(per_pos.values())
        slot_bytes = 2 * kvh * hd * torch.finfo(dtype).bits // 8  # one slot in one layer
        self.pools: dict[str, BlockPool] = {}
        for name, ids in (("pre", pre), ("core", core), ("coda", coda)):
            if len(ids) == 0:
                continue
            bs = core_block_size if name == "core" else block_size
            share = budget_bytes * per_pos[name] / total
            nb = int(share // (slot_bytes * bs * len(ids)))
            self.pools[name] = BlockPool(ids, max(nb, 1), bs, kvh, hd, dtype, dev)
        self.pool_of_layer = {li: p for p in self.pools.values() for li in p.layer_ids}
        self.pre = StreamTable(self.pools["pre"], max_seqs, 1, max_len, dev) if "pre" in self.pools else None
        E = max_len * self.D  # most core entries of one sequence
        self.core = StreamTable(self.pools["core"], max_seqs, 1, E, dev)
        # coda streams: 0 = exit state, 1 … D = depth readouts
        self.coda = StreamTable(self.pools["coda"], max_seqs, coda_streams, max_len, dev) if self.has_coda else None
        # core entry metadata of sequence s: entry count, and each entry's depth, position and exit flag
        self.count = torch.zeros(max_seqs, dtype=torch.long, device=dev)
        self.n_entries_py = [0] * max_seqs
        self.count_py = [[0] * (self.D + 1) for _ in range(max_seqs)]  # entries per depth (index 0 unused)
        self.depth = torch.zeros(max_seqs, E, dtype=torch.int16, device=dev)
        self.pos = torch.zeros(max_seqs, E, dtype=torch.long, device=dev)
        self.last = torch.zeros(max_seqs, E, dtype=torch.bool, device=dev)

    # -- budget ---------------------------------------------------------------------------------
    def worst_case(self, n_positions: int, readout: bool) -> dict[str, int]:
        """Blocks a request of ``n_positions`` positions may need, per pool."""
        nb = -(-n_positions // self.bs)
        out = {}
        if "pre" in self.pools:
            out["pre"] = nb
        out["core"] = -(-n_positions * self.D // self.core_bs)
        if self.has_coda:
            out["coda"] = nb * (1 + (self.D if readout and self.readout_coda else 0))
        return out

    def fits_ever(self, blocks: dict[str, int]) -> bool:
        return all(n <= self.pools[p].num_blocks for p, n in blocks.items())

    def try_reserve(self, blocks: dict[str, int]) -> Reservation | None:
        if any(self.pools[p].reserved + n > self.pools[p].num_blocks for p, n in blocks.items()):
            return None
        for p, n in blocks.items():
            self.pools[p].reserved += n
        return Reservation(dict(blocks))

    def release(self, s: int, res: Reservation) -> None:
        """Free sequence slot ``s``'s blocks and its reservation."""
        for t in (self.pre, self.core, self.coda):
            if t is not None:
                t.free_seq(s)
        for p, n in res.blocks.items():
            self.pools[p].reserved -= n
        self.count[s] = 0
        self.n_entries_py[s] = 0
        self.count_py[s] = [0] * (self.D + 1)
        self.last[s].zero_()

    def blocks_in_use(self) -> int:
        return sum(p.in_use for p in self.pools.values())

    def bytes_in_use(self, pool: str | None = None) -> int:
        pools = self.pools.values() if pool is None else [self.pools[pool]]
        return sum(p.in_use * p.bytes_per_block for p in pools)

    def seq_blocks(self, s: int, pool: str) -> int:
        t = {"pre": self.pre, "core": self.core, "coda": self.coda}[pool]
        return 0 if t is None else t.blocks_of(s)

    # -- dense streams (one entry per position) -----------------------------------------------------
    def dense_write(
        self,
        table: StreamTable,
        s: torch.Tensor,
        j: torch.Tensor,
        pos: torch.Tensor,
        s_py: list[int],
        j_py: list[int],
        end_py: list[int],
    ) -> torch.Tensor:
        """Slots of the entries at positions ``pos`` ``[N]`` of streams ``(s, j)``; allocates blocks up to
        ``end_py`` (exclusive) per distinct ``(s, j)`` given in the Python lists."""
        table.ensure_many(zip(s_py, j_py, end_py))
        return table.slots(s, j, pos)

    def dense_keys(
        self,
        table: StreamTable,
        unit_s: torch.Tensor,
        unit_j: torch.Tensor,
        unit_qmax: torch.Tensor,
        lmax: int,
        unit_rows,
        qpos,
        single,
    ) -> KeyList:
        """Keys of units reading positions ``0 … qmax`` of their stream."""
        k = torch.arange(lmax, device=self.device)
        idx = table.slots(unit_s[:, None], unit_j[:, None], k[None, :])
        valid = k[None, :] <= unit_qmax[:, None]
        return KeyList(
            idx=idx, valid=valid, kpos=k[None, :].expand_as(idx), unit_rows=unit_rows, qpos=qpos, single=single
        )

    # -- core stream -------------------------------------------------------------------------------
    def core_write(
        self,
        groups: list[tuple[int, int, int]],
        s: torch.Tensor,
        d: torch.Tensor,
        rank: torch.Tensor,
        pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append entries for the rows running a depth this step.

        Args:
            groups: per unit ``(seq slot, depth, n rows)``; a sequence runs at most one depth per step.
            s, d, rank, pos: ``[N]`` per row: sequence slot, depth, rank among its unit's rows, position.

        Returns:
            ``(slots [N], entry index [N])``.
        """
        if len({si for si, _, _ in groups}) != len(groups):
            raise RuntimeError("core_write: a sequence appears in two units of one step")
        base = self.count[s]  # entries before this step
        for si, di, n in groups:
            self.count_py[si][di] += n
            self.n_entries_py[si] += n
        self.core.ensure_many((si, 0, self.n_entries_py[si]) for si, _, _ in groups)
        k = base + rank
        self.count.index_put_((s,), torch.ones_like(s), accumulate=True)
        self.depth[s, k] = d.to(self.depth.dtype)
        self.pos[s, k] = pos
        return self.core.slots(s, 0, k), k

    def mark_exit(self, s: torch.Tensor, k: torch.Tensor) -> None:
        """Core entries ``k`` of sequences ``s`` are their tokens' exit depth."""
        self.last[s, k] = True

    def core_keys(
        self, unit_s: torch.Tensor, unit_m: torch.Tensor, unit_qmax: torch.Tensor, unit_rows, qpos, single: bool
    ) -> KeyList:
        """Keys of query units (sequence ``s``, depth ``m``, rows up to position ``qmax``), after this step's
        ``core_write`` (so a row sees its own new entry); visible keys in depth-major order."""
        cnt = self.count[unit_s]  # [U]
        kc = int(cnt.max())
        k = torch.arange(kc, device=self.device)
        dep = self.depth[unit_s, :kc].long()  # [U, kc]
        valid = k[None, :] < cnt[:, None]
        m = unit_m[:, None]
        if self.mode == "duo-causal":
            valid &= dep <= m
        else:
            valid &= (dep == m) | ((dep < m) & self.last[unit_s, :kc])
        kpos = self.pos[unit_s, :kc]
        valid &= kpos <= unit_qmax[:, None]
        L = int(valid.sum(1).max())
        # visible keys to the front, by depth then arrival (stable): the order of one stream per depth
        order = torch.sort(torch.where(valid, dep, self.D + 1), dim=1, stable=True).indices[:, :L]
        slots = self.core.slots(unit_s[:, None], 0, k[None, :])  # [U, kc]
        return KeyList(
            idx=slots.gather(1, order),
            valid=valid.gather(1, order),
            kpos=kpos.gather(1, order),
            unit_rows=unit_rows,
            qpos=qpos,
            single=single,
        )
