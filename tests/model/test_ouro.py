"""Ouro (docs/ouro.md): the exit distribution, Stage I's expected loss, Stage II's gate loss and the Q-exit, each
against a computation by hand from forced-depth passes of the same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrofit
from retrofit import LoopConfig
from retrofit.model.config import LoopConfigError
from retrofit.testing import tiny_base

D = 3


def _model(q=0.5, beta=0.05, seed=0, family="llama"):
    torch.manual_seed(seed)
    model = retrofit.convert(
        tiny_base(family, seed=seed),
        LoopConfig(max_depth=D, method="ouro", options={"exit_q": q, "entropy_beta": beta}),
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a gate that tells tokens apart, and an updater that changes depth 2
        model.halting.gate.weight.copy_(torch.randn(model.halting.gate.weight.shape, generator=g) * 0.8)
        model.updater.w2.weight.normal_(0.0, 0.05, generator=g)
    return model


def _batch(B=3, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    return ids, labels


def _forced(model, ids):
    """Per step t: the logits and the gate's λ_t of every token, each from a forward forced to depth t (every
    token at every step is what Ouro's training forward runs)."""
    logits, lams = [], []
    for t in range(1, D + 1):
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o))
        try:
            out = model(ids, depth=t)
        finally:
            hook.remove()
        logits.append(out.logits)
        lams.append(torch.sigmoid(model.halting.gate(seen["h"]).squeeze(-1).float()))  # the final-normed state
    return torch.stack(logits, 2), torch.stack(lams, -1)  # [B, T, D, V], [B, T, D]


def _exit_distribution(lam):
    """p(t) = λ_t Π_{j<t} (1 − λ_j) for t < D, the rest at D (by hand, step by step)."""
    B, T, _ = lam.shape
    p = torch.zeros(B, T, D)
    survive = torch.ones(B, T)
    for t in range(D - 1):
        p[..., t] = lam[..., t] * survive
        survive = survive * (1 - lam[..., t])
    p[..., D - 1] = survive
    return p


def test_stage_one_loss_is_the_expected_loss_minus_the_entropy():
    model = _model(beta=0.1).train()
    ids, labels = _batch()
    out = model(ids, labels=labels)
    assert out.depths.eq(D).all()  # training runs every token through every step
    with torch.no_grad():
        z, lam = _forced(model, ids)
        torch.testing.assert_close(out.halt_signals, lam[..., : D - 1], atol=1e-6, rtol=0)
        p = _exit_distribution(lam)
        torch.testing.assert_close(out.depth_probs, p, atol=1e-6, rtol=0)
        target = F.pad(labels[:, 1:], (0, 1), value=-100)
        ce = torch.stack(
            [
                F.cross_entropy(z[:, :, t].flatten(0, 1), target.flatten(), reduction="none").view_as(target)
                for t in range(D)
            ],
            -1,
        )
        mask = target != -100
        per_token = (p * ce).sum(-1) + 0.1 * (p * p.log()).sum(-1)  # expected loss − β H(p)
        want = per_token[mask].sum() / mask.sum()
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=0)
    out.loss.backward()  # the gate learns from the expected loss and the entropy; so does the backbone
    assert model.halting.gate.weight.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_stage_one_normalizes_by_num_items_in_batch():
    model = _model().train()
    ids, labels = _batch()
    a = model(ids, labels=labels).loss
    n = int((labels[:, 1:] != -100).sum())
    b = model(ids, labels=labels, num_items_in_batch=torch.tensor(4 * n)).loss
    torch.testing.assert_close(b, a / 4, atol=1e-6, rtol=0)


def test_stage_two_trains_the_gate_on_realized_improvements():
    model = _model().train()
    ids, labels = _batch()
    out = model(ids, labels=labels, decider_phase=True)
    with torch.no_grad():
        z, lam = _forced(model, ids)
        target = F.pad(labels[:, 1:], (0, 1), value=-100)
        nll = torch.stack(
            [
                F.cross_entropy(z[:, :, t].flatten(0, 1), target.flatten(), reduction="none").view_as(target)
                for t in range(D)
            ],
            -1,
        )
        gain = (nll[..., :-1] - nll[..., 1:]).clamp_min(0)  # I^(t+1) for the decision after step t
        w = torch.sigmoid(50.0 * (gain - 0.005))
        cont = 1 - lam[..., : D - 1]
        bce = -(w * cont.log() + (1 - w) * (1 - cont).log())
        mask = (target != -100)[..., None].expand_as(bce)
        want = bce[mask].mean()
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=0)
    assert torch.equal(out.aux_loss, out.loss) and "gate_loss" in out.aux_metrics
    out.loss.backward()
    assert model.halting.gate.weight.grad.abs().sum() > 0
    # the targets are detached: the same loss with targets from a perturbed copy of the per-step losses moves
    # nothing but through λ (checked: the loss is a function of λ and of constants)
    lam = out.halt_signals
    assert lam.requires_grad and not out.depth_nll.requires_grad


@pytest.mark.parametrize("q", [0.3, 0.5, 0.8, 1.0])
def test_q_exit_stops_at_the_first_step_whose_cdf_reaches_q(q):
    model = _model(q=q).eval()
    ids, _ = _batch()
    with torch.no_grad():
        out = model(ids)
    lam = out.halt_signals  # the decisions the forward made, at each token's executed steps
    survive = torch.ones(ids.shape)
    want = torch.full(ids.shape, D)
    decided = torch.zeros(ids.shape, dtype=torch.bool)
    for t in range(lam.shape[-1]):
        survive = survive * (1 - lam[..., t])
        stop = ~decided & ((1 - survive) >= q)
        want[stop] = t + 1
        decided |= stop
    assert torch.equal(out.depths, want)
    if q == 1.0:
        assert out.depths.eq(D).all()  # q = 1 runs every step
    if q == 0.5:
        assert len(out.depths.unique()) > 1, "the test needs mixed exits"


def test_call_time_threshold_and_set_decider_threshold():
    model = _model(q=0.5).eval()
    ids, _ = _batch()
    with torch.no_grad():
        low = model(ids, decider_threshold=0.05).depths
        high = model(ids, decider_threshold=0.999).depths
    assert low.float().mean() < high.float().mean()
    assert model.set_decider_threshold(0.999) == "exit_q"
    assert model.config.loop["options"]["exit_q"] == 0.999 and model.loop.method_options.exit_q == 0.999
    with torch.no_grad():
        assert torch.equal(model(ids).depths, high)


def test_options_are_validated_saved_and_reloaded(tmp_path):
    with pytest.raises(LoopConfigError, match="unknown options.*ouro.*exit_q"):
        LoopConfig(method="ouro", options={"exit_threshold": 0.3})
    with pytest.raises(LoopConfigError, match=r"exit_q must be a number in \(0, 1\]"):
        LoopConfig(method="ouro", options={"exit_q": 0.0})
    with pytest.raises(LoopConfigError, match=r"unknown options \['exit_q'\] for method 'tah2'; its options: alpha_d"):
        LoopConfig(method="tah2", options={"exit_q": 0.3})
    with pytest.raises(LoopConfigError, match="unknown options.*fixed.*none"):
        LoopConfig(method="fixed", options={"exit_q": 0.3})
    model = _model(q=0.7)
    model.save_pretrained(tmp_path)
    loaded = retrofit.LoopedLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.loop.options == {"exit_q": 0.7, "entropy_beta": 0.05, "gate_k": 50.0, "gate_gamma": 0.005}
    ids, _ = _batch()
    with torch.no_grad():
        a, b = model.eval()(ids), loaded(ids)
    assert torch.equal(a.depths, b.depths)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)


def test_options_flow_from_flags_and_other_methods_options_are_refused():
    from types import SimpleNamespace

    cfg = LoopConfig.from_fields(SimpleNamespace(method="ouro", max_depth=3, exit_q=0.9, entropy_beta=None))
    assert cfg.options["exit_q"] == 0.9 and cfg.options["entropy_beta"] == 0.05
    with pytest.raises(LoopConfigError, match="exit_q is an option of method ouro, not of 'tah2'"):
        LoopConfig.from_fields(SimpleNamespace(method="tah2", exit_q=0.9))
    # a control arm built from Ouro's flags (the method overridden) takes none of Ouro's options
    fixed = LoopConfig.from_fields(SimpleNamespace(method="ouro", exit_q=0.9), method="fixed")
    assert fixed.options == {}


def test_identity_at_init_and_heads_budget():
    """A converted model at depth 1 is the base model; the gate is one linear layer."""
    base = tiny_base("llama", seed=0)
    model = retrofit.convert(base, LoopConfig(max_depth=D, method="ouro"))
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, depth=1).logits, base(ids).logits, atol=1e-5, rtol=0)
    assert sum(p.numel() for p in model.halting.parameters()) == model.config.hidden_size + 1


def test_exported_folder_runs_ouro_without_retrofit(tmp_path):
    """``retrofit export`` bundles Ouro's module (the registry line pulls it in): a fresh process with retrofit
    hidden loads the folder with trust_remote_code and gives the same logits and exit depths."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))
    from test_export import run_fresh

    from retrofit.hub.export import export_model

    model = _model(q=0.5).eval()
    out = export_model(model, tmp_path / "ouro_export")
    assert (out / "retrofit_halting_ouro.py").is_file() and (out / "retrofit_registry.py").is_file()
    ids, _ = _batch()
    res = run_fresh({"ouro": out}, ids, tmp_path)
    with torch.no_grad():
        ref = model(ids)
    assert len(ref.depths.unique()) > 1
    torch.testing.assert_close(res["ouro"]["logits"], ref.logits, rtol=0, atol=1e-5)
    assert torch.equal(res["ouro"]["depths"], ref.depths)
