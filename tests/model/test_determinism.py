"""Determinism guard for every attention path (issue 29, docs/long-context.md "padding rows").

An exactness test that runs its forward once can pass by luck: a kernel that reads uninitialized memory (a
fully masked padding row, a stale scratch buffer) is right on some calls and NaN on others. Here every path
runs ``REPEATS`` forwards in one process and each one must equal the reference: the dense kernels (the
reference itself must repeat bitwise), the block kernel (its CPU flash parts and its device-agnostic math
parts), flex attention (one ``BlockMask`` per depth, transformers' flex path for the prelude/coda), the
same-depth gather, duo-causal and same-depth, left padding, packed rows and mixed exits; and greedy
generation of a left-padded batch on sdpa, eager and flex.

Every mask retrofit builds lets a padding query see itself, so no row is empty (``test_no_mask_has_an_empty_row``).
"""

from __future__ import annotations

import pytest
import torch
from attention_setup import attention_looped, kernels_used

import retrofit
import retrofit.model.depth_attention as da
from retrofit.model.attention import depth_key_visibility

REPEATS = 10
ATOL = 2e-5


def _looped(method, attention, max_depth=3, impl="sdpa", seed=3, train=False):
    return attention_looped(method, attention, max_depth, impl=impl, seed=seed, train=train)


def _batch(layout, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":  # one padding-free row of three sequences
        ids = torch.randint(3, 104, (1, T), generator=g)
        pos = torch.cat([torch.arange(9), torch.arange(7), torch.arange(T - 16)])[None]
        return dict(input_ids=ids, position_ids=pos), torch.ones(1, T, dtype=torch.bool)
    ids = torch.randint(3, 104, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return dict(input_ids=ids, attention_mask=mask), mask.bool()


def _forced(batch, max_depth=3, seed=2):
    return torch.randint(1, max_depth + 1, batch["input_ids"].shape, generator=torch.Generator().manual_seed(seed))


def _repeat(fn, ref, real, tol=ATOL):
    """``fn()`` ``REPEATS`` times: every result finite and within ``tol`` of ``ref`` on the real positions."""
    for i in range(REPEATS):
        out = fn()
        assert torch.isfinite(out[real]).all(), f"forward {i}: non-finite logits on real positions"
        err = (out[real] - ref[real]).abs().max().item()
        assert err <= tol, f"forward {i}: max |out - ref| = {err:.3g} on real positions"


@pytest.mark.parametrize(
    "method, attention, layout, kernel, runs",
    [
        ("tah2", "duo-causal", "left-pad", "cpu", "chunked"),
        ("tah2", "duo-causal", "packed", "math", "chunked"),
        ("tah2", "same-depth", "left-pad", "cpu", "chunked"),  # lookahead rows: the rule kernel
        ("anira-e", "same-depth", "left-pad", "cpu", "gather"),
        ("anira-e", "same-depth", "packed", "cpu", "gather"),
        ("fixed", "duo-causal", "left-pad", "math", "chunked"),
    ],
)
def test_training_forward_repeats_exactly(method, attention, layout, kernel, runs):
    """The training forward (TaH2's lookahead rows, ANIRA-E's sampled depths under a fixed seed) on the block
    kernel and the gather path, ``REPEATS`` times, against the dense reference."""
    model = _looped(method, attention, train=True)
    batch, real = _batch(layout)
    batch["labels"] = batch["input_ids"].masked_fill(~real, -100)

    def run(**kw):
        torch.manual_seed(0)
        with torch.no_grad(), da.dense_reference() if kw.pop("ref", False) else da.settings(**kw):
            out = model(**batch)
        return torch.cat([out.logits.flatten(), out.loss.reshape(1)]), out

    ref_flat, ref = run(ref=True)
    dense_again, _ = run(ref=True)
    assert torch.equal(dense_again, ref_flat)  # the reference itself repeats bitwise
    used = kernels_used(model, batch, query_chunk=5, chunk_kernel=kernel)
    assert runs in used
    if method != "fixed":
        depths = ref.depths[real]
        assert depths.min() < 3 and depths.max() == 3  # mixed exits
    _repeat(lambda: run(query_chunk=5, chunk_kernel=kernel)[0], ref_flat, torch.ones_like(ref_flat, dtype=torch.bool))


@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
@pytest.mark.parametrize("layout", ["left-pad", "packed"])
@pytest.mark.parametrize("impl", ["flex_attention", "eager", "sdpa"])
def test_inference_forward_repeats_exactly(impl, layout, attention):
    """Forced mixed exits in eval on each implementation (flex: transformers' compiled flex path for the
    prelude/coda, one ``BlockMask`` per depth for the core), ``REPEATS`` times against the dense reference."""
    model = _looped("fixed", attention, impl=impl)
    batch, real = _batch(layout)
    depths = _forced(batch)
    with torch.no_grad():
        with da.dense_reference():
            ref = model(**batch, depth=depths).logits
        _repeat(lambda: model(**batch, depth=depths).logits, ref, real)


def test_tah2_flex_forward_repeats_exactly():
    """TaH2's own decider (the mixture of depths) on the flex path, left-padded."""
    model = _looped("tah2", "duo-causal", impl="flex_attention")
    batch, real = _batch("left-pad")
    with torch.no_grad():
        with da.dense_reference():
            ref = model(**batch)
        assert ref.depths[real].min() < 3 and ref.depths[real].max() == 3
        _repeat(lambda: model(**batch).logits, ref.logits, real)


def test_plain_flex_model_through_retrofit_loading_repeats_exactly():
    """A plain (not looped) tiny Llama loaded by ``load_model`` with flex attention, against sdpa."""
    from retrofit.hub.loading import load_model

    flex, _ = load_model("tiny-llama", attn_implementation="flex_attention")
    sdpa, _ = load_model("tiny-llama", attn_implementation="sdpa")
    batch, real = _batch("left-pad")
    with torch.no_grad():
        ref = sdpa(**batch).logits
        _repeat(lambda: flex(**batch).logits, ref, real)


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_padded_generation_repeats_exactly(impl):
    """Greedy generation of a left-padded batch (TaH2's decider, the depth-aware cache): ``REPEATS`` runs give
    the tokens of the sdpa run and of an unpadded run of each row alone."""
    ids = torch.randint(3, 104, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ref_model = _looped("tah2", "duo-causal", impl="sdpa")
    model = _looped("tah2", "duo-causal", impl=impl)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref_model.generate(ids, attention_mask=mask, **kw)
        alone = ref_model.generate(ids[:1, 4:], **kw)
        assert torch.equal(want[0, 4:], alone[0])  # padding changes nothing for the real tokens
        for i in range(REPEATS):
            got = model.generate(ids, attention_mask=mask, **kw)
            assert torch.equal(got, want), f"generation {i} differs on {impl}"


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("layout", ["left-pad", "packed"])
def test_no_mask_has_an_empty_row(impl, layout):
    """Every query row of every mask a forward builds has a visible key: the prelude's and coda's (transformers'
    mask with retrofit's rules), each depth's rule, and the decode path's."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    model = _looped("fixed", "duo-causal", impl=impl)
    batch, real = _batch(layout)
    B, T = batch["input_ids"].shape
    x = torch.zeros(B, T, 64)
    pos = batch.get("position_ids")
    if pos is None:
        pos = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    seq = da.SequenceAttention(model, x, batch.get("attention_mask"), pos, da_store())
    plain = seq.plain
    if isinstance(plain, BlockMask):
        vis = create_mask(plain.mask_mod, B, None, T, T, device="cpu")[:, 0]
    elif plain is None:
        vis = torch.ones(B, T, T, dtype=torch.bool).tril()
    elif plain.dtype == torch.bool:
        vis = plain[:, 0]
    else:
        vis = plain[:, 0] == 0
    assert vis.any(-1).all(), "an empty row in the prelude/coda mask"
    assert torch.equal(vis[real], seq.base_vis[real])  # real queries: exactly the base model's pattern
    depths = _forced(batch)
    active = [depths >= j for j in range(1, 4)]
    for m in (2, 3):
        dense = depth_key_visibility(torch.stack(active), m, "duo-causal", seq.base_vis)
        assert dense.any(-1).all(), f"an empty row at depth {m}"
    cache = retrofit.model.cache.DepthKVCache(model.config)
    if "attention_mask" in batch:
        cache.begin_step(batch["attention_mask"].bool(), pos, False)
        dm = cache.dense_mask(0, T, torch.float32)
        assert (dm[:, 0] == 0).any(-1).all(), "an empty row in the decode path's prefill mask"


def da_store():
    from retrofit.model.backends import DepthKVStore

    return DepthKVStore()
