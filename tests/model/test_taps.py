"""Step schedules (retrofit.model.schedulers.taps): the TAPS formula against a scalar reference, η ≡ 1
equals the unit step exactly, and TAPS in the model (forward and generate)."""

from __future__ import annotations

import pytest
import torch

from retrofit import LoopConfig, convert
from retrofit.model.schedulers import STEP_SCHEDULES, TAPS, UnitStep, build_step_schedule
from retrofit.testing import char_tokenizer, tiny_base


def taps_reference(deltas: list[list[float]], beta=0.5, gain=0.5, eta_min=0.5, eta_max=1.5, eps=1e-12) -> list[float]:
    """η_2, η_3, … for one token's updates Δ_2, Δ_3, … written out with Python floats."""
    H = len(deltas[0])
    m = [0.0] * H
    S = 0.0
    etas = []
    for n, dlt in enumerate(deltas, start=1):
        m_hat_prev = [x / (1 - beta ** (n - 1)) for x in m] if n > 1 else [0.0] * H
        S = beta * S + (1 - beta) * sum((a - b) ** 2 for a, b in zip(dlt, m_hat_prev))
        m = [beta * a + (1 - beta) * b for a, b in zip(m, dlt)]
        corr = 1 - beta**n
        P = sum((x / corr) ** 2 for x in m)
        rho = P / (P + S / corr + eps)
        eta = min(max(1 + gain * (2 * rho - 1), eta_min), eta_max)
        etas.append(1.0 if n == 1 else eta)
    return etas


def run_schedule(sched, h1: torch.Tensor, F) -> list[torch.Tensor]:
    """Iterate ``h_d = sched(h_{d-1}, F(h_{d-1}))`` from ``h_1``; returns ``[h_1, h_2, …]``."""
    state = sched.init(h1.shape[0])
    hs = [h1]
    for d in range(2, 7):
        hs.append(sched.step(d, hs[-1], F(hs[-1]), state, None))
    return hs


def test_taps_matches_the_scalar_reference():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(8, 8, generator=g, dtype=torch.float64) * 0.4
    b = torch.randn(8, generator=g, dtype=torch.float64)
    F = lambda h: torch.tanh(h @ A + b)
    h1 = torch.randn(3, 8, generator=g, dtype=torch.float64)
    sched = TAPS(beta=0.6, gain=0.7)
    state = sched.init(3)
    h = h1
    deltas, etas = [[] for _ in range(3)], []
    for d in range(2, 7):
        raw = F(h)
        for i in range(3):
            deltas[i].append((raw[i] - h[i]).tolist())
        h = sched.step(d, h, raw, state, None)
        etas.append(state["etas"][d])
    for i in range(3):
        ref = taps_reference(deltas[i], beta=0.6, gain=0.7)
        got = [float(e[i]) for e in etas]
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_taps_grows_on_persistent_progress_and_shrinks_on_oscillation():
    sched = TAPS()
    h1 = torch.zeros(1, 4)
    steady = run_schedule(sched, h1, lambda h: h + torch.tensor([1.0, 0.5, 0.0, 0.0]))  # constant direction
    etas_steady = [float((steady[k + 1] - steady[k]).norm() / 1.118034) for k in range(len(steady) - 1)]
    assert etas_steady[0] == pytest.approx(1.0)  # first update: no information, unit step
    assert all(e > 1.0 for e in etas_steady[1:]) and max(etas_steady) <= 1.5 + 1e-6

    state = sched.init(1)
    h = torch.zeros(1, 4)
    sign = 1.0
    etas = []
    for d in range(2, 7):
        target = torch.tensor([[sign * 1.0, 0.0, 0.0, 0.0]])  # the update flips direction every step
        raw = target
        h_new = sched.step(d, h, raw, state, None)
        etas.append(float(state["etas"][d]))
        h = h_new
        sign = -sign
    assert etas[0] == 1.0 and all(e < 1.0 for e in etas[1:]) and min(etas) >= 0.5


def test_eta_one_is_exactly_the_unit_step():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(16, 16, generator=g) * 0.3
    F = lambda h: torch.sin(h @ A) + 0.1
    h1 = torch.randn(5, 16, generator=g)
    unit = run_schedule(UnitStep(), h1, F)
    for sched in (TAPS(gain=0.0), TAPS(eta_min=1.0, eta_max=1.0)):
        relaxed = run_schedule(sched, h1, F)
        assert all(torch.equal(a, b) for a, b in zip(unit, relaxed))


def looped(max_depth=4, split=True, seed=2, **loop):
    kw = {"prelude": 1, "core": 3} if split else {}
    model = convert(tiny_base("llama"), LoopConfig.from_fields(dict(max_depth=max_depth, method="tah2", **kw, **loop)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


IDS = torch.randint(4, 104, (2, 10), generator=torch.Generator().manual_seed(0))


def hand_unrolled_taps(model, ids, depth, **taps):
    """The looped model at a uniform depth with TAPS, written out: the base layers called one by one with
    a plain causal mask (same-depth attention at one depth = attention within the depth), η of every
    token from ``taps_reference`` (Python floats), ``h_d = h_{d-1} + η_d (F(h_{d-1}) - h_{d-1})``."""
    B, T = ids.shape
    pos = torch.arange(T)[None].expand(B, T)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    x = model.model.embed_tokens(ids)
    pe = model.model.rotary_emb(x, pos)

    def stack(layers, h):
        for layer in layers:
            h = layer(h, attention_mask=causal, position_embeddings=pe, position_ids=pos)
        return h

    e = stack(model.prelude_layers, x)
    h = stack(model.core_layers, e)
    deltas = [[[] for _ in range(T)] for _ in range(B)]
    etas = []
    for d in range(2, depth + 1):
        state = model.model.norm(h) if model.loop.decider_state == "final_norm" else h  # what the updater reads
        raw = stack(model.core_layers, model.updater(e, state))
        delta = raw - h
        eta = torch.zeros(B, T)
        for b in range(B):
            for t in range(T):
                deltas[b][t].append(delta[b, t].tolist())
                eta[b, t] = taps_reference(deltas[b][t], **taps)[-1]
        etas.append(eta)
        h = h + eta[..., None] * delta
    return model.lm_head(model.model.norm(stack(model.coda_layers, h))), torch.stack(etas)


def test_taps_in_the_forward_matches_the_hand_unrolled_loop():
    model = looped(attention="same-depth")
    with torch.no_grad():
        ours = model(IDS, depth=4, step_schedule=TAPS(beta=0.6, gain=0.7))
        ref, etas = hand_unrolled_taps(model, IDS, 4, beta=0.6, gain=0.7)
        unit = model(IDS, depth=4)
    assert (etas[0] == 1).all() and (etas[1:] - 1).abs().max() > 0.05  # TAPS acts from depth 3 on
    torch.testing.assert_close(ours.logits, ref, atol=2e-5, rtol=1e-4)
    assert (ours.logits - unit.logits).abs().max() > 1e-3, "TAPS should change a depth-4 trajectory"


def test_taps_in_the_forward_eta_one_equals_unit_and_composes_with_the_decider():
    model = looped(split=False, mixture_output=False)
    with torch.no_grad():
        unit = model(IDS, depth=4)
        same = model(IDS, depth=4, step_schedule=TAPS(gain=0.0))
        taps_decider = model(IDS, step_schedule="taps")
        forced = model(IDS, depth=taps_decider.depths, step_schedule="taps")
    assert torch.equal(unit.logits, same.logits)
    d = taps_decider.depths
    assert len(d.unique()) > 1, "the test needs mixed exit depths"
    # the decider's exits, on TAPS-relaxed states: the continue rule holds, and the output is the TAPS
    # trajectory stopped at those depths (no coda: the exit depth's readout = the exit state's)
    c = taps_decider.halt_signals
    for b in range(d.shape[0]):
        for t in range(d.shape[1]):
            k = int(d[b, t])
            assert all(c[b, t, j] >= 0.5 for j in range(k - 1)) and (k == 4 or c[b, t, k - 1] < 0.5)
    torch.testing.assert_close(taps_decider.logits, forced.logits, atol=1e-5, rtol=0)


def test_taps_is_the_unit_step_up_to_depth_two():
    model = looped(max_depth=2)
    with torch.no_grad():
        assert torch.equal(model(IDS, depth=2).logits, model(IDS, depth=2, step_schedule="taps").logits)


def test_taps_at_generate_time():
    """Cached decoding with TAPS = decoding with full forwards (use_cache=False), tokens and depths, and
    the depths are those of the full forward over the generated sequence."""
    tok = char_tokenizer()
    model = looped()
    enc = tok(["hello", "hi"], return_tensors="pt", padding=True, padding_side="left")
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    unit = model.generate(**enc, **kw)
    same = model.generate(**enc, step_schedule=TAPS(gain=0.0), **kw)
    assert torch.equal(unit.sequences, same.sequences) and torch.equal(unit.depths, same.depths)
    P = enc["input_ids"].shape[1]
    for policy in ({}, {"exit_policy": "kl", "exit_threshold": 1e-2}, {"depth": 3}):
        out = model.generate(**enc, step_schedule="taps", **policy, **kw)
        plain = model.generate(
            **enc, step_schedule="taps", use_cache=False, **policy, **{**kw, "return_dict_in_generate": False}
        )
        assert torch.equal(out.sequences, plain), policy
        seq = out.sequences[:, :-1]
        mask = torch.cat([enc["attention_mask"], torch.ones(2, seq.shape[1] - P, dtype=torch.long)], 1)
        with torch.no_grad():
            full = model(seq, attention_mask=mask, step_schedule="taps", **policy)
        assert torch.equal(out.depths, full.depths[:, P - 1 :]), policy


def test_schedule_table_and_errors():
    assert set(STEP_SCHEDULES) == {"unit", "taps"}
    assert isinstance(build_step_schedule(None), UnitStep) and isinstance(build_step_schedule("taps"), TAPS)
    with pytest.raises(ValueError, match="unknown step_schedule"):
        build_step_schedule("adam")
    with pytest.raises(ValueError, match="eta_min"):
        TAPS(eta_min=1.2)
    with pytest.raises(ValueError, match="beta"):
        TAPS(beta=1.0)
