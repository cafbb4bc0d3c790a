"""KV backends of the depth loop (``retrofit.model.loop``): where the core's keys and values live, which
tokens compute each depth, and how a state becomes logits.

- ``FullSequence``: the full-sequence forward (training, scoring, prefill without a cache). Every
  token computes every depth the loop runs (static shapes; a token past its exit is *passed
  through*: its state is kept, and its deeper keys are invisible to everyone else); ``DepthKVStore``
  keeps the keys of every depth executed so far, and the core's attention at depth ``m`` reads them
  under the rule of ``retrofit.model.attention`` without a dense mask (``retrofit.model.depth_attention``; the
  prelude and coda run the base model's own causal attention). It also serves TaH2's gradient-free
  lookahead iteration.
- ``CachedStep``: one step of incremental decoding with a ``retrofit.model.cache.DepthKVCache``: the step's
  new tokens (the prompt at prefill, one token per row afterwards) run the prelude once, then at each
  depth only the tokens still running are packed (``retrofit.model.token_sets.Pack``), run through the core, and
  written to the cache; an exited token is not computed at deeper depths and writes no K/V there.
  Its result equals the full-sequence forward on the whole sequence with the same per-token depths
  (tests/model/test_generation.py), and a row's result does not depend on the other rows of the batch.

``share_first_depth(model)`` lets full-sequence forwards of the *same batch* share their first depth (see
``FirstDepthShare``): what every exit policy computes alike, before its first decision.

A backend offers ``first_active``, ``begin_depth`` (returns the running tokens, or None),
``core``, ``readout``, ``end_depth``, ``final_readout`` and ``finish``; its constructor runs the
prelude and leaves the core input in ``e`` and the ``[B, T]`` real-token (not padding) mask in ``real``.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torch.utils.checkpoint import checkpoint

from .cache import DepthKVCache
from .depth_attention import SequenceAttention
from .loop import _keep
from .token_sets import AllTokens, Pack


def call_layer(model, layer, x, mask, pe, pos, store, depth: int):
    """A base decoder layer with ``store`` as its cache; ``depth`` reaches ``store.update`` (0 = not
    a core layer). Activation checkpointing is ours: transformers' per-layer checkpointing drops the
    ``cache`` argument of a layer that writes to it (which would silently turn duo-causal attention
    into same-depth-only attention); the stores are idempotent under replay."""
    kwargs = dict(
        attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=store, use_cache=False, loop_depth=depth
    )
    if model._loop_checkpointing and model.training and torch.is_grad_enabled():
        return checkpoint(layer, x, **kwargs, **model._loop_checkpointing_kwargs)
    return layer(x, **kwargs)


def head(model, h: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head: ``[..., H]`` -> ``[..., V]``."""
    return model.lm_head(model.model.norm(h))


class DepthKVStore:
    """K/V of the full-sequence forward, keyed by (layer index, depth).

    The base attention calls ``update(k, v, layer_idx, kwargs=...)``; the current depth arrives in
    ``kwargs["loop_depth"]`` (passed through the decoder layer's ``**kwargs``). ``update`` records the
    depth's K/V and returns them unchanged; the core's attention at depth ``m`` (a
    ``retrofit.model.depth_attention.DepthMask``) reads depths ``1 … m - 1`` from ``kv`` and lays them out as
    its kernel needs. Writing is idempotent per (layer, depth), so activation checkpointing may replay a
    layer safely.
    """

    def __init__(self):
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        depth = (kwargs.get("kwargs") or {}).get("loop_depth", 0)
        if depth:  # prelude and coda layers (depth 0) keep nothing
            self.kv[(layer_idx, depth)] = (key_states, value_states)
        return key_states, value_states


def default_position_ids(attention_mask, B: int, T: int, device) -> torch.Tensor:
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    return torch.arange(T, device=device)[None].expand(B, T)


#: ``share_first_depth``'s default memory budget for the shared first depths, in bytes
SHARE_MAX_BYTES = 1 << 30


class _SharedDepth:
    """One batch's first depth (``FirstDepthShare``): the prelude's output ``e``, depth 1's core output and K/V,
    depth 1's coda output."""

    __slots__ = ("e", "core", "coda")

    def __init__(self):
        self.e = self.core = self.coda = None


class FirstDepthShare:
    """Full-sequence forwards of the same batch, inside ``share_first_depth``, share their first depth.

    Until its first decision every exit policy (the decider at any threshold, random allocation, the oracle's
    depths, a forced depth) computes the same thing: the prelude, depth 1 of the core and, where the method
    reads depth 1's prediction, the coda over depth 1's states — every token runs depth 1 under the base
    model's causal mask, whatever is decided later. The first forward of a batch stores those three results
    (and depth 1's keys and values); a later forward of a batch with the same embeddings, padding mask and
    positions reads them instead of recomputing them, so its results are bitwise those of a forward of its own.
    What differs per policy is still computed: depth 1's LM head and decider, every deeper depth.

    Only in inference (``model.eval()``, no autograd) and only for the forward's own layers: a forward hook on
    a prelude or core layer would not run on a shared depth, so a model with one shares nothing.

    Attributes:
        max_bytes: stop storing new batches once the stored tensors reach this size (they are then computed).
        hits, misses: batches served from the store / computed (and stored, while the budget allows).
    """

    def __init__(self, max_bytes: int = SHARE_MAX_BYTES):
        self.max_bytes = int(max_bytes)
        self.entries: dict[bytes, _SharedDepth] = {}
        self.bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def key(attn, x, attention_mask, position_ids) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        h.update(repr((tuple(x.shape), str(x.dtype), str(x.device), attn.impl, attn.mode, attn.settings)).encode())
        for t in (x, attention_mask, position_ids):
            if t is not None:
                t = t.detach()
                h.update(repr((tuple(t.shape), str(t.dtype))).encode())
                h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        return h.digest()

    def lookup(self, attn, x, attention_mask, position_ids) -> _SharedDepth | None:
        """The batch's entry (a new, empty one on a miss while the budget allows; else None)."""
        k = self.key(attn, x, attention_mask, position_ids)
        entry = self.entries.get(k)
        if entry is not None:
            self.hits += 1
            return entry
        self.misses += 1
        if self.bytes >= self.max_bytes:
            return None
        entry = self.entries[k] = _SharedDepth()
        return entry

    def add_bytes(self, *tensors) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)


def _looped_module(model):
    """The looped model under ``model`` (itself, or a PEFT wrapper's base model), else None. Recognized by what
    ``FullSequence`` reads (its loop, core layers and halting method), not by class: causal_lm imports this module."""
    # a PEFT wrapper forwards attribute reads to the model it wraps: ask for that model first
    for m in (getattr(model, "get_base_model", lambda: None)(), model):
        if all(hasattr(m, a) for a in ("loop", "core_layers", "prelude_layers", "halting")):
            return m
    return None


@contextlib.contextmanager
def share_first_depth(model, enabled: bool = True, max_bytes: int = SHARE_MAX_BYTES):
    """Within the block, full-sequence forwards of ``model`` on the same batch share their first depth
    (``FirstDepthShare``, yielded; None when ``enabled`` is false or ``model`` is not looped). The store is freed
    on exit. Nested blocks: the inner one has its own store."""
    looped = _looped_module(model) if enabled else None
    if looped is None:
        yield None
        return
    share, before = FirstDepthShare(max_bytes), getattr(looped, "_first_depth_share", None)
    looped._first_depth_share = share
    try:
        yield share
    finally:
        looped._first_depth_share = before


def _has_hooks(layers) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for layer in layers for m in layer.modules())


class FullSequence:
    """The full-sequence backend (see the module docstring).

    Args:
        model: the looped model.
        x: ``[B, T, H]`` input embeddings.
        attention_mask: ``[B, T]`` padding mask (left or right padding) or None.
        position_ids: ``[B, T]``; resets to 0 mark packed sequences.
    """

    supports_lookahead = True

    def __init__(self, model, x: torch.Tensor, attention_mask=None, position_ids=None):
        B, T, _ = x.shape
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be a [B, T] padding mask, got shape {tuple(attention_mask.shape)}")
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, B, T, x.device)
        self.model, self.pos, self.dtype = model, position_ids, x.dtype
        self.store = DepthKVStore()
        self.attn = SequenceAttention(model, x, attention_mask, position_ids, self.store)
        self.plain_mask = self.attn.plain
        self.real = self.attn.valid  # [B, T] not padding
        self.pe = model.model.rotary_emb(x, position_ids)
        self.coda = model.coda_layers
        share = getattr(model, "_first_depth_share", None)
        self.shared = share if share is None else self._shared(share, x, attention_mask, position_ids)
        if self.shared is not None and self.shared.e is not None:
            self.e = self.shared.e
            return
        for layer in model.prelude_layers:
            x = call_layer(model, layer, x, self.plain_mask, self.pe, self.pos, self.store, 0)
        self.e = x
        if self.shared is not None:
            self.shared.e = x
            share.add_bytes(x)

    def _shared(self, share, x, attention_mask, position_ids):
        m = self.model
        if m.training or torch.is_grad_enabled() or _has_hooks([*m.prelude_layers, *m.core_layers, *self.coda]):
            return None
        self._share = share
        return share.lookup(self.attn, x, attention_mask, position_ids)

    def first_active(self, B, T):
        return torch.ones(B, T, dtype=torch.bool, device=self.e.device)

    def begin_depth(self, d, active, lookahead=False):
        self.mask = self.attn.for_depth(d, active, lookahead)
        return AllTokens(active[-1])

    def core(self, d, x, run):
        sh = self.shared if d == 1 else None
        if sh is not None and sh.core is not None:
            out, kv = sh.core
            self.store.kv.update(kv)
            return out
        for layer in self.model.core_layers:
            x = call_layer(self.model, layer, x, self.mask, self.pe, self.pos, self.store, d)
        if sh is not None:
            kv = {k: v for k, v in self.store.kv.items() if k[1] == 1}
            sh.core = (x, kv)
            self._share.add_bytes(x, *(t for pair in kv.values() for t in pair))
        return x

    def _coda_at(self, d, h):
        """The coda over depth ``d``'s states ``h`` (depth 1's from the shared store when there is one)."""
        sh = self.shared if d == 1 else None
        if sh is None:
            return self._coda(h)
        if sh.coda is None:
            sh.coda = self._coda(h)
            self._share.add_bytes(sh.coda)
        return sh.coda

    def _coda(self, h):
        """The coda layers (if any) over a full sequence of states ``[B, T, H]``."""
        for layer in self.coda:
            h = call_layer(self.model, layer, h, self.plain_mask, self.pe, self.pos, self.store, 0)
        return h

    def _readout(self, h, rows=None, d=None):
        """Coda (if any) + final norm + LM head: ``[B, T, H]`` -> ``[B, T, V]``, or ``[N, V]`` at the flat
        positions ``rows`` only (the coda still runs over the whole sequence). ``d``: ``h`` is depth ``d``'s
        states (depth 1's coda may be shared)."""
        y = self._coda(h) if d is None else self._coda_at(d, h)
        return head(self.model, y if rows is None else y.reshape(-1, y.shape[-1]).index_select(0, rows))

    def readout(self, d, h, raw, run, la, separate_lookahead=False):
        raw = raw.view_as(h)
        # under fixed_graph every rank runs the same layers, lookahead rows or not (FSDP/ZeRO-3 collectives)
        has_la = la is not None and (self.model.loop.fixed_graph or bool(la.any()))
        if has_la and not self.coda and not separate_lookahead:
            # without a coda the readout is per token: one pass serves the executed tokens and the
            # lookahead ones (their input detached, and their logits only feed depth_nll, so the
            # lookahead stays gradient-free) instead of a second vocabulary-wide readout
            z = self._readout(torch.where(la[..., None], raw.detach(), h))
        else:
            z = self._readout(h, d=d)
            if has_la:
                with torch.no_grad():
                    z_la = self._readout(torch.where(la[..., None], raw, h))
                z = torch.where(la[..., None], z_la, z)
        return z.reshape(-1, z.shape[-1]), z

    def readout_rows(self, d, h, raw, la, rows, full):
        """Depth ``d``'s readout for the loss path at the flat positions ``rows`` ``[N]`` only.

        The coda attends over the whole sequence, so it runs on every token; the LM head and all
        vocabulary-wide work after it run on ``rows`` only (``full``: also every token's logits, e.g.
        for the decider's features). A lookahead token's row holds its gradient-free depth-``d``
        logits, as in ``readout``.

        Returns:
            ``(z_full, z_rows)``: ``[B, T, V]`` or None, and ``[N, V]``.
        """
        if full:
            z = self._readout(h, d=d)
            z_flat = z.reshape(-1, z.shape[-1])
            at = la.reshape(-1).nonzero().squeeze(1) if la is not None else None
            src = at
        else:
            z_flat = self._readout(h, rows, d=d)
            at = la.reshape(-1).index_select(0, rows).nonzero().squeeze(1) if la is not None else None
            src = rows.index_select(0, at) if at is not None else None
        # rows ``at`` <- the lookahead logits of positions ``src``; under fixed_graph the coda runs even for none, so
        # every rank runs the same layers (FSDP/ZeRO-3 collectives)
        if at is not None and (at.numel() or (self.coda and self.model.loop.fixed_graph)):
            with torch.no_grad():
                z_la = self._readout(torch.where(la[..., None], raw.view_as(h), h), src)
            z_flat = z_flat.index_copy(0, at, z_la.to(z_flat.dtype))
        if full:
            return z_flat.view_as(z), z_flat.index_select(0, rows)
        return None, z_flat

    def end_depth(self, d, run, stop):
        pass

    def final_readout(self, final, logits_to_keep):
        return _keep(self._readout(final), logits_to_keep)

    def final_readout_rows(self, final, rows):
        """``final_readout`` at the flat positions ``rows`` only: ``[B, T, H]`` -> ``[N, V]``."""
        return self._readout(final, rows)

    def finish(self, d_last, h, depths):
        pass


class CachedStep:
    """One incremental step with a ``DepthKVCache`` (see the module docstring).

    Args:
        model: the looped model, in eval mode.
        cache: the ``DepthKVCache`` (None: a new one, returned in ``self.cache``).
        x: ``[B, Tn, H]`` the new tokens' embeddings.
        attention_mask: ``[B, S + Tn]`` (past and new) or ``[B, Tn]`` padding mask; None = no padding.
        position_ids: ``[B, Tn]``; default: each row's real tokens count on from its last position.
        readout: the step reads out every depth (TaH2's decider, the ``kl`` exit, depth logits).
    """

    supports_lookahead = False

    def __init__(self, model, cache, x: torch.Tensor, attention_mask=None, position_ids=None, readout=False):
        if model.training:
            raise RuntimeError("incremental decoding with a cache is inference-only; call model.eval() first")
        if cache is None:
            cache = DepthKVCache(model.config)
        if not isinstance(cache, DepthKVCache):
            raise TypeError(
                f"a looped model needs a retrofit.model.cache.DepthKVCache, got {type(cache).__name__}; "
                "pass cache=DepthKVCache(model.config) or let generate() create it"
            )
        B, Tn, _ = x.shape
        dev = x.device
        S0 = cache.get_seq_length()
        if attention_mask is None:
            new_valid = torch.ones(B, Tn, dtype=torch.bool, device=dev)
        elif attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
        elif attention_mask.shape[1] == S0 + Tn:
            new_valid = attention_mask[:, S0:].bool()
        elif attention_mask.shape[1] == Tn:
            new_valid = attention_mask.bool()
        else:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns; expected past + new = {S0} + {Tn} or new = {Tn}"
            )
        if position_ids is None:
            position_ids = (
                cache.next_position_ids(new_valid)
                if cache.batch is not None
                else (new_valid.long().cumsum(1) - 1).clamp_min(0)
            )
        else:
            position_ids = position_ids.expand(B, Tn)
        self.model, self.cache, self.dtype = model, cache, x.dtype
        self.new_valid, self.pos, self.readout_all = new_valid, position_ids, readout
        self.real = new_valid  # [B, Tn] not padding
        self.S0 = cache.begin_step(new_valid, position_ids, readout)
        self.dense_mask = cache.dense_mask(self.S0, Tn, x.dtype)
        self.pe = model.model.rotary_emb(x, position_ids)
        self.coda = model.coda_layers
        self.z_full = None
        for layer in model.prelude_layers:
            x = call_layer(model, layer, x, self.dense_mask, self.pe, self.pos, cache.prelude, 0)
        self.e = x

    def first_active(self, B, T):
        return self.new_valid  # padding never enters the core

    def begin_depth(self, d, active, lookahead=False):
        pack = Pack(active[-1])
        if pack.N == 0:
            return None
        cos, sin = self.pe
        self.pe_p = (pack.gather(cos), pack.gather(sin))
        self.pos_p = pack.gather(self.pos)
        self.mask = self.cache.core.begin_depth(d, pack, self.S0, self.dtype)
        return pack

    def core(self, d, x, run):
        for layer in self.model.core_layers:
            x = call_layer(self.model, layer, x, self.mask, self.pe_p, self.pos_p, self.cache.core, d)
        return x

    def readout(self, d, h, raw, run, la, separate_lookahead=False):
        if self.coda:
            # the reference readout runs the coda over every token's (passthrough) state at depth d
            y = h
            for layer in self.coda:
                y = call_layer(self.model, layer, y, self.dense_mask, self.pe, self.pos, self.cache.coda_readout[d], 0)
            z_run = head(self.model, run.select(y))
        else:
            z_run = head(self.model, run.select(h))
        # the latest logits of every token (exited ones keep theirs): the decider's features
        if run.full:
            self.z_full = z_run
        else:
            prev = self.z_full if self.z_full is not None else z_run.new_zeros(run.B * run.Tn, z_run.shape[-1])
            self.z_full = prev.index_copy(0, run.flat, z_run)
        return z_run, self.z_full.view(run.B, run.Tn, -1)

    def end_depth(self, d, run, stop):
        self.cache.core.mark_last(run.select(stop))

    def final_readout(self, final, logits_to_keep):
        y = final
        for layer in self.coda:
            y = call_layer(self.model, layer, y, self.dense_mask, self.pe, self.pos, self.cache.coda, 0)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            y = y[:, -logits_to_keep:]
            logits_to_keep = 0
        return _keep(head(self.model, y), logits_to_keep)

    def finish(self, d_last, h, depths):
        if self.readout_all and self.coda:
            # later tokens may run deeper: their depth-j readout sees this step's tokens at depth j
            for j in range(d_last + 1, self.model.loop.max_depth + 1):
                y = h
                for layer in self.coda:
                    y = call_layer(
                        self.model, layer, y, self.dense_mask, self.pe, self.pos, self.cache.coda_readout[j], 0
                    )
        self.cache.end_step(depths)
