"""A base decoder layer run on a flat batch of rows whose keys live in paged K/V pools.

The serving engine runs one layer call over rows of many sequences at once: each row is one token
(of any sequence, at any depth), and each row attends to its own list of keys. The layer's own
``forward`` takes a ``[B, T, H]`` batch with one mask, which would pad every row to the longest
group; so the engine calls the layer's *submodules* itself — the same modules, the same weights:

    h   = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(norm(x))), v_proj(norm(x))))
    out = h + mlp(post_attention_layernorm(h))

Everything that differs between families lives in ``LAYER_OPS`` (one entry per family, STYLE.md
habit 6): Qwen3 normalizes each head's query and key (``q_norm``/``k_norm``) before the rotary
embedding, Llama does not. ``tests/serving/test_serving_engine.py`` checks ``LayerRunner`` against the
layer's own ``forward`` for both families, and ``attend`` against a per-row softmax for every unit layout.

The projections run through ``linear`` (``LayerRunner.linear``), which on CPU computes a linear of
16 to 63 rows as ``W @ x.T`` instead of ``F.linear`` (see ``SMALL_GEMM_ROWS``): the same weight, the
same product, a different GEMM layout that is two to three times faster on 2 threads of MKL there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rope

#: CPU float32: a linear of ``lo <= rows < hi`` rows is computed as ``(W @ x.T).T`` instead of
#: ``F.linear(x, W)`` (``x @ W.T``). MKL (torch 2.13, 2 threads, AVX-512) takes a slow path for the
#: latter at these row counts: time of ``W @ x.T`` over ``F.linear``, median of 3 × 30 calls, weights
#: out × in (SmolLM2-135M's, the serving benchmark's LM head, Qwen3-1.7B's):
#:
#: ============  =====  =====  =====  =====  =====  =====  =====  =====
#: rows              8     12     16     24     32     48     64     96
#: ============  =====  =====  =====  =====  =====  =====  =====  =====
#: 576 × 576      0.40   0.38   0.37   0.44   0.41   0.45   1.29   1.04
#: 1536 × 576     1.21   0.91   0.34   0.42   0.38   0.46   1.17   1.01
#: 576 × 1536     1.33   1.00   0.34   0.42   0.40   0.42   1.24   1.19
#: 32000 × 512    0.66   0.50   0.47   0.51   0.51   0.48   1.01   0.95
#: 6144 × 2048    0.81   0.58   0.82   0.99   0.85   0.82   1.13   0.97
#: ============  =====  =====  =====  =====  =====  =====  =====  =====
#:
#: From 16 to 48 rows every shape gains and the results are bitwise equal; below 16 the gain depends
#: on the shape, from 64 on there is none. A decoding batch of 16-63 rows per step is the common case
#: of the engine (``benchmarks/serve.py`` at batch 32), so this is where it pays.
SMALL_GEMM_ROWS = (16, 64)


def linear(mod: nn.Module, x: torch.Tensor, small_gemm: bool = True) -> torch.Tensor:
    """``mod(x)`` for a linear module ``mod`` and rows ``x`` ``[N, in]``; for a plain float32
    ``nn.Linear`` on CPU with ``N`` in ``SMALL_GEMM_ROWS``, computed as ``(W @ x.T).T (+ b)``.

    Anything else (adapters, quantized or other subclasses, other dtypes and devices) calls the module."""
    lo, hi = SMALL_GEMM_ROWS
    if (
        small_gemm
        and type(mod) is nn.Linear
        and x.dim() == 2
        and lo <= x.shape[0] < hi
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and mod.weight.dtype == torch.float32
    ):
        y = torch.mm(mod.weight, x.t()).t()
        return y if mod.bias is None else y + mod.bias
    return mod(x)


# MLP classes whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
_GATED_MLP_FORWARDS = (LlamaMLP.forward, Qwen3MLP.forward)


@dataclass(frozen=True)
class LayerOps:
    """What a family's decoder layer does around the shared structure.

    Attributes:
        qk_norm: per-head RMSNorm of queries and keys before RoPE (``self_attn.q_norm`` / ``k_norm``).
        rope: the family's ``apply_rotary_pos_emb``.
    """

    qk_norm: bool
    rope: Callable


LAYER_OPS: dict[str, LayerOps] = {
    "llama": LayerOps(qk_norm=False, rope=llama_rope),
    "qwen3": LayerOps(qk_norm=True, rope=qwen3_rope),
}


def layer_ops_for(model) -> LayerOps:
    """The ``LayerOps`` of a looped model's family (``model.family.name``)."""
    name = model.family.name
    if name not in LAYER_OPS:
        raise ValueError(f"the serving engine has no layer ops for family {name!r}; supported: {', '.join(LAYER_OPS)}")
    return LAYER_OPS[name]


@dataclass
class KeyList:
    """The keys one attention call reads, per query *unit* (a group of rows sharing a key list).

    Attributes:
        idx: ``[U, L]`` physical slots in the layer's pool (padding: any valid slot, masked).
        valid: ``[U, L]`` bool, the key is visible to the unit.
        kpos: ``[U, L]`` sequence position of each key (for causality inside a multi-row unit).
        unit_rows: per unit, ``(start, count)`` in the call's row order; rows of a unit are
            contiguous, in position order.
        qpos: ``[N]`` position of each row (used by multi-row units).
        single: every unit has one row (the decode case: one batched attention, no causal mask).
    """

    idx: torch.Tensor
    valid: torch.Tensor
    kpos: torch.Tensor
    unit_rows: list[tuple[int, int]]
    qpos: torch.Tensor
    single: bool
    _plan: list | None = field(default=None, repr=False, compare=False)

    def plan(self) -> list[_Part]:
        """The attention calls over these keys (built once, shared by every layer of the call)."""
        if self._plan is None:
            self._plan = _build_plan(self)
        return self._plan


@dataclass
class _Part:
    """One ``scaled_dot_product_attention`` call of a plan: query rows, the keys they read, their mask.

    Attributes:
        flat: ``[Up * Lp]`` pool slots to gather (``Up`` units of ``Lp`` keys, trimmed to the last visible one).
        Up, Lp: the gathered keys' shape.
        mask: ``[Up, 1, Tq, Lp]`` bool attention mask.
        q_rows: rows of the queries: ``[Up]`` (one query per unit, ``Tq = 1``) or ``[Up, Tq]`` (padded).
        out_rows: ``[n]`` rows written; ``out_sel``: ``[Up, Tq]`` bool, the real queries (``None``: all).
        rows: ``(start, n)`` when the part is one unit of contiguous rows (no gather of queries).
    """

    flat: torch.Tensor
    Up: int
    Lp: int
    mask: torch.Tensor
    q_rows: torch.Tensor | None = None
    out_rows: torch.Tensor | None = None
    out_sel: torch.Tensor | None = None
    rows: tuple[int, int] | None = None


def _trim(valid: torch.Tensor) -> int:
    """Columns up to the last visible key of any unit (at least 1): masked columns past it cost only time."""
    cols = valid.any(0).nonzero()
    return int(cols.max()) + 1 if cols.numel() else 1


#: Attention calls of one-row units are split by key count (``_buckets``) when the padded key slots saved
#: exceed this many per extra call: on CPU one call's fixed cost (two gathers, an SDPA launch, a scatter;
#: ~120 µs on 2 threads, more with ``OMP_WAIT_POLICY=PASSIVE``) is the work of ~200-250 key slots of
#: 8 heads × 64 while the gathered keys stay in cache (0.5-0.6 µs a slot). So short decodes (batch 8-32,
#: keys 9-24 apart) keep one call, and long, spread contexts are split. At most ``MAX_ONE_ROW_CALLS``.
CALL_COST_SLOTS, MAX_ONE_ROW_CALLS = 256, 4


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Split units with ``lengths[u]`` keys each into at most ``MAX_ONE_ROW_CALLS`` groups, each padded to
    its longest: greedy, each split the one that saves the most padded slots, while it saves more than
    ``CALL_COST_SLOTS``. Returns the groups' units, in ascending length."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if len(lengths) * lengths[order[-1]] - sum(lengths) <= CALL_COST_SLOTS:
        return [order]  # no split can save more than all the padding: one call (the common decode step)
    segs = [(0, len(order))]  # [start, end) in ``order``
    while len(segs) < MAX_ONE_ROW_CALLS:
        best = None  # (saving, segment index, split)
        for si, (a, b) in enumerate(segs):
            whole = (b - a) * lengths[order[b - 1]]
            for k in range(a + 1, b):
                if lengths[order[k - 1]] == lengths[order[k]]:
                    continue  # split only between different lengths
                saving = whole - (k - a) * lengths[order[k - 1]] - (b - k) * lengths[order[b - 1]]
                if best is None or saving > best[0]:
                    best = (saving, si, k)
        if best is None or best[0] <= CALL_COST_SLOTS:
            break
        _, si, k = best
        a, b = segs[si]
        segs[si : si + 1] = [(a, k), (k, b)]
    return [order[a:b] for a, b in segs]


def _one_row_parts(keys: KeyList, units: list[int] | None) -> list[_Part]:
    """The calls of one-row units (all of them when ``units`` is None: the ``single`` layout), bucketed by
    their number of keys (``_buckets``): one call when the lengths are close."""
    idx, valid, dev = keys.idx, keys.valid, keys.idx.device
    v = valid if units is None else valid[torch.tensor(units, device=dev)]
    cols = torch.arange(1, v.shape[1] + 1, device=dev)
    lengths = (v * cols).amax(1).clamp_min(1).tolist()  # per unit: columns up to its last visible key
    groups = _buckets(lengths)
    if len(groups) == 1 and units is None:  # every row, one call, no gather of queries
        Lp = max(lengths)
        return [_Part(idx[:, :Lp].reshape(-1), idx.shape[0], Lp, valid[:, None, None, :Lp])]
    parts = []
    for grp in groups:
        Lp = lengths[grp[-1]]
        ui = [u if units is None else units[u] for u in grp]
        ut = torch.tensor(ui, device=dev)
        ri = torch.tensor([keys.unit_rows[u][0] for u in ui], device=dev)
        parts.append(
            _Part(idx[ut, :Lp].reshape(-1), len(ui), Lp, valid[ut][:, None, None, :Lp], q_rows=ri, out_rows=ri)
        )
    return parts


def _build_plan(keys: KeyList) -> list[_Part]:
    """Split the units into attention calls: the one-row units in one call, or a few by number of keys
    (``_one_row_parts``); multi-row units (prompts) padded to the longest in one call when that wastes at
    most half the queries, else one call each."""
    idx, valid, dev = keys.idx, keys.valid, keys.idx.device
    N = keys.qpos.shape[0]
    if keys.single:
        return _one_row_parts(keys, None)
    parts = []
    ones = [u for u, (_, n) in enumerate(keys.unit_rows) if n == 1]
    if ones:  # the one-row units (decoding tokens)
        parts.extend(_one_row_parts(keys, ones))
    multi = [u for u, (_, n) in enumerate(keys.unit_rows) if n > 1]
    if not multi:
        return parts
    tmax = max(keys.unit_rows[u][1] for u in multi)
    if len(multi) * tmax <= 2 * sum(keys.unit_rows[u][1] for u in multi):
        # prompts of similar lengths: one call, queries padded to the longest (padding rows masked out)
        ui = torch.tensor(multi, device=dev)
        vm = valid[ui]
        Lp = _trim(vm)
        t = torch.arange(tmax, device=dev)
        starts = torch.tensor([keys.unit_rows[u][0] for u in multi], device=dev)
        ns = torch.tensor([keys.unit_rows[u][1] for u in multi], device=dev)
        real = t[None, :] < ns[:, None]  # [U2, tmax]
        ri = (starts[:, None] + t[None, :]).clamp_max(N - 1)  # row of each (unit, query slot)
        qpos = keys.qpos[ri]
        mask = vm[:, None, :Lp] & (keys.kpos[ui][:, None, :Lp] <= qpos[:, :, None])  # [U2, tmax, Lp]
        mask = mask | ~real[:, :, None]  # padded queries see everything (their output is dropped)
        parts.append(
            _Part(idx[ui, :Lp].reshape(-1), len(multi), Lp, mask[:, None], q_rows=ri, out_rows=ri[real], out_sel=real)
        )
        return parts
    for u in multi:  # prompts of very different lengths: one call each, causal inside
        start, n = keys.unit_rows[u]
        Lp = _trim(valid[u : u + 1])
        qp = keys.qpos[start : start + n]
        mask = valid[u][None, :Lp] & (keys.kpos[u][None, :Lp] <= qp[:, None])  # [n, Lp]
        parts.append(_Part(idx[u, :Lp], 1, Lp, mask[None, None], rows=(start, n)))
    return parts


class LayerRunner:
    """Runs base decoder layers over flat rows ``[N, H]`` with paged K/V.

    Args:
        ops: the family's ``LayerOps``.
        small_gemm: compute linears of ``SMALL_GEMM_ROWS`` rows as ``W @ x.T`` on CPU (``linear``);
            False calls every module as it is.
    """

    def __init__(self, ops: LayerOps, small_gemm: bool = True):
        self.ops = ops
        self.small_gemm = small_gemm

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)``, through ``linear`` (see ``SMALL_GEMM_ROWS``)."""
        return linear(mod, x, self.small_gemm)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on rows ``x``. Llama's and Qwen3's gated MLP (``down(act(gate(x)) * up(x))``,
        their ``forward`` unchanged) has its projections run through ``linear``; any other is called."""
        if type(mlp).forward not in _GATED_MLP_FORWARDS:
            return mlp(x)
        lin = self.linear
        return lin(mlp.down_proj, mlp.act_fn(lin(mlp.gate_proj, x)) * lin(mlp.up_proj, x))

    def qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[N, H]`` (the layer's input, before ``input_layernorm``), ``cos``/``sin`` ``[N, hd]``
        -> ``q`` ``[N, Hq, hd]``, ``k``/``v`` ``[N, KVH, hd]`` (RoPE applied)."""
        a = layer.self_attn
        hd = a.head_dim
        hn = layer.input_layernorm(x)
        N = hn.shape[0]
        q = self.linear(a.q_proj, hn).reshape(N, -1, hd)
        k = self.linear(a.k_proj, hn).reshape(N, -1, hd)
        v = self.linear(a.v_proj, hn).reshape(N, -1, hd)
        if self.ops.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        # [N, heads, hd] is the [b, h, s, d] layout with s folded into b: cos/sin [N, hd] unsqueeze at 1
        q, k = self.ops.rope(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def attend(self, layer, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, keys: KeyList) -> torch.Tensor:
        """Attention of rows ``q`` ``[N, Hq, hd]`` over the pooled keys -> ``[N, Hq * hd]``.

        The calls, their gathered slots and masks are planned once per ``KeyList`` (``KeyList.plan``) and
        reused by every layer; per layer only the keys are gathered and attended."""
        a = layer.self_attn
        N, Hq, hd = q.shape
        kvh, vd = k_pool.shape[1], v_pool.shape[-1]
        gqa = kvh != Hq
        plan = keys.plan()
        out = None
        for part in plan:
            K = k_pool.index_select(0, part.flat).view(part.Up, part.Lp, kvh, hd).transpose(1, 2)
            V = v_pool.index_select(0, part.flat).view(part.Up, part.Lp, kvh, vd).transpose(1, 2)
            if part.rows is not None:  # one unit of contiguous rows
                start, n = part.rows
                qp = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, hd]
            elif part.q_rows is None:  # every row, one query each
                qp = q[:, :, None, :]
            elif part.q_rows.dim() == 1:  # some rows, one query each
                qp = q[part.q_rows][:, :, None, :]
            else:  # padded multi-row units
                qp = q[part.q_rows].transpose(1, 2)  # [U2, Hq, tmax, hd]
            o = F.scaled_dot_product_attention(qp, K, V, attn_mask=part.mask, scale=a.scaling, enable_gqa=gqa)
            if len(plan) == 1 and part.q_rows is None and part.rows is None:
                return o.reshape(N, Hq * hd)
            if out is None:
                out = q.new_empty(N, Hq, hd)
            if part.rows is not None:
                start, n = part.rows
                out[start : start + n] = o[0].transpose(0, 1)
            elif part.out_sel is None:
                out[part.out_rows] = o[:, :, 0]
            else:
                out[part.out_rows] = o.transpose(1, 2)[part.out_sel]
        return out.reshape(N, Hq * hd)

    def finish(self, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP: ``x`` ``[N, H]``, ``attn`` ``[N, Hq * hd]`` -> ``[N, H]``."""
        h = x + self.linear(layer.self_attn.o_proj, attn)
        return h + self.mlp(layer.mlp, layer.post_attention_layernorm(h))

    def run(self, layer, x, cos, sin, k_pool, v_pool, write_slots: torch.Tensor, keys: KeyList) -> torch.Tensor:
        """One layer over rows ``x`` ``[N, H]``: write their K/V at ``write_slots`` ``[N]`` of the layer's
        pools (``[slots, KVH, hd]``), then attend over ``keys`` (which may include the rows' own)."""
        q, k, v = self.qkv(layer, x, cos, sin)
        k_pool.index_copy_(0, write_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write_slots, v.to(v_pool.dtype))
        return self.finish(layer, x, self.attend(layer, q, k_pool, v_pool, keys))
