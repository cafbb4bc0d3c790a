"""``share_first_depth`` (retrofit/model/backends.py): forwards of the same batch that share their first depth give
bitwise the results of forwards of their own, for every exit rule the evaluation runs, and sharing never happens
where it could be wrong (training, autograd, hooks, another batch)."""

from __future__ import annotations

import types

import pytest
import torch
from tiny_looped import mixed_depth_looped

from retrofit.model.backends import FirstDepthShare, share_first_depth
from retrofit.model.halting.training_free import RandomContinue

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _batch(seed=0, B=3, T=11, V=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding, as the evaluation batches
    mask[1, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=pos)


def _calls(B, T):
    """Every kind of forward the evaluation runs on one batch: the decider at several thresholds, random
    allocation (a policy deferring to the decider), forced depths (all, and per token), depth logits, labels
    with the lookahead and the LM head at the labelled positions only."""
    where = torch.zeros(B, T, dtype=torch.bool)
    where[:, T // 2 :] = True
    per_token = torch.randint(1, 3, (B, T), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(3, 64, (B, T), generator=torch.Generator().manual_seed(2))
    labels[:, : T // 2] = -100
    return [
        dict(),
        dict(decider_threshold=0.2),
        dict(decider_threshold=0.8),
        dict(decider_threshold=0.5, exit_policy=RandomContinue(0.5, seed=3, where=where)),
        dict(depth=2),
        dict(depth=per_token),
        dict(depth=2, output_depth_logits=True, logits_to_keep=4),
        dict(labels=labels, output_depth_losses=True, labelled_logits_only=True),
        dict(decider_threshold=0.2),  # a repeat
    ]


FIELDS = ("logits", "depths", "depth_probs", "depth_logits", "depth_nll", "loss")


def _same(a, b):
    for f in FIELDS:
        x, y = getattr(a, f, None), getattr(b, f, None)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(torch.nan_to_num(x, nan=-7.0), torch.nan_to_num(y, nan=-7.0)), f


@pytest.mark.parametrize(
    "method, loop",
    [
        ("tah2", {}),  # duo-causal attention, a coda
        ("tah2", {"core": None}),  # no coda: the loop runs to the last layer
        ("anira-o", {"attention": "same-depth"}),
        ("anira-e", {}),
        ("fixed", {}),
    ],
)
def test_shared_first_depth_is_bitwise_a_forward_of_its_own(method, loop):
    model = mixed_depth_looped(max_depth=3, method=method, spread_anira=True, **loop)
    batch = _batch()
    B, T = batch["input_ids"].shape
    calls = [c for c in _calls(B, T) if method != "fixed" or not set(c) & {"decider_threshold", "exit_policy"}]
    with torch.no_grad():
        refs = [model(**batch, **c) for c in calls]
        with share_first_depth(model) as share:
            got = [model(**batch, **c) for c in calls]
            other = model(**_batch(seed=9))  # another batch: its own entry
    for r, g in zip(refs, got):
        _same(r, g)
    assert share.misses == 2 and share.hits == len(calls) - 1
    assert share.bytes > 0
    with torch.no_grad():
        _same(model(**_batch(seed=9)), other)
    # the decider's depths vary (the sharing is not trivially right because every token did the same)
    if method != "fixed":
        assert any(len(torch.unique(r.depths)) > 1 for r, c in zip(refs, calls) if "depth" not in c)


def test_no_sharing_in_training_with_autograd_or_hooks_and_none_after_the_block():
    model = mixed_depth_looped()
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch).logits
    with share_first_depth(model) as share:
        model(**batch).logits.sum()  # autograd on: nothing stored
        assert share.hits == share.misses == 0
        model.train()
        with torch.no_grad():
            model(**batch)
        model.eval()
        assert share.hits == share.misses == 0
        calls = []
        h = model.core_layers[-1].register_forward_hook(lambda *a: calls.append(1))
        with torch.no_grad():
            model(**batch)
            model(**batch)
        h.remove()
        assert share.hits == share.misses == 0 and len(calls) == 2 * 3  # every depth, every forward
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, ref, rtol=0, atol=0)
        assert share.misses == 1
    assert getattr(model, "_first_depth_share", None) is None
    with torch.no_grad():
        model(**batch)
    assert share.hits == 0 and share.misses == 1  # the block is closed: the store is not read any more


def test_budget_and_disabled_and_plain_models():
    model = mixed_depth_looped()
    batch = _batch()
    with torch.no_grad(), share_first_depth(model, max_bytes=0) as share:
        a, b = model(**batch), model(**batch)
    assert share.hits == 0 and share.misses == 2 and share.bytes == 0  # over budget: computed, never stored
    _same(a, b)
    with share_first_depth(model, enabled=False) as share:
        assert share is None and getattr(model, "_first_depth_share", None) is None
    from retrofit.testing import tiny_base

    with share_first_depth(tiny_base("llama")) as share:  # a plain model: nothing to share
        assert share is None
    # the key tells batches apart by their padding and positions, not only their tokens
    k = FirstDepthShare.key
    x = torch.randn(3, 11, 16)
    m1, m2 = _batch()["attention_mask"], torch.ones(3, 11, dtype=torch.long)
    p = (m1.cumsum(-1) - 1).clamp_min(0)
    attn = types.SimpleNamespace(impl="sdpa", mode="duo-causal", settings=None)
    assert k(attn, x, m1, p) == k(attn, x.clone(), m1.clone(), p.clone())
    assert k(attn, x, m1, p) != k(attn, x, m2, p)
    assert k(attn, x, m1, p) != k(attn, x, m1, p + 1)
    assert k(attn, x, m1, p) != k(types.SimpleNamespace(impl="eager", mode="duo-causal", settings=None), x, m1, p)
    y = x.clone()
    y[2, 10, 15] += 1e-6
    assert k(attn, x, m1, p) != k(attn, y, m1, p)


def test_a_peft_wrapped_model_shares_too():
    from retrofit.training.model_setup import apply_lora

    model = apply_lora(mixed_depth_looped(), r=4, alpha=8).eval()
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch, decider_threshold=0.3).logits
        with share_first_depth(model) as share:
            model(**batch)
            got = model(**batch, decider_threshold=0.3).logits
    assert share.hits == 1 and share.misses == 1
    assert torch.equal(ref, got)
