"""Attention of the full-sequence forward without dense ``T × T`` masks (docs/long-context.md).

The looped model calls the base model's own decoder layers. What changes is the attention *function*
they dispatch to: every attention module of a looped backbone sees a ``LoopedAttentionConfig`` (its
config, except that ``_attn_implementation`` names ``looped_attention_forward``, registered with
transformers' ``AttentionInterface``). That function

- runs the depth attention of the core when the layer is called with a ``DepthMask`` as its
  ``attention_mask`` (the full-sequence forward at depth ``m >= 2``), and
- hands every other call, unchanged, to the implementation the user chose (``config._attn_implementation``:
  sdpa, eager, flex_attention, flash_attention_*): the prelude, the coda, depth 1 of the core (which sees
  exactly the prelude's causal pattern) and the same-depth gather below run on the base model's own path,
  with the mask transformers' ``create_causal_mask`` builds for it (``None`` for sdpa without padding, so
  ``is_causal``; ``position_ids`` for flash-attention's packed rows; a ``BlockMask`` for flex).

The kernels of a ``DepthMask`` (``SequenceAttention.for_depth`` picks one per depth):

- ``gather`` (same-depth, ANIRA): query ``(t, m)`` sees each ``s <= t`` once, at depth ``min(m, d*_s)``,
  so each position's K/V at that depth is gathered into one length-``T`` sequence and ordinary causal
  attention runs on it (the user's implementation, the prelude's mask). A lookahead row (a token that
  exited at ``m - 1``, TaH2 §3) must see *itself* at depth ``m``, which the gathered sequence cannot
  express: when the forward has lookahead rows at ``m``, the rule kernel below runs instead.
- ``chunked`` (sdpa and flash users, any device): the depth-stacked keys ``(s, j)``, ``j <= m``, are laid
  out position-major (key ``s·m + j - 1``) and queries run in blocks of ``query_chunk``; a block
  ``[t0, t1)`` reads only the keys of positions ``[lo, t1)`` (``lo`` = the earliest start of the block's
  packed sequences), so the work is causal, not full. Those keys come in two parts (``DepthMask.parts``):
  the diagonal block ``[t0, t1)``, with a small ``C × C·m`` mask from the rule
  (``retrofit.model.attention.depth_rule``), and the earlier keys ``[lo, t0)``, which every query of the block
  sees alike (one broadcast row of the pattern, or no mask at all when every one is visible); the two
  attentions are merged by their log-sum-exps. The backward recomputes each part's probabilities from the
  saved output and log-sum-exp (a flash-style custom autograd ``Function``), so memory, autograd
  included, is linear in ``T``. On CPU the parts run PyTorch's fused flash-attention CPU kernels;
  elsewhere a plain matmul/softmax per part.
- ``flex`` (flex_attention users): one ``BlockMask`` per depth from the same rule, built once and reused
  by every core layer and the backward; the call is transformers' own flex-attention function. Compiled
  flex attention has no backward on CPU in current PyTorch, so flex training needs a GPU.
- ``dense`` (eager users, and ``dense_reference()``): the original implementation, the reference the
  others are tested against: keys stacked depth-major and a ``[B, 1, T, m·T]`` additive mask.

The decode path (``retrofit.model.backends.CachedStep``) passes dense masks over cached keys, as before; they
go to the user's implementation when it is sdpa or eager, and to sdpa otherwise (neither flash- nor flex-
attention takes a dense mask), so decoding's numerics do not change.
"""

from __future__ import annotations

import weakref
from functools import cached_property
from typing import NamedTuple

import torch
from transformers.masking_utils import and_masks, create_causal_mask, find_packed_sequence_indices
from transformers.modeling_utils import AttentionInterface

from .attention import base_visibility, depth_key_visibility, depth_rule, segment_ids, to_additive_mask
from .attention_dispatch import (  # noqa: F401  (their home is attention_dispatch)
    ATTENTION_NAME,
    LoopedAttentionConfig,
    delegate,
    install,
)
from .attention_settings import _SETTINGS, Settings, dense_reference, settings  # noqa: F401
from .chunked_attention import _CPU_FLASH, _additive, _ChunkedAttention

#: the attention implementations a looped model runs as chosen (``retrofit.convert`` keeps them)
HONOURED_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


# ------------------------------------------------------------------------------------------------
# Dispatch: what the attention modules of a looped backbone call (the rest: attention_dispatch)
# ------------------------------------------------------------------------------------------------
def looped_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The attention function of a looped backbone's layers (see the module docstring).

    Args:
        module: the layer's attention module.
        query: ``[B, Hq, Tq, hd]``; key, value: ``[B, Hkv, Tk, hd]`` (after RoPE and the cache's update).
        attention_mask: a ``DepthMask`` (the core at depth ``m >= 2`` of the full-sequence forward) or
            whatever the user's implementation takes.

    Returns:
        ``(attn_output [B, Tq, Hq, hd], weights or None)``, as transformers' attention functions.
    """
    if isinstance(attention_mask, DepthMask):
        return attention_mask.attend(module, query, key, value, **kwargs)
    return delegate(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, looped_attention_forward)


# ------------------------------------------------------------------------------------------------
# Per-forward metadata and the per-depth masks
# ------------------------------------------------------------------------------------------------
class Block(NamedTuple):
    """Queries ``t0 … t1-1`` of the chunked kernel. ``lo``: the first position any of them can see (the
    earliest start of their packed sequences, over the batch); ``uniform``: in every row they belong to
    one packed sequence (so keys before ``t0`` are visible to all of them or to none)."""

    t0: int
    t1: int
    lo: int
    uniform: bool


class SequenceAttention:
    """The attention metadata of one full-sequence forward, and the mask each layer call gets.

    Built once per forward from ``[B, T]`` tensors only: ``valid`` (not padding), ``seg`` (packed-sequence
    ids, ``retrofit.model.attention.segment_ids``) and, per depth, ``last`` (each token's last executed depth).

    Args:
        model: the looped model.
        x: ``[B, T, H]`` the input embeddings (batch, length, dtype, device).
        attention_mask: ``[B, T]`` padding mask or None.
        position_ids: ``[B, T]`` (resets to 0 mark packed sequences).
        store: the forward's ``retrofit.model.backends.DepthKVStore`` (the K/V of every depth run so far).

    Attributes:
        plain: the prelude's and coda's mask (what ``create_causal_mask`` returns for the base model; the
            dense ``[B, 1, T, T]`` additive mask under ``dense_reference``).
    """

    def __init__(self, model, x: torch.Tensor, attention_mask, position_ids, store):
        B, T, _ = x.shape
        # weak: the backward of the chunked kernel keeps its DepthMask (hence this object), not the store's K/V
        self._store = weakref.ref(store)
        self.B, self.T, self.dtype, self.device = B, T, x.dtype, x.device
        self.settings = _SETTINGS.get()
        self.impl = model.config._attn_implementation or "sdpa"
        self.mode = model.loop.attention
        self.attention_mask, self.position_ids = attention_mask, position_ids
        pad = attention_mask is not None and not bool(attention_mask.all())
        self.valid = attention_mask.bool() if pad else torch.ones(B, T, dtype=torch.bool, device=x.device)
        self.seg = segment_ids(position_ids, self.valid)
        if self.settings.dense:
            self.plain = to_additive_mask(self.base_vis, x.dtype)
        else:
            self.plain = _causal_mask(model.config, x, attention_mask if pad else None, position_ids, self.seg)

    @property
    def store(self):
        """The forward's ``DepthKVStore`` (alive while the forward, or a checkpointed layer's replay, runs)."""
        return self._store()

    @cached_property
    def base_vis(self) -> torch.Tensor:
        """``[B, T, T]`` bool position-level visibility (the dense kernel only)."""
        return base_visibility(self.B, self.T, self.device, self.attention_mask, self.position_ids)

    def chunks(self, C: int) -> list[Block]:
        """Query blocks of at most ``C`` queries (see ``Block``)."""
        starts = list(range(0, self.T, C))
        ends = [min(self.T, t0 + C) for t0 in starts]
        if self.seg is None:
            return [Block(t0, t1, 0, True) for t0, t1 in zip(starts, ends)]
        idx = torch.arange(self.T, device=self.device).expand(self.B, self.T)
        new = torch.ones_like(self.valid)
        new[:, 1:] = self.seg[:, 1:] != self.seg[:, :-1]
        seg_start = torch.where(new, idx, torch.zeros_like(idx)).cummax(-1).values  # [B, T]
        los = seg_start[:, starts].min(0).values.tolist()
        uniform = (self.seg[:, starts] == self.seg[:, [t1 - 1 for t1 in ends]]).all(0).tolist()
        return [Block(*b) for b in zip(starts, ends, los, uniform)]

    def for_depth(self, d: int, active: list[torch.Tensor], lookahead: bool = False):
        """The ``attention_mask`` of the core layers at depth ``d``.

        Args:
            active: ``[B, T]`` bool per depth ``1 … d``: token executed that depth.
            lookahead: the forward computes the lookahead rows (tokens that exited at ``d - 1`` attend as
                if they continued; TaH2's per-depth losses).
        """
        if d == 1:  # every token runs depth 1 and sees the prelude's causal pattern
            return self.plain
        if self.settings.dense or self.impl == "eager":
            vis = depth_key_visibility(torch.stack(active[:d]), d, self.mode, self.base_vis)
            return DepthMask(self, d, "dense", dense=to_additive_mask(vis, self.dtype))
        last = torch.stack(active[:d]).sum(0)  # [B, T]: last executed depth, min(d, d*)
        if self.mode == "same-depth" and not (lookahead and bool((active[d - 2] & ~active[d - 1]).any())):
            return DepthMask(self, d, "gather", last=last)
        return DepthMask(self, d, "flex" if self.impl == "flex_attention" else "chunked", last=last)


def _causal_mask(config, x, attention_mask, position_ids, seg):
    """The prelude's and coda's mask: what the base model itself would use (``create_causal_mask``), except that
    no query row is empty.

    transformers reads a packing from the position ids only without a padding mask, and splits
    sequences where consecutive ids do not step by one; retrofit splits where an id resets to 0
    (``segment_ids``). When the two disagree, or a batch is both padded and packed, the segment rule is
    added as an ``and_mask_function`` (a dense pattern for sdpa and eager, a block mask for flex).

    With padding, every query also sees its own position: a padding query's row holds itself instead of
    nothing, and a real query's row is unchanged (retrofit.model.attention; docs/long-context.md, "padding
    rows"). transformers applies its padding rule last, after any ``or_mask_function``, so for flex (and with
    the segment rule) the padding rule is retrofit's own ``and_mask_function``; a dense mask alone gets its
    diagonal set visible after transformers built it (``_self_visible``), which keeps transformers' fast
    index-based construction. flash-attention takes the padding mask as it is (it unpads: no row is empty).
    """
    kwargs = dict(config=config, inputs_embeds=x, attention_mask=attention_mask, cache=None, position_ids=position_ids)
    B, T = x.shape[:2]
    impl = config._attn_implementation or "sdpa"
    flash = impl.startswith("flash_attention")
    theirs = find_packed_sequence_indices(position_ids.expand(B, T)) if attention_mask is None else None
    rules = []
    if seg is None:
        if theirs is not None:  # ids that do not step by one, but no reset: one sequence (a padding mask
            kwargs["attention_mask"] = torch.ones(B, T, dtype=torch.bool, device=x.device)  # turns the reading off)
    elif not (theirs is not None and torch.equal(theirs[:, 1:] != theirs[:, :-1], seg[:, 1:] != seg[:, :-1])):
        if flash:
            raise ValueError(
                "flash-attention cannot take this batch: it is both padded and packed (or its position ids reset "
                "to 0 without the steps of one transformers reads packings from); use sdpa or flex_attention"
            )

        def same_segment(b, h, q, k):
            return seg[b, q] == seg[b, k]

        rules.append(same_segment)
    padded = attention_mask is not None and not flash
    if padded and (rules or impl == "flex_attention"):
        valid = attention_mask.bool()

        def real_key_or_self(b, h, q, k):
            return valid[b, k] | (q == k)

        rules.append(real_key_or_self)
        kwargs["attention_mask"] = torch.ones(B, T, dtype=torch.bool, device=x.device)  # the rule reads it
        padded = False
    if rules:
        kwargs["and_mask_function"] = rules[0] if len(rules) == 1 else and_masks(*rules)
    mask = create_causal_mask(**kwargs)
    return _self_visible(mask) if padded else mask


def _self_visible(mask):
    """A dense ``[B, 1, T, T]`` mask (bool, or additive float) with every query's own key made visible."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    if not mask.is_contiguous():
        mask = mask.contiguous()
    mask.diagonal(dim1=-2, dim2=-1).fill_(True if mask.dtype == torch.bool else 0)
    return mask


class DepthMask:
    """The ``attention_mask`` the core layers get at depth ``m >= 2`` of the full-sequence forward.

    It carries no ``[T, m·T]`` pattern (except for the dense kernel): the kernels read the K/V of depths
    ``1 … m`` from the forward's ``DepthKVStore`` and the per-token metadata of ``SequenceAttention``.
    One object serves every core layer at this depth and their backward.

    Attributes:
        depth: ``m``; kernel: ``"gather"``, ``"chunked"``, ``"flex"`` or ``"dense"``.
        last: ``[B, T]`` each token's last executed depth up to ``m``.
    """

    def __init__(self, seq: SequenceAttention, depth: int, kernel: str, last=None, dense=None):
        self.seq, self.depth, self.kernel, self.last, self.dense = seq, depth, kernel, last, dense
        self._block_mask = None
        self._parts: dict[tuple, list] = {}  # the uniform blocks' key parts (``parts``), by (block, dtype)

    def attend(self, module, query, key, value, dropout: float = 0.0, scaling: float | None = None, **kwargs):
        """The attention of one core layer at this depth (``looped_attention_forward``'s depth branch)."""
        m, li = self.depth, module.layer_idx
        kv = self.seq.store.kv
        ks = [kv[(li, j)][0] for j in range(1, m)] + [key]  # [B, Hkv, T, hd] per depth
        vs = [kv[(li, j)][1] for j in range(1, m)] + [value]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if self.kernel == "dense":  # the reference: depth-major keys, key (j - 1) * T + s
            k, v = torch.cat(ks, 2), torch.cat(vs, 2)
            return delegate(module, query, k, v, self.dense, dropout=dropout, scaling=scaling, **kwargs)
        if self.kernel == "gather":  # position s at depth min(m, d*_s): one causal sequence
            sel = self.last[:, None, :, None]  # [B, 1, T, 1]
            k, v = ks[-1], vs[-1]
            for j in range(m - 1, 0, -1):
                k = torch.where(sel == j, ks[j - 1], k)
                v = torch.where(sel == j, vs[j - 1], v)
            return delegate(module, query, k, v, self.seq.plain, dropout=dropout, scaling=scaling, **kwargs)
        if dropout:
            raise NotImplementedError(
                "attention dropout is not supported by the looped model's depth attention; set the config's "
                "attention_dropout to 0 (Llama and Qwen3 default) or use attn_implementation='eager'"
            )
        # position-major stacking: key s * m + (j - 1), so the keys of positions [lo, t1) are one slice
        k = torch.stack(ks, 3).flatten(2, 3)  # [B, Hkv, T * m, hd]
        v = torch.stack(vs, 3).flatten(2, 3)
        if self.kernel == "flex":
            return delegate(module, query, k, v, self.block_mask(), "flex_attention", scaling=scaling, **kwargs)
        out = _ChunkedAttention.apply(query, k, v, self, scaling)  # [B, T, Hq, hd]
        return out, None

    # -- the rule, per query block and per flex tile ---------------------------------------------
    @cached_property
    def plan(self) -> list[Block]:
        return self.seq.chunks(self.seq.settings.query_chunk)

    @cached_property
    def chunk_kernel(self) -> str:
        kind = self.seq.settings.chunk_kernel
        if kind == "auto":
            kind = "cpu" if self.seq.device.type == "cpu" and _CPU_FLASH is not None else "math"
        return kind

    def visibility(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        """``[B, t1 - t0, (s1 - s0) * m]`` bool: queries ``t0 … t1-1`` (at depth ``m``) against the
        position-major keys of positions ``s0 … s1-1``, depths ``1 … m`` (``retrofit.model.attention.depth_rule``)."""
        seq, m, dev = self.seq, self.depth, self.seq.device
        t = torch.arange(t0, t1, device=dev)[None, :, None, None]
        s = torch.arange(s0, s1, device=dev)[None, None, :, None]
        j = torch.arange(1, m + 1, device=dev)[None, None, None, :]
        last_s = self.last[:, None, s0:s1, None]
        valid_s = seq.valid[:, None, s0:s1, None]
        if seq.seg is None:
            seg_t = seg_s = s.new_zeros(())
        else:
            seg_t, seg_s = seq.seg[:, t0:t1, None, None], seq.seg[:, None, s0:s1, None]
        vis = depth_rule(seq.mode, m, t, s, j, last_s, seg_t, seg_s, valid_s)  # [B, C, L, m]
        return vis.expand(seq.B, t1 - t0, s1 - s0, m).reshape(seq.B, t1 - t0, (s1 - s0) * m)

    def block_visibility(self, t0: int, t1: int, lo: int) -> torch.Tensor:
        """``[B, t1 - t0, (t1 - lo) * m]`` bool: a block's queries against every key it reads."""
        return self.visibility(t0, t1, lo, t1)

    def parts(self, blk: Block, dtype) -> list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
        """The key ranges of a query block, each ``(k0, k1, mask, empty)`` in position-major key indices.

        - the **diagonal** part, positions ``t0 … t1-1``: a ``[B, 1, C, C·m]`` additive mask from the rule;
        - the **earlier** part, positions ``lo … t0-1`` (all before every query of the block, so the causal
          and lookahead terms of the rule are constant): when the block is ``uniform``, one row of the
          pattern serves every query, a broadcast ``[B, 1, 1, L·m]`` mask, or no mask at all when every
          such key is visible (no exits, no padding, one sequence: the common case); otherwise the full
          ``[B, 1, C, L·m]`` rule.

        ``empty``: rows with no visible key in the part (``[B, 1, 1]`` or ``[B, 1, C]`` bool, or None),
        whose log-sum-exp the merge sets to -inf. Uniform blocks' parts are the same for every core layer
        at this depth and their backward: they are kept (O(T·C·m) in all); the others are rebuilt.
        """
        if (blk, dtype) in self._parts:
            return self._parts[(blk, dtype)]
        m, (t0, t1, lo, uniform) = self.depth, blk
        vis = self.visibility(t0, t1, t0, t1)
        out = [(t0 * m, t1 * m, _additive(vis[:, None], dtype), ~vis.any(-1)[:, None])]
        if lo < t0:
            if uniform:  # the block's first query stands for all of them
                row = self.visibility(t0, t0 + 1, lo, t0)[:, None]  # [B, 1, 1, L*m]
                if bool(row.all()):
                    out.append((lo * m, t0 * m, None, None))
                else:
                    out.append((lo * m, t0 * m, _additive(row, dtype), ~row.any(-1)))
            else:
                full = self.visibility(t0, t1, lo, t0)
                out.append((lo * m, t0 * m, _additive(full[:, None], dtype), ~full.any(-1)[:, None]))
        if uniform:
            self._parts[(blk, dtype)] = out
        return out

    def block_mask(self):
        """The flex-attention ``BlockMask`` of this depth (``[B, 1, T, T·m]``, position-major keys), built
        once from the rule and reused by every core layer and the backward. Compiled where flex attention
        runs compiled kernels (not on CPU, where an uncompiled build materialises the pattern once)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            seq, m, mode = self.seq, self.depth, self.seq.mode
            last, valid = self.last, seq.valid
            seg = seq.seg if seq.seg is not None else torch.zeros_like(last)

            def mask_mod(b, h, q_idx, kv_idx):
                s = kv_idx // m
                return depth_rule(mode, m, q_idx, s, kv_idx % m + 1, last[b, s], seg[b, q_idx], seg[b, s], valid[b, s])

            self._block_mask = create_block_mask(
                mask_mod, seq.B, None, seq.T, seq.T * m, device=seq.device, _compile=seq.device.type != "cpu"
            )
        return self._block_mask


__all__ = [
    "ATTENTION_NAME",
    "HONOURED_IMPLEMENTATIONS",
    "DepthMask",
    "LoopedAttentionConfig",
    "SequenceAttention",
    "Settings",
    "delegate",
    "dense_reference",
    "install",
    "looped_attention_forward",
    "settings",
]
