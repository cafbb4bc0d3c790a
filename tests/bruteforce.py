"""Slow, obviously-correct references for the looped forward (STYLE.md habit 3).

Everything is computed one token and one depth at a time, with explicit key lists and a hand-written
attention (RMSNorm → q/k/v → RoPE → softmax over the listed keys → o_proj → MLP). It reuses the base
layer's *weights* but none of its forward code, the masks, or the K/V store.
"""

from __future__ import annotations

import torch


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(x, cos, sin):
    """x: [heads, hd]; cos/sin: [hd]."""
    return x * cos + rotate_half(x) * sin


def attn_layer(layer, x_q, pos_q, keys, cos_sin):
    """One decoder layer for one query.

    Args:
        layer: a Llama/Qwen3 decoder layer (weights only are used).
        x_q: [H] the query token's layer input.
        pos_q: its position.
        keys: list of (x_k [H], pos_k): layer inputs of the visible keys (the query itself included
            when visible).
        cos_sin: function pos -> (cos [hd], sin [hd]).
    Returns:
        [H] the layer output for the query.
    """
    a = layer.self_attn
    hd = a.head_dim
    n_h = a.config.num_attention_heads
    n_kv = a.config.num_key_value_heads

    def proj(x, lin, n, norm):
        y = lin(layer.input_layernorm(x)).view(n, hd)
        return norm(y) if norm is not None else y

    q_norm = getattr(a, "q_norm", None)
    k_norm = getattr(a, "k_norm", None)
    cq, sq = cos_sin(pos_q)
    q = rope(proj(x_q, a.q_proj, n_h, q_norm), cq, sq)  # [n_h, hd]
    ks, vs = [], []
    for xk, pk in keys:
        ck, sk = cos_sin(pk)
        ks.append(rope(proj(xk, a.k_proj, n_kv, k_norm), ck, sk))
        vs.append(proj(xk, a.v_proj, n_kv, None))
    K = torch.stack(ks, 1)  # [n_kv, S, hd]
    V = torch.stack(vs, 1)
    rep = n_h // n_kv
    K = K.repeat_interleave(rep, 0)
    V = V.repeat_interleave(rep, 0)
    w = (q[:, None, :] * K).sum(-1) * a.scaling  # [n_h, S]
    w = w.float().softmax(-1).to(V.dtype)
    o = (w[..., None] * V).sum(1).reshape(-1)
    h = x_q + a.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def looped_reference(model, input_ids, depths, attention_mask=None):
    """Logits of a looped model for per-token exit depths, token by token.

    Only executed (token, depth) states are ever computed: a token that exits at d* has no state
    at deeper depths, so nothing can leak from them.

    Args:
        model: a ``LoopedForCausalLM`` whose method does not mix depths (e.g. ``fixed``), or with
            ``mixture_output=False``.
        input_ids: [B, T]; depths: [B, T] exit depths; attention_mask: [B, T] (1 = real token).

    Returns:
        [B, T, V] logits (rows of padding tokens are zeros).
    """
    loop = model.loop
    pre, core, coda = (list(r) for r in model._ranges)

    def state(h):  # what the updater reads after a depth (LoopConfig.decider_state)
        return model.model.norm(h) if loop.decider_state == "final_norm" else h

    layers = model.model.layers
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.long)
    out = torch.zeros(B, T, model.config.vocab_size)
    for b in range(B):
        real = [t for t in range(T) if attention_mask[b, t]]
        pos = {t: i for i, t in enumerate(real)}  # positions count real tokens only

        def cos_sin(p):
            x = torch.zeros(1, 1, model.config.hidden_size)
            c, s = model.model.rotary_emb(x, torch.tensor([[p]]))
            return c[0, 0], s[0, 0]

        emb = {t: model.model.embed_tokens(input_ids[b, t]) for t in real}

        def plain_stack(idx, states):
            for li in idx:
                new = {}
                for t in real:
                    keys = [(states[s], pos[s]) for s in real if s <= t]
                    new[t] = attn_layer(layers[li], states[t], pos[t], keys, cos_sin)
                states = new
            return states

        e = plain_stack(pre, emb)
        dstar = {t: int(depths[b, t]) for t in real}
        h = {}  # (t, j) -> core output at depth j
        xin = {}  # (li, t, j) -> input of core layer li
        for m in range(1, loop.max_depth + 1):
            run = [t for t in real if dstar[t] >= m]
            cur = {t: (e[t] if m == 1 else model.updater(e[t], state(h[(t, m - 1)]))) for t in run}
            for li in core:
                for t in run:
                    xin[(li, t, m)] = cur[t]
                new = {}
                for t in run:
                    if loop.attention == "duo-causal":
                        vis = [(s, j) for s in real if s <= t for j in range(1, min(m, dstar[s]) + 1)]
                    else:
                        vis = [(s, min(m, dstar[s])) for s in real if s <= t]
                    keys = [(xin[(li, s, j)], pos[s]) for s, j in vis]
                    new[t] = attn_layer(layers[li], cur[t], pos[t], keys, cos_sin)
                cur = new
            for t in run:
                h[(t, m)] = cur[t]
        final = {t: h[(t, dstar[t])] for t in real}
        final = plain_stack(coda, final)
        for t in real:
            out[b, t] = model.lm_head(model.model.norm(final[t]))
    return out
