"""The checkpoint format the plugin reads: ``config.json`` of a looped model, and the loop spec in it.

A looped checkpoint (``save_pretrained`` or ``retrofit export``) has a flat Llama/Qwen3 config with
``model_type`` ``looped_llama`` / ``looped_qwen3``, ``architectures`` ``[LoopedLlamaForCausalLM]`` /
``[LoopedQwen3ForCausalLM]`` and a ``loop`` dict (the fields of ``retrofit.LoopConfig``). This
module depends on that format only, not on retrofit's modeling code: the plugin must keep working
while retrofit's internals change, and an export folder is served where retrofit's modeling code is
not what wrote it. Only transformers is imported here (no vLLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, LlamaConfig, Qwen3Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

#: the methods this plugin serves (its per-method adapters in model.py and heads.py): the registered methods that
#: declare ``vllm_supported`` (retrofit.model.registry); a checkpoint of any other method gets one clear error
METHODS = ("tah2", "anira-e", "anira-o", "fixed")
ATTENTION_MODES = ("same-depth", "duo-causal")
# the method's attention when the checkpoint leaves it None: a copy of those methods' ``default_attention``
# (the plugin does not import retrofit.model); tests/vllm_plugin/test_vllm_plugin_config.py keeps both equal
DEFAULT_ATTENTION = {
    "tah2": "duo-causal",
    "anira-e": "same-depth",
    "anira-o": "same-depth",
    "fixed": "same-depth",
}
#: the methods' own options (``config.loop["options"]``) the plugin reads; the others only shape training
#: (the loss weights, the training decisions) and are ignored. Keep in step with the methods' ``Options``
#: dataclasses (tests/vllm_plugin/test_vllm_plugin_config.py checks it).
SERVED_OPTIONS = {
    "tah2": ("decider_top_k", "decider_arch", "exit_threshold", "mixture_output"),
    "anira-o": ("halt_threshold",),
}
TRAINING_ONLY_OPTIONS = {
    "tah2": (
        "alpha_d",
        "rho",
        "decider_weighting",
        "dyn_pos_weight",
        "pos_weight",
        "cost_min",
        "cost_max",
        "decider_loss_norm",
        "bce_margin",
        "kappa_scope",
        "kappa_gather",
        "decider_loss_scope",
        "train_decisions",
        "decider_topk_grad",
        "decider_init_std",
        "decider_init",
    ),
    "anira-e": ("gamma", "prior_base", "gumbel_tau"),
    "anira-o": ("gamma", "prior_base"),
}


def _flat(table: dict) -> tuple[str, ...]:
    """The option names of ``table`` (every method's), as the flat fields of checkpoints written before retrofit
    0.4 nested them in ``options`` (those stored every method's settings)."""
    return tuple(sorted({name for names in table.values() for name in names}))


# loop fields that only shape training: serving ignores them
TRAINING_ONLY = (
    "fixed_graph",
    "deep_init_logit",
    "extra",
    # vLLM schedules real tokens only: there is no padding to stop
    "padding_stops",
    *_flat(TRAINING_ONLY_OPTIONS),
)
INFERENCE_FIELDS = (
    "prelude",
    "core",
    "max_depth",
    "method",
    "attention",
    "updater",
    "updater_hidden",
    "decider_state",
    "decider_hidden",
    "decider_width_rule",
    "options",  # a method's own options (retrofit >= 0.4; earlier checkpoints store them as flat fields)
    *_flat(SERVED_OPTIONS),
)
#: what the plugin serves of the fields whose values it cannot all serve (absent: the value of checkpoints
#: written before the field existed, retrofit.model.config.LEGACY_VALUES)
SERVED_VALUES = {"updater": ("residual", "release"), "decider_state": ("core", "final_norm")}
#: config attribute that forces every token to one depth (set it with vLLM's ``hf_overrides``)
SERVE_DEPTH_ATTR = "retrofit_depth"

UNSUPPORTED_HINT = (
    "vLLM serves retrofit checkpoints with methods {methods} and attention {modes}, with the decider's "
    "exits or a fixed depth; for anything else serve with retrofit itself (`retrofit generate`, or the "
    "HF model's generate())"
)


class LoopSpecError(ValueError):
    """A looped config the plugin cannot serve; the message says why and what is supported."""


@dataclass(frozen=True)
class LoopSpec:
    """What serving needs from ``config.loop``, resolved against the model (docs/looped-model.md, docs/tah2.md,
    docs/anira.md).

    Attributes:
        prelude / core / coda: layer index ranges.
        max_depth: ``D``.
        method / attention: see ``retrofit.LoopConfig``; ``attention`` is resolved (never None).
        updater_hidden / decider_hidden: head widths (defaults resolved: ``H``, and ``H`` under
            ``decider_width_rule="release"`` — a converted model stores the width it chose — or ``max(1, H // 4)``).
        top_k: TaH2 decider's top-K probability features (0: none; None in the checkpoint: ``H``).
        decider_arch: TaH2 decider's body, ``"swiglu"`` (the authors' release) or ``"ffn"`` (checkpoints
            written before the field existed).
        exit_threshold / halt_threshold: TaH2's ``τ_exit``; ANIRA-O's inference ``u``.
        mixture_output: TaH2 output = mixture of per-depth distributions.
        updater: ``"residual"`` (``e + W2·SiLU(W1·)``) or ``"release"`` (the TaH2 release's updater; absent in
            checkpoints written before the field: ``"residual"``).
        decider_state: the state the decider and the updater read, ``"core"`` or ``"final_norm"`` (the final norm
            of the core output; absent: ``"core"``).
        serve_depth: every token runs this many iterations (None: the method's decider).
    """

    prelude: range
    core: range
    coda: range
    max_depth: int
    method: str
    attention: str
    updater_hidden: int
    decider_hidden: int
    top_k: int
    decider_arch: str
    exit_threshold: float
    halt_threshold: float
    mixture_output: bool
    updater: str
    decider_state: str
    serve_depth: int | None

    @property
    def needs_readout(self) -> bool:
        """TaH2 reads every depth's next-token distribution (decider features, output mixture), unless its
        decider reads no probabilities and its output is the exit depth's."""
        return self.method == "tah2" and (self.top_k > 0 or self.mixture_output)


def _error(msg: str) -> LoopSpecError:
    return LoopSpecError(
        f"{msg}. " + UNSUPPORTED_HINT.format(methods=", ".join(METHODS), modes=", ".join(ATTENTION_MODES))
    )


def loop_spec(config) -> LoopSpec:
    """Read and validate the loop spec of a looped HF config (one clear error if it cannot be served).

    Args:
        config: the checkpoint's config (any object with ``loop``, ``num_hidden_layers``,
            ``hidden_size``; ``retrofit_depth`` optional).

    Raises:
        LoopSpecError: the config is not a looped one, or asks for something vLLM does not serve.
    """
    loop = getattr(config, "loop", None)
    if not isinstance(loop, dict):
        raise _error(
            f"config has no `loop` dict (model_type {getattr(config, 'model_type', None)!r}): not a looped checkpoint"
        )
    unknown = sorted(set(loop) - set(INFERENCE_FIELDS) - set(TRAINING_ONLY))
    if unknown:
        raise _error(f"config.loop has fields this plugin does not know: {unknown}")
    n = int(config.num_hidden_layers)
    H = int(config.hidden_size)
    method = loop.get("method", "tah2")
    if method not in METHODS:
        raise _error(f"method {method!r} is not served by the vLLM plugin")
    options = loop.get("options") or {}
    unserved = sorted(set(options) - set(SERVED_OPTIONS.get(method, ())) - set(TRAINING_ONLY_OPTIONS.get(method, ())))
    if unserved:
        raise _error(f"config.loop has {method} options this plugin does not know: {unserved}")
    # TaH2's top-K: an option (retrofit >= 0.4) or a flat field; None = the hidden size; absent = 10 (retrofit < 0.2)
    top_k = options["decider_top_k"] if "decider_top_k" in options else loop.get("decider_top_k", 10)
    attention = loop.get("attention") or DEFAULT_ATTENTION[method]
    if attention not in ATTENTION_MODES:
        raise _error(f"unknown attention mode {attention!r}")
    D = loop.get("max_depth", 2)
    p = loop.get("prelude", 0)
    c = loop.get("core")
    c = n - p if c is None else c
    if not (
        isinstance(D, int) and D >= 1 and isinstance(p, int) and isinstance(c, int) and 0 <= p and c >= 1 and p + c <= n
    ):
        raise _error(f"invalid loop ranges: prelude={p}, core={c}, max_depth={D} for {n} layers")
    types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise _error(f"only full-attention layers can be looped; layer_types has {sorted(set(types))}")
    for name, served in SERVED_VALUES.items():
        value = loop.get(name, served[0])
        if value not in served:
            raise LoopSpecError(
                f"config.loop has {name}={value!r}, which the vLLM plugin does not serve (it serves {name} "
                f"{' or '.join(repr(v) for v in served)}); serve this checkpoint with retrofit itself "
                "(`retrofit serve`, `retrofit generate`, or the HF model's generate())"
            )
    depth = getattr(config, SERVE_DEPTH_ATTR, None)
    if depth is not None and not (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= D):
        raise LoopSpecError(f"{SERVE_DEPTH_ATTR}={depth!r} is out of range: allowed None (the decider) or 1..{D}")
    return LoopSpec(
        prelude=range(p),
        core=range(p, p + c),
        coda=range(p + c, n),
        max_depth=D,
        method=method,
        attention=attention,
        updater_hidden=loop.get("updater_hidden") or H,
        decider_hidden=loop.get("decider_hidden")
        or (H if loop.get("decider_width_rule", "quarter") == "release" else max(1, H // 4)),
        top_k=H if top_k is None else top_k,
        decider_arch=options.get("decider_arch", loop.get("decider_arch", "ffn")),  # absent: before the release's
        exit_threshold=float(options.get("exit_threshold", loop.get("exit_threshold", 0.5))),
        halt_threshold=float(options.get("halt_threshold", loop.get("halt_threshold", 0.5))),
        mixture_output=bool(options.get("mixture_output", loop.get("mixture_output", True))),
        updater=loop.get("updater", "residual"),
        decider_state=loop.get("decider_state", "core"),
        serve_depth=depth,
    )


# ------------------------------------------------------------------------------------------------
# Config classes, for processes where retrofit's own are not registered (`import retrofit` registers
# those; they then take precedence and these stay unused).
# ------------------------------------------------------------------------------------------------
@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class ServedLoopedLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the ``loop`` dict."""

    model_type = "looped_llama"
    loop: dict | None = None


@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class ServedLoopedQwen3Config(Qwen3Config):
    """``Qwen3Config`` plus the ``loop`` dict."""

    model_type = "looped_qwen3"
    loop: dict | None = None


def register_configs() -> None:
    """Make ``AutoConfig`` read looped configs without remote code (no-op for registered types)."""
    for cls in (ServedLoopedLlamaConfig, ServedLoopedQwen3Config):
        if cls.model_type not in CONFIG_MAPPING:
            AutoConfig.register(cls.model_type, cls)
