"""A base decoder layer run on a flat batch of rows whose keys live in paged K/V pools.

The serving engine runs one layer call over rows of many sequences at once: each row is one token
(of any sequence, at any depth), and each row attends to its own list of keys. The layer's own
``forward`` takes a ``[B, T, H]`` batch with one mask, which would pad every row to the longest
group; so the engine calls the layer's *submodules* itself — the same modules, the same weights:

    h   = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(norm(x))), v_proj(norm(x))))
    out = h + mlp(post_attention_layernorm(h))

Everything that differs between families lives in ``LAYER_OPS`` (one entry per family, STYLE.md
habit 6): Qwen3 normalizes each head's query and key (``q_norm``/``k_norm``) before the rotary
embedding, Llama does not. ``tests/test_serving_engine.py`` checks ``LayerRunner`` against the
layer's own ``forward`` for both families, and ``attend`` against a per-row softmax for every unit layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rope


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


def _build_plan(keys: KeyList) -> list[_Part]:
    """Split the units into attention calls: all one-row units in one call; multi-row units (prompts) padded
    to the longest in one call when that wastes at most half the queries, else one call each."""
    idx, valid, dev = keys.idx, keys.valid, keys.idx.device
    U = idx.shape[0]
    N = keys.qpos.shape[0]
    if keys.single:
        Lp = _trim(valid)
        return [_Part(idx[:, :Lp].reshape(-1), U, Lp, valid[:, None, None, :Lp])]
    parts = []
    ones = [u for u, (_, n) in enumerate(keys.unit_rows) if n == 1]
    if ones:  # the one-row units (decoding tokens): one batched call
        ui = torch.tensor(ones, device=dev)
        v1 = valid[ui]
        Lp = _trim(v1)
        ri = torch.tensor([keys.unit_rows[u][0] for u in ones], device=dev)
        parts.append(_Part(idx[ui, :Lp].reshape(-1), len(ones), Lp, v1[:, None, None, :Lp], q_rows=ri, out_rows=ri))
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
    """

    def __init__(self, ops: LayerOps):
        self.ops = ops

    def qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[N, H]`` (the layer's input, before ``input_layernorm``), ``cos``/``sin`` ``[N, hd]``
        -> ``q`` ``[N, Hq, hd]``, ``k``/``v`` ``[N, KVH, hd]`` (RoPE applied)."""
        a = layer.self_attn
        hd = a.head_dim
        hn = layer.input_layernorm(x)
        N = hn.shape[0]
        q = a.q_proj(hn).view(N, -1, hd)
        k = a.k_proj(hn).view(N, -1, hd)
        v = a.v_proj(hn).view(N, -1, hd)
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
        h = x + layer.self_attn.o_proj(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def run(self, layer, x, cos, sin, k_pool, v_pool, write_slots: torch.Tensor, keys: KeyList) -> torch.Tensor:
        """One layer over rows ``x`` ``[N, H]``: write their K/V at ``write_slots`` ``[N]`` of the layer's
        pools (``[slots, KVH, hd]``), then attend over ``keys`` (which may include the rows' own)."""
        q, k, v = self.qkv(layer, x, cos, sin)
        k_pool.index_copy_(0, write_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write_slots, v.to(v_pool.dtype))
        return self.finish(layer, x, self.attend(layer, q, k_pool, v_pool, keys))
