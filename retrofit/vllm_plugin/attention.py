"""Attention per depth for the vLLM plugin: one ``Attention`` (one paged KV cache) per (layer, depth),
picked by ``DepthAttention``; duo-causal attention computed by the plugin over the same paged caches
(``duo_causal_attention``). The model that wires them in is ``retrofit.vllm_plugin.model``; why the
caches hold what same-depth and duo-causal attention read is in that module's docstring."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention


class LoopState:
    """What the attention modules need to know about the current pass (shared, set by the model).

    Attributes:
        depth: ``{"core": m, "coda": d}`` depth being run by the core / the coda readout.
        exec_depth: ``[num_slots]`` int8, last executed core depth of the token in each KV slot
            (duo-causal only; allocated on first use from the cache size).
        slots: ``[n]`` slot of each scheduled token in this step (duo-causal only).
    """

    def __init__(self):
        self.depth = {"core": 1, "coda": 1}
        self.exec_depth: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.checked_block_size = False


def attn_metadata(layer_name: str):
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # speculative decoding: [0] is the target model's
        md = md[0]
    if isinstance(md, dict):
        return md.get(layer_name)
    return md


def kv_store(attn: Attention, dtype: torch.dtype) -> torch.Tensor:
    """The paged cache vLLM allocated for ``attn``, viewed as ``[num_slots, KVH, 2, hd]`` (our layout).

    Duo-causal layers never run vLLM's kernels, so the plugin owns the bytes: slot ``i`` (vLLM's slot
    numbering, ``block * block_size + offset``) holds the token's key and value.
    """
    kv = attn.kv_cache[0] if isinstance(attn.kv_cache, (list, tuple)) else attn.kv_cache
    if not kv.is_contiguous():
        raise RuntimeError(
            f"duo-causal attention needs a contiguous KV cache tensor; {attn.layer_name} has strides {kv.stride()}"
        )
    flat = kv.view(-1)
    if flat.dtype != dtype:
        flat = flat.view(torch.uint8).view(dtype)
    per_slot = attn.num_kv_heads * 2 * attn.head_size
    return flat[: flat.numel() // per_slot * per_slot].view(-1, attn.num_kv_heads, 2, attn.head_size)


def duo_causal_attention(attns: list[Attention], q, k, v, state: LoopState, block_size: int) -> torch.Tensor:
    """Duo-causal attention of the queries at depth ``m = len(attns)`` (docs/looped-model.md).

    Query ``(t, m)`` attends to every ``(s, j)`` with ``s <= t``, ``j <= m`` and ``j <= d*_s`` (the
    depths ``s`` executed; ``state.exec_depth``), one softmax over all of them — the same function
    as ``retrofit.model.attention.depth_key_visibility(..., "duo-causal")``.

    Args:
        attns: the ``Attention`` modules of depths ``1 … m`` of one core layer.
        q: ``[N, Hq * hd]``; k, v: ``[N, KVH * hd]`` (after RoPE / norms), this step's tokens.
        state: ``LoopState`` with ``slots`` and ``exec_depth`` set for this depth.
        block_size: tokens per KV block (vLLM's slot numbering).

    Returns:
        ``[N, Hq * hd]``.
    """
    top = attns[-1]
    Hq, KVH, hd = top.num_heads, top.num_kv_heads, top.head_size
    out = torch.zeros(q.shape[0], Hq * hd, dtype=q.dtype, device=q.device)
    meta = attn_metadata(attns[0].layer_name)
    if meta is None or state.slots is None:  # profiling / warm-up run: no cache yet
        return out
    n = int(meta.num_actual_tokens)
    stores = [kv_store(a, q.dtype) for a in attns]
    slots = state.slots
    stores[-1][slots, :, 0] = k[:n].view(n, KVH, hd)
    stores[-1][slots, :, 1] = v[:n].view(n, KVH, hd)
    m = len(attns)
    scale = top.impl.scale
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    bt = meta.block_table
    dev = q.device
    depth_ids = torch.arange(1, m + 1, device=dev)[:, None]  # [m, 1]
    for r in range(len(seq_lens)):
        a, b = qsl[r], qsl[r + 1]
        if b <= a:
            continue
        L, nq = seq_lens[r], b - a
        pos = torch.arange(L, device=dev)
        kslots = bt[r, pos // block_size].long() * block_size + pos % block_size  # [L]
        if not state.checked_block_size:  # our slot arithmetic must be vLLM's
            if not torch.equal(kslots[L - nq :], slots[a:b].long()):
                raise RuntimeError(
                    "duo-causal attention: block table and slot mapping disagree (unexpected KV block size)"
                )
            state.checked_block_size = True
        K = torch.stack([s[kslots, :, 0] for s in stores])  # [m, L, KVH, hd]
        V = torch.stack([s[kslots, :, 1] for s in stores])
        ex = state.exec_depth[kslots].long()  # [L]
        vis = depth_ids <= ex[None, :]  # [m, L] executed
        qpos = torch.arange(L - nq, L, device=dev)
        causal = pos[None, :] <= qpos[:, None]  # [nq, L]
        mask = (vis[None] & causal[:, None]).reshape(nq, m * L)  # [nq, m * L]
        rep = Hq // KVH
        Kh = K.reshape(m * L, KVH, hd).repeat_interleave(rep, dim=1)  # [mL, Hq, hd]
        Vh = V.reshape(m * L, KVH, hd).repeat_interleave(rep, dim=1)
        Q = q[a:b].view(nq, Hq, hd)
        scores = torch.einsum("qhd,khd->hqk", Q.float(), Kh.float()) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), Vh.float())
        out[a:b] = o.reshape(nq, Hq * hd).to(q.dtype)
    return out


class DepthAttention(nn.Module):
    """Stands in for a decoder layer's ``self_attn.attn``: the ``Attention`` of the current depth.

    ``attns[0]`` is the layer's own ``Attention`` (its usual cache name), ``attns[d - 1]`` the one of
    depth ``d``. ``mode``: ``"kernel"`` (vLLM's attention on the depth's cache: same-depth reads, coda
    readouts) or ``"duo-causal"`` (``duo_causal_attention`` over depths ``1 … d``).
    """

    def __init__(
        self,
        attns: list[Attention],
        state: LoopState,
        group: str,
        mode: str,
        block_size: int,
    ):
        super().__init__()
        self.attns = nn.ModuleList(attns)
        self.state = state
        self.group = group
        self.mode = mode
        self.block_size = block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        d = self.state.depth[self.group]
        if self.mode == "duo-causal":
            return duo_causal_attention(list(self.attns[:d]), q, k, v, self.state, self.block_size)
        return self.attns[d - 1](q, k, v)


def add_depth_attention(
    layer: nn.Module,
    depths: int,
    new_name,
    state: LoopState,
    group: str,
    mode: str,
    block_size: int,
) -> None:
    """Give ``layer.self_attn`` one ``Attention`` (one KV cache) per depth, cloned from its own."""
    base: Attention = layer.self_attn.attn
    attns = [base]
    for _ in range(1, depths):
        attns.append(
            Attention(
                base.num_heads,
                base.head_size,
                base.impl.scale,
                num_kv_heads=base.num_kv_heads,
                cache_config=get_current_vllm_config().cache_config,
                prefix=new_name(),
            )
        )
    layer.self_attn.attn = DepthAttention(attns, state, group, mode, block_size)
