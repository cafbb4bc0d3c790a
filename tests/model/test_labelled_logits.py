"""``labelled_logits_only=True``: the loss path's vocabulary-wide work at the labelled positions only.

Its loss, auxiliary loss, per-depth losses, exit depths and every gradient must equal the full
forward's, and its ``[N, V]`` logits must be the full logits' labelled rows, for every method, with
and without a coda, with padding, prompts and tokens that exit early (lookahead readouts).
"""

from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.testing import perturb_updater, spread_decider, tiny_base

CASES = [
    ("llama", dict(method="tah2", max_depth=3, prelude=1, core=3)),  # coda of 2 layers
    ("qwen3", dict(method="tah2", max_depth=3, prelude=1, core=5)),  # no coda
    ("llama", dict(method="tah2", max_depth=2, prelude=2, core=2, mixture_output=False)),
    ("llama", dict(method="fixed", max_depth=2, prelude=1, core=3)),
    ("llama", dict(method="fixed", max_depth=1, prelude=1, core=3)),  # the SFT control
    ("qwen3", dict(method="anira-e", max_depth=3, prelude=1, core=3)),
    ("llama", dict(method="anira-o", max_depth=3, prelude=1, core=3)),
]


def _model(family, loop, seed=0):
    torch.manual_seed(seed)
    model = retrofit.convert(tiny_base(family, seed=seed), retrofit.LoopConfig.from_fields(loop)).train()
    with torch.no_grad():  # mixed exits (lookahead tokens exist) and a non-trivial updater
        perturb_updater(model, 0.05)
        if loop["method"] == "tah2":  # continue logits ~ N(0, 4): about half the tokens stop at each depth
            spread_decider(model, logit_std=2.0)
        else:
            for p in model.halting.parameters():
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5) if p.dim() > 1 else p.zero_()
    return model


def _batch(B=3, T=13, V=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        labels[b, : 2 + 2 * b] = -100  # prompts of different lengths
    mask[-1, -3:] = 0  # right padding on the last row
    labels[-1, -3:] = -100
    return ids, labels, mask


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,loop", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_labelled_rows_match_the_full_forward(family, loop, weighted):
    model = _model(family, loop)
    ids, labels, mask = _batch()
    kw = dict(input_ids=ids, labels=labels, attention_mask=mask)
    if weighted:  # the trainer's token-count normalization
        kw["num_items_in_batch"] = torch.tensor(40)
    torch.manual_seed(5)
    full = model(**kw)
    full.loss.backward()
    g_full = _grads(model)
    model.zero_grad()
    torch.manual_seed(5)
    fast = model(**kw, labelled_logits_only=True)
    fast.loss.backward()
    g_fast = _grads(model)

    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
    rows = (shift != -100).nonzero().squeeze(1)
    assert torch.equal(fast.logits_rows, rows)
    assert fast.logits.shape == (rows.numel(), full.logits.shape[-1])
    torch.testing.assert_close(fast.logits, full.logits.reshape(-1, full.logits.shape[-1])[rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.depths, full.depths)
    if loop["method"] != "fixed" and loop["max_depth"] > 1:
        assert 1 < full.depths[mask.bool()].float().mean() < loop["max_depth"]  # exits really are mixed
    torch.testing.assert_close(fast.loss, full.loss, atol=1e-6, rtol=1e-5)
    for name in ("aux_loss", "depth_nll", "halt_signals", "depth_probs"):
        a, b = getattr(full, name), getattr(fast, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, equal_nan=True, msg=name)
    assert g_full.keys() == g_fast.keys() and g_full
    for n in g_full:
        torch.testing.assert_close(g_fast[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_labelled_rows_errors_name_the_conflict():
    model = _model("llama", dict(method="tah2", max_depth=2, prelude=1, core=3))
    ids, labels, mask = _batch()
    with pytest.raises(ValueError, match="labelled_logits_only needs labels"):
        model(input_ids=ids, labelled_logits_only=True)
    with pytest.raises(ValueError, match="does not work with output_depth_logits"):
        model(input_ids=ids, labels=labels, labelled_logits_only=True, output_depth_logits=True)
    with pytest.raises(ValueError, match="does not work with logits_to_keep"):
        model(input_ids=ids, labels=labels, labelled_logits_only=True, logits_to_keep=1)


@pytest.mark.parametrize("family,loop", CASES)
@pytest.mark.parametrize("keep", [1, 5, "positions"])
def test_logits_to_keep_matches_the_full_forward(family, loop, keep):
    """``logits_to_keep`` without labels runs the loop's readouts at the kept positions only (the decider still
    reads every position's logits): the kept logits, exit depths and depth distributions equal the full
    forward's."""
    model = _model(family, loop).eval()
    ids, _, mask = _batch()
    T = ids.shape[1]
    rows_seen = []
    hook = model.lm_head.register_forward_hook(
        lambda m, a, o: rows_seen.append(a[0].reshape(-1, a[0].shape[-1]).shape[0])
    )
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask)
        n_full = sum(rows_seen)
        rows_seen.clear()
        arg = torch.tensor([2, 7, 12]) if keep == "positions" else keep
        fast = model(input_ids=ids, attention_mask=mask, logits_to_keep=arg)
    hook.remove()
    positions = arg if keep == "positions" else torch.arange(T - keep, T)
    assert fast.logits.shape == (ids.shape[0], positions.numel(), full.logits.shape[-1])
    torch.testing.assert_close(fast.logits, full.logits[:, positions], atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.depths, full.depths)
    for name in ("halt_signals", "depth_probs"):
        a, b = getattr(full, name), getattr(fast, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    assert sum(rows_seen) < n_full  # the LM head really ran on fewer rows
