"""The looped model: prelude → core × depth → coda around a pretrained backbone (METHODS.md §1–2).

``LoopedForCausalLM`` wraps the base model's own modules by reference — ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head`` keep their names, so base
checkpoints load into it and its checkpoints look like the base's plus two heads (``updater.*``,
``halting.*``). No modeling file of transformers is copied (STYLE.md habit 1).

The full-sequence forward (training, scoring, prefill without a cache) unrolls the core up to
``max_depth`` times. Per token ``i`` the exit depth ``d*_i`` is either forced (``depth=``) or decided
by the halting method; a token past its exit is *passed through*: its state is copied, its later
keys are invisible to everyone else, and the coda sees its exit-depth state. Keys of every depth
executed so far are stacked along the key axis and masked by ``retrofit.attention``; the stacking
happens in ``DepthKVStore``, a minimal cache object handed to the base layers, which call its
``update`` exactly as they would a transformers ``Cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import os
import inspect
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, LlamaConfig, PreTrainedModel, Qwen3Config
from transformers.modeling_outputs import ModelOutput

from .attention import base_visibility, depth_key_visibility, to_additive_mask
from .config import LoopConfig, LoopConfigError
from .families import FAMILIES, Family, family_for
from .halting import build_halting
from .halting.training_free import resolve_exit_policy
from .heads import Updater, init_tagged
from .schedulers import UnitStep, build_step_schedule


# ------------------------------------------------------------------------------------------------
# Configs: flat subclasses of the base configs, plus the loop spec as one dict field.
# ------------------------------------------------------------------------------------------------
class _LoopedConfigMixin:
    # TRL's create_model_from_path reads `config.auto_map` for architectures outside transformers
    # and transformers tests `name in config.auto_map`: {} until a config.json sets one (exports do).
    @property
    def auto_map(self) -> dict:
        return self.__dict__.get("auto_map", {})

    @auto_map.setter
    def auto_map(self, value):
        self.__dict__["auto_map"] = value

    @property
    def loop_config(self) -> LoopConfig:
        """The ``LoopConfig`` stored in ``self.loop`` (validated on every read)."""
        return LoopConfig.from_dict(self.loop or {})


@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class LoopedLlamaConfig(_LoopedConfigMixin, LlamaConfig):
    """``LlamaConfig`` plus ``loop``: a ``LoopConfig`` as a dict."""

    model_type = "looped_llama"
    loop: dict | None = None


@strict(accept_kwargs=True)
@dataclasses.dataclass(repr=False)
class LoopedQwen3Config(_LoopedConfigMixin, Qwen3Config):
    """``Qwen3Config`` plus ``loop``: a ``LoopConfig`` as a dict."""

    model_type = "looped_qwen3"
    loop: dict | None = None


# ------------------------------------------------------------------------------------------------
@dataclass
class LoopedCausalLMOutput(ModelOutput):
    """Output of ``LoopedForCausalLM.forward``.

    Attributes:
        loss: next-token loss on ``logits`` (the mixture NLL for TaH2), when labels are given.
        logits: ``[B, T, V]``. For a TaH2 mixture: ``log p_mix + logsumexp(z^(d*))``, i.e. the log
            mixture shifted per token by the exit depth's log-partition, so that a one-depth mixture
            returns that depth's raw logits and ``softmax(logits) = p_mix``.
        depths: ``[B, T]`` long, each token's exit depth (1-based).
        depth_probs: ``[B, T, D]`` the method's halting distribution (TaH2: mixture weights π;
            ANIRA: q); None for ``fixed``.
        halt_signals: ``[B, T, k]`` per-depth decider outputs (TaH2: continue probabilities
            ``c^(1..k)``; ANIRA-O: halting probabilities ``α``); None otherwise.
        depth_logits_q: ``[B, T, D]`` ANIRA-E's raw depth logits (its q before softmax); else None.
        depth_nll: ``[B, T, D]`` next-token loss at each depth (position t predicts label t+1;
            TaH2's lookahead depth ``d*+1`` included); NaN where not computed. Present when labels
            are given and the method needs it (TaH2) or ``output_depth_losses=True``.
        depth_logits: ``[D, B, T, V]`` per-depth logits (NaN beyond a token's lookahead) when
            ``output_depth_logits=True``.
        active: ``[D, B, T]`` bool, token executed depth d.
        cache: the depth-aware cache, when decoding with one.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    depth_probs: torch.Tensor | None = None
    halt_signals: torch.Tensor | None = None
    depth_logits_q: torch.Tensor | None = None
    depth_nll: torch.Tensor | None = None
    depth_logits: torch.Tensor | None = None
    active: torch.Tensor | None = None
    cache: object | None = None


class DepthKVStore:
    """K/V of the full-sequence forward, keyed by (layer index, depth).

    The base attention calls ``update(k, v, layer_idx, kwargs=...)``; the current depth arrives in
    ``kwargs["loop_depth"]`` (passed through the decoder layer's ``**kwargs``). ``update`` records
    the depth's K/V and returns the keys of depths ``1 … m`` stacked along the sequence axis
    (``[B, H, m * T, hd]``), the layout ``retrofit.attention`` masks. Writing is idempotent per
    (layer, depth), so activation checkpointing may replay a layer safely.
    """

    def __init__(self):
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.prelude_or_coda = None  # layers outside the core pass loop_depth=0: no stacking

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        depth = (kwargs.get("kwargs") or {}).get("loop_depth", 0)
        if depth == 0:
            return key_states, value_states
        self.kv[(layer_idx, depth)] = (key_states, value_states)
        if depth == 1:
            return key_states, value_states
        ks = [self.kv[(layer_idx, j)][0] for j in range(1, depth + 1)]
        vs = [self.kv[(layer_idx, j)][1] for j in range(1, depth + 1)]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)



# ------------------------------------------------------------------------------------------------
# TRL's fused LM head
# ------------------------------------------------------------------------------------------------
# TRL 1.x trainers (SFT, DPO, GRPO, RLOO, KTO) call `add_fused_lm_head(model)`, which assigns
# `model.forward = _fused_forward`: `model(..., labels=, fused_lm_head=True)` then runs only
# `model.base_model` (the base backbone, once, all layers) and applies `lm_head` itself. For a looped
# model that trains the plain base and never the heads. `LoopedForCausalLM.__setattr__` installs
# `_looped_fused_forward` instead: the same contract, computed from the real looped logits.
def _is_trl_fused_forward(value) -> bool:
    # functools.wraps copies the model's forward's name and module onto TRL's function: look at its code
    code = getattr(getattr(value, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and f"{os.sep}trl{os.sep}" in code.co_filename


@dataclass
class LoopedFusedLMOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput`` (defined here: exported remote code must not need TRL)."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_outputs_from_logits(logits, labels, shift_labels=None, temperature=1.0, num_items_in_batch=None,
                              outputs=("log_probs",)):
    """TRL's ``FusedCausalLMOutput`` from full logits ``[B, T, V]`` (TaH2: the mixture logits).

    ``labels`` ``[B, T]`` are unshifted (position t is scored on label t+1; -100 ignored), or
    ``shift_labels`` ``[B, T]`` already shifted. Per-token fields are ``[B, T-1]`` (``[B, T]`` with
    ``shift_labels``), zero where ignored; the logits are divided by ``temperature``.
    """
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    mask = labels != -100
    z = logits.float() / temperature
    logp = z.log_softmax(-1)
    tgt = labels.clamp(min=0)
    log_probs = logp.gather(-1, tgt[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
    entropy = log_sum_sq = mean_logits = is_top1 = None
    if "entropy" in outputs:
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
    if "log_sum_sq_probs" in outputs:
        log_sum_sq = torch.logsumexp(2 * logp.detach(), -1).masked_fill(~mask, 0.0)
    if "mean_logits" in outputs:
        mean_logits = z.detach().mean(-1).masked_fill(~mask, 0.0)
    if "is_top1" in outputs:
        is_top1 = (z.detach().argmax(-1) == tgt) & mask
    n = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return LoopedFusedLMOutput(loss=-log_probs.sum() / n, log_probs=log_probs, entropy=entropy,
                               log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits, is_top1=is_top1,
                               label_mask=mask)


def _looped_fused_forward(original, temperature: float = 1.0, outputs=("log_probs",)):
    @functools.wraps(original)  # generate() validates its kwargs against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            for k, v in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):
                if v is not None:
                    kwargs[k] = v
            return original(self, *args, **kwargs)
        kwargs["use_cache"] = False
        out = original(self, *args, **kwargs)  # the full looped forward; no labels, so no loss here
        return fused_outputs_from_logits(out.logits, labels, shift_labels, temperature, num_items_in_batch, outputs)

    return forward

# ------------------------------------------------------------------------------------------------
class LoopedForCausalLM(PreTrainedModel):
    """A pretrained causal LM with a looped core and per-token adaptive depth.

    Build one with ``retrofit.convert(base_model, LoopConfig(...))`` (reuses the base's modules) or
    load a saved one with ``AutoModelForCausalLM.from_pretrained``. Family subclasses
    (``LoopedLlamaForCausalLM``, ``LoopedQwen3ForCausalLM``) only bind the config class.
    """

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False  # the depth masks are dense custom masks
    _supports_flex_attn = False
    _supports_attention_backend = False
    family: Family = None

    def __init__(self, config, backbone: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__(config)
        loop = config.loop_config
        n_layers = config.num_hidden_layers
        self._ranges = loop.layer_ranges(n_layers)
        self._check_layer_types(config)
        self.model = backbone if backbone is not None else self.family.backbone_cls(config)
        self.vocab_size = config.vocab_size
        self.lm_head = lm_head if lm_head is not None else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        H = config.hidden_size
        self.updater = Updater(H, loop.updater_hidden or H, eps=config.rms_norm_eps)
        self.halting = build_halting(H, loop)
        self._loop_checkpointing = False
        self._loop_checkpointing_kwargs: dict = {}
        if backbone is not None:
            # the reused modules are already trained: keep post_init's initializer off them
            for m in [*self.model.modules(), *self.lm_head.modules()]:
                m._is_hf_initialized = True
        self.post_init()

    # -- TRL ---------------------------------------------------------------------------------------
    _serves_trl_fused_head = True

    def __setattr__(self, name, value):
        if name == "forward" and _is_trl_fused_forward(value):
            nonlocals = inspect.getclosurevars(value.__func__).nonlocals
            fwd = _looped_fused_forward(type(self).forward, nonlocals.get("temperature", 1.0),
                                        tuple(nonlocals.get("outputs", ("log_probs",))))
            value = types.MethodType(fwd, self)
        super().__setattr__(name, value)

    # -- structure ---------------------------------------------------------------------------
    @staticmethod
    def _check_layer_types(config) -> None:
        types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in types):
            raise LoopConfigError(
                f"only full-attention layers can be looped; this config has layer_types {sorted(set(types))} "
                "(set use_sliding_window=False)"
            )

    @property
    def loop(self) -> LoopConfig:
        return self.config.loop_config

    @property
    def prelude_layers(self) -> list[nn.Module]:
        return [self.model.layers[i] for i in self._ranges[0]]

    @property
    def core_layers(self) -> list[nn.Module]:
        return [self.model.layers[i] for i in self._ranges[1]]

    @property
    def coda_layers(self) -> list[nn.Module]:
        return [self.model.layers[i] for i in self._ranges[2]]

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

    # -- activation checkpointing -------------------------------------------------------------
    # transformers' per-layer checkpointing drops the `cache` argument of a layer that writes to it,
    # which would silently turn duo-causal attention into same-depth-only attention. We checkpoint
    # layers ourselves; our K/V store is idempotent under replay.
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

    def _run_layer(self, layer, x, mask, position_embeddings, position_ids, store, depth):
        kwargs = dict(
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            cache=store,
            use_cache=False,
            loop_depth=depth,
        )
        if self._loop_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, x, **kwargs, **self._loop_checkpointing_kwargs)
        return layer(x, **kwargs)

    # -- readout ---------------------------------------------------------------------------------
    def _readout(self, h, mask, pe, pos, store):
        """Coda (if any) + final norm + LM head: ``[B, T, H]`` -> ``[B, T, V]``."""
        for layer in self.coda_layers:
            h = self._run_layer(layer, h, mask, pe, pos, store, 0)
        return self.lm_head(self.model.norm(h))

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
        **kwargs,
    ) -> LoopedCausalLMOutput:
        """Run the looped model on a full sequence, or decode incrementally with a cache.

        With ``cache=`` (a ``retrofit.cache.DepthKVCache``) or ``use_cache=True`` in eval mode, the
        call is one step of incremental decoding (``retrofit.generation.cached_forward``): only the
        new tokens run, exited tokens are not computed at deeper depths, and the cache is returned
        in ``cache``.

        Args:
            input_ids: ``[B, T]``.
            attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (left or right).
            position_ids: ``[B, T]``; defaults to ``0 … T-1``. Resets to 0 mark packed sequences.
            labels: ``[B, T]`` (shifted inside, -100 ignored) -> ``loss``.
            depth: exit depth to force: an int for every token or a ``[B, T]`` tensor, each in
                ``1 … max_depth``; ``None`` lets the halting method decide.
            output_depth_losses: also return ``depth_nll`` (needs labels).
            output_depth_logits: also return every depth's logits ``[D, B, T, V]``.
            backprop_depth: truncated backprop (Huginn): gradients flow through the last ``k`` core
                iterations only; iterations ``d ≤ n - k`` (``n`` = the largest forced depth, else
                ``max_depth``) run without autograd, so their activations are not stored. ``None``
                = full backprop. Readouts and deciders keep their gradients.
            exit_policy: who decides the exit depth: None/``"decider"`` (the halting method),
                ``"fixed"`` (with ``depth``), ``"kl"`` or ``"state"`` (training-free, with
                ``exit_threshold``; ``retrofit.halting.training_free``) or an ``ExitPolicy``.
            exit_threshold: the training-free exit's threshold.
            step_schedule: ``"unit"`` (default), ``"taps"`` or a ``StepSchedule``
                (``retrofit.schedulers.taps``).

        Returns:
            ``LoopedCausalLMOutput``.
        """
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if cache is not None or (use_cache and not self.training and labels is None):
            from .generation import cached_forward

            return cached_forward(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                inputs_embeds=inputs_embeds, labels=labels, depth=depth, logits_to_keep=logits_to_keep,
                output_depth_logits=output_depth_logits, exit_policy=exit_policy, exit_threshold=exit_threshold,
                step_schedule=step_schedule,
            )
        loss_kwargs = {k: v for k, v in kwargs.items() if k in ("num_items_in_batch", "shift_labels", "ignore_index")}
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        B, T, H = inputs_embeds.shape
        dev = inputs_embeds.device
        loop = self.loop
        D = loop.max_depth
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be a [B, T] padding mask, got shape {tuple(attention_mask.shape)}")

        depth, policy = resolve_exit_policy(exit_policy, exit_threshold, depth)
        sched = build_step_schedule(step_schedule)
        forced = self._forced_depths(depth, B, T, dev)
        need_depth_losses = labels is not None and (output_depth_losses or (self.halting.needs_depth_readout and self.training))
        need_readout = self.halting.needs_depth_readout or need_depth_losses or output_depth_logits
        need_readout = need_readout or (policy is not None and policy.needs_logits)
        lookahead = need_depth_losses  # one gradient-free iteration past each exit (TaH2 §3)
        mixture = self.halting.mixture_output

        base_vis = base_visibility(B, T, dev, attention_mask, position_ids)
        dtype = inputs_embeds.dtype
        plain_mask = to_additive_mask(base_vis, dtype)
        pe = self.model.rotary_emb(inputs_embeds, position_ids)
        store = DepthKVStore()

        x = inputs_embeds
        for layer in self.prelude_layers:
            x = self._run_layer(layer, x, plain_mask, pe, position_ids, store, 0)
        e = x

        ctx = self.halting.new_context(self.training)
        planned = self.halting.plan(e, ctx)
        # [B, T] or None (online); a training-free policy overrides the method's plan
        exit_at = forced if forced is not None else (planned if policy is None else None)
        sstate = sched.init(B * T)
        pstate = policy.init(B * T) if policy is not None else None
        all_idx = torch.arange(B * T, device=dev) if policy is not None else None

        # active[j]: token executed depth j + 1; a list, since tensors saved for backward must not be
        # modified in place
        active: list[torch.Tensor] = [torch.ones(B, T, dtype=torch.bool, device=dev)]
        h = None
        states: list[torch.Tensor] = []
        depth_nll = torch.full((B, T, D), float("nan"), device=dev) if need_depth_losses else None
        depth_logits = [] if output_depth_logits else None
        # streaming TaH2 mixture: log Σ_d π_d softmax(z_d), π_d known right after depth d's decision
        log_mix = lse_exit = None
        survive = torch.ones(B, T, device=dev)
        z_exit = None
        shift_labels = None
        if labels is not None and need_depth_losses:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)

        if backprop_depth is not None and (not isinstance(backprop_depth, int) or backprop_depth < 1):
            raise ValueError(f"backprop_depth must be None or an int >= 1, got {backprop_depth!r}")
        n_unroll = int(forced.max()) if forced is not None else D

        for d in range(1, D + 1):
            act = active[d - 1]
            no_grad_core = backprop_depth is not None and d <= n_unroll - backprop_depth
            with torch.no_grad() if no_grad_core else contextlib.nullcontext():
                x_in = e if d == 1 else self.updater(e, h)
                vis = depth_key_visibility(torch.stack(active), d, loop.attention, base_vis)
                mask = to_additive_mask(vis, dtype)
                raw = x_in
                for layer in self.core_layers:
                    raw = self._run_layer(layer, raw, mask, pe, position_ids, store, d)
            if d == 1 or isinstance(sched, UnitStep):
                new = raw
            else:  # relaxed step h + η (F(h) - h) (METHODS.md §5)
                new = sched.step(d, h.reshape(B * T, H), raw.reshape(B * T, H), sstate, None).view(B, T, H)
            h = new if d == 1 else torch.where(act[..., None], new, h)
            states.append(h)

            la = (~act) & active[d - 2] if (lookahead and d >= 2) else None
            z = None
            if need_readout:
                has_la = la is not None and bool(la.any())
                if has_la and not self.coda_layers and depth_logits is None:
                    # without a coda the readout is per token: one pass serves the executed tokens and
                    # the lookahead ones (their input detached, and their logits only feed depth_nll,
                    # so the lookahead stays gradient-free) instead of a second vocabulary-wide readout
                    z = self._readout(torch.where(la[..., None], raw.detach(), h), plain_mask, pe, position_ids, store)
                else:
                    z = self._readout(h, plain_mask, pe, position_ids, store)
                    if has_la:
                        with torch.no_grad():
                            z_la = self._readout(torch.where(la[..., None], raw, h), plain_mask, pe, position_ids, store)
                        z = torch.where(la[..., None], z_la, z)
                if depth_logits is not None:
                    keep = act if la is None else (act | la)
                    depth_logits.append(z.masked_fill(~keep[..., None], float("nan")))
                # the mixture's log-softmax doubles as the source of the per-depth losses
                logp = z.float().log_softmax(-1) if (mixture and self.halting.needs_depth_readout) else None
                if need_depth_losses:
                    # = F.cross_entropy(z, shift_labels, reduction="none"), bitwise, without autograd
                    with torch.no_grad():
                        src = logp if logp is not None else z.float().log_softmax(-1)
                        ignore = shift_labels == -100
                        nll = -src.gather(-1, shift_labels.clamp_min(0)[..., None]).squeeze(-1)
                        nll = nll.masked_fill(ignore, 0.0)
                    keep = act if la is None else (act | la)
                    depth_nll[..., d - 1] = torch.where(keep, nll, torch.full_like(nll, float("nan")))

            # decide who continues to depth d + 1
            if d < D:
                probs = None
                if z is not None and self.halting.needs_depth_readout:
                    with torch.no_grad():  # decider features: no gradient into the LM through them
                        probs = z.float().softmax(-1)
                cont = self.halting.step(d, e, h, probs, ctx)
                if exit_at is not None:
                    cont = exit_at > d
                elif policy is not None:
                    lp = z.float().log_softmax(-1).reshape(B * T, -1) if policy.needs_logits else None
                    cont = ~policy.check(d, h.reshape(B * T, H), lp, pstate, all_idx).view(B, T)
                elif cont is None:
                    cont = torch.ones_like(act)
                active.append(act & cont)
            stop_here = act & ~active[d] if d < D else act

            if z is not None and self.halting.needs_depth_readout:
                if mixture:
                    c = ctx.signals[d - 1] if d <= len(ctx.signals) else None
                    pi = survive if c is None else torch.where(stop_here, survive, survive * (1 - c))
                    # clamp: a saturated c (= 1.0 in fp32) must not give log(0), whose backward is NaN
                    log_pi = torch.where(act, pi.clamp_min(1e-30).log(), torch.full_like(pi, float("-inf")))
                    term = log_pi[..., None] + logp
                    log_mix = term if log_mix is None else torch.logaddexp(log_mix, term)
                    with torch.no_grad():  # only a per-token shift of the output (see below)
                        lse = z.float().logsumexp(-1)
                    lse_exit = lse if lse_exit is None else torch.where(stop_here, lse, lse_exit)
                    if c is not None:
                        survive = survive * c
                # a mixture reads z_exit only for tokens that exit at depth 1: keep the depth-1
                # logits instead of a vocabulary-wide select per depth
                if z_exit is None or not mixture:
                    z_exit = z if z_exit is None else torch.where(stop_here[..., None], z, z_exit)

            more = d < D and (bool(active[d].any()) or (lookahead and bool(stop_here.any())) or loop.fixed_graph)
            if not more:
                break

        active_t = torch.stack(active)
        depths = active_t.long().sum(0)
        depth_probs, st = self.halting.distribution(ctx, depths)

        if self.halting.needs_depth_readout:
            logits = z_exit
            if mixture:
                # a token that exits at depth 1 has a one-term mixture: return its raw logits exactly
                # (the shifted log-mixture equals them only up to float rounding)
                # lse_exit carries no gradient: a per-token shift of the logits leaves every softmax
                # and NLL unchanged, so its gradient is 0 in exact arithmetic; skipping it saves
                # vocabulary-wide backward passes
                first = depths == 1
                if not bool(first.all()):  # (skip vocabulary-wide work that selects nothing)
                    mixed = (log_mix + lse_exit[..., None]).to(z_exit.dtype)
                    logits = torch.where(first[..., None], z_exit, mixed) if bool(first.any()) else mixed
        else:
            if st is not None:
                while len(states) < D:
                    states.append(states[-1])
                final = sum(st[..., k, None].to(dtype) * states[k] for k in range(D))
            else:
                final = h
            logits = self._readout(final, plain_mask, pe, position_ids, store)

        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)

        signals = torch.stack(ctx.signals, -1) if ctx.signals else None
        return LoopedCausalLMOutput(
            loss=loss,
            logits=logits,
            depths=depths,
            depth_probs=depth_probs,
            halt_signals=signals,
            depth_logits_q=ctx.extra.get("q_logits"),
            depth_nll=depth_nll,
            depth_logits=torch.stack(depth_logits) if depth_logits else None,
            active=active_t,
        )

    # -- generation ------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate`` with per-token adaptive depth and a depth-aware KV cache.

        Extra keyword arguments: ``exit_policy``, ``exit_threshold``, ``depth``, ``step_schedule``;
        with ``return_dict_in_generate=True`` the output also has ``depths`` ``[B, new_tokens]``.
        See ``retrofit.generation``.
        """
        from .generation import looped_generate

        return looped_generate(self, super().generate, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # a DynamicCache cannot hold per-depth K/V: default to the depth-aware cache
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            from .cache import DepthKVCache

            model_kwargs["cache"] = DepthKVCache(self.config)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _forced_depths(self, depth, B, T, dev):
        if depth is None:
            return None
        D = self.loop.max_depth
        if isinstance(depth, int) and not isinstance(depth, bool):
            if not 1 <= depth <= D:
                raise ValueError(f"depth={depth} is out of range: allowed 1..{D} (max_depth)")
            return torch.full((B, T), depth, dtype=torch.long, device=dev)
        if isinstance(depth, torch.Tensor):
            if depth.shape != (B, T):
                raise ValueError(f"a depth tensor must have shape [B, T] = {(B, T)}, got {tuple(depth.shape)}")
            depth = depth.to(dev).long()
            if bool((depth < 1).any()) or bool((depth > D).any()):
                raise ValueError(f"depth values must lie in 1..{D} (max_depth); got min {int(depth.min())}, max {int(depth.max())}")
            return depth
        raise TypeError(f"depth must be None, an int or a [B, T] LongTensor, got {type(depth).__name__}")


class LoopedLlamaForCausalLM(LoopedForCausalLM, GenerationMixin):
    config_class = LoopedLlamaConfig
    family = FAMILIES["llama"]
    _no_split_modules = ["LlamaDecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


class LoopedQwen3ForCausalLM(LoopedForCausalLM, GenerationMixin):
    config_class = LoopedQwen3Config
    family = FAMILIES["qwen3"]
    _no_split_modules = ["Qwen3DecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


LOOPED_CLASSES: dict[str, tuple[type, type]] = {
    "llama": (LoopedLlamaConfig, LoopedLlamaForCausalLM),
    "qwen3": (LoopedQwen3Config, LoopedQwen3ForCausalLM),
}
