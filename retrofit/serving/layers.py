"""A base decoder layer run on a flat batch of rows whose keys live in paged K/V pools.

The serving engine runs one layer call over rows of many sequences at once: each row is one token
(of any sequence, at any depth), and each row attends to its own list of keys. The layer's own
``forward`` takes a ``[B, T, H]`` batch with one mask, which would pad every row to the longest
group; so the engine calls the layer's *submodules* itself — the same modules, the same weights:

    h   = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(norm(x))), v_proj(norm(x))))
    out = h + mlp(post_attention_layernorm(h))

Everything that differs between families lives in ``LAYER_OPS`` (one entry per family, STYLE.md
habit 6): Qwen3 normalizes each head's query and key (``q_norm``/``k_norm``) before the rotary
embedding, Llama does not. ``tests/test_serving_layers.py`` checks ``LayerRunner`` against the
layer's own ``forward`` for both families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
        """Attention of rows ``q`` ``[N, Hq, hd]`` over the pooled keys -> ``[N, Hq * hd]``."""
        a = layer.self_attn
        N, Hq, hd = q.shape
        U, L = keys.idx.shape
        kvh = k_pool.shape[1]
        K = k_pool.index_select(0, keys.idx.reshape(-1)).view(U, L, kvh, hd).transpose(1, 2)
        V = v_pool.index_select(0, keys.idx.reshape(-1)).view(U, L, kvh, v_pool.shape[-1]).transpose(1, 2)
        gqa = kvh != Hq
        if keys.single:
            mask = keys.valid[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], K, V, attn_mask=mask, scale=a.scaling, enable_gqa=gqa
            )
            return out.reshape(N, Hq * hd)
        out = q.new_empty(N, Hq, hd)
        ones = [u for u, (_, n) in enumerate(keys.unit_rows) if n == 1]
        if ones:  # the one-row units (decoding tokens): one batched call
            ui = torch.tensor(ones, device=q.device)
            ri = torch.tensor([keys.unit_rows[u][0] for u in ones], device=q.device)
            o = F.scaled_dot_product_attention(
                q[ri][:, :, None, :],
                K[ui],
                V[ui],
                attn_mask=keys.valid[ui][:, None, None, :],
                scale=a.scaling,
                enable_gqa=gqa,
            )
            out[ri] = o[:, :, 0]
        multi = [u for u, (_, n) in enumerate(keys.unit_rows) if n > 1]
        if not multi:
            return out.reshape(N, Hq * hd)
        tmax = max(keys.unit_rows[u][1] for u in multi)
        if len(multi) * tmax <= 2 * sum(keys.unit_rows[u][1] for u in multi):
            # prompts of similar lengths: one call, queries padded to the longest (padding rows masked out)
            ui = torch.tensor(multi, device=q.device)
            t = torch.arange(tmax, device=q.device)
            starts = torch.tensor([keys.unit_rows[u][0] for u in multi], device=q.device)
            ns = torch.tensor([keys.unit_rows[u][1] for u in multi], device=q.device)
            real = t[None, :] < ns[:, None]  # [U2, tmax]
            ri = (starts[:, None] + t[None, :]).clamp_max(N - 1)  # row of each (unit, query slot)
            qpos = keys.qpos[ri]
            mask = keys.valid[ui][:, None, :] & (keys.kpos[ui][:, None, :] <= qpos[:, :, None])  # [U2, tmax, L]
            mask = mask | ~real[:, :, None]  # padded queries see everything (their output is dropped)
            qb = q[ri].transpose(1, 2)  # [U2, Hq, tmax, hd]
            o = F.scaled_dot_product_attention(
                qb, K[ui], V[ui], attn_mask=mask[:, None], scale=a.scaling, enable_gqa=gqa
            )
            out[ri[real]] = o.transpose(1, 2)[real]
            return out.reshape(N, Hq * hd)
        for u in multi:  # prompts of very different lengths: one call each, causal inside
            start, n = keys.unit_rows[u]
            qp = keys.qpos[start : start + n]
            mask = keys.valid[u][None, :] & (keys.kpos[u][None, :] <= qp[:, None])  # [n, L]
            qu = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, hd]
            o = F.scaled_dot_product_attention(
                qu, K[u : u + 1], V[u : u + 1], attn_mask=mask[None, None], scale=a.scaling, enable_gqa=gqa
            )
            out[start : start + n] = o[0].transpose(0, 1)
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
