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
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors

from .config import LoopSpec, LoopSpecError, loop_spec


# ------------------------------------------------------------------------------------------------
# Heads, rebuilt from the checkpoint's weights with vLLM layers (same names: updater.*, halting.decider.*)
# ------------------------------------------------------------------------------------------------
class Updater(nn.Module):
    """``x_{d+1} = e + W2 · SiLU(W1 · [norm_e(e); norm_h(h)])`` (docs/looped-model.md)."""

    def __init__(self, hidden: int, inner: int, eps: float, prefix: str):
        super().__init__()
        self.norm_e = RMSNorm(hidden, eps=eps)
        self.norm_h = RMSNorm(hidden, eps=eps)
        self.w1 = ReplicatedLinear(2 * hidden, inner, bias=False, prefix=f"{prefix}.w1")
        self.w2 = ReplicatedLinear(inner, hidden, bias=False, prefix=f"{prefix}.w2")

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``e``, ``h``: ``[N, H]`` -> ``[N, H]``."""
        z, _ = self.w1(torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1))
        out, _ = self.w2(nn.functional.silu(z))
        return e + out


class DeciderFFN(nn.Module):
    """``fc2(SiLU(fc1(norm(x))))``, the body of every decider (``retrofit.model.heads.DeciderFFN``)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, prefix: str):
        super().__init__()
        self.norm = RMSNorm(in_features, eps=1e-6)
        self.fc1 = ReplicatedLinear(in_features, hidden, bias=True, prefix=f"{prefix}.fc1")
        self.fc2 = ReplicatedLinear(hidden, out_features, bias=True, prefix=f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, _ = self.fc1(self.norm(x))
        out, _ = self.fc2(nn.functional.silu(z))
        return out


class SwiGLUDecider(nn.Module):
    """The TaH2 release's decider (``retrofit.model.heads.SwiGLUDecider``): each input part RMS-normed on its own,
    ``score(norm_out(down(SiLU(gate x) * up x)))`` with ``x = input_proj([norm_i(x_i)])``."""

    def __init__(self, parts: list[int], width: int, prefix: str):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(n, eps=1e-6) for n in parts)
        self.input_proj = ReplicatedLinear(sum(parts), width, bias=False, prefix=f"{prefix}.input_proj")
        self.gate_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.gate_proj")
        self.up_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.up_proj")
        self.down_proj = ReplicatedLinear(width, width, bias=False, prefix=f"{prefix}.down_proj")
        self.norm_out = RMSNorm(width, eps=1e-6)
        self.score = ReplicatedLinear(width, 1, bias=False, prefix=f"{prefix}.score")

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        x, _ = self.input_proj(torch.cat([n(x) for n, x in zip(self.norms, xs)], dim=-1))
        g, _ = self.gate_proj(x)
        u, _ = self.up_proj(x)
        y, _ = self.down_proj(nn.functional.silu(g) * u)
        out, _ = self.score(self.norm_out(y))
        return out


class Halting(nn.Module):
    """Holds ``decider`` (so weight names match ``halting.decider.*``); None for ``fixed``."""

    def __init__(self, spec: LoopSpec, hidden: int, prefix: str):
        super().__init__()
        H, D = hidden, spec.max_depth
        if spec.method == "tah2" and spec.decider_arch == "swiglu":
            parts = [H, H] + ([spec.top_k] if spec.top_k else [])
            self.decider = SwiGLUDecider(parts, spec.decider_hidden, f"{prefix}.decider")
            return
        in_out = {
            "tah2": (2 * H + spec.top_k, 1),
            "anira-e": (H, D),
            "anira-o": (H, 1),
        }.get(spec.method)
        self.decider = (
            None if in_out is None else DeciderFFN(in_out[0], spec.decider_hidden, in_out[1], f"{prefix}.decider")
        )


# ------------------------------------------------------------------------------------------------
# Attention per depth
# ------------------------------------------------------------------------------------------------
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


def _metadata(layer_name: str):
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # speculative decoding: [0] is the target model's
        md = md[0]
    if isinstance(md, dict):
        return md.get(layer_name)
    return md


def _store(attn: Attention, dtype: torch.dtype) -> torch.Tensor:
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
    meta = _metadata(attns[0].layer_name)
    if meta is None or state.slots is None:  # profiling / warm-up run: no cache yet
        return out
    n = int(meta.num_actual_tokens)
    stores = [_store(a, q.dtype) for a in attns]
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


def _add_depth_attention(
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
        self.updater = Updater(H, spec.updater_hidden, config.rms_norm_eps, maybe_prefix(prefix, "updater"))
        self.halting = Halting(spec, H, maybe_prefix(prefix, "halting"))

        # one KV cache per (core layer, depth); extra caches get fresh layer indices after the stack's
        counter = iter(range(config.num_hidden_layers, 10**9))

        def new_name() -> str:
            return f"{model_prefix}.layers.{next(counter)}.self_attn.attn"

        self.state = LoopState()
        block_size = vllm_config.cache_config.block_size
        D = spec.max_depth
        for i in spec.core:
            _add_depth_attention(
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
                _add_depth_attention(
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
        meta = _metadata(first.layer_name)
        if meta is None:
            return
        n = int(meta.num_actual_tokens)
        self.state.slots = meta.slot_mapping[:n].long()
        if self.state.exec_depth is None:
            num_slots = _store(first, self.model.embed_tokens.weight.dtype).shape[0]
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
        h = e
        saved: list[torch.Tensor | None] = [None] * len(spec.core)
        # TaH2 output mixture, streamed over depths (retrofit.model.generation.cached_forward)
        log_mix = lse_exit = z_exit = None
        survive = torch.ones(N, device=dev)
        depths = torch.full((N,), D, dtype=torch.long, device=dev)

        for d in range(1, D + 1):
            self.state.depth["core"] = d
            if duo:
                self._mark_executed(active, d)
            cur = e if d == 1 else self.updater(e, h)
            for li, layer in enumerate(self._layers(spec.core)):
                # an exited token re-enters each layer with its input from its exit depth: its K/V
                # here equal its exit-depth ones (same weights), what same-depth attention reads
                if saved[li] is not None:
                    cur = torch.where(active[:, None], cur, saved[li])
                saved[li] = cur
                cur = self._run(layer, positions, cur)
            h = cur if d == 1 else torch.where(active[:, None], cur, h)

            z = self._readout(h, positions, d) if spec.needs_readout else None
            c = None
            if d < D:
                if exit_at is not None:
                    cont = exit_at > d
                elif spec.method == "tah2":
                    parts = [e, h]
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
                    a = torch.sigmoid(self.halting.decider(h).squeeze(-1).float())
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
