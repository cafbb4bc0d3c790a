"""The TaH2 release's options on the model side (docs/tah2.md, "the options of the release"), each against a hand
computation or a brute-force reference: the updater, the state the decider and the updater read, the top-K
features' gradient, the decider's width and init, padding that never continues; their defaults per method and
what an older checkpoint's ``loop`` dict means."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from bruteforce import looped_reference

import retrofit
from retrofit import LoopConfig, LoopConfigError
from retrofit.model import registry
from retrofit.model.config import GENERIC_DEFAULTS, LEGACY_VALUES
from retrofit.model.heads import SwiGLUUpdater, Updater, release_decider_width, swiglu_decider_parameters
from retrofit.testing import spread_decider, tiny_base

pytestmark = pytest.mark.usefixtures("one_thread")

RELEASE = {
    "updater": "release",
    "decider_state": "final_norm",
    "decider_width_rule": "release",
    "padding_stops": True,
}
#: TaH2's own options whose defaults are the release's (``TaH2Options``)
RELEASE_OPTIONS = {"decider_topk_grad": True, "decider_init": "torch", "decider_arch": "swiglu"}


def ids_for(B=2, T=9, seed=0):
    return torch.randint(4, 104, (B, T), generator=torch.Generator().manual_seed(seed))


def _rms(x, w, eps):
    """RMSNorm written out: ``x / sqrt(mean(x²) + eps) * w``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ------------------------------------------------------------------------------------------------
# defaults
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", retrofit.METHODS)
def test_method_defaults_are_the_release_for_tah2_only(method):
    assert registry.method_class("tah2").loop_defaults == RELEASE
    loop = LoopConfig(method=method)
    # each method's own loop_defaults over the generic ones (Ouro's gate reads the final-normed state)
    want = RELEASE if method == "tah2" else {**GENERIC_DEFAULTS, **registry.method_class(method).loop_defaults}
    assert {k: getattr(loop, k) for k in RELEASE} == want
    if method == "tah2":
        o = loop.method_options
        assert (o.kappa_scope, o.kappa_gather, o.decider_loss_scope) == ("per-boundary", True, "global")
        assert {k: getattr(o, k) for k in RELEASE_OPTIONS} == RELEASE_OPTIONS and o.decider_top_k is None
    assert loop.decider_hidden is None
    stored = LoopConfig.from_dict(loop.to_dict())  # to_dict stores the resolved values
    assert stored == loop


def test_new_fields_reject_unknown_values_naming_the_allowed_ones():
    for name, bad, allowed in [
        ("updater", "identity", "release, residual"),
        ("decider_state", "prenorm", "final_norm, core"),
        ("decider_width_rule", "half", "release, quarter"),
    ]:
        with pytest.raises(LoopConfigError, match=allowed):
            LoopConfig(**{name: bad})
    for name, bad, allowed in [
        ("decider_init", "xavier", "torch, normal"),
        ("decider_arch", "mlp", "swiglu, ffn"),
        ("kappa_scope", "global", "per-boundary, pooled"),
        ("decider_loss_scope", "rank", "global, local"),
    ]:  # TaH2's own options
        with pytest.raises(LoopConfigError, match=f"tah2 options: {name} must be one of {allowed}"):
            LoopConfig(options={name: bad})
    with pytest.raises(LoopConfigError, match="true or false"):
        LoopConfig(padding_stops="yes")
    for name in ("kappa_gather", "decider_topk_grad"):
        with pytest.raises(LoopConfigError, match=f"{name} must be true or false"):
            LoopConfig(options={name: "yes"})
    with pytest.raises(LoopConfigError, match="None .the hidden size."):
        LoopConfig(options={"decider_top_k": -1})


def test_an_old_checkpoint_dict_keeps_what_it_computed():
    """A ``loop`` dict written before the release's options existed (``to_dict`` stored every field then,
    ``decider_hidden: null`` meaning H // 4 and ``decider_top_k: 2048``) loads with the legacy values, builds the
    same modules (``updater.w1``/``w2``, a width-H/4 decider over the top-2,048) and computes what that version
    computed: the residual updater on the core output, detached top-K features, pooled κ. Its loss settings are
    flat fields, every method's (retrofit < 0.4): TaH2's move into ``options``, ANIRA's are dropped."""
    new = LoopConfig(max_depth=3, options={"decider_top_k": 2048}).to_dict()
    old = {k: v for k, v in new.items() if k not in LEGACY_VALUES and k != "options"}
    old.update(decider_top_k=2048, decider_init_std=0.01)  # flat then; decider_topk_grad and decider_init absent
    old.update(decider_arch="swiglu", dyn_pos_weight=True, cost_min=1e-6, cost_max=1.0, decider_loss_norm="tokens")
    old.update(alpha_d=0.07, rho=0.99, decider_weighting="distance", pos_weight=1.0, bce_margin=0.0)
    old.update(mixture_output=True, train_decisions="threshold", gamma=0.01, prior_base=2.0, gumbel_tau=1.0)
    assert old["decider_hidden"] is None
    loop = LoopConfig.from_dict(old)
    assert {k: getattr(loop, k) for k in LEGACY_VALUES if k in RELEASE} == {k: LEGACY_VALUES[k] for k in RELEASE}
    o = loop.method_options
    assert (o.kappa_scope, o.kappa_gather, o.decider_loss_scope) == ("pooled", False, "local")
    assert (o.decider_topk_grad, o.decider_init, o.decider_top_k) == (False, "normal", 2048)
    assert (o.alpha_d, o.dyn_pos_weight, o.cost_min) == (0.07, True, 1e-6) and set(loop.options) == set(new["options"])
    with pytest.raises(LoopConfigError, match=r"config.loop has alpha_d=0.5 and options\['alpha_d'\]=0.05"):
        LoopConfig.from_dict({**new, "alpha_d": 0.5})  # a flat setting beside the nested one: refused, not ignored
    base = tiny_base("llama")
    cfg = retrofit.looped_config_for(base.config, LoopConfig(max_depth=3))
    cfg.loop = old
    torch.manual_seed(0)
    m = retrofit.LoopedLlamaForCausalLM(cfg, backbone=base.model, lm_head=base.lm_head)
    assert isinstance(m.updater, Updater) and m.halting.decider.input_proj.weight.shape == (16, 2 * 64 + 2048)
    # nothing resolved into it (its shapes were explicit already); its flat method settings are stored nested now
    assert m.config.loop == LoopConfig.from_dict(old).to_dict() and "alpha_d" not in m.config.loop
    H = base.config.hidden_size
    assert m.halting.decider_hidden == H // 4


# ------------------------------------------------------------------------------------------------
# 1. the updater
# ------------------------------------------------------------------------------------------------
def test_release_updater_by_hand():
    """``x = norm_out(W_down(SiLU(W_gate q) ⊙ W_up q))``, ``q = norm_mid(W_p [norm_e(e); norm_h(s)])``: the
    output replaces the core input (no ``e +``)."""
    torch.manual_seed(0)
    u = SwiGLUUpdater(8, 12, eps=1e-5)
    with torch.no_grad():
        for n in (u.norm_e, u.norm_h, u.norm_mid, u.norm_out):
            n.weight.uniform_(0.5, 1.5)
    e, s = torch.randn(3, 8), torch.randn(3, 8)
    p = torch.cat([_rms(e, u.norm_e.weight, 1e-5), _rms(s, u.norm_h.weight, 1e-5)], -1) @ u.proj.weight.T
    q = _rms(p, u.norm_mid.weight, 1e-5)
    mlp = (F.silu(q @ u.gate_proj.weight.T) * (q @ u.up_proj.weight.T)) @ u.down_proj.weight.T
    torch.testing.assert_close(u(e, s), _rms(mlp, u.norm_out.weight, 1e-5))
    assert (
        u.proj.weight.shape == (8, 16) and u.gate_proj.weight.shape == (12, 8) and u.down_proj.weight.shape == (8, 12)
    )


def test_release_updater_has_pytorch_init_and_depth_one_is_still_the_base():
    base = tiny_base("qwen3")
    ids = ids_for()
    torch.manual_seed(0)
    m = retrofit.convert(base, LoopConfig(max_depth=2, method="tah2")).eval()
    assert isinstance(m.updater, SwiGLUUpdater)
    for lin in (m.updater.proj, m.updater.gate_proj, m.updater.up_proj, m.updater.down_proj):
        bound = 1 / math.sqrt(lin.in_features)  # kaiming_uniform(a=√5) = U(±1/√fan_in)
        assert lin.weight.abs().max() <= bound
        assert lin.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    for n in (m.updater.norm_e, m.updater.norm_h, m.updater.norm_mid, m.updater.norm_out):
        assert torch.equal(n.weight, torch.ones_like(n.weight))
    with torch.no_grad():
        torch.testing.assert_close(m(ids, depth=1).logits, base(ids).logits, rtol=0, atol=0)
        assert (m(ids, depth=2).logits - m(ids, depth=1).logits).abs().max() > 1e-2  # not the identity at init
    residual = retrofit.convert(base, LoopConfig(max_depth=2, method="tah2", updater="residual")).eval()
    with torch.no_grad():  # the residual updater starts at e (W2 = 0)
        torch.testing.assert_close(residual(ids, depth=2).logits, residual(ids, depth=1).logits)


@pytest.mark.parametrize("updater", ["release", "residual"])
@pytest.mark.parametrize("state", ["final_norm", "core"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_updater_and_state_match_the_brute_force_loop(family, updater, state):
    """Mixed forced depths with a coda (prelude 1 / core 3 / coda 2): the updater reads ``e`` and the state
    (the final norm of the core output, or the core output) — the token-by-token reference of tests/bruteforce.py."""
    torch.manual_seed(1)
    m = retrofit.convert(
        tiny_base(family),
        LoopConfig(prelude=1, core=3, max_depth=3, method="fixed", updater=updater, decider_state=state),
    ).eval()
    with torch.no_grad():
        for p in m.updater.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 / p.shape[1] ** 0.5)
            else:
                p.uniform_(0.5, 1.5)
        m.model.norm.weight.uniform_(0.5, 1.5)  # so that the final norm is not the plain RMS normalization
        ids = ids_for(T=6)
        depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(m(ids, depth=depths).logits, looped_reference(m, ids, depths), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# 2. the state the decider reads
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["final_norm", "core"])
def test_decider_reads_the_final_norm_of_the_core_output(state):
    """Whole-stack TaH2 at M = 2: the depth-1 continue logit is the decider on (the embeddings, the base model's
    ``hidden_states[-1]`` — after its final norm — or the last layer's output before it, the top-K of the base
    model's next-token distribution), computed from the base model alone."""
    base = tiny_base("llama")
    with torch.no_grad():
        base.model.norm.weight.uniform_(0.5, 1.5)
    torch.manual_seed(0)
    m = retrofit.convert(base, LoopConfig(max_depth=2, decider_state=state)).eval()
    spread_decider(m, logit_std=2.0)
    ids = ids_for()
    seen = {}
    hook = base.model.layers[-1].register_forward_hook(lambda mod, a, out: seen.__setitem__("h", out))
    with torch.no_grad():
        ref = base(ids, output_hidden_states=True)
        hook.remove()
        s = ref.hidden_states[-1] if state == "final_norm" else seen["h"]
        assert not torch.allclose(ref.hidden_states[-1], seen["h"])
        probs = ref.logits.float().softmax(-1)
        top = F.pad(probs.topk(probs.shape[-1], -1).values, (0, m.halting.top_k - probs.shape[-1]))
        want = m.halting.decider(base.model.embed_tokens(ids), s, top).squeeze(-1)
        out = m(ids)
    torch.testing.assert_close(out.halt_logits[..., 0], want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# 3. the top-K features' gradient
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk_grad", [True, False])
def test_topk_gradient_matches_a_hand_built_decider_loss(topk_grad):
    """Whole-stack TaH2 at M = 2: every decision is made after depth 1, on inputs the base model computes by
    itself. The reference writes ``α_D · L_D`` out from the base model's own forward: ``c = decider(embed(x),
    hidden_states[-1], top-K(softmax(logits)))``, BCE against the labels (uniform weights, static pos_weight),
    over the labelled tokens; its gradient w.r.t. the backbone (the final norm, the untied LM head, the last
    layer) is autograd through that formula, with the probabilities live or detached. The model's gradient
    equals the matching one; the LM head reaches the decider only through the top-K probabilities, so detached
    it gets no gradient at all."""
    torch.manual_seed(0)
    base = tiny_base("llama", tie_word_embeddings=False)
    loop = LoopConfig(
        max_depth=2,
        options={
            "decider_topk_grad": topk_grad,
            "decider_top_k": 16,
            "decider_weighting": "uniform",
            "dyn_pos_weight": False,
        },
    )
    m = retrofit.convert(base, loop).train()
    spread_decider(m, logit_std=2.0)
    ids = ids_for(B=2, T=8, seed=3)
    labels = ids.clone()
    labels[:, :2] = -100
    params = {
        "model.norm.weight": m.model.norm.weight,
        "lm_head.weight": m.lm_head.weight,
        "mlp": m.model.layers[-1].mlp.down_proj.weight,
    }

    def grads(loss) -> dict:
        gs = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
        return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), gs)}

    out = m(ids, labels=labels)
    got = grads(out.aux_loss)

    from retrofit.model.halting.tah2 import lookahead_labels, next_token_mask

    mask = next_token_mask(labels)
    y = lookahead_labels(out.depth_nll, mask, rho=m.loop.method_options.rho).labels[..., 0].float()

    def reference(live: bool) -> dict:
        ref = base(ids, output_hidden_states=True)
        probs = ref.logits.float().softmax(-1)
        probs = probs if live else probs.detach()
        top = probs.topk(16, -1).values
        logit = m.halting.decider(base.model.embed_tokens(ids), ref.hidden_states[-1], top).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(logit, y, reduction="none")
        loss = m.loop.method_options.alpha_d * bce[mask].sum() / mask.sum()
        torch.testing.assert_close(loss, out.aux_loss)
        return grads(loss)

    want, other = reference(topk_grad), reference(not topk_grad)
    for name in params:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)
    assert (other["lm_head.weight"] - want["lm_head.weight"]).abs().max() > 1e-5  # the two really differ
    if not topk_grad:
        assert torch.equal(got["lm_head.weight"], torch.zeros_like(got["lm_head.weight"]))


# ------------------------------------------------------------------------------------------------
# 4. the decider's width and init
# ------------------------------------------------------------------------------------------------
def test_release_decider_width_rule_by_hand():
    H = 100
    upd = 5 * H * H  # the release updater at intermediate H (norm weights aside)
    full = swiglu_decider_parameters([H, H, H], H)
    assert full == 3 * H + 3 * H * H + 3 * H * H + H + H
    # fits: H; the first of H, H/2, H/4 under 3%; none fits: H/4
    assert release_decider_width(H, H, upd, math.ceil((upd + full) / 0.03) + 1) == H
    half = swiglu_decider_parameters([H, H, H], H // 2)
    assert release_decider_width(H, H, upd, math.ceil((upd + half) / 0.03) + 1) == H // 2
    assert release_decider_width(H, H, upd, 10) == H // 4


@pytest.mark.parametrize(
    "name, width",
    [
        ("Qwen/Qwen3-1.7B-Base", 2048),
        ("Qwen/Qwen3-8B-Base", 4096),
        ("meta-llama/Llama-3.2-1B", 1024),  # 3.7% at the full width: halved
        ("HuggingFaceTB/SmolLM2-135M", 576),
    ],
)
def test_release_width_at_real_shapes_is_stored_in_the_config(name, width):
    from retrofit.cli.params import REAL_SHAPES
    from retrofit.model.heads import parameter_report

    cfg_cls, lm_cls, fields = REAL_SHAPES[name]
    with torch.device("meta"):
        m = retrofit.convert(lm_cls(cfg_cls(**fields)), LoopConfig(max_depth=2))
    H = fields["hidden_size"]
    assert m.config.loop["decider_hidden"] == width and m.config.loop["options"]["decider_top_k"] == H
    assert m.halting.decider.input_proj.weight.shape == (width, 3 * H)
    assert isinstance(m.updater, SwiGLUUpdater) and m.updater.gate_proj.weight.shape == (H, H)
    assert parameter_report(m)["heads_share"] < 0.03


@pytest.mark.parametrize("init", ["torch", "normal"])
def test_decider_init(init):
    torch.manual_seed(0)
    m = retrofit.convert(
        tiny_base("llama"), LoopConfig(decider_hidden=256, options={"decider_init": init, "decider_init_std": 0.01})
    )
    d = m.halting.decider
    for lin in (d.input_proj, d.gate_proj, d.up_proj, d.down_proj):
        bound = 1 / math.sqrt(lin.in_features)
        std = bound / math.sqrt(3) if init == "torch" else m.config.initializer_range
        assert lin.weight.std().item() == pytest.approx(std, rel=0.1), lin
        if init == "torch":
            assert lin.weight.abs().max() <= bound
    assert d.score.weight.std().item() == pytest.approx(0.01, rel=0.2) and d.score.bias is None


def test_flops_count_the_release_heads():
    from retrofit.model.flops import model_costs

    base = tiny_base("llama")
    m = retrofit.convert(base, LoopConfig(max_depth=2, decider_hidden=24, options={"decider_top_k": 10}))
    H, inner = 64, 64  # the updater MLP width: updater_hidden = H
    c = model_costs(m)
    assert c["updater"] == 2 * H * H + 3 * H * inner
    assert c["decider"] == (2 * H + 10) * 24 + 3 * 24 * 24 + 24


# ------------------------------------------------------------------------------------------------
# 7. padding never continues
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padding_stops_at_depth_one_and_real_tokens_are_unchanged(family):
    """Left and right padding, most real tokens continuing (threshold 0.3): with ``padding_stops`` the padding
    positions exit at depth 1 and get no lookahead row (NaN depth losses beyond depth 1); the real tokens'
    logits and depths, the loss and the decider loss equal those with padding that runs the loop."""
    torch.manual_seed(0)
    m = retrofit.convert(tiny_base(family), LoopConfig(prelude=1, core=3, max_depth=3)).train()
    ids = ids_for(B=3, T=8, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # the first real token is no target: no padding position predicts a label (as in SFT rows)
    real = mask.bool()
    outs = {}
    for stops in (True, False):
        m.config.loop = {**m.config.loop, "padding_stops": stops}
        outs[stops] = m(ids, attention_mask=mask, labels=labels, decider_threshold=0.3)
    on, off = outs[True], outs[False]
    assert (on.depths[~real] == 1).all() and (off.depths[~real] > 1).any()
    assert torch.equal(on.depths[real], off.depths[real]) and (on.depths[real] > 1).any()
    torch.testing.assert_close(on.logits[real], off.logits[real], atol=1e-5, rtol=1e-5)
    assert torch.isnan(on.depth_nll[~real][:, 1:]).all()  # no lookahead rows for padding
    torch.testing.assert_close(on.loss, off.loss)
    torch.testing.assert_close(on.aux_loss, off.aux_loss)
