"""What makes adaptive depth trainable and measurable (docs/tah2.md, docs/evaluation.md): the release's decider,
call-time decision thresholds, random allocation at a given mean depth, the depth curriculum, deep supervision
(every depth trained before the decider decides) and the trainer's phase switch, with exact resume across it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from sft_setup import LOGGED_RUN, addition_rows, sft_config

import retrofit
from retrofit.model.config import LoopConfig
from retrofit.model.halting.training_free import RandomContinue, continue_rate_for_mean_depth
from retrofit.model.heads import SwiGLUDecider
from retrofit.testing import char_tokenizer, perturb_updater, spread_decider, tiny_base
from retrofit.training import RetrofitSFTConfig, RetrofitSFTTrainer
from retrofit.training.checkpointing import last_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(method="tah2", max_depth=2, seed=0, spread=True, **loop):
    if method.startswith("anira"):
        loop = {"prelude": 1, "core": 4, **loop}
    torch.manual_seed(seed)
    m = retrofit.convert(
        tiny_base("llama", seed=seed), LoopConfig.from_fields(dict(max_depth=max_depth, method=method, **loop))
    )
    if spread and method == "tah2":
        spread_decider(m, logit_std=2.0, generator=torch.Generator().manual_seed(seed))
    return m


def _ids(B=4, T=20, seed=0):
    return torch.randint(4, 104, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# the release's decider
# ------------------------------------------------------------------------------------------------
def test_swiglu_decider_starts_near_one_half_and_norms_each_part():
    m = _model(spread=False).eval()
    assert isinstance(m.halting.decider, SwiGLUDecider)
    assert m.halting.decider.score.bias is None
    with torch.no_grad():
        out = m(_ids())
    c = out.halt_signals
    assert (c - 0.5).abs().max() < 0.05  # score ~ N(0, 0.01): every decision near p = 0.5
    # each part is normed on its own: scaling the probability features leaves the decision unchanged
    dec = m.halting.decider
    e, h, p = torch.randn(3, 64), torch.randn(3, 64), torch.rand(3, m.loop.method_options.decider_top_k)
    torch.testing.assert_close(dec(e, h, p), dec(e, h, 7.0 * p))
    with pytest.raises(ValueError, match="input parts"):
        dec(e, h)


def test_checkpoints_without_the_new_fields_load_as_they_were_trained(tmp_path):
    """A stored ``loop`` dict from before decider_arch / the loss guards existed reads as the old behaviour."""
    opts = {"decider_arch": "ffn", "decider_top_k": 10}
    old = {k: v for k, v in LoopConfig(method="tah2", options=opts).to_dict().items()}
    for k in ("decider_arch", "decider_init_std", "dyn_pos_weight", "cost_min", "cost_max", "decider_loss_norm"):
        old["options"].pop(k)
    lc = LoopConfig.from_dict(old)
    o = lc.method_options
    assert (o.decider_arch, o.dyn_pos_weight, o.cost_min, o.cost_max, o.decider_loss_norm) == (
        "ffn",
        False,
        0.0,
        None,
        "weights",
    )
    # a saved "ffn" model whose config.json lost the new keys reloads with identical logits
    m = _model(decider_arch="ffn", decider_top_k=10).eval()
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k in ("decider_arch", "dyn_pos_weight", "cost_min", "cost_max", "decider_loss_norm"):
        cfg["loop"]["options"].pop(k)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.loop.method_options.decider_arch == "ffn"
    with torch.no_grad():
        torch.testing.assert_close(back(_ids()).logits, m(_ids()).logits)


def test_decider_without_probability_features_needs_no_per_depth_readout():
    m = _model(decider_top_k=0, mixture_output=False).eval()
    assert not m.halting.needs_depth_readout
    assert m.halting.decider.parts == [64, 64]
    with torch.no_grad():
        out = m(_ids())
    assert out.halt_signals is not None and out.depths.max() <= 2
    from retrofit.model.flops import cost_report

    with_readout = cost_report(_model(decider_top_k=0), out.depths)  # mixture on: reads every depth
    without = cost_report(m, out.depths)
    assert without["flops"] < with_readout["flops"]


# ------------------------------------------------------------------------------------------------
# call-time thresholds (the frontier's knob; TaH2's threshold warm-up)
# ------------------------------------------------------------------------------------------------
def _with_loop(m, **fields):
    """The same weights under a model built with other LoopConfig fields or method options."""
    d = m.loop.to_dict()
    opts = {k: fields.pop(k) for k in list(fields) if k in d["options"]}
    loop = LoopConfig(**{**d, **fields, "options": {**d["options"], **opts}})
    other = retrofit.convert(tiny_base("llama"), loop).eval()
    other.load_state_dict(m.state_dict())
    return other


def test_decider_threshold_equals_the_configured_threshold():
    m = _model(max_depth=3).eval()
    ids = _ids()
    with torch.no_grad():
        for tau in (0.2, 0.5, 0.8):
            a = m(ids, decider_threshold=tau)
            b = _with_loop(m, exit_threshold=tau)(ids)
            assert torch.equal(a.depths, b.depths)
            torch.testing.assert_close(a.logits, b.logits)
        assert (m(ids, decider_threshold=0.0).depths == 3).all()  # c >= 0: every token continues
        d = [m(ids, decider_threshold=t).depths.float().mean().item() for t in (0.1, 0.5, 0.9)]
        assert d[0] >= d[1] >= d[2] and d[0] > d[2]


def test_anira_thresholds_at_inference():
    o = _model("anira-o", max_depth=3).eval()
    ids = _ids()
    with torch.no_grad():
        for p in o.halting.parameters():
            p.normal_(0, 0.5)
        a = o(ids, decider_threshold=0.3)
        assert torch.equal(a.depths, _with_loop(o, halt_threshold=0.3)(ids).depths)
        assert not torch.equal(a.depths, o(ids).depths)
    e = _model("anira-e", max_depth=3).eval()
    with torch.no_grad():
        for p in e.halting.parameters():
            p.normal_(0, 0.5)
        q = e(ids).depth_probs  # [B, T, 3]
        for u in (0.1, 0.5, 0.9):
            got = e(ids, decider_threshold=u).depths
            # the first depth whose cumulative mass reaches u, by hand
            cdf = q.cumsum(-1)
            want = torch.tensor(
                [
                    [next(d + 1 for d in range(3) if d == 2 or cdf[b, t, d] >= u) for t in range(q.shape[1])]
                    for b in range(q.shape[0])
                ]
            )
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="decider_threshold"):
        e(ids, decider_threshold=1.5)


# ------------------------------------------------------------------------------------------------
# random allocation at a given mean depth
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D, dbar", [(2, 1.3), (2, 1.0), (3, 1.75), (3, 2.6)])
def test_random_continue_hits_the_requested_mean_depth(D, dbar):
    q = continue_rate_for_mean_depth(dbar, D)
    assert sum(q**k for k in range(D)) == pytest.approx(dbar, abs=1e-9)
    m = _model(max_depth=D).eval()
    ids = _ids(B=50, T=200)  # 10,000 tokens
    with torch.no_grad():
        a = m(ids, exit_policy=RandomContinue(q, seed=3))
        b = m(ids, exit_policy=RandomContinue(q, seed=3))
        c = m(ids, exit_policy=RandomContinue(q, seed=4))
    assert abs(a.depths.float().mean().item() - dbar) < 0.02
    assert torch.equal(a.depths, b.depths)  # seeded
    if 1.0 < dbar:
        assert not torch.equal(a.depths, c.depths)
    torch.testing.assert_close(a.logits, b.logits)


def test_random_continue_keeps_the_deciders_depths_outside_its_positions():
    """Randomizing only positions >= k leaves positions < k exactly as the adaptive run (causal), and the
    randomized positions still get the decider's mixture weights (the decider runs)."""
    m = _model(max_depth=2).eval()
    ids = _ids(B=3, T=24)
    where = torch.zeros(3, 24, dtype=torch.bool)
    where[:, 16:] = True
    with torch.no_grad():
        own = m(ids)
        rnd = m(ids, exit_policy=RandomContinue(1.0, seed=0, where=where))
    assert torch.equal(rnd.depths[:, :16], own.depths[:, :16])
    assert (rnd.depths[:, 16:] == 2).all()
    torch.testing.assert_close(rnd.logits[:, :16], own.logits[:, :16])
    assert rnd.halt_signals is not None
    with pytest.raises(ValueError, match="rate"):
        RandomContinue(1.5)
    with pytest.raises(ValueError, match="outside"):
        continue_rate_for_mean_depth(3.5, 3)


# ------------------------------------------------------------------------------------------------
# the depth curriculum and deep supervision
# ------------------------------------------------------------------------------------------------
def test_depth_cap_bounds_depth_and_lookahead():
    m = _model(max_depth=3).train()
    ids = _ids()
    labels = ids.clone()
    spread_decider(m, logit_std=0.0)  # c = 0.5 >= τ: everyone would continue to 3
    out = m(ids, labels=labels, depth_cap=2)
    assert out.depths.max() == 2
    assert out.halt_signals.shape[-1] == 1  # one decision, after depth 1
    assert torch.isnan(out.depth_nll[..., 2]).all()  # no lookahead beyond the cap
    one = m(ids, labels=labels, depth_cap=1)
    assert (one.depths == 1).all() and one.halt_signals is None and one.aux_loss is None
    with pytest.raises(ValueError, match="depth_cap"):
        m(ids, depth_cap=4)


@pytest.mark.parametrize("method", ["tah2", "anira-e", "fixed"])
def test_depth_supervision_is_the_mean_of_every_depths_own_loss(method):
    m = _model(method, max_depth=3).train()
    with torch.no_grad():
        perturb_updater(m, 0.05)
    ids = _ids()
    labels = ids.clone()
    labels[:, :5] = -100
    out = m(ids, labels=labels, depth_supervision=True)
    assert (out.depths == 3).all() and out.halt_signals is None and out.aux_loss is None
    ref = m(ids, labels=labels, depth=3, output_depth_logits=True)
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    per_depth = [
        F.cross_entropy(ref.depth_logits[d].flatten(0, 1), shift.flatten(), ignore_index=-100) for d in range(3)
    ]
    torch.testing.assert_close(out.depth_ce, torch.stack(per_depth).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, torch.stack(per_depth).mean(), atol=1e-5, rtol=1e-5)

    def updater_grad():
        return sum(p.grad.abs().sum() for p in m.updater.parameters() if p.grad is not None)

    out.loss.backward()
    assert updater_grad() > 0  # depths 2 and 3 get next-token gradient
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in m.halting.parameters())  # no decider
    # every depth's own loss has gradient: each alone moves the updater (depth 1 does not use it)
    for d in (1, 2):
        m.zero_grad()
        out = m(ids, labels=labels, depth_supervision=True)
        out.depth_ce[d].backward()
        assert updater_grad() > 0
    with pytest.raises(ValueError, match="depth_supervision"):
        m(ids, labels=labels, depth_supervision=True, depth=2)


# ------------------------------------------------------------------------------------------------
# the trainer: phases by step, exact resume across the switch
# ------------------------------------------------------------------------------------------------
def _rows(n=48):
    return addition_rows(8, n, chat=False)


def _trainer(tmp_path, model=None, callbacks=None, **kw):
    args = sft_config(
        tmp_path,
        **{
            "max_steps": 6,
            "learning_rate": 3e-3,
            **LOGGED_RUN,
            "lr_scheduler_type": "linear",
            **kw,
        },
    )
    model = model if model is not None else _model(max_depth=2)
    return RetrofitSFTTrainer(
        model, args, train_dataset=_rows(), processing_class=char_tokenizer(), callbacks=callbacks
    )


def _spy(trainer):
    calls = []
    orig = trainer.model.forward

    def spy(*a, **kw):
        calls.append({k: kw.get(k) for k in ("depth_supervision", "decider_threshold", "depth_cap", "depth")})
        return orig(*a, **kw)

    trainer.model.forward = spy
    return calls


def test_depth_warmup_trains_every_depth_then_the_decider(tmp_path):
    tr = _trainer(tmp_path, depth_warmup_steps=3, threshold_warmup_steps=2, max_steps=6)
    decider0 = [p.detach().clone() for p in tr.model.halting.parameters()]
    seen = {}

    from transformers import TrainerCallback

    class AtStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen[state.global_step] = [p.detach().clone() for p in model.halting.parameters()]

    tr.add_callback(AtStep())
    calls = _spy(tr)
    tr.train()
    assert [c["depth_supervision"] for c in calls] == [True, True, True, None, None, None]
    # the threshold ramps over the 2 steps after the switch: τ·0/2, τ·1/2, then the model's own
    assert [c["decider_threshold"] for c in calls] == [None, None, None, 0.0, 0.25, None]
    # the decider does not move during the warm-up, and starts training at the switch
    assert all(torch.equal(a, b) for a, b in zip(decider0, seen[3]))
    assert any(not torch.equal(a, b) for a, b in zip(seen[3], seen[4]))
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert "depth_loss_1" in logged[0] and "depth_loss_2" in logged[0] and "decider_loss" not in logged[0]
    assert "decider_loss" in logged[4] and logged[0]["mean_depth"] == 2.0


def test_depth_schedule_caps_the_depth(tmp_path):
    tr = _trainer(tmp_path, max_steps=4, depth_schedule="0:1,2:2")
    calls = _spy(tr)
    tr.train()
    assert [c["depth_cap"] for c in calls] == [1, 1, None, None]
    with pytest.raises(ValueError, match="depth_schedule"):
        RetrofitSFTConfig(output_dir=str(tmp_path), depth_schedule="1-2", use_cpu=True)
    assert RetrofitSFTConfig(output_dir=str(tmp_path), depth_schedule="5:2,0:1", use_cpu=True).depth_cap_at(3) == 1


def test_resume_across_the_warmup_switch_is_exact(tmp_path):
    """6 steps straight = 2 steps, stop, resume from checkpoint-2 in a fresh trainer (the switch at step 3 lies
    after the checkpoint): the same losses step by step and the same final weights."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    kw = dict(depth_warmup_steps=3, threshold_warmup_steps=2, save_strategy="steps", save_steps=2)
    full = _trainer(tmp_path / "full", **kw)
    full.train()
    first = _trainer(tmp_path / "split", callbacks=[StopAt()], **kw)
    first.train()
    ckpt = last_checkpoint(tmp_path / "split")
    assert ckpt.endswith("checkpoint-2")
    second = _trainer(tmp_path / "split", model=_model(max_depth=2, seed=1), **kw)
    second.train(resume_from_checkpoint=ckpt)

    def losses(t):
        return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}

    a, b = losses(full), {**losses(first), **losses(second)}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-6), (s, a, b)
    for (n, p), q in zip(full.model.named_parameters(), second.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("method", ["tah2", "ouro"])
def test_decider_phase_trains_only_the_decider_on_the_frozen_backbone(tmp_path, method):
    """``depth_warmup_steps 2`` + ``decider_phase_from 2``: two steps of every depth (the backbone moves, the
    decider does not), then the decider alone (the backbone is frozen and stays put; the decider moves), with the
    method's decider-phase loss (TaH2: its BCE; Ouro: Stage II's)."""
    from transformers import TrainerCallback

    model = (
        _model(method=method, max_depth=2)
        if method == "tah2"
        else retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2, method="ouro"))
    )
    tr = _trainer(tmp_path, model=model, depth_warmup_steps=2, decider_phase_from=2, max_steps=5)
    seen = {}

    def snap(m):
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    class AtStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen[state.global_step] = snap(model)

    tr.add_callback(AtStep())
    calls = []
    orig = tr.model.forward

    def spy(*a, **kw):
        calls.append(bool(kw.get("decider_phase")))
        return orig(*a, **kw)

    tr.model.forward = spy
    start = snap(tr.model)
    tr.train()
    assert calls == [False, False, True, True, True]

    def moved(a, b, decider):
        return any(not torch.equal(a[n], b[n]) for n in a if (".halting." in f".{n}") == decider)

    assert moved(start, seen[2], decider=False) and not moved(start, seen[2], decider=True)
    assert moved(seen[2], seen[5], decider=True) and not moved(seen[2], seen[5], decider=False)
    logged = [h for h in tr.state.log_history if "loss" in h]
    key = "decider_loss" if method == "tah2" else "gate_loss"
    assert key in logged[-1] and key not in logged[0]
    with pytest.raises(ValueError, match="decider_phase_from must be None or an integer step >= depth_warmup_steps"):
        RetrofitSFTConfig(output_dir=str(tmp_path), depth_warmup_steps=3, decider_phase_from=1, use_cpu=True)
