"""Attention at long context (issue 23, docs/long-context.md): the mask-free paths against the dense reference.

The reference is ``retrofit.model.depth_attention.dense_reference()``: the original implementation, with a dense
``[B, 1, T, T]`` mask for the prelude and coda and a ``[B, 1, T, m·T]`` one for the core. The paths under
test (sdpa: the prelude/coda on transformers' own causal mask, the core's depth attention by query blocks,
same-depth by gathering K/V; flex: one ``BlockMask`` per depth) must give the same logits, losses and
gradients. Tolerance: fp32, ``atol = 2e-5`` on losses/logits and ``atol = 1e-5, rtol = 1e-4`` on
gradients (the kernels differ in summation order only). Query blocks of 5 on sequences of 20–30 tokens
put block boundaries everywhere; the tiny models have GQA (4 query heads, 2 key/value heads).
"""

from __future__ import annotations

import pytest
import torch
from attention_setup import attention_looped, kernels_used

import retrofit
import retrofit.model.depth_attention as da
from retrofit import LoopConfig
from retrofit.model.attention import base_visibility, depth_key_visibility
from retrofit.model.backends import DepthKVStore
from retrofit.testing import tiny_base

ATOL, G_ATOL, G_RTOL = 2e-5, 1e-5, 1e-4


def _looped(method, attention, max_depth, family="llama", impl="sdpa", seed=3):
    return attention_looped(method, attention, max_depth, family=family, impl=impl, seed=seed)


def _batch(layout, T=26, seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":  # one padding-free row of three sequences (position-id resets)
        ids = torch.randint(3, 104, (1, T), generator=g)
        pos = torch.cat([torch.arange(11), torch.arange(8), torch.arange(T - 19)])[None]
        return dict(input_ids=ids, position_ids=pos, labels=ids.clone())
    ids = torch.randint(3, 104, (2, T), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone())
    if layout == "left-pad":
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        batch["attention_mask"] = mask
        # the first real token's label too: with the shift, the last padding position would be scored on it,
        # and a padding query's output is whatever the kernel gives a fully masked row (the dense reference:
        # the mean of every value; transformers' sdpa path and the block kernel: zero)
        batch["labels"] = ids.masked_fill(mask == 0, -100)
        batch["labels"][1, 7] = -100
    return batch


def _step(model, batch, reference: bool, **kw):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # ANIRA-E samples its depths in training
    with da.dense_reference() if reference else da.settings(**kw):
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


_kernels_used = kernels_used


def _assert_same(model, batch, **kw):
    ref, g_ref = _step(model, batch, True)
    out, g_out = _step(model, batch, False, **kw)
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    assert torch.equal(out.depths[real], ref.depths[real])  # padding tokens' own depths may differ
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)
    if ref.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[real], ref.logits[real], atol=ATOL, rtol=0)
    assert g_out.keys() == g_ref.keys() and g_ref
    for n in g_ref:
        torch.testing.assert_close(g_out[n], g_ref[n], atol=G_ATOL, rtol=G_RTOL, msg=n)
    return ref


@pytest.mark.parametrize(
    "method, attention, max_depth, layout, kernel, runs",
    [
        ("tah2", "duo-causal", 2, "left-pad", "cpu", "chunked"),  # lookahead rows, padding, M = 2
        ("tah2", "duo-causal", 3, "packed", "cpu", "chunked"),  # packed rows, M = 3
        ("tah2", "duo-causal", 3, "left-pad", "math", "chunked"),  # the device-agnostic block kernel
        ("tah2", "same-depth", 3, "left-pad", "cpu", "chunked"),  # same-depth with lookahead rows: the rule
        ("anira-e", "same-depth", 3, "packed", "cpu", "gather"),  # same-depth, no lookahead: gathered K/V
        ("anira-e", "same-depth", 2, "left-pad", "cpu", "gather"),
        ("fixed", "duo-causal", 3, "none", "math", "chunked"),
    ],
)
def test_training_step_equals_dense_reference(method, attention, max_depth, layout, kernel, runs):
    model = _looped(method, attention, max_depth)
    batch = _batch(layout)
    assert runs in _kernels_used(model, batch, query_chunk=5)
    ref = _assert_same(model, batch, query_chunk=5, chunk_kernel=kernel)
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    if method != "fixed":  # a mix of exited and active tokens (TaH2: the exited ones have lookahead rows)
        assert ref.depths[real].min() < max_depth and ref.depths[real].max() == max_depth, ref.depths


def test_qwen3_and_activation_checkpointing_equal_dense_reference():
    model = _looped("tah2", "duo-causal", 2, family="qwen3")
    model.gradient_checkpointing_enable()
    _assert_same(model, _batch("left-pad", T=21), query_chunk=4)


def test_eager_is_the_dense_reference():
    """``attn_implementation="eager"`` runs the dense core (and the base model's own eager prelude/coda)."""
    sdpa = _looped("tah2", "duo-causal", 3)
    eager = _looped("tah2", "duo-causal", 3, impl="eager")
    batch = _batch("left-pad")
    real = batch["attention_mask"].bool()
    a, _ = _step(sdpa, batch, False, query_chunk=6)
    b, _ = _step(eager, batch, False)
    torch.testing.assert_close(a.logits[real], b.logits[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(a.loss, b.loss, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# The rule, per block and per flex tile, against the dense visibility
# ------------------------------------------------------------------------------------------------
def _metadata_case(mode, seed=0):
    """A forward's ``SequenceAttention`` with padding and packed rows, and random exit depths."""
    g = torch.Generator().manual_seed(seed)
    B, T, D = 3, 23, 4
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, :5] = 0  # left padding
    pos = (pad.cumsum(-1) - 1).clamp_min(0)
    pos[2] = torch.cat([torch.arange(9), torch.arange(6), torch.arange(T - 15)])  # packed row
    depths = torch.randint(1, D + 1, (B, T), generator=g)
    active = [depths >= j for j in range(1, D + 1)]
    model = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=D, method="fixed", attention=mode))
    seq = da.SequenceAttention(model, torch.zeros(B, T, 64), pad, pos, DepthKVStore())
    base = base_visibility(B, T, "cpu", pad, pos)
    return seq, active, base, B, T, D


@pytest.mark.parametrize(
    "pad, pos",
    [
        (None, None),  # sdpa's is_causal
        ("left", None),  # transformers' padding mask
        (None, "packed"),  # transformers reads the packing from the position ids
        ("left", "packed"),  # both: the segment rule is added to transformers' mask
        (None, "steps-of-two"),  # ids that never reset: one sequence for retrofit, two for transformers' rule
    ],
)
def test_prelude_mask_is_the_base_models_with_retrofits_segments(pad, pos):
    B, T = 2, 12
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[1, :4] = 0
    pids = (mask.cumsum(-1) - 1).clamp_min(0)
    if pos == "packed":
        pids[0] = torch.cat([torch.arange(5), torch.arange(7)])
    if pos == "steps-of-two":
        pids = torch.cat([torch.arange(6), torch.arange(8, 14)])[None].expand(B, T)
    model = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2))
    seq = da.SequenceAttention(model, torch.zeros(B, T, 64), mask if pad else None, pids, DepthKVStore())
    want = base_visibility(B, T, "cpu", mask if pad else None, pids)
    got = torch.ones(B, T, T, dtype=torch.bool).tril() if seq.plain is None else seq.plain[:, 0]
    real = mask.bool()
    assert torch.equal(got[real], want[real])
    assert (seq.plain is None) == (pad is None and pos in (None, "steps-of-two"))


@pytest.mark.parametrize("mode", retrofit.ATTENTION_MODES)
def test_block_rule_equals_dense_visibility(mode):
    seq, active, base, B, T, D = _metadata_case(mode)
    for m in range(2, D + 1):
        dense = depth_key_visibility(torch.stack(active), m, mode, base)  # [B, T, m*T], key (j-1)*T + s
        dense = dense.view(B, T, m, T).transpose(2, 3)  # [B, T, T (s), m (j)]: position-major
        dm = da.DepthMask(seq, m, "chunked", last=torch.stack(active[:m]).sum(0))
        for C in (1, 4, 7, T):
            for blk in seq.chunks(C):
                t0, t1, lo = blk.t0, blk.t1, blk.lo
                got = dm.block_visibility(t0, t1, lo).view(B, t1 - t0, t1 - lo, m)
                assert torch.equal(got, dense[:, t0:t1, lo:t1]), (m, C, t0)
                # the keys a block skips (positions before lo or after its last query) are invisible
                assert not dense[:, t0:t1, :lo].any() and not dense[:, t0:t1, t1:].any()
                # the kernel's parts (diagonal; earlier keys, shared row or full) together are the same pattern
                want = dense[:, t0:t1].reshape(B, t1 - t0, T * m)
                for k0, k1, mask, empty in dm.parts(blk, torch.float32):
                    part = torch.ones(B, 1, t1 - t0, k1 - k0, dtype=torch.bool) if mask is None else mask == 0
                    assert torch.equal(part.expand(B, 1, t1 - t0, k1 - k0)[:, 0], want[:, :, k0:k1]), (m, C, t0)
                    if empty is not None:
                        assert torch.equal(empty.expand(B, 1, t1 - t0)[:, 0], ~want[:, :, k0:k1].any(-1))


@pytest.mark.parametrize("mode", retrofit.ATTENTION_MODES)
def test_flex_block_mask_equals_dense_visibility(mode):
    from torch.nn.attention.flex_attention import create_mask

    seq, active, base, B, T, D = _metadata_case(mode, seed=1)
    m = 3
    dense = depth_key_visibility(torch.stack(active), m, mode, base)
    dense = dense.view(B, T, m, T).transpose(2, 3).reshape(B, T, T * m)  # position-major keys
    dm = da.DepthMask(seq, m, "flex", last=torch.stack(active[:m]).sum(0))
    bm = dm.block_mask()
    assert bm.shape == (B, 1, T, T * m)
    # element by element: the mask_mod of the BlockMask is the rule
    assert torch.equal(create_mask(bm.mask_mod, B, None, T, T * m, device="cpu")[:, 0], dense)
    # tile by tile: every tile holding a visible key is computed
    blocks = bm.to_dense()[:, 0].bool()  # [B, q tiles, kv tiles]
    qb, kb = bm.BLOCK_SIZE
    for b in range(B):
        for i in range(blocks.shape[1]):
            for k in range(blocks.shape[2]):
                if dense[b, i * qb : (i + 1) * qb, k * kb : (k + 1) * kb].any():
                    assert blocks[b, i, k]


# ------------------------------------------------------------------------------------------------
# No dense pattern on the long-context path
# ------------------------------------------------------------------------------------------------
def test_no_dense_mask_is_built(monkeypatch):
    """A training step (sdpa, TaH2 with lookahead rows, packed rows) never builds a ``T × T`` pattern: the
    dense builders are not called, the prelude/coda take transformers' own mask (None without padding:
    sdpa's ``is_causal``), and each query block's mask covers at most ``query_chunk`` queries."""

    def refuse(*a, **k):
        raise AssertionError("a dense mask was built")

    for name in ("depth_key_visibility", "to_additive_mask", "base_visibility"):
        monkeypatch.setattr(da, name, refuse)
    shapes = []
    real_vis = da.DepthMask.visibility

    def spy(self, *span):
        out = real_vis(self, *span)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(da.DepthMask, "visibility", spy)
    model = _looped("tah2", "duo-causal", 3)
    for layout in ("none", "packed"):
        batch = _batch(layout, T=30)
        with da.settings(query_chunk=8):
            model(**batch).loss.backward()
    assert shapes and max(s[1] for s in shapes) <= 8
    assert max(s[2] for s in shapes) <= 3 * 30
    seq = da.SequenceAttention(model, torch.zeros(1, 30, 64), None, torch.arange(30)[None], DepthKVStore())
    assert seq.plain is None  # sdpa, no padding: is_causal, as the base model


# ------------------------------------------------------------------------------------------------
# attn_implementation is honoured
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_convert_and_load_keep_the_attention_implementation(tmp_path, impl):
    looped = retrofit.convert(tiny_base("llama", attn_implementation=impl), LoopConfig(max_depth=2))
    assert looped.config._attn_implementation == impl
    assert looped.model.layers[1].self_attn.config.inner._attn_implementation == impl
    looped.save_pretrained(tmp_path)
    loaded = retrofit.LoopedLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=impl)
    assert loaded.config._attn_implementation == impl
    looped.set_attn_implementation("sdpa")  # the layers follow a later change
    assert looped.model.layers[1].self_attn.config.inner._attn_implementation == "sdpa"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_base_model_sharing_the_layers_is_unchanged(impl):
    """``convert`` routes the shared layers' attention through ``looped_attention_forward``; the base model
    then gets exactly its own implementation's result (padded forward and cached greedy decoding)."""
    base = tiny_base("llama", attn_implementation=impl)
    ids = torch.randint(3, 104, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        before = base(ids, attention_mask=mask).logits
        gen_before = base.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        retrofit.convert(base, LoopConfig(max_depth=2))
        assert isinstance(base.model.layers[0].self_attn.config, da.LoopedAttentionConfig)
        after = base(ids, attention_mask=mask).logits
        gen_after = base.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(before, after) and torch.equal(gen_before, gen_after)


def test_build_looped_model_takes_the_attention_implementation():
    from retrofit.training.model_setup import build_looped_model

    model, _ = build_looped_model("tiny-llama", LoopConfig(max_depth=2), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_flash_attention_is_not_downgraded(tmp_path):
    """Without the flash-attn package (CPU), asking for it fails with transformers' own clear error."""
    retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2)).save_pretrained(tmp_path)
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="FlashAttention2"):
        retrofit.LoopedLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_2")


def test_flex_attention_model_equals_dense_reference():
    """A model converted from a flex-attention checkpoint: the prelude/coda on transformers' flex path, the
    core on one BlockMask per depth; CPU runs compiled flex attention without gradients only, so eval."""
    model = _looped("fixed", "duo-causal", 3, impl="flex_attention").eval()
    batch = _batch("left-pad", T=24)
    batch.pop("labels")
    depths = torch.randint(1, 4, batch["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        with da.dense_reference():
            ref = model(**batch, depth=depths).logits
        out = model(**batch, depth=depths).logits
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=0)
    assert _kernels_used(model, {**batch, "depth": depths}) == {"flex"}


def test_flex_model_decodes_like_sdpa():
    """Decoding keeps its dense masks over cached keys; a flex model runs them on sdpa: same tokens."""
    ids = torch.randint(3, 104, (2, 6), generator=torch.Generator().manual_seed(4))
    out = {}
    for impl in ("sdpa", "flex_attention"):
        model = _looped("tah2", "duo-causal", 3, impl=impl).eval()
        out[impl] = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out["sdpa"], out["flex_attention"])
