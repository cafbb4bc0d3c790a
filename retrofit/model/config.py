"""The loop specification: which layers loop, how deep, which halting method, which attention.

A pretrained stack ``L_0 … L_{N-1}`` is split into three contiguous ranges (docs/looped-model.md)::

    prelude = L_0 … L_{p-1}          runs once per token
    core    = L_p … L_{p+c-1}        runs d = 1 … max_depth times per token
    coda    = L_{p+c} … L_{N-1}      runs once, on each token's exit-depth state

``LoopConfig`` holds what changes the model's function; each halting method's own settings (TaH2's loss weights
and switches, ANIRA's prior, Ouro's exit rule) live in that method's ``Options`` dataclass, in its module, and are
nested here as ``LoopConfig.options``: the model computes its own auxiliary loss from them when given labels, so
any trainer optimizes the method's objective. Other training hyper-parameters live with the trainer
(``retrofit.training``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import registry
from .errors import RetrofitUserError

ATTENTION_MODES = ("duo-causal", "same-depth")
UPDATERS = ("release", "residual")
DECIDER_STATES = ("final_norm", "core")
DECIDER_WIDTH_RULES = ("release", "quarter")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def __getattr__(name):
    """``METHODS`` (the registered method names) and ``DEFAULT_ATTENTION`` (each one's natural attention,
    docs/looped-model.md): read from the registry (``retrofit.model.registry``), where each method declares
    them."""
    if name == "METHODS":
        return registry.names()
    if name == "DEFAULT_ATTENTION":
        return {n: registry.method_class(n).default_attention for n in registry.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The model-side fields whose default (``None``) the method chooses (its ``loop_defaults``: TaH2 takes the authors'
#: release, docs/tah2.md "the options of the release"); these are the values of a method that declares none.
GENERIC_DEFAULTS: dict[str, Any] = {
    "updater": "residual",
    "decider_state": "core",
    "decider_width_rule": "quarter",
    "padding_stops": False,
}


#: Upper bound of ``max_depth``. Every depth keeps its own K/V for the core layers in the cache and,
#: in training, its own activations and next-token logits ``[B, T, V]``, so memory and time grow
#: linearly with the depth; the looped-model papers train at 2-8 (TaH2, ANIRA) and at most 32 on
#: average (Huginn). 64 leaves room for test-time extrapolation; raise it here if you really need more.
MAX_DEPTH = 64


class LoopConfigError(RetrofitUserError, ValueError):
    """An invalid loop specification; the message says what was wrong and what is allowed."""


class DepthError(RetrofitUserError, ValueError):
    """A forced exit depth (``depth=``) of the wrong type, shape or range."""


#: Fields added after retrofit 0.1 whose default changed what the model computes, with the value an older
#: checkpoint (whose stored ``loop`` dict lacks the field) was trained with: ``LoopConfig.from_dict``.
#: 0.2: the release's decider; 0.3: the rest of the release (docs/tah2.md, "the options of the release"). A
#: method's own options have theirs in its ``Options.LEGACY_VALUES`` (TaH2's loss guards).
LEGACY_VALUES: dict[str, Any] = {
    "updater": "residual",
    "decider_state": "core",
    "decider_width_rule": "quarter",
    "padding_stops": False,
}


@dataclass
class LoopConfig:
    """How to loop a pretrained model.

    Args:
        prelude: Number of leading layers run once per token (0 = whole-stack looping).
        core: Number of layers looped after the prelude. ``None`` means all remaining layers
            (whole-stack looping when ``prelude == 0``); the layers after the core form the coda.
        max_depth: Maximum number of core iterations ``D`` (TaH2's ``M``). 1 reproduces the base model.
        method: Halting method: a registered name (``retrofit.model.registry``; built in: ``"tah2"``,
            ``"anira-e"``, ``"anira-o"``, ``"fixed"``, ``"ouro"``).
        attention: ``"duo-causal"`` (attend to every executed depth ≤ the current one, TaH2) or
            ``"same-depth"`` (attend to each earlier token once, at depth ``min(d, d*_s)``, ANIRA).
            ``None`` picks the method's natural mode (its ``default_attention``).
        updater: How depth ``d + 1``'s core input is made from ``e`` and the state ``s_d`` (docs/tah2.md,
            "updater"): ``"release"`` (the TaH2 release's ``SwiGLUUpdater``, which replaces the core input;
            PyTorch's init, so depth 2 is not depth 1 at init) or ``"residual"`` (``e + W2·SiLU(W1·)``,
            ``W2 = 0``). Either way depth-1 exits reproduce the base model. ``None``: the method's default.
        updater_hidden: Hidden width of the updater MLP; ``None`` = the model's hidden size. Lower
            it if the heads' parameter share matters (the report in ``retrofit.model.heads``).
        decider_state: The state ``s_d`` the decider and the updater read after depth ``d``:
            ``"final_norm"`` (the release's ``hidden_states[-1]``: the final norm of the core output, before
            any coda) or ``"core"`` (the core output).
        decider_hidden: Hidden width of the decider; ``None`` = the width of ``decider_width_rule``.
        decider_width_rule: The decider's width when ``decider_hidden`` is None: ``"release"`` (``H``, halved
            until the heads fit 3% of the base model, ``heads.release_decider_width``; the converted model
            stores the width) or ``"quarter"`` (``H // 4``, retrofit < 0.3).
        padding_stops: padding positions (``attention_mask == 0``) stop at depth 1 and get no lookahead
            iteration (the release); real tokens never see padding, so their outputs are unchanged.
        updater, decider_state, decider_width_rule, padding_stops: ``None`` =
            the method's default (its ``loop_defaults``, else ``GENERIC_DEFAULTS``: the release's for TaH2), resolved
            on construction.
        fixed_graph: Always unroll all ``max_depth`` iterations, even when every token has exited.
            Needed under DeepSpeed ZeRO-3, whose trace cache thrashes on dynamic control flow, and under FSDP,
            whose per-layer all-gathers hang when the ranks run the core a different number of times; the
            recipes set it under both (``retrofit.training.model_setup.sharded_training``). The extra iterations
            change no token: losses and gradients are the same.
        options: The method's own options (the fields of its ``Options`` dataclass, in the method's module:
            ``TaH2Options``, ``AniraOnlineOptions``, ``AniraEarlyOptions``, ``OuroOptions``), validated and
            completed with their defaults; a method without options takes none. ``LoopConfig.from_fields``
            takes them by name too, and ``from_dict`` moves the flat fields of checkpoints written before the
            nesting into them.
        deep_init_logit: Initial logit of the deciders' "continue" choice (ANIRA, and TaH2's ``"ffn"``
            decider). Deciders start deep (they continue at init) because shallow starts trap training
            (an ACT finding).
    """

    prelude: int = field(
        default=0, metadata={"help": "Layers run once before the loop (0 = whole-stack looping, as TaH2 and Ouro)."}
    )
    core: int | None = field(
        default=None,
        metadata={"help": "Layers looped after the prelude; the rest form the coda. None = all remaining."},
    )
    max_depth: int = field(
        default=2, metadata={"help": "Maximum iterations (TaH2's M; ANIRA's D). Compute grows ~linearly with it."}
    )
    method: str = field(
        default="tah2",
        metadata={"help": ("Halting method: tah2, anira-e, anira-o or fixed (the recipe says which it takes).")},
    )
    attention: str | None = field(
        default=None, metadata={"help": "duo-causal (TaH2) or same-depth (ANIRA); default: the method's own."}
    )
    updater: str | None = field(
        default=None,
        metadata={
            "help": (
                "How depth d+1's core input is made: 'release' (the TaH2 release's SwiGLU updater, replaces"
                " the core input, PyTorch init) or 'residual' (e + a zero-initialized MLP). None = the "
                "method's default (release for tah2, residual otherwise)."
            )
        },
    )
    updater_hidden: int | None = field(default=None, metadata={"help": "Updater MLP width; None = hidden size."})
    decider_state: str | None = field(
        default=None,
        metadata={
            "help": (
                "The state the decider and updater read after each depth: 'final_norm' (the final norm of "
                "the core output, the release) or 'core' (the core output). None = the method's default "
                "(final_norm for tah2, core otherwise)."
            )
        },
    )
    decider_hidden: int | None = field(
        default=None, metadata={"help": "Decider width; None = the width of --decider_width_rule."}
    )
    decider_width_rule: str | None = field(
        default=None,
        metadata={
            "help": (
                "Decider width when --decider_hidden is not set: 'release' (hidden size, halved until the "
                "heads fit 3%% of the base) or 'quarter' (hidden size / 4). None = the method's default "
                "(release for tah2)."
            )
        },
    )
    padding_stops: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Padding positions stop at depth 1 and get no lookahead iteration (the release); false = "
                "padding runs the loop. None = the method's default (true for tah2)."
            )
        },
    )
    fixed_graph: bool = field(
        default=False,
        metadata={
            "help": (
                "Unroll every depth in training even when every token has exited (a static graph: set by "
                "the recipes under DeepSpeed ZeRO-3 and FSDP, whose collectives need every rank to run the "
                "same layers)."
            )
        },
    )
    deep_init_logit: float = field(
        default=3.0, metadata={"help": "Initial continue logit of the deciders (> 0 = start deep; σ(3) = 0.95)."}
    )
    options: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        try:
            cls = registry.method_class(self.method)
        except registry.UnknownMethodError as e:
            raise LoopConfigError(str(e)) from None
        if self.attention is None:
            self.attention = cls.default_attention
        if self.attention not in ATTENTION_MODES:
            raise LoopConfigError(f"unknown attention mode {self.attention!r}; allowed: {', '.join(ATTENTION_MODES)}")
        if not _is_int(self.max_depth) or self.max_depth < 1:
            raise LoopConfigError(f"max_depth must be an integer >= 1, got {self.max_depth!r}")
        if self.max_depth > MAX_DEPTH:
            raise LoopConfigError(
                f"max_depth={self.max_depth} is above the limit of {MAX_DEPTH}: every depth keeps its own K/V and, in "
                f"training, its own activations and logits, so memory and time grow linearly with it (the papers use "
                f"2-32); use max_depth <= {MAX_DEPTH}"
            )
        if not _is_int(self.prelude) or self.prelude < 0:
            raise LoopConfigError(f"prelude must be an integer >= 0 (number of leading layers), got {self.prelude!r}")
        if self.core is not None and (not _is_int(self.core) or self.core < 1):
            raise LoopConfigError(f"core must be None (all remaining layers) or an integer >= 1, got {self.core!r}")
        for name, default in GENERIC_DEFAULTS.items():  # None: the method's own (resolved, so to_dict stores it)
            if getattr(self, name) is None:
                setattr(self, name, cls.loop_defaults.get(name, default))
        for name, allowed in (
            ("updater", UPDATERS),
            ("decider_state", DECIDER_STATES),
            ("decider_width_rule", DECIDER_WIDTH_RULES),
        ):
            if getattr(self, name) not in allowed:
                raise LoopConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("updater_hidden", "decider_hidden"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise LoopConfigError(f"{name} must be None or a positive integer, got {v!r}")
        if not _is_number(self.deep_init_logit) or not math.isfinite(self.deep_init_logit):
            raise LoopConfigError(f"deep_init_logit must be a finite number, got {self.deep_init_logit!r}")
        for name in ("fixed_graph", "padding_stops"):
            if not isinstance(getattr(self, name), bool):
                raise LoopConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._method_options = _method_options(cls, self.options)
        self.options = dataclasses.asdict(self._method_options)

    @property
    def method_options(self):
        """The method's own options: an instance of its ``Options`` dataclass (``options`` holds its fields), made
        and validated on construction like every field (the depth loop reads it at every depth). The model hands it
        to the method's losses (``HaltingMethod.loss``'s ``cfg``)."""
        return self._method_options

    # ----------------------------------------------------------------------------------------
    def layer_ranges(self, num_layers: int) -> tuple[range, range, range]:
        """Resolve the split against a stack of ``num_layers`` layers.

        Returns:
            ``(prelude, core, coda)`` as ``range`` objects of layer indices.

        Raises:
            LoopConfigError: if the ranges do not fit in ``num_layers``.
        """
        p = self.prelude
        if p >= num_layers:
            raise LoopConfigError(
                f"prelude={p} leaves no layer to loop: the model has {num_layers} layers, "
                f"so prelude must be in 0..{num_layers - 1}"
            )
        c = num_layers - p if self.core is None else self.core
        if p + c > num_layers:
            raise LoopConfigError(
                f"prelude={p} + core={c} = {p + c} exceeds the model's {num_layers} layers; "
                f"with prelude={p}, core must be in 1..{num_layers - p} (or None for all remaining)"
            )
        return range(0, p), range(p, p + c), range(p + c, num_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, source: Any, *, strict: bool = True, **override) -> "LoopConfig":
        """A ``LoopConfig`` from whatever holds its fields by name: parsed flags (an ``argparse.Namespace``,
        a dataclass such as ``LoopArgs``) or a mapping.

        Every ``LoopConfig`` field that ``source`` has is copied (``extra`` excepted), so a new field flows
        from a flag of the same name without edits here; fields it lacks keep their defaults. So do the
        chosen method's own options (a value of None keeps the option's default); setting another method's
        option is an error. ``override`` replaces fields (e.g. ``fixed_graph=True``, or a control arm's
        ``method``). ``strict=False`` drops other methods' options instead (one settings dict for several
        methods, as the tests' helpers have).
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

        def get(k):
            return source.get(k) if isinstance(source, Mapping) else getattr(source, k, None)

        def has(k):
            return k in source if isinstance(source, Mapping) else hasattr(source, k)

        values = {k: get(k) for k in names if has(k)}
        if "method" in override and has("method") and get("method") != override["method"]:
            values.pop("options", None)  # the source method's options are not the control's
        values = {**values, **override}
        # the method's own options, by name too (a flag named like an option; None = the method's default); a
        # control arm that overrides the method takes none of the source method's options
        method = values.get("method", cls.method)
        own = {f.name for f in dataclasses.fields(registry.method_class(method).Options)}
        opts = dict(values.get("options") or {})
        switched = "method" in override and has("method") and get("method") != override["method"]
        for name, (_, owners) in registry.option_fields().items():
            v = get(name) if has(name) and not switched else None
            if v is None:
                continue
            if name not in own:
                if not strict:
                    continue
                raise LoopConfigError(f"{name} is an option of method {' / '.join(owners)}, not of {method!r}")
            opts[name] = v
        if opts:
            values["options"] = opts
        return cls(**values)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoopConfig":
        """A ``LoopConfig`` from a stored dict (a checkpoint's ``config.loop``).

        ``to_dict`` writes every field and every option of the method, so a field or option missing from ``d`` was
        written before it existed: it takes the value of ``LEGACY_VALUES`` (a field) or of the method's
        ``Options.LEGACY_VALUES`` (an option) that reproduces what that older version computed (e.g. the ``"ffn"``
        decider, TaH2's unclamped costs), not the current default. Checkpoints written before the methods' options
        were nested (retrofit < 0.4) store them as flat fields (``alpha_d``, ``gamma``, ...), those of every method:
        the method's own move into ``options``, the others (which that model never read) are dropped.
        """
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        flat = {k: d.pop(k) for k in list(d) if k not in known and k in registry.option_fields()}
        unknown = set(d) - known
        if unknown:
            raise LoopConfigError(f"unknown LoopConfig fields {sorted(unknown)}; allowed: {sorted(known)}")
        try:
            method_cls = registry.method_class(d.get("method", cls.method))
        except registry.UnknownMethodError as e:
            raise LoopConfigError(str(e)) from None
        own = [f.name for f in dataclasses.fields(method_cls.Options)]
        opts = dict(d.get("options") or {})
        for k in own:
            if k in flat and k in opts and flat[k] != opts[k]:
                raise LoopConfigError(
                    f"config.loop has {k}={flat[k]!r} and options[{k!r}]={opts[k]!r}: a method's settings live in "
                    f"config.loop['options'] (retrofit >= 0.4); set {k} there"
                )
            if k not in opts and k in flat:
                opts[k] = flat[k]
        legacy = getattr(method_cls.Options, "LEGACY_VALUES", {})
        d["options"] = {**{k: v for k, v in legacy.items() if k not in opts}, **opts}
        return cls(**{**{k: v for k, v in LEGACY_VALUES.items() if k not in d}, **d})


def _method_options(cls, options):
    """``options`` checked by the method's ``Options`` dataclass and completed with its defaults: an instance of it
    (``LoopConfig`` stores its every field, so a checkpoint records what it ran with)."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise LoopConfigError(f"options must be a mapping of {cls.name}'s option names to values, got {options!r}")
    known = [f.name for f in dataclasses.fields(cls.Options)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        allowed = ", ".join(known) if known else "none"
        raise LoopConfigError(f"unknown options {unknown} for method {cls.name!r}; its options: {allowed}")
    try:
        return cls.Options(**options)
    except (TypeError, ValueError) as e:
        raise LoopConfigError(f"{cls.name} options: {e}") from None


def validate_depth(depth, batch: int, seq: int, max_depth: int):
    """Check a forced exit depth (the ``depth=`` argument of the looped forward and ``generate``).

    Args:
        depth: None, an int, or a ``[B, T]`` tensor of an *integer* dtype; values in ``1 … max_depth``.
        batch, seq: ``B`` and ``T`` of the input.
        max_depth: ``D``.

    Returns:
        None, or a ``[B, T]`` long tensor (an int is broadcast; ``batch``/``seq`` decide the shape).

    Raises:
        DepthError: a float or bool tensor (1.7 would silently become 1), a bool, a wrong shape, or a
            value outside ``1 … max_depth``.
    """
    if depth is None:
        return None
    import torch

    if _is_int(depth):
        if not 1 <= depth <= max_depth:
            raise DepthError(f"depth={depth} is out of range: allowed 1..{max_depth} (max_depth)")
        return torch.full((batch, seq), depth, dtype=torch.long)
    if isinstance(depth, torch.Tensor):
        if depth.dtype.is_floating_point or depth.dtype.is_complex or depth.dtype == torch.bool:
            raise DepthError(
                f"a depth tensor must have an integer dtype (depths are whole iterations), got {depth.dtype}; "
                "round it yourself and pass .long()"
            )
        if tuple(depth.shape) != (batch, seq):
            raise DepthError(f"a depth tensor must have shape [B, T] = {(batch, seq)}, got {tuple(depth.shape)}")
        depth = depth.long()
        if depth.numel() and (bool((depth < 1).any()) or bool((depth > max_depth).any())):
            raise DepthError(
                f"depth values must lie in 1..{max_depth} (max_depth); "
                f"got min {int(depth.min())}, max {int(depth.max())}"
            )
        return depth
    raise DepthError(f"depth must be None, an int or a [B, T] integer tensor, got {type(depth).__name__}")
