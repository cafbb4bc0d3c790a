"""Looped Llama / Qwen3 for vLLM, built from vLLM's own layers (imported by vLLM, by name, on first use).

The backbone is vLLM's ``LlamaModel`` / ``Qwen3Model`` (its decoder layers, attention, RoPE, weight
loading, tensor parallel linears); the looped model only decides which layers run how often
(docs/looped-model.md, docs/tah2.md, docs/anira.md)::

    e = prelude(embed(x));   h_1 = core(e);   h_{d+1} = core(U(e, h_d))   (a token stops at d*)
    logits = lm_head(norm(coda(h_{d*})))                 ANIRA-E/O, fixed
    logits = log Σ_d π_d softmax(z_d) (+ lse z_{d*})      TaH2, z_d = lm_head(norm(coda_d(h_d)))

KV caches: one per (core layer, depth) — the core's weights are shared, its attention modules are
not: each core layer gets ``D`` ``Attention`` modules (vLLM allocates a paged cache for each), and
the module of the depth being run is picked by ``DepthAttention``. With TaH2 and a coda, each coda
layer also has one cache per depth (the depth-``d`` readout runs the coda on every token's depth-``d``
state, as the HF model does).

Per-token exits, with every depth computed for every token. A token that exited at ``d*`` is passed
through at deeper depths: each core layer gets, as its input, the token's input to that layer at
``d*``. The core's weights being shared, its keys/values at every depth ``j > d*`` then equal those
at ``d*``, and the cache of depth ``m`` holds, for every token ``s``, the K/V of depth ``min(m, d*_s)``:
exactly what **same-depth** attention reads (``retrofit/model/attention.py``), so vLLM's kernel reads the
depth-``m`` cache as is. **Duo-causal** attention (query at depth ``m`` sees every executed
``(s, j)``, ``j <= min(m, d*_s)``) reads the caches of depths ``1 … m`` together, masked by each
position's last executed depth; the plugin computes it itself over the same paged caches
(``duo_causal_attention``), in a layout it owns, since vLLM's kernels can neither mask keys nor
return the log-sum-exp a per-depth merge needs.

Cost: every token runs all ``D`` depths (an exited token's deeper iterations only refresh caches),
so vLLM's throughput is that of depth ``D``; the HF model skips exited tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors

from .attention import LoopState, add_depth_attention, attn_metadata, kv_store
from .config import LoopSpecError, loop_spec
from .heads import UPDATERS, Halting


# ------------------------------------------------------------------------------------------------
class LoopedForCausalLM(nn.Module):
    """A looped Llama / Qwen3 for vLLM (subclasses bind the backbone class)."""

    backbone_cls: type = None
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.spec = spec = loop_spec(config)
        if get_pp_group().world_size > 1:
            raise LoopSpecError("looped checkpoints are served without pipeline parallelism (tensor parallelism works)")
        model_prefix = maybe_prefix(prefix, "model")
        self.model = self.backbone_cls(vllm_config=vllm_config, prefix=model_prefix)
        H = config.hidden_size
        self.lm_head = ParallelLMHead(config.vocab_size, H, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.updater = UPDATERS[spec.updater](
            H, spec.updater_hidden, config.rms_norm_eps, maybe_prefix(prefix, "updater")
        )
        self.halting = Halting(spec, H, maybe_prefix(prefix, "halting"))

        # one KV cache per (core layer, depth); extra caches get fresh layer indices after the stack's
        counter = iter(range(config.num_hidden_layers, 10**9))

        def new_name() -> str:
            return f"{model_prefix}.layers.{next(counter)}.self_attn.attn"

        self.state = LoopState()
        block_size = vllm_config.cache_config.block_size
        D = spec.max_depth
        for i in spec.core:
            add_depth_attention(
                self.model.layers[i],
                D,
                new_name,
                self.state,
                "core",
                spec.attention,
                block_size,
            )
        if spec.needs_readout and len(spec.coda) and D > 1:
            for i in spec.coda:
                add_depth_attention(
                    self.model.layers[i],
                    D,
                    new_name,
                    self.state,
                    "coda",
                    "kernel",
                    block_size,
                )

    # -- vLLM's model interface ---------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.spec.needs_readout:
            # forward already returned the logits (TaH2's mixture needs every depth's readout)
            return hidden_states
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # tied embeddings are resolved by the loader; `fixed` checkpoints carry no halting.* weights
        return AutoWeightsLoader(self).load_weights(weights)

    # -- the loop ---------------------------------------------------------------------------
    def _layers(self, idx: range) -> list[nn.Module]:
        return [self.model.layers[i] for i in idx]

    @staticmethod
    def _run(layer: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer on the full residual stream ``x`` ``[N, H]`` (vLLM's layers carry
        ``(hidden, residual)`` pairs; the sum is the HF layer's output)."""
        hidden, residual = layer(positions, x, None)
        return hidden + residual

    def _readout(self, h: torch.Tensor, positions: torch.Tensor, d: int) -> torch.Tensor:
        """Depth-``d`` logits ``[N, V]`` (float32): the coda (depth-``d`` caches) on ``h``, norm, lm_head."""
        self.state.depth["coda"] = d
        y = h
        for layer in self._layers(self.spec.coda):
            y = self._run(layer, positions, y)
        return self.logits_processor(self.lm_head, self.model.norm(y)).float()

    def _set_slots(self) -> None:
        """Duo-causal: this step's KV slots, and the per-slot depth buffer sized from the cache."""
        self.state.slots = None
        first = self.model.layers[self.spec.core[0]].self_attn.attn.attns[0]
        meta = attn_metadata(first.layer_name)
        if meta is None:
            return
        n = int(meta.num_actual_tokens)
        self.state.slots = meta.slot_mapping[:n].long()
        if self.state.exec_depth is None:
            num_slots = kv_store(first, self.model.embed_tokens.weight.dtype).shape[0]
            self.state.exec_depth = torch.zeros(num_slots, dtype=torch.int8, device=self.state.slots.device)

    def _mark_executed(self, active: torch.Tensor, d: int) -> None:
        if self.state.slots is None:
            return
        n = self.state.slots.shape[0]
        self.state.exec_depth[self.state.slots[active[:n]]] = d

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N]`` scheduled tokens -> ``[N, H]`` final hidden states (``[N, V]`` logits for TaH2)."""
        spec = self.spec
        D = spec.max_depth
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self._layers(spec.prelude):
            x = self._run(layer, positions, x)
        e = x
        N = e.shape[0]
        dev = e.device
        duo = spec.attention == "duo-causal"
        if duo:
            self._set_slots()

        exit_at = None  # [N] planned exit depth
        # a forced depth runs no decider, and TaH2 then returns the exit depth's logits (retrofit.model.loop.ForcedExit)
        mixing = spec.mixture_output and spec.serve_depth is None
        if spec.serve_depth is not None:
            exit_at = torch.full((N,), spec.serve_depth, dtype=torch.long, device=dev)
        elif spec.method == "anira-e":
            exit_at = self.halting.decider(e).float().argmax(-1) + 1
        cdf = torch.zeros(N, device=dev)  # ANIRA-O
        remain = torch.ones(N, device=dev)

        active = torch.ones(N, dtype=torch.bool, device=dev)
        h = s = e
        saved: list[torch.Tensor | None] = [None] * len(spec.core)
        # TaH2 output mixture, streamed over depths (retrofit.model.generation.cached_forward)
        log_mix = lse_exit = z_exit = None
        survive = torch.ones(N, device=dev)
        depths = torch.full((N,), D, dtype=torch.long, device=dev)

        for d in range(1, D + 1):
            self.state.depth["core"] = d
            if duo:
                self._mark_executed(active, d)
            cur = e if d == 1 else self.updater(e, s)
            for li, layer in enumerate(self._layers(spec.core)):
                # an exited token re-enters each layer with its input from its exit depth: its K/V
                # here equal its exit-depth ones (same weights), what same-depth attention reads
                if saved[li] is not None:
                    cur = torch.where(active[:, None], cur, saved[li])
                saved[li] = cur
                cur = self._run(layer, positions, cur)
            h = cur if d == 1 else torch.where(active[:, None], cur, h)
            s = self.model.norm(h) if spec.decider_state == "final_norm" else h  # what the decider and updater read

            z = self._readout(h, positions, d) if spec.needs_readout else None
            c = None
            if d < D:
                if exit_at is not None:
                    cont = exit_at > d
                elif spec.method == "tah2":
                    parts = [e, s]
                    if spec.top_k:
                        probs = z.softmax(-1)
                        k = min(spec.top_k, probs.shape[-1])
                        top = probs.topk(k, dim=-1).values
                        if k < spec.top_k:
                            top = nn.functional.pad(top, (0, spec.top_k - k))
                        parts.append(top.to(h.dtype))
                    if spec.decider_arch == "swiglu":
                        logit = self.halting.decider(*parts)
                    else:
                        logit = self.halting.decider(torch.cat(parts, dim=-1))
                    c = torch.sigmoid(logit.squeeze(-1).float())
                    cont = c >= spec.exit_threshold
                elif spec.method == "anira-o":
                    a = torch.sigmoid(self.halting.decider(s).squeeze(-1).float())
                    cdf = cdf + a * remain
                    remain = remain * (1 - a)
                    cont = cdf < spec.halt_threshold
                else:
                    cont = torch.ones_like(active)
                nxt = active & cont
            else:
                nxt = torch.zeros_like(active)
            stop_here = active & ~nxt
            depths = torch.where(stop_here, torch.full_like(depths, d), depths)

            if z is not None:
                if mixing:
                    pi = survive if c is None else torch.where(stop_here, survive, survive * (1 - c))
                    log_pi = torch.where(
                        active,
                        pi.clamp_min(1e-30).log(),
                        torch.full_like(pi, float("-inf")),
                    )
                    term = log_pi[:, None] + z.log_softmax(-1)
                    log_mix = term if log_mix is None else torch.logaddexp(log_mix, term)
                    lse = z.logsumexp(-1)
                    lse_exit = lse if lse_exit is None else torch.where(stop_here, lse, lse_exit)
                    if c is not None:
                        survive = survive * c
                z_exit = z if z_exit is None else torch.where(stop_here[:, None], z, z_exit)
            active = nxt

        if spec.needs_readout:
            if not mixing:
                return z_exit
            # a depth-1 exit returns its raw logits; otherwise the log-mixture shifted by the exit
            # depth's log-partition (LoopedCausalLMOutput.logits)
            return torch.where((depths <= 1)[:, None], z_exit, log_mix + lse_exit[:, None])
        y = h
        for layer in self._layers(spec.coda):
            y = self._run(layer, positions, y)
        return self.model.norm(y)


class LoopedLlamaForCausalLM(LoopedForCausalLM):
    backbone_cls = LlamaModel


class LoopedQwen3ForCausalLM(LoopedForCausalLM):
    backbone_cls = Qwen3Model
