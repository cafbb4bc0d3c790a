"""How a looped backbone's attention modules reach the attention function (docs/long-context.md).

``install`` gives every attention module a ``LoopedAttentionConfig``, whose ``_attn_implementation``
names ``looped_attention_forward`` (``retrofit.model.depth_attention``, registered with transformers'
``AttentionInterface`` under ``ATTENTION_NAME``); ``delegate`` hands every call that is not the core's depth
attention, unchanged, to the implementation the user chose (sdpa, eager, flex_attention, flash_attention_*).
"""

from __future__ import annotations

import importlib

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

#: the name ``looped_attention_forward`` is registered under (what ``LoopedAttentionConfig`` reports)
ATTENTION_NAME = "retrofit_looped"


class LoopedAttentionConfig:
    """The config an attention module of a looped backbone sees: the backbone's own config, read and
    written through, except that ``_attn_implementation`` names ``looped_attention_forward``.

    The user's choice stays on the real config (``inner``), where ``set_attn_implementation`` changes it;
    ``looped_attention_forward`` reads it on every call.
    """

    def __init__(self, config):
        object.__setattr__(self, "inner", config)

    @property
    def _attn_implementation(self) -> str:
        return ATTENTION_NAME

    def __getattr__(self, name):
        if name == "inner" or name.startswith("__"):  # copy/pickle probe dunders before ``inner`` exists
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def __repr__(self):
        return f"LoopedAttentionConfig({self.inner._attn_implementation!r})"


def install(backbone) -> None:
    """Route the attention of every decoder layer of ``backbone`` through ``looped_attention_forward``.

    The layers are the base model's own (shared by reference with the base model, which then runs
    through the same function and gets its own implementation's result: every call without a
    ``DepthMask`` is handed over unchanged).
    """
    proxies: dict[int, LoopedAttentionConfig] = {}
    for layer in backbone.layers:
        attn = layer.self_attn
        if isinstance(attn.config, LoopedAttentionConfig):
            continue
        key = id(attn.config)
        if key not in proxies:
            proxies[key] = LoopedAttentionConfig(attn.config)
        attn.config = proxies[key]


class _AsBase:
    """The attention module as its own implementation sees it: the module, with its real config
    (flash-attention reads ``module.config._attn_implementation`` to pick its kernel)."""

    __slots__ = ("_module", "config")

    def __init__(self, module, config):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", config)

    def __getattr__(self, name):
        return getattr(self._module, name)


_EAGER: dict[str, object] = {}


def _eager_of(module):
    """The model file's own ``eager_attention_forward`` (what transformers falls back to for "eager")."""
    name = type(module).__module__
    if name not in _EAGER:
        _EAGER[name] = importlib.import_module(name).eager_attention_forward
    return _EAGER[name]


def delegate(module, query, key, value, attention_mask, impl: str | None = None, **kwargs):
    """Run the user's attention implementation (or ``impl``, as given) exactly as the base model would.

    Without ``impl``, the decode path's dense masks go to sdpa when the user's implementation is flash- or
    flex-attention (``_route``): neither takes a dense mask (flash not at all, flex only as a per-element
    score).
    """
    config = module.config.inner if isinstance(module.config, LoopedAttentionConfig) else module.config
    if impl is None:
        impl = config._attn_implementation or "sdpa"
        impl = _route(impl, query, key, attention_mask)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, _eager_of(module))
    return fn(_AsBase(module, config), query, key, value, attention_mask, **kwargs)


def _route(impl: str, query, key, attention_mask) -> str:
    """sdpa for what flash- and flex-attention cannot take: a dense 4-D mask (the decode path's), and, for
    flex, no mask over cached keys (the decode path without padding; transformers' own flex masks are
    ``BlockMask``s). A 2-D padding mask or None stays with flash-attention, which reads them itself."""
    if impl in ("sdpa", "eager"):
        return impl
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return "sdpa"
    if impl == "flex_attention" and attention_mask is None and key.shape[2] != query.shape[2]:
        return "sdpa"
    return impl
