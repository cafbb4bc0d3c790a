"""Training-free exits (retrofit.model.halting.training_free): the rules on constructed trajectories, a
model at init, and a token-by-token brute force of the exit depths on a random model."""

from __future__ import annotations

import pytest
import torch

from retrofit import LoopConfig, convert
from retrofit.model.halting.training_free import (
    EXIT_POLICIES,
    KLExit,
    StateChangeExit,
    resolve_exit_policy,
)
from retrofit.testing import char_tokenizer, tiny_base


def run_policy(policy, hs, lps=None):
    """Exit depth of each token under ``policy`` for per-depth states ``hs[d-1]`` ``[n, H]``."""
    n = hs[0].shape[0]
    D = len(hs)
    state = policy.init(n)
    exit_at = torch.full((n,), D)
    running = torch.ones(n, dtype=torch.bool)
    for d in range(1, D):
        idx = running.nonzero().squeeze(1)
        stop = policy.check(d, hs[d - 1][idx], None if lps is None else lps[d - 1][idx], state, idx)
        exit_at[idx[stop]] = d
        running[idx[stop]] = False
    return exit_at


def test_kl_exit_stops_where_successive_distributions_agree():
    V = 5
    # token 0: distributions converge after depth 3; token 1: at depth 2; token 2: never
    base = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5]), -1)
    far = torch.log_softmax(torch.tensor([-1.0, 3.0, 0.0, 2.0, -2.0]), -1)
    lps = [
        torch.stack([far, base, far]),
        torch.stack([base, base, base]),
        torch.stack([base, base, far]),
        torch.stack([base, base, base]),
        torch.stack([base, base, far]),
    ]
    hs = [torch.zeros(3, 4)] * 5
    assert run_policy(KLExit(1e-6), hs, lps).tolist() == [3, 2, 5]
    # KL(p_d || p_{d-1}) is the direction Huginn uses
    pol = KLExit(1.0)
    state = pol.init(1)
    pol.check(1, hs[0][:1], far[None], state, torch.tensor([0]))
    pol.check(2, hs[0][:1], base[None], state, torch.tensor([0]))
    expect = (base.exp() * (base - far)).sum()
    assert float(state["last_kl"][0]) == pytest.approx(float(expect), rel=1e-6)
    assert base.numel() == V


def test_state_exit_stops_at_small_relative_change():
    g = torch.Generator().manual_seed(0)
    h1 = torch.randn(3, 8, generator=g)
    # token i changes by 0.5^(d) relative: with threshold 0.1 it stops at the first d with 0.5^(d-1) < 0.1
    hs = [h1]
    for d in range(2, 7):
        step = torch.stack([0.5 ** (d - 1) * torch.ones(8), 0.05 * torch.ones(8), torch.ones(8)])
        hs.append(hs[-1] + step * hs[-1].norm(dim=-1, keepdim=True) / 8**0.5)
    got = run_policy(StateChangeExit(0.1), hs)
    # relative change at d is |step| / |h_{d-1}|, computed the same way here
    expect = []
    for i in range(3):
        e = 6
        for d in range(2, 6):
            rel = (hs[d - 1][i] - hs[d - 2][i]).norm() / hs[d - 2][i].norm()
            if rel < 0.1:
                e = d
                break
        expect.append(e)
    assert got.tolist() == expect
    assert expect[1] == 2 and expect[2] == 6


def looped(method="fixed", split="whole", max_depth=4, randomize=True, seed=2):
    kw = {"prelude": 1, "core": 3} if split == "middle" else {}
    model = convert(tiny_base("llama"), LoopConfig(max_depth=max_depth, method=method, **kw))
    if randomize:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for mod in (model.updater, model.halting):
                for p in mod.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


IDS = torch.randint(4, 104, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("policy", ["kl", "state"])
def test_a_model_at_init_exits_at_depth_two(policy):
    """At init the updater adds nothing: depth 2 repeats depth 1, so both rules stop there."""
    model = looped(randomize=False)
    with torch.no_grad():
        out = model(IDS, exit_policy=policy, exit_threshold=1e-4)
    assert bool((out.depths == 2).all())
    tok = char_tokenizer()
    gen = model.generate(
        **tok(["hello"], return_tensors="pt"),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        exit_policy=policy,
        exit_threshold=1e-4,
        return_dict_in_generate=True,
    )
    assert bool((gen.depths == 2).all())


def bruteforce_exits(model, ids, policy: str, threshold: float) -> torch.Tensor:
    """Decide each token's exit depth one token at a time from its full-depth trajectory.

    Token t's states and readouts at depths 1..D depend only on earlier tokens' exit depths (decided
    before it) and on t itself running, so forcing t to depth D exposes its whole trajectory.
    """
    B, T = ids.shape
    D = model.loop.max_depth
    dstar = torch.full((B, T), D)
    layer = model.core_layers[-1]
    for t in range(T):
        states = []
        hook = layer.register_forward_hook(lambda m, a, out, states=states: states.append(out.detach()))
        try:
            with torch.no_grad():
                out = model(ids, depth=dstar, output_depth_logits=True)
        finally:
            hook.remove()
        lp = out.depth_logits[:, :, t].float().log_softmax(-1)  # [D, B, V]
        hs = torch.stack([s[:, t] for s in states]).float()  # [D, B, H] (whole stack: core output = state)
        for b in range(B):
            for d in range(2, D):
                if policy == "kl":
                    val = (lp[d - 1, b].exp() * (lp[d - 1, b] - lp[d - 2, b])).sum()
                else:
                    val = (hs[d - 1, b] - hs[d - 2, b]).norm() / hs[d - 2, b].norm()
                if val < threshold:
                    dstar[b, t] = d
                    break
    return dstar


@pytest.mark.parametrize("policy", ["kl", "state"])
def test_exit_depths_match_a_token_by_token_bruteforce(policy):
    model = looped("fixed", "whole", max_depth=4)
    # a threshold inside the observed range, so that exits vary
    states = []
    hook = model.core_layers[-1].register_forward_hook(lambda m, a, out: states.append(out.detach()))
    with torch.no_grad():
        probe = model(IDS, depth=4, output_depth_logits=True)
    hook.remove()
    if policy == "kl":
        lp = probe.depth_logits.float().log_softmax(-1)
        vals = (lp[1].exp() * (lp[1] - lp[0])).sum(-1)
    else:
        vals = (states[1] - states[0]).norm(dim=-1) / states[0].norm(dim=-1)
    threshold = float(vals.median())
    expect = bruteforce_exits(model, IDS, policy, threshold)
    with torch.no_grad():
        got = model(IDS, exit_policy=policy, exit_threshold=threshold).depths
    assert torch.equal(got, expect)
    assert len(expect.unique()) > 1, "the threshold should give mixed depths"


def test_resolve_and_errors():
    assert set(EXIT_POLICIES) == {"kl", "state"}
    assert resolve_exit_policy(None, None, 2) == (2, None)
    assert resolve_exit_policy("fixed", None, 3) == (3, None)
    d, p = resolve_exit_policy("kl", 0.1, None)
    assert d is None and isinstance(p, KLExit) and p.threshold == 0.1
    with pytest.raises(ValueError, match="unknown exit_policy"):
        resolve_exit_policy("entropy", 0.1, None)
    with pytest.raises(ValueError, match="exit_threshold > 0"):
        resolve_exit_policy("state", None, None)
    with pytest.raises(ValueError, match="needs depth"):
        resolve_exit_policy("fixed", None, None)
    with pytest.raises(ValueError, match="decider"):
        resolve_exit_policy("decider", 0.5, None)
    model = looped()
    with pytest.raises(ValueError, match="drop depth"):
        model(IDS, depth=2, exit_policy="kl", exit_threshold=0.1)
