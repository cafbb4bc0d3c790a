"""The looped engine (issue 2): identity at init, brute-force parity, passthrough, save/load, errors."""

from __future__ import annotations

import pytest
import torch
from bruteforce import looped_reference
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import retrofit
from retrofit import LoopConfig, LoopConfigError, UnsupportedArchitectureError
from retrofit.model.halting.tah2 import mixture_weights
from retrofit.testing import tiny_base

SPLITS = [(0, None), (2, 3)]  # whole stack; prelude 2 / core 3 / coda 1


def randomize_heads(model, seed=1, scale=0.3):
    """Give the zero-initialized heads real weights so that deeper depths differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("updater.", "halting.")) and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
    return model


def ids_for(B=2, T=7, seed=0, vocab=104):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (B, T), generator=g)


@pytest.mark.parametrize("method", retrofit.METHODS)
@pytest.mark.parametrize("split", SPLITS)
def test_identity_at_init(family, method, split):
    base = tiny_base(family)
    ids = ids_for()
    ref = base(ids).logits
    looped = retrofit.convert(base, LoopConfig(prelude=split[0], core=split[1], max_depth=3, method=method)).eval()
    out = looped(ids, depth=1)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    assert out.depths.eq(1).all()


def test_convert_reuses_layers_by_reference():
    base = tiny_base("llama")
    looped = retrofit.convert(base, LoopConfig(prelude=1, core=2, max_depth=2))
    assert looped.model is base.model
    assert looped.lm_head is base.lm_head
    assert looped.core_layers[0] is base.model.layers[1]
    assert [id(x) for x in looped.coda_layers] == [id(x) for x in base.model.layers[3:]]
    # no parameter of the backbone was re-initialized by post_init
    ref = tiny_base("llama")
    for (n, p), (_, q) in zip(base.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def test_deciders_start_deep(family):
    """ANIRA's deciders and TaH2's older "ffn" decider start deep; TaH2's release decider starts at p ≈ 0.5."""
    base = tiny_base(family)
    ids = ids_for()
    for method, arch in (("tah2", "ffn"), ("anira-e", None), ("anira-o", None)):
        extra = {"options": {"decider_arch": arch}} if arch else {}
        looped = retrofit.convert(base, LoopConfig(max_depth=4, method=method, **extra)).eval()
        assert looped(ids).depths.eq(4).all(), method
    looped = retrofit.convert(base, LoopConfig(max_depth=4, method="tah2")).eval()
    with torch.no_grad():
        assert (looped(ids).halt_signals[..., 0] - 0.5).abs().max() < 0.05


@pytest.mark.parametrize("attention", retrofit.ATTENTION_MODES)
@pytest.mark.parametrize("split", SPLITS)
def test_fixed_depth_matches_bruteforce(family, attention, split):
    base = tiny_base(family)
    looped = randomize_heads(
        retrofit.convert(
            base, LoopConfig(prelude=split[0], core=split[1], max_depth=3, method="fixed", attention=attention)
        )
    ).eval()
    ids = ids_for(T=6)
    for k in (2, 3):
        depths = torch.full(ids.shape, k)
        with torch.no_grad():
            ours = looped(ids, depth=k).logits
            ref = looped_reference(looped, ids, depths)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", retrofit.ATTENTION_MODES)
@pytest.mark.parametrize("split", SPLITS)
def test_mixed_depths_match_bruteforce(family, attention, split):
    base = tiny_base(family)
    looped = randomize_heads(
        retrofit.convert(
            base, LoopConfig(prelude=split[0], core=split[1], max_depth=3, method="fixed", attention=attention)
        )
    ).eval()
    ids = ids_for(T=7, seed=3)
    depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in row 1
    with torch.no_grad():
        ours = looped(ids, attention_mask=mask, depth=depths).logits
        ref = looped_reference(looped, ids, depths, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-4, rtol=1e-4)
    assert looped(ids, depth=depths).depths.equal(depths)


def test_tah2_final_depth_output_matches_bruteforce():
    """TaH2 without the mixture (the 'final-depth only' ablation) is the plain exit-depth readout."""
    base = tiny_base("qwen3")
    looped = randomize_heads(
        retrofit.convert(base, LoopConfig(max_depth=3, method="tah2", options={"mixture_output": False}))
    ).eval()
    ids = ids_for(T=6, seed=2)
    depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(
            looped(ids, depth=depths).logits, looped_reference(looped, ids, depths), atol=1e-4, rtol=1e-4
        )


def test_passthrough_ignores_deeper_states_of_exited_tokens():
    """Noise injected into the (discarded) deeper core outputs of exited tokens changes nothing."""
    base = tiny_base("llama")
    for attention in retrofit.ATTENTION_MODES:
        looped = randomize_heads(
            retrofit.convert(base, LoopConfig(prelude=1, core=3, max_depth=3, method="fixed", attention=attention))
        ).eval()
        ids = ids_for(T=8, seed=4)
        depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(2))
        clean = looped(ids, depth=depths).logits

        def noisy(module, args, kwargs, output):
            m = kwargs["loop_depth"]
            exited = (depths < m)[..., None]
            return torch.where(exited, output + 10 * torch.randn_like(output), output)

        handles = [layer.register_forward_hook(noisy, with_kwargs=True) for layer in looped.core_layers]
        try:
            dirty = looped(ids, depth=depths).logits
        finally:
            for hd in handles:
                hd.remove()
        torch.testing.assert_close(dirty, clean, atol=1e-5, rtol=0)


def test_token_depends_only_on_depths_of_itself_and_earlier_tokens():
    base = tiny_base("llama")
    looped = randomize_heads(
        retrofit.convert(base, LoopConfig(max_depth=3, method="fixed", attention="duo-causal"))
    ).eval()
    ids = ids_for(B=1, T=8)
    d1 = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(0))
    d2 = d1.clone()
    d2[0, 5:] = 4 - d2[0, 5:]  # change only later tokens' depths
    a = looped(ids, depth=d1).logits
    b = looped(ids, depth=d2).logits
    torch.testing.assert_close(a[0, :5], b[0, :5], atol=1e-5, rtol=0)
    assert not torch.allclose(a[0, 5:], b[0, 5:])


def test_tah2_mixture_equals_direct_computation():
    base = tiny_base("llama")
    looped = randomize_heads(retrofit.convert(base, LoopConfig(max_depth=3, method="tah2")), scale=3.0).eval()
    ids = ids_for(T=9, seed=7)
    out = looped(ids, output_depth_logits=True)
    c = out.halt_signals  # [B, T, k]
    d = out.depths
    assert d.min() >= 1 and d.max() <= 3
    # direct: π_d = (1 - c_d) Π_{j<d} c_j before the exit, Π_{j<d*} c_j at the exit
    B, T = d.shape
    p = torch.zeros(B, T, base.config.vocab_size)
    for b in range(B):
        for t in range(T):
            surv = 1.0
            for j in range(1, int(d[b, t]) + 1):
                w = surv if j == d[b, t] else surv * (1 - c[b, t, j - 1])
                p[b, t] += w * out.depth_logits[j - 1, b, t].softmax(-1)
                if j < d[b, t]:
                    surv = surv * c[b, t, j - 1]
    torch.testing.assert_close(out.logits.softmax(-1), p, atol=1e-5, rtol=1e-4)
    # the decision rule: continue iff c >= τ
    for b in range(B):
        for t in range(T):
            k = int(d[b, t])
            assert all(c[b, t, j] >= 0.5 for j in range(k - 1))
            if k < 3:
                assert c[b, t, k - 1] < 0.5
    torch.testing.assert_close(out.depth_probs.sum(-1), torch.ones(B, T))


def test_mixture_weights_rows_sum_to_one():
    g = torch.Generator().manual_seed(0)
    cont = [torch.rand(3, 5, generator=g) for _ in range(3)]
    depths = torch.randint(1, 5, (3, 5), generator=g)
    w = mixture_weights(cont, depths, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 5))
    assert (w[depths.unsqueeze(-1) < torch.arange(1, 5)] == 0).all()


def test_anira_rules_in_eval():
    base = tiny_base("llama")
    ids = ids_for(T=9)
    e = randomize_heads(retrofit.convert(base, LoopConfig(max_depth=4, method="anira-e")), scale=20.0).eval()
    out = e(ids)
    assert torch.equal(out.depths, out.depth_probs.argmax(-1) + 1)
    o = randomize_heads(retrofit.convert(base, LoopConfig(max_depth=4, method="anira-o")), scale=20.0).eval()
    out = o(ids)
    q = out.depth_probs
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:2]))
    # the median rule: first depth whose cumulative mass reaches 0.5
    median = (q.cumsum(-1) >= 0.5).float().argmax(-1) + 1
    assert torch.equal(out.depths, median)
    assert out.depths.unique().numel() > 1, "constructed case should mix depths"


def test_eval_forward_is_deterministic_and_training_samples():
    base = tiny_base("llama")
    ids = ids_for(T=9)
    m = randomize_heads(retrofit.convert(base, LoopConfig(max_depth=4, method="anira-e")), scale=0.5)
    m.eval()
    assert torch.equal(m(ids).logits, m(ids).logits)
    m.train()
    torch.manual_seed(0)
    d1 = m(ids).depths
    torch.manual_seed(1)
    d2 = m(ids).depths
    assert not torch.equal(d1, d2)  # Gumbel sampling in training


def test_packed_sequences_do_not_attend_across_boundaries():
    base = tiny_base("llama")
    looped = randomize_heads(
        retrofit.convert(base, LoopConfig(max_depth=2, method="fixed", attention="duo-causal"))
    ).eval()
    a, b = ids_for(B=1, T=5, seed=1), ids_for(B=1, T=4, seed=2)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(5), torch.arange(4)])[None]
    out = looped(packed, position_ids=pos, depth=2).logits
    torch.testing.assert_close(out[:, :5], looped(a, depth=2).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, 5:], looped(b, depth=2).logits, atol=1e-5, rtol=0)


def test_gradient_checkpointing_keeps_duo_causal_attention():
    base = tiny_base("llama")
    m = randomize_heads(retrofit.convert(base, LoopConfig(max_depth=3, method="fixed", attention="duo-causal"))).train()
    ids = ids_for(T=6)
    loss_a = m(ids, labels=ids, depth=3).loss
    loss_a.backward()
    grads_a = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    m.gradient_checkpointing_enable()
    assert m.is_gradient_checkpointing
    loss_b = m(ids, labels=ids, depth=3).loss
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b)
    for n, p in m.named_parameters():
        if n in grads_a:
            torch.testing.assert_close(p.grad, grads_a[n], atol=1e-6, rtol=1e-5)


def test_save_load_round_trip(tmp_path, family):
    base = tiny_base(family)
    looped = randomize_heads(
        retrofit.convert(base, LoopConfig(prelude=1, core=4, max_depth=3, method="tah2")), scale=2.0
    ).eval()
    ids = ids_for()
    ref = looped(ids)
    looped.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(looped)
    assert loaded.loop == looped.loop
    out = loaded(ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)
    assert torch.equal(out.depths, ref.depths)
    for (n, p), (_, q) in zip(looped.named_parameters(), loaded.named_parameters()):
        if n.startswith(("updater", "halting")):
            assert torch.equal(p, q), n


def test_base_checkpoint_loads_into_looped_class(tmp_path):
    base = tiny_base("llama")
    base.save_pretrained(tmp_path)
    cfg = retrofit.looped_config_for(base.config, LoopConfig(max_depth=2, method="anira-o"))
    looped = retrofit.LoopedLlamaForCausalLM.from_pretrained(tmp_path, config=cfg).eval()
    ids = ids_for()
    torch.testing.assert_close(looped(ids, depth=1).logits, base(ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(looped.updater.w2.weight, torch.zeros_like(looped.updater.w2.weight))


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prelude=6), "prelude=6 leaves no layer"),
        (dict(prelude=2, core=5), "exceeds the model's 6 layers"),
        (dict(max_depth=0), "max_depth must be an integer >= 1"),
        (dict(method="act"), "allowed: tah2, anira-e, anira-o, fixed"),
        (dict(attention="bidirectional"), "allowed: duo-causal, same-depth"),
        (dict(core=0), "core must be None"),
        (dict(prelude=-1), "prelude must be an integer >= 0"),
        (dict(options={"exit_threshold": 1.5}), "tah2 options: exit_threshold must be a number strictly between 0"),
        (dict(method="anira-o", options={"halt_threshold": 0.0}), "halt_threshold must be a number strictly between"),
    ],
)
def test_invalid_loop_configs_raise(kwargs, match):
    base = tiny_base("llama")
    with pytest.raises(LoopConfigError, match=match):
        retrofit.convert(base, LoopConfig(**kwargs))


def test_unsupported_architecture_raises():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(
        UnsupportedArchitectureError, match=r"unsupported architecture 'gpt2'.*supported are: llama.*qwen3"
    ):
        retrofit.convert(gpt2, LoopConfig())


def test_bad_depth_arguments_raise():
    looped = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2))
    ids = ids_for()
    with pytest.raises(ValueError, match=r"allowed 1..2"):
        looped(ids, depth=3)
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        looped(ids, depth=torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"lie in 1..2"):
        looped(ids, depth=torch.zeros_like(ids))


def test_float_depth_tensor_is_refused_not_truncated():
    """``depth=`` as a float tensor (1.7) used to become 1 through ``.long()``; now a DepthError naming integers."""
    from retrofit.model.config import DepthError
    from retrofit.model.errors import RetrofitUserError

    looped = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2)).eval()
    ids = ids_for()
    for bad in (torch.full(ids.shape, 1.7), torch.ones(ids.shape, dtype=torch.bool), torch.full(ids.shape, 2.0)):
        with pytest.raises(DepthError, match=r"integer dtype.*\.long\(\)") as e:
            looped(ids, depth=bad)
        assert isinstance(e.value, RetrofitUserError) and isinstance(e.value, ValueError)
    with pytest.raises(DepthError, match="must be None, an int"):
        looped(ids, depth=1.0)
    with torch.no_grad():  # an integer tensor of any integer dtype is accepted and means what it says
        for dt in (torch.int32, torch.int64, torch.uint8):
            out = looped(ids, depth=torch.full(ids.shape, 2, dtype=dt))
            assert out.depths.eq(2).all(), dt
        assert looped(ids, depth=1).depths.eq(1).all()


def test_sliding_window_core_is_refused():
    base = tiny_base("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    with pytest.raises(LoopConfigError, match="full-attention"):
        retrofit.convert(base, LoopConfig())


@pytest.mark.parametrize("name", ["Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-8B-Base", "meta-llama/Llama-3.2-1B"])
def test_heads_under_three_percent_at_real_shapes(name):
    from retrofit.cli.params import meta_report

    for method in retrofit.METHODS:
        r = meta_report(name, LoopConfig(max_depth=8, method=method))
        assert r["heads_share"] < 0.03, (name, method, r)
        assert r["base"] > 1e9


@pytest.mark.parametrize("method", ["tah2", "anira-e", "anira-o"])
def test_forced_depth_runs_no_decider(method):
    """``depth=`` replaces the exit rule: the decider is never called (full forward and decoding alike),
    the output is the plain looped model at those depths (brute force, coda included), and TaH2 reads out
    only the exit states (one LM-head call) instead of every depth."""
    base = tiny_base("llama")
    looped = randomize_heads(
        retrofit.convert(base, LoopConfig(prelude=2, core=3, max_depth=3, method=method)), scale=2.0
    ).eval()
    calls = {"decider": 0, "head": 0}
    hooks = [
        looped.halting.decider.register_forward_hook(lambda *a: calls.__setitem__("decider", calls["decider"] + 1)),
        looped.lm_head.register_forward_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1)),
    ]
    ids = ids_for(T=6, seed=2)
    depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            out = looped(ids, depth=depths)
            assert calls == {"decider": 0, "head": 1}
            assert out.depth_probs is None and out.halt_signals is None
            torch.testing.assert_close(out.logits, looped_reference(looped, ids, depths), atol=1e-4, rtol=1e-4)
            looped.generate(ids[:, :3], max_new_tokens=3, depth=2, do_sample=False, pad_token_id=0)
            assert calls["decider"] == 0
            looped(ids)  # the method's own exit rule calls it
        assert calls["decider"] > 0
    finally:
        for h in hooks:
            h.remove()
