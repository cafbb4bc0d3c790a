"""``LoopedForCausalLM``: the looped causal LM around a pretrained backbone (docs/looped-model.md).

The class every family shares (``retrofit.model.modeling`` defines the configs and the family classes,
``LoopedLlamaForCausalLM`` / ``LoopedQwen3ForCausalLM``, and re-exports this one); see that module's
docstring for the forward, the loss and the wrapping by reference.
"""

from __future__ import annotations

import importlib
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import fixed_cross_entropy

from . import registry
from .backends import CachedStep, FullSequence
from .cache import DepthKVCache
from .config import LoopConfig, LoopConfigError
from .depth_attention import install as install_looped_attention
from .families import Family
from .generation import looped_generate
from .halting import build_halting
from .halting.base import AuxLoss
from .halting.training_free import resolve_exit_policy
from .heads import build_updater, init_tagged, parameter_count
from .loop import _kept_positions, exit_rule_for, forced_depths, run_depth_loop, shifted_labels
from .outputs import LoopedCausalLMOutput, _halting_signals_finite
from .schedulers import build_step_schedule
from .versions import check_versions

# exported remote code carries this check too (retrofit/__init__ is not bundled); TRL and PEFT are
# not needed by the modeling code, so only transformers is checked here
check_versions(packages=("transformers",))


def _from_installed_package(cls) -> bool:
    """``cls`` is retrofit's own class (not a copy loaded from an exported folder's remote code)."""
    return cls.__module__.split(".")[0] == "retrofit"


# ------------------------------------------------------------------------------------------------
def _trl_integration():
    """``retrofit.model.trl_fused``, imported by name: exported remote code leaves it out (no TRL needed)."""
    try:
        return importlib.import_module(__name__.rpartition(".")[0] + ".trl_fused")
    except ImportError:
        return None


class LoopedForCausalLM(PreTrainedModel):
    """A pretrained causal LM with a looped core and per-token adaptive depth.

    Build one with ``retrofit.convert(base_model, LoopConfig(...))`` (reuses the base's modules) or
    load a saved one with ``AutoModelForCausalLM.from_pretrained``. Family subclasses
    (``LoopedLlamaForCausalLM``, ``LoopedQwen3ForCausalLM``) only bind the config class.
    """

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # every implementation runs the prelude and coda as the base model would; the core's depth attention
    # has its own kernels per implementation (retrofit.model.depth_attention, docs/long-context.md)
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = False
    family: Family = None

    def __init__(self, config, backbone: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__(config)
        loop = config.loop_config
        if set(config.loop or {}) & set(registry.option_fields()):
            # written before the methods' settings were nested (flat alpha_d, exit_threshold, ...): store the current
            # layout, so a save or a calibrated threshold (written into options) cannot leave a stale flat copy
            config.loop = loop.to_dict()
        n_layers = config.num_hidden_layers
        self._ranges = loop.layer_ranges(n_layers)
        self._check_layer_types(config)
        self.model = backbone if backbone is not None else self.family.backbone_cls(config)
        install_looped_attention(self.model)
        self.vocab_size = config.vocab_size
        self.lm_head = lm_head if lm_head is not None else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        H = config.hidden_size
        self.updater = build_updater(loop.updater, H, loop.updater_hidden or H, eps=config.rms_norm_eps)
        loop = self._resolve_decider_shape(config, loop)
        self.halting = build_halting(H, loop)
        self._loop_checkpointing = False
        self._loop_checkpointing_kwargs: dict = {}
        if backbone is not None:
            # the reused modules are already trained: keep post_init's initializer off them
            for m in [*self.model.modules(), *self.lm_head.modules()]:
                m._is_hf_initialized = True
        self.post_init()

    # -- TRL (retrofit.model.trl_fused) -------------------------------------------------------------------
    _serves_trl_fused_head = True

    def __setattr__(self, name, value):
        if name == "forward" and callable(value):
            trl = _trl_integration()
            if trl is not None:
                value = trl.intercept(self, value)
        super().__setattr__(name, value)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        if _from_installed_package(cls):  # see _LoopedConfigMixin.register_for_auto_class
            return
        return super().register_for_auto_class(auto_class)

    # -- structure ---------------------------------------------------------------------------
    def _resolve_decider_shape(self, config, loop: LoopConfig) -> LoopConfig:
        """Write the decider's top-K (``None``: the hidden size) and its ``"release"`` width (which counts the base
        model's parameters: ``heads.release_decider_width``) into ``config.loop``: a saved checkpoint (and the vLLM
        plugin reading it) states the shapes it was built with. Returns the resolved ``LoopConfig``."""
        base = parameter_count(self.model, None if config.tie_word_embeddings else self.lm_head)
        cls = registry.method_class(loop.method)
        resolved = cls.resolve_shapes(loop, config.hidden_size, parameter_count(self.updater), base)
        if resolved:
            stored = dict(config.loop or {})
            options = {**(stored.get("options") or {}), **resolved.pop("options", {})}
            config.loop = {**stored, **resolved, **({"options": options} if options else {})}
        return config.loop_config if resolved else loop

    @staticmethod
    def _check_layer_types(config) -> None:
        types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in types):
            raise LoopConfigError(
                f"only full-attention layers can be looped; this config has layer_types {sorted(set(types))} "
                "(set use_sliding_window=False)"
            )

    def set_decider_threshold(self, value: float) -> str:
        """Set the decider's own threshold (the method's ``threshold_field``: TaH2's ``exit_threshold``, ANIRA-O's
        ``halt_threshold``, Ouro's ``exit_q``) in ``config.loop`` (what ``save_pretrained`` writes) and in the
        halting module that decides; returns the field's name.

        Raises:
            LoopConfigError: a method without one (the fixed loop; ANIRA-E decides by the argmax of ``q``) or a
                value outside ``[0, 1]``.
        """
        cls = type(self.halting)
        field = cls.threshold_field
        if field is None:
            allowed = [n for n in registry.names() if registry.method_class(n).threshold_field]
            raise LoopConfigError(
                f"method {cls.name!r} has no decider threshold to set; methods with one: {', '.join(allowed)}"
            )
        if not 0.0 <= float(value) <= 1.0:
            raise LoopConfigError(f"a decider threshold must lie in [0, 1], got {value!r}")
        self.config.loop = cls.with_threshold(self.config.loop or {}, float(value))
        if getattr(self.halting, "loop", None) is not None:
            self.halting.loop = LoopConfig.from_dict(self.config.loop)
        return field

    @property
    def loop(self) -> LoopConfig:
        """The ``LoopConfig`` of ``config.loop`` (parsed again whenever that dict changes)."""
        src = self.config.loop or {}
        if self.__dict__.get("_loop_src") != src:
            self.__dict__["_loop_cfg"] = LoopConfig.from_dict(src)
            self.__dict__["_loop_src"] = dict(src)
        return self.__dict__["_loop_cfg"]

    def _layer_slice(self, r: range) -> list[nn.Module]:
        # the decode loop reads these every depth: slice the ModuleList's dict, not item by item
        return list(self.model.layers._modules.values())[r.start : r.stop]

    @property
    def prelude_layers(self) -> list[nn.Module]:
        return self._layer_slice(self._ranges[0])

    @property
    def core_layers(self) -> list[nn.Module]:
        return self._layer_slice(self._ranges[1])

    @property
    def coda_layers(self) -> list[nn.Module]:
        return self._layer_slice(self._ranges[2])

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _init_weights(self, module):
        if hasattr(module, "_retrofit_init"):
            init_tagged(module, self.config.initializer_range)
            return
        super()._init_weights(module)

    # -- activation checkpointing (retrofit.model.backends.call_layer) ---------------------------------
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        self._loop_checkpointing = True
        self._loop_checkpointing_kwargs = dict(gradient_checkpointing_kwargs or {})
        self._loop_checkpointing_kwargs.setdefault("use_reentrant", False)
        if self._loop_checkpointing_kwargs["use_reentrant"]:
            warnings.warn("retrofit checkpoints layers with use_reentrant=False (keyword inputs, K/V store)")
            self._loop_checkpointing_kwargs["use_reentrant"] = False
        if getattr(self, "_hf_peft_config_loaded", False):
            self.enable_input_require_grads()

    activation_checkpointing_enable = gradient_checkpointing_enable

    def gradient_checkpointing_disable(self):
        self._loop_checkpointing = False

    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self._loop_checkpointing

    # -- forward -----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        depth: int | torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_depth_losses: bool = False,
        output_depth_logits: bool = False,
        backprop_depth: int | None = None,
        exit_policy=None,
        exit_threshold: float | None = None,
        step_schedule=None,
        output_router_logits: bool | None = None,
        labelled_logits_only: bool = False,
        decider_threshold: float | None = None,
        depth_cap: int | None = None,
        depth_supervision: bool = False,
        decider_phase: bool = False,
        **kwargs,
    ) -> LoopedCausalLMOutput:
        """Run the looped model on a full sequence, or decode incrementally with a cache.

        With ``cache=`` (a ``retrofit.model.cache.DepthKVCache``) or ``use_cache=True`` in eval mode, the
        call is one step of incremental decoding (``retrofit.model.backends.CachedStep``): only the new
        tokens run, exited tokens are not computed at deeper depths, and the cache is returned in
        ``cache``.

        Args:
            input_ids: ``[B, T]``.
            attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (left or right).
            position_ids: ``[B, T]``; defaults to ``0 … T-1``. Resets to 0 mark packed sequences.
            labels: ``[B, T]`` (shifted inside, -100 ignored) -> ``loss`` (next-token loss plus the
                weighted auxiliary loss, see ``output_router_logits``).
            depth: exit depth to force: an int for every token or a ``[B, T]`` tensor, each in
                ``1 … max_depth``; ``None`` lets the halting method decide. A forced depth runs no
                decider: the output is each token's exit-depth readout (no TaH2 mixture).
            output_depth_losses: also return ``depth_nll`` (needs labels).
            output_depth_logits: also return every depth's logits ``[D, B, T, V]`` (``[D, B, K, V]`` at the
                ``K`` positions of ``logits_to_keep``).
            backprop_depth: truncated backprop (Huginn): gradients flow through the last ``k`` core
                iterations only; iterations ``d ≤ n - k`` (``n`` = the largest forced depth, else
                ``max_depth``) run without autograd, so their activations are not stored. ``None``
                = full backprop. Readouts and deciders keep their gradients.
            exit_policy: who decides the exit depth: None/``"decider"`` (the halting method),
                ``"fixed"`` (with ``depth``), ``"kl"`` or ``"state"`` (training-free, with
                ``exit_threshold``; ``retrofit.model.halting.training_free``) or an ``ExitPolicy``.
            exit_threshold: the training-free exit's threshold.
            step_schedule: ``"unit"`` (default), ``"taps"`` or a ``StepSchedule``
                (``retrofit.model.schedulers.taps``).
            output_router_logits: with labels, compute the method's auxiliary loss (``aux_loss``)
                and add ``config.router_aux_loss_coef`` times it to ``loss``; default
                ``config.output_router_logits`` (True). TaH2's needs the per-depth losses, so it
                also runs the gradient-free lookahead iteration.
            logits_to_keep: ``k > 0``: logits of the last ``k`` positions only; a 1-D index tensor: of those
                positions (``logits`` ``[B, k, V]``, as in transformers). Without labels or a cache,
                every depth's LM head, TaH2's mixture and the final readout run at
                those positions only (the decider's features still read every position's depth-d logits).
            labelled_logits_only: with labels, run the LM head and every vocabulary-wide operation of
                the loss (log-softmax, TaH2's mixture, the per-depth losses) only at the positions
                with a next-token label (``labels[:, t + 1] != -100``): ``logits`` is then ``[N, V]``
                for those positions in row-major order (``logits_rows`` holds their flat indices into
                ``B * T``), and ``loss``, ``aux_loss`` and the other outputs are those of the full
                forward. Saves time and memory when prompts are not trained on (completion-only SFT):
                ``RetrofitSFTTrainer`` uses it for training steps. Not with a cache,
                ``output_depth_logits``, ``logits_to_keep`` or a logit-reading exit (``"kl"``).
            decider_threshold: this call's threshold for the method's own decider, replacing the
                ``LoopConfig``'s: TaH2's τ_exit (continue iff ``c >= τ``), ANIRA-O's cumulative halting mass
                ``u`` (inference), ANIRA-E's allocation quantile (inference: the first depth whose
                cumulative ``q`` reaches it, instead of the argmax). The accuracy-compute frontier sweeps it;
                TaH2's threshold warm-up ramps it in training.
            depth_cap: no token runs deeper than this (``1 … max_depth``): the release's depth curriculum.
            depth_supervision: with labels, deep supervision: every token runs every depth (up to
                ``depth_cap``), no decider runs, and ``loss`` is the mean over depths of each depth's own
                next-token loss (``depth_ce``), so every depth's readout gets gradient — the "train every
                depth before the decider decides" phase of ``RetrofitSFTConfig.depth_warmup_steps``.
            decider_phase: with labels, the decider-only phase (Ouro's Stage II;
                ``RetrofitSFTConfig.decider_phase_from``, whose trainer freezes everything but the decider): ``loss``
                is the method's
                ``decider_phase_loss`` (TaH2: its decider BCE; Ouro: the gate's BCE on the realized loss
                improvements) where it has one, else its usual loss.

        Returns:
            ``LoopedCausalLMOutput``.
        """
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        cached = cache is not None or bool(use_cache and not self.training and labels is None)
        if cached and labels is not None:
            raise ValueError(
                "labels are not supported with a cache; run the full-sequence forward (no cache) for a loss"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        if depth_cap is not None and not (isinstance(depth_cap, int) and 1 <= depth_cap <= self.loop.max_depth):
            raise ValueError(f"depth_cap must be None or an int in 1..{self.loop.max_depth}, got {depth_cap!r}")
        if decider_threshold is not None and not 0.0 <= float(decider_threshold) <= 1.0:
            raise ValueError(f"decider_threshold must lie in [0, 1], got {decider_threshold!r}")
        if depth_supervision:
            if labels is None or cached:
                raise ValueError("depth_supervision needs labels and the full-sequence forward (no cache)")
            if depth is not None or exit_policy is not None:
                raise ValueError("depth_supervision runs every token through every depth; drop depth= / exit_policy=")
            depth = depth_cap or self.loop.max_depth
        depth, policy = resolve_exit_policy(exit_policy, exit_threshold, depth)
        rule = exit_rule_for(forced_depths(depth, B, T, x.device, self.loop.max_depth), policy)
        schedule = build_step_schedule(step_schedule)
        shift = shifted_labels(labels) if labels is not None else None
        loss_rows = None
        if labelled_logits_only:
            if labels is None:
                raise ValueError("labelled_logits_only needs labels")
            conflicts = [
                ("a cache", cached),
                ("output_depth_logits", output_depth_logits),
                ("logits_to_keep", not (isinstance(logits_to_keep, int) and logits_to_keep == 0)),
                ("shift_labels", kwargs.get("shift_labels") is not None),
                (f"the {policy!r} exit", rule.needs_logits),
            ]
            for name, present in conflicts:
                if present:
                    raise ValueError(f"labelled_logits_only does not work with {name}")
            loss_rows = (shift.reshape(-1) != -100).nonzero().squeeze(1)
        kept = None
        if loss_rows is None and labels is None and not cached and not rule.needs_logits:
            # logits_to_keep (HF's "logits of these positions only", e.g. the last one in prefill): run the
            # loop's vocabulary-wide work (every depth's LM head but the decider's, TaH2's mixture) only there
            kept = _kept_positions(logits_to_keep, T, x.device)
            if kept is not None:
                loss_rows = (torch.arange(B, device=x.device)[:, None] * T + kept[None]).reshape(-1)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", True)
        want_aux = labels is not None and bool(output_router_logits)
        if decider_phase and (labels is None or depth_supervision):
            raise ValueError("decider_phase needs labels and excludes depth_supervision")
        # the main-loss hook (HaltingMethod.main_loss): in training, every executed depth's per-token loss
        main_hook = labels is not None and self.training and self.halting.needs_depth_ce and rule.runs_decider
        depth_losses = labels is not None and (
            output_depth_losses
            or depth_supervision
            or decider_phase
            or main_hook
            or (want_aux and self.halting.needs_depth_losses)
        )

        if cached:
            readout = (
                (self.halting.needs_depth_readout and rule.runs_decider) or output_depth_logits or rule.needs_logits
            )
            backend = CachedStep(self, cache, x, attention_mask, position_ids, readout)
        else:
            backend = FullSequence(self, x, attention_mask, position_ids)
        res = run_depth_loop(
            self,
            backend.e,
            backend,
            rule,
            schedule,
            shift_labels=shift if depth_losses else None,
            output_depth_logits=output_depth_logits,
            backprop_depth=backprop_depth,
            logits_to_keep=logits_to_keep,
            loss_rows=loss_rows,
            decider_threshold=decider_threshold,
            depth_cap=depth_cap,
            supervise_depths=depth_supervision,
            depth_ce_tokens=main_hook,
        )
        logits, depth_logits = res.logits, res.depth_logits
        if kept is not None:  # [B * K, V] in row-major order -> [B, K, V], as HF returns kept logits
            logits, loss_rows = logits.view(B, kept.numel(), -1), None
            if depth_logits is not None:
                depth_logits = depth_logits.view(depth_logits.shape[0], B, kept.numel(), -1)
        out = LoopedCausalLMOutput(
            logits=logits,
            depths=res.depths,
            depth_probs=res.depth_probs,
            halt_signals=res.halt_signals,
            halt_logits=res.halt_logits,
            depth_logits_q=res.depth_logits_q,
            depth_nll=res.depth_nll,
            depth_ce_tokens=res.depth_ce_tokens,
            depth_logits=depth_logits,
            active=res.active,
            cache=backend.cache if cached else None,
            logits_rows=loss_rows,
        )
        if labels is not None:
            loss_kwargs = {
                k: v for k, v in kwargs.items() if k in ("num_items_in_batch", "shift_labels", "ignore_index")
            }
            if loss_rows is None:
                out.loss = self.loss_function(
                    logits=out.logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs
                )
            else:  # ForCausalLMLoss on the labelled rows: the same sum (or mean) over the same targets
                target = shift.reshape(-1).index_select(0, loss_rows)
                out.loss = fixed_cross_entropy(
                    out.logits.float(),
                    target,
                    loss_kwargs.get("num_items_in_batch"),
                    loss_kwargs.get("ignore_index", -100),
                )
            if main_hook:  # the method's objective replaces the output's next-token loss
                main = self.halting.main_loss(out, labels, loss_kwargs.get("num_items_in_batch"))
                if main is not None:
                    out.loss = main
            if depth_supervision:  # the mean of every depth's own loss, each reduced as `loss` is
                n_items = loss_kwargs.get("num_items_in_batch")
                denom = n_items if n_items is not None else (shift != -100).sum().clamp_min(1)
                out.depth_ce = res.depth_ce_sum / torch.as_tensor(denom, device=res.depth_ce_sum.device)
                out.loss = out.depth_ce.mean()
            aux = None
            if want_aux and not _halting_signals_finite(out):
                # diverged decider weights: TaH2's BCE raises on NaN input, so no op runs on them; a NaN
                # loss instead, which a trainer's NaN stop names (retrofit.training.nan_guard)
                aux = AuxLoss(torch.full((), float("nan"), device=out.loss.device), {})
            elif want_aux:
                n_items = loss_kwargs.get("num_items_in_batch")
                opts = self.loop.method_options
                aux = self.halting.loss(out, labels, opts, attention_mask, num_items_in_batch=n_items)
            if aux is not None:
                out.aux_loss, out.aux_metrics = aux.loss, aux.metrics
                out.loss = out.loss + getattr(self.config, "router_aux_loss_coef", 1.0) * aux.loss
            if decider_phase:
                phase = self.halting.decider_phase_loss(
                    out, labels, self.loop.method_options, loss_kwargs.get("num_items_in_batch")
                )
                if phase is not None:  # the decider's own objective alone (the backbone is frozen): an auxiliary
                    # loss with no next-token part, so trainers scale and log it as they do the method's own
                    out.aux_loss, out.aux_metrics = phase.loss, {**(out.aux_metrics or {}), **phase.metrics}
                    out.loss = getattr(self.config, "router_aux_loss_coef", 1.0) * phase.loss
        return out

    # -- generation ------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate`` with per-token adaptive depth and a depth-aware KV cache.

        Extra keyword arguments: ``exit_policy``, ``exit_threshold``, ``depth``, ``step_schedule``;
        with ``return_dict_in_generate=True`` the output also has ``depths`` ``[B, new_tokens]``.
        See ``retrofit.model.generation``.
        """
        return looped_generate(self, super().generate, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # a DynamicCache cannot hold per-depth K/V: default to the depth-aware cache
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = DepthKVCache(self.config)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
