"""Incremental decoding and generate() of looped models (retrofit.model.generation).

The full-sequence forward is the reference (it is itself checked against a token-by-token
brute force in tests/model/test_modeling.py): decoding with the depth-aware cache must give the same
logits and depths, whatever the split, the attention mode, the method, padding and batch mates.
"""

from __future__ import annotations

import io
import itertools
from contextlib import redirect_stdout

import pytest
import torch
from transformers import DynamicCache, TextStreamer

from retrofit import LoopConfig, convert
from retrofit.model.cache import DepthKVCache
from retrofit.model.outputs import LoopedGenerateOutput
from retrofit.testing import spread_decider, tiny_base

SPLITS = {"whole": {"prelude": 0, "core": None}, "middle": {"prelude": 1, "core": 3}}


def randomized(model, seed: int = 1, scale: float = 0.5):
    """Random heads: depths vary per token and deeper iterations change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    if model.loop.method == "tah2":  # unit-gain decider layers: scores that differ from token to token
        spread_decider(model, logit_std=2.0, generator=g)
    return model.eval()


def looped(family="llama", method="fixed", split="whole", attention=None, max_depth=3, seed=0, head_seed=1, **kw):
    loop = LoopConfig.from_fields(
        dict(max_depth=max_depth, method=method, attention=attention, **SPLITS[split], **kw), strict=False
    )
    return randomized(convert(tiny_base(family, seed=seed), loop), head_seed)


def decode_stepwise(model, ids, depth=None, attention_mask=None, prefill=4, chunks=None, **kw):
    """Prefill ``prefill`` tokens (or the given chunk lengths), then one token per step."""
    _B, T = ids.shape
    cache = DepthKVCache(model.config)
    bounds = [0]
    for c in chunks or [prefill]:
        bounds.append(bounds[-1] + c)
    bounds += list(range(bounds[-1] + 1, T + 1))
    logits, depths = [], []
    with torch.no_grad():
        for a, b in itertools.pairwise(bounds):
            dk = {} if depth is None else {"depth": depth[:, a:b] if torch.is_tensor(depth) else depth}
            am = None if attention_mask is None else attention_mask[:, :b]
            out = model(ids[:, a:b], attention_mask=am, cache=cache, **dk, **kw)
            logits.append(out.logits)
            depths.append(out.depths)
    return torch.cat(logits, 1), torch.cat(depths, 1), cache


IDS = torch.randint(4, 104, (3, 11), generator=torch.Generator().manual_seed(0))
DEPTHS = torch.randint(1, 4, (3, 11), generator=torch.Generator().manual_seed(1))
LEFT_PAD = torch.tensor([[1] * 11, [0, 0, 0] + [1] * 8, [0] * 6 + [1] * 5])


# ------------------------------------------------------------------------------------------------
# incremental decoding == full-sequence forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["whole", "middle"])
@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
@pytest.mark.parametrize("method", ["fixed", "tah2"])
def test_forced_mixed_depths_match_full_forward(family, split, attention, method):
    model = looped(family, method, split, attention)
    with torch.no_grad():
        full = model(IDS, depth=DEPTHS)
    logits, depths, cache = decode_stepwise(model, IDS, DEPTHS)
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=0)
    assert torch.equal(depths, DEPTHS)
    assert cache.executed_pairs() == int(DEPTHS.sum())


@pytest.mark.parametrize("split", ["whole", "middle"])
@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
def test_left_padding_matches_full_forward(split, attention):
    model = looped("llama", "tah2", split, attention)
    with torch.no_grad():
        full = model(IDS, attention_mask=LEFT_PAD, depth=DEPTHS)
    logits, depths, cache = decode_stepwise(model, IDS, DEPTHS, attention_mask=LEFT_PAD, prefill=7)
    real = LEFT_PAD.bool()
    torch.testing.assert_close(logits[real], full.logits[real], atol=1e-4, rtol=0)
    assert torch.equal(depths[real], DEPTHS[real]) and bool((depths[~real] == 0).all())
    # padding runs no core iteration and stores no core K/V
    assert cache.executed_pairs() == int(DEPTHS[real].sum())


#: the TaH2 release's options next to each other value (docs/tah2.md); "defaults" are the method's own (TaH2's: the
#: release's)
RELEASE_OPTIONS = {
    "defaults": {},
    "legacy": {"updater": "residual", "decider_state": "core", "decider_topk_grad": False, "padding_stops": False},
    "release-updater-core-state": {"updater": "release", "decider_state": "core"},
    "residual-updater-final-norm": {"updater": "residual", "decider_state": "final_norm"},
}


@pytest.mark.parametrize(
    "method,split,seed,options",
    [(m, sp, sd, "defaults") for m, sp, sd in [("anira-o", "middle", 1), ("anira-e", "whole", 1), ("ouro", "whole", 2)]]
    + [(m, sp, sd, o) for m, sp, sd in [("tah2", "whole", 3), ("tah2", "middle", 2)] for o in RELEASE_OPTIONS],
)
def test_decider_depths_and_logits_match_full_forward(method, split, seed, options):
    model = looped("llama", method, split, head_seed=seed, **RELEASE_OPTIONS[options])
    with torch.no_grad():
        full = model(IDS)
    assert len(full.depths.unique()) > 1, "the test needs mixed depths"
    logits, depths, _ = decode_stepwise(model, IDS)
    assert torch.equal(depths, full.depths)
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
def test_chunked_prefill_with_a_filled_cache(attention):
    """Several multi-token steps: packing per row, causality inside a step, mixed depths."""
    model = looped("qwen3", "fixed", "middle", attention)
    with torch.no_grad():
        full = model(IDS, attention_mask=LEFT_PAD, depth=DEPTHS)
    logits, _, _ = decode_stepwise(model, IDS, DEPTHS, attention_mask=LEFT_PAD, chunks=[3, 4, 2])
    real = LEFT_PAD.bool()
    torch.testing.assert_close(logits[real], full.logits[real], atol=1e-4, rtol=0)


def test_exited_tokens_are_not_computed():
    """Each core layer sees exactly the executed (token, depth) pairs of each step."""
    model = looped("llama", "fixed", "middle")
    rows = []
    hook = model.core_layers[0].register_forward_pre_hook(lambda m, args: rows.append(tuple(args[0].shape[:2])))
    try:
        decode_stepwise(model, IDS, DEPTHS, prefill=1)
    finally:
        hook.remove()
    # one token per step: the packed batch at depth d holds the rows still running at d
    expected = []
    for t in range(IDS.shape[1]):
        for d in range(1, 4):
            n = int((DEPTHS[:, t] >= d).sum())
            if n:
                expected.append((n, 1))
    assert rows == expected


def test_batch_composition_does_not_change_a_row():
    model = looped("llama", "anira-o", "middle", head_seed=1)
    ids = IDS[:1]
    alone, d_alone, _ = decode_stepwise(model, ids)
    mixed, d_mixed, _ = decode_stepwise(model, torch.cat([IDS[1:], ids, IDS[2:]]))
    torch.testing.assert_close(mixed[2:3], alone, atol=1e-5, rtol=0)
    assert torch.equal(d_mixed[2:3], d_alone)


def test_taps_and_training_free_exits_decode_like_full_forward():
    model = looped("llama", "fixed", "middle", max_depth=4, head_seed=2)
    for kw in (
        {"step_schedule": "taps", "depth": DEPTHS.clamp(max=4)},
        {"exit_policy": "kl", "exit_threshold": 1e-3},
        {"exit_policy": "state", "exit_threshold": 0.3, "step_schedule": "taps"},
    ):
        with torch.no_grad():
            full = model(IDS, **kw)
        dec_kw = dict(kw)
        depth = dec_kw.pop("depth", None)
        logits, depths, _ = decode_stepwise(model, IDS, depth, **dec_kw)
        assert torch.equal(depths, full.depths), kw
        torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# generate()
# ------------------------------------------------------------------------------------------------
PROMPTS = ["hello world", "hi", "abc def g"]


@pytest.mark.parametrize(
    "method,split,seed,options",
    [
        ("tah2", "whole", 3, "defaults"),
        ("tah2", "middle", 2, "legacy"),
        ("tah2", "middle", 2, "release-updater-core-state"),
        ("tah2", "whole", 3, "residual-updater-final-norm"),
        ("anira-o", "middle", 1, "defaults"),
        ("anira-e", "whole", 1, "defaults"),
        ("ouro", "whole", 2, "defaults"),
    ],
)
def test_batched_left_padded_generation_equals_one_by_one(tok, method, split, seed, options):
    model = looped("llama", method, split, head_seed=seed, **RELEASE_OPTIONS[options])
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(out, LoopedGenerateOutput)
    assert out.depths.shape == (len(PROMPTS), 10)
    assert len(out.depths[out.depths > 0].unique()) > 1, "the test needs mixed exit depths"
    P = enc["input_ids"].shape[1]
    for i, p in enumerate(PROMPTS):
        one = model.generate(
            **tok([p], return_tensors="pt"),
            max_new_tokens=10,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        n = one.sequences.shape[1] - len(p)
        assert out.sequences[i, P : P + n].tolist() == one.sequences[0, len(p) :].tolist()
        assert out.depths[i, :n].tolist() == one.depths[0].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_depth_one_generation_equals_base_generate(tok, family):
    base = tiny_base(family, seed=0)
    model = looped(family, "tah2", "middle", seed=0, head_seed=3)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    ref = base.generate(**enc, **kw)
    out = model.generate(**enc, depth=1, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    assert bool((out.depths[out.depths > 0] == 1).all())


def test_generated_depths_are_the_forward_depths(tok):
    """``depths[i]`` = exit depth at the position that produced token i, as the full forward says."""
    model = looped("llama", "tah2", "whole", head_seed=3)
    enc = tok(["hello world"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    P = enc["input_ids"].shape[1]
    with torch.no_grad():
        full = model(out.sequences[:, :-1])
    assert out.depths.tolist() == full.depths[:, P - 1 :].tolist()
    assert out.cache.executed_pairs() == int(full.depths.sum())


def test_sampling_num_return_sequences_and_exit_policies(tok):
    model = looped("llama", "fixed", "middle", max_depth=4, head_seed=2)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True, padding_side="left")
    for kw in (
        {},
        {"depth": 2},
        {"exit_policy": "kl", "exit_threshold": 1e-3},
        {"exit_policy": "state", "exit_threshold": 0.3},
        {"step_schedule": "taps"},
    ):
        torch.manual_seed(0)
        a = model.generate(
            **enc,
            max_new_tokens=4,
            do_sample=True,
            num_return_sequences=3,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kw,
        )
        torch.manual_seed(0)
        b = model.generate(**enc, max_new_tokens=4, do_sample=True, num_return_sequences=3, pad_token_id=0, **kw)
        assert a.sequences.shape[0] == 6 and a.depths.shape == (6, 4)
        assert torch.equal(a.sequences, b), "sampling must be reproducible under a seed"
        if "depth" in kw:
            assert bool((a.depths == 2).all())
        if "exit_policy" in kw:
            assert bool((a.depths >= 2).all()), "training-free exits never stop at depth 1"
    # the copies of a prompt are consecutive rows and start from the same prompt
    P = enc["input_ids"].shape[1]
    assert torch.equal(a.sequences[0, :P], a.sequences[2, :P]) and torch.equal(a.sequences[3, :P], a.sequences[5, :P])


def test_streamer_prints_the_generated_text(tok):
    model = looped("llama", "tah2", "whole", head_seed=3)
    enc = tok(["abc"], return_tensors="pt")
    buf = io.StringIO()
    with redirect_stdout(buf):
        out = model.generate(
            **enc, max_new_tokens=6, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True), pad_token_id=0
        )
    assert buf.getvalue().strip() == tok.decode(out[0, 3:]).strip()


def test_beam_search_runs(tok):
    model = looped("llama", "anira-o", "middle", head_seed=1)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, enc["input_ids"].shape[1] + 5)


def test_use_cache_false_still_generates_the_same(tok):
    model = looped("llama", "tah2", "middle", head_seed=2)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    a = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
    b = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(a, b)


def test_bad_inputs_raise(tok):
    model = looped("llama", "fixed", "whole")
    ids = IDS[:1, :4]
    with pytest.raises(TypeError, match="DepthKVCache"):
        model(ids, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="unknown exit_policy"):
        model.generate(ids, max_new_tokens=2, exit_policy="nope")
    with pytest.raises(ValueError, match="exit_threshold"):
        model.generate(ids, max_new_tokens=2, exit_policy="kl")
    with pytest.raises(ValueError, match="depth="):
        model.generate(ids, max_new_tokens=2, depth=2, exit_policy="state", exit_threshold=0.1)
    with pytest.raises(ValueError, match="step_schedule"):
        model.generate(ids, max_new_tokens=2, step_schedule="fast")
    model.train()
    with pytest.raises(RuntimeError, match="inference-only"):
        model(ids, cache=DepthKVCache(model.config))


# ------------------------------------------------------------------------------------------------
# FLOPs accounting
# ------------------------------------------------------------------------------------------------
def test_cost_report_against_hand_counts(tok):
    from retrofit.model.flops import cost_report, generate_cost, model_costs

    model = looped("llama", "fixed", "middle", max_depth=3)  # prelude 1, core 3, coda 2
    c = model_costs(model)
    layer = c["all_layers"] // 6
    assert c["prelude"] == layer and c["core"] == 3 * layer and c["coda"] == 2 * layer
    deep = cost_report(model, torch.full((2, 5), 3))
    assert deep["flops_vs_fixed"] == pytest.approx(1.0) and deep["cost_exec"] == 30 and deep["core_layer_passes"] == 90
    one = cost_report(model, torch.ones(2, 5, dtype=torch.long))
    assert one["flops_vs_base"] == pytest.approx(1.0)  # depth 1 = the base model's compute
    d = torch.tensor([[1, 2, 3, 0]])  # 0 = padding, not counted
    rep = cost_report(model, d)
    assert rep["n_tokens"] == 3 and rep["cost_exec"] == 6 and rep["mean_depth"] == pytest.approx(2.0)
    per_tok = lambda k: 2 * (c["prelude"] + k * c["core"] + (k - 1) * c["updater"] + c["coda"] + c["head"])
    assert rep["flops"] == pytest.approx(per_tok(1) + per_tok(2) + per_tok(3))
    assert rep["flops_vs_fixed"] == pytest.approx(rep["flops"] / (3 * per_tok(3)))
    assert rep["layers_adaptive_vs_fixed"] == pytest.approx((1 + 3 * 2 + 2) / (1 + 3 * 3 + 2))
    out = model.generate(
        **tok(["hi"], return_tensors="pt"),
        max_new_tokens=4,
        do_sample=False,
        depth=2,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    g = generate_cost(model, out)
    assert g["n_tokens"] == 4 and g["mean_depth"] == 2.0
    assert generate_cost(model, out, include_prompt=True)["n_tokens"] == 2 + 4 - 1


@pytest.mark.parametrize("split", ["whole", "middle"])
@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
def test_shared_depth_steps_match_full_forward(split, attention, monkeypatch):
    """One-token steps in which every row runs the same depths take the cache's uniform path (one slot
    shared by all rows, written by slicing); once depths mix, the general path takes over. Both equal
    the full forward."""
    from retrofit.model.kv_stores import TaggedKV

    calls = []
    orig = TaggedKV._begin_uniform
    monkeypatch.setattr(TaggedKV, "_begin_uniform", lambda self, *a: calls.append(a[0]) or orig(self, *a))
    model = looped("llama", "fixed", split, attention)
    depths = torch.full_like(DEPTHS, 3)
    depths[:, 8:] = DEPTHS[:, 8:]  # the last steps mix depths (exits below depth 3: same-depth reads them)
    with torch.no_grad():
        full = model(IDS, depth=depths)
    logits, got, cache = decode_stepwise(model, IDS, depths)
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=0)
    assert torch.equal(got, depths) and cache.executed_pairs() == int(depths.sum())
    assert sorted(set(calls)) == [1, 2, 3] and len(calls) >= 3 * 4  # steps 4..7 at least took the uniform path
