"""The chunked depth-attention kernel: linear memory, autograd included (docs/long-context.md).

Queries run in blocks; each block's keys come in parts (``retrofit.model.depth_attention.DepthMask.parts``)
whose attentions are merged by their log-sum-exps. The backward recomputes each part's probabilities from
the saved output and log-sum-exp (a flash-style custom autograd ``Function``). On CPU the parts run
PyTorch's fused flash-attention CPU kernels (``"cpu"``); elsewhere a plain matmul/softmax per part
(``"math"``).
"""

from __future__ import annotations

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _additive(vis: torch.Tensor, dtype) -> torch.Tensor:
    """bool -> additive mask (0 / -inf); both kernels give a fully masked row a zero output and no gradient."""
    zero = torch.zeros((), dtype=dtype, device=vis.device)
    return torch.where(vis, zero, zero - float("inf"))


def _math_forward(q, k, v, mask, scale):
    """One query block, matmul + softmax. q ``[B, Hq, C, hd]``; k, v ``[B, Hkv, K, hd]``; mask ``[B, 1, C or 1, K]``
    additive, or None.

    Query head ``h`` reads key head ``h // G`` (transformers' ``repeat_kv`` layout); the groups are folded
    into the query axis instead of repeating the keys. Returns ``(out [B, Hq, C, hd], lse [B, Hq, C])``.
    """
    B, Hq, C, hd = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = Hq // Hkv
    s = torch.matmul(q.reshape(B, Hkv, G * C, hd), k.transpose(-1, -2)).float().mul_(scale).view(B, Hkv, G, C, K)
    if mask is not None:
        s = s + mask[:, :, None].float()
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # fully masked rows: p = 0
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p.to(v.dtype).view(B, Hkv, G * C, K), v).view(B, Hq, C, hd)
    return out, lse.view(B, Hq, C)


def _math_backward(g, q, k, v, out, lse, mask, scale):
    """Gradients of ``_math_forward`` from its saved output and log-sum-exp (the probabilities are recomputed)."""
    B, Hq, C, hd = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * C, hd)
    s = torch.matmul(qf, k.transpose(-1, -2)).float().mul_(scale).view(B, Hkv, G, C, K)
    if mask is not None:
        s = s + mask[:, :, None].float()
    p = torch.exp(s - lse.view(B, Hkv, G, C)[..., None])
    gf = g.reshape(B, Hkv, G * C, hd)
    delta = (g.float() * out.float()).sum(-1).view(B, Hkv, G, C, 1)
    dv = torch.matmul(p.view(B, Hkv, G * C, K).transpose(-1, -2).to(g.dtype), gf)
    dp = torch.matmul(gf, v.transpose(-1, -2)).float().view(B, Hkv, G, C, K)
    ds = (p * (dp - delta)).mul_(scale).view(B, Hkv, G * C, K).to(q.dtype)
    dq = torch.matmul(ds, k).view(B, Hq, C, hd)
    dk = torch.matmul(ds.transpose(-1, -2), qf)
    return dq, dk, dv


def _cpu_forward(q, k, v, mask, scale):
    out, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse


def _cpu_backward(g, q, k, v, out, lse, mask, scale):
    return _CPU_FLASH_BWD(g, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)


_KERNELS = {"cpu": (_cpu_forward, _cpu_backward), "math": (_math_forward, _math_backward)}


class _ChunkedAttention(torch.autograd.Function):
    """Depth attention by query blocks (see the module docstring).

    Forward: per block and per key part (``DepthMask.parts``), attend and keep the output and the
    log-sum-exp; a block's parts are merged by their log-sum-exps (as flash attention merges its tiles).
    Saved for backward: ``q``, the position-major ``k``/``v``, the merged output ``[B, T, Hq, hd]`` and
    log-sum-exp ``[B, Hq, T]``: all linear in ``T``. Backward: per block and part, the kernel recomputes the
    probabilities from the merged log-sum-exp (so each part's gradient is that of the whole softmax).
    """

    @staticmethod
    def forward(ctx, q, k, v, dm, scale: float):  # dm: the depth's DepthMask (retrofit.model.depth_attention)
        # q [B, Hq, T, hd]; k, v [B, Hkv, T * m, hd] (position-major)
        B, Hq, T, hd = q.shape
        fwd, _ = _KERNELS[dm.chunk_kernel]
        out = q.new_empty(B, T, Hq, hd)
        lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
        for blk in dm.plan:
            t0, t1 = blk.t0, blk.t1
            res = []
            for k0, k1, mask, empty in dm.parts(blk, q.dtype):
                o_p, lse_p = fwd(q[:, :, t0:t1], k[:, :, k0:k1], v[:, :, k0:k1], mask, scale)
                lse_p = lse_p.float()
                if empty is not None:
                    lse_p = lse_p.masked_fill(empty, float("-inf"))
                res.append((o_p, lse_p))
            if len(res) == 1:
                o_b, lse_b = res[0]
            else:
                (o1, lse1), (o2, lse2) = res
                lse_b = torch.logaddexp(lse1, lse2)
                w1, w2 = torch.exp(lse1 - lse_b)[..., None], torch.exp(lse2 - lse_b)[..., None]
                o_b = o1 * w1.nan_to_num(0.0).to(o1.dtype) + o2 * w2.nan_to_num(0.0).to(o2.dtype)
            out[:, t0:t1] = o_b.transpose(1, 2)
            lse[:, :, t0:t1] = lse_b.masked_fill(torch.isneginf(lse_b), 0.0)  # no visible key (padding): p = 0
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dm, ctx.scale = dm, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        dm, scale = ctx.dm, ctx.scale
        _, bwd = _KERNELS[dm.chunk_kernel]
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for blk in dm.plan:
            t0, t1 = blk.t0, blk.t1
            g_b, o_b = g[:, t0:t1].transpose(1, 2), out[:, t0:t1].transpose(1, 2)
            for k0, k1, mask, _ in dm.parts(blk, q.dtype):
                gq, gk, gv = bwd(g_b, q[:, :, t0:t1], k[:, :, k0:k1], v[:, :, k0:k1], o_b, lse[..., t0:t1], mask, scale)
                dq[:, :, t0:t1] += gq
                dk[:, :, k0:k1] += gk
                dv[:, :, k0:k1] += gv
        return dq, dk, dv, None, None
