"""The depth-aware KV cache (retrofit.model.cache): compact storage, memory accounting, batch operations."""

from __future__ import annotations

import pytest
import torch

from retrofit import LoopConfig, convert
from retrofit.model.cache import DepthKVCache
from retrofit.model.token_sets import Pack as _Pack
from retrofit.testing import tiny_base

IDS = torch.randint(4, 104, (3, 9), generator=torch.Generator().manual_seed(0))
DEPTHS = torch.randint(1, 4, (3, 9), generator=torch.Generator().manual_seed(1))


def model_for(split="middle", attention="duo-causal", method="fixed", family="llama"):
    kw = {"prelude": 1, "core": 3} if split == "middle" else {}
    return convert(tiny_base(family), LoopConfig(max_depth=3, method=method, attention=attention, **kw)).eval()


def fill(model, ids=IDS, depths=DEPTHS, attention_mask=None, prefill=3):
    cache = DepthKVCache(model.config)
    with torch.no_grad():
        model(
            ids[:, :prefill],
            depth=depths[:, :prefill],
            cache=cache,
            attention_mask=None if attention_mask is None else attention_mask[:, :prefill],
        )
        for t in range(prefill, ids.shape[1]):
            model(
                ids[:, t : t + 1],
                depth=depths[:, t : t + 1],
                cache=cache,
                attention_mask=None if attention_mask is None else attention_mask[:, : t + 1],
            )
    return cache


def per_pair_bytes(model):
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_core = len(model._ranges[1])
    return n_core * 2 * cfg.num_key_value_heads * hd * 4  # K and V, fp32


@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
def test_nbytes_equals_executed_pairs(family, attention):
    model = model_for("middle", attention, family=family)
    cache = fill(model)
    pairs = int(DEPTHS.sum())
    assert cache.executed_pairs() == pairs
    assert cache.nbytes("core") == pairs * per_pair_bytes(model)
    # prelude and coda: one entry per position
    per_pos = per_pair_bytes(model) // 3  # one layer's K and V
    assert cache.nbytes("prelude") == IDS.numel() * per_pos
    assert cache.nbytes("coda") == 2 * IDS.numel() * per_pos
    assert cache.nbytes() == cache.nbytes("core") + cache.nbytes("prelude") + cache.nbytes("coda")
    assert cache.allocated_nbytes() >= cache.nbytes()


def test_only_executed_depths_are_stored():
    """Depth j holds exactly the tokens with d* >= j: nothing is written for exited tokens."""
    model = model_for("whole", "same-depth")
    cache = fill(model)
    li = model._ranges[1][0]
    for b in range(IDS.shape[0]):
        for j in range(1, 4):
            seq, k, v = cache.core.entries(li, j, b)
            expect = (DEPTHS[b] >= j).nonzero().squeeze(1)
            assert sorted(seq.tolist()) == expect.tolist()
            assert k.shape[1] == expect.numel() and v.shape[1] == expect.numel()
        # exit depths are marked where same-depth reads need them: one per token, at its d*
        seq, depth = cache.core.exits(b)
        assert sorted(seq.tolist()) == list(range(IDS.shape[1]))
        assert torch.equal(depth, DEPTHS[b][seq])


def test_stored_keys_equal_the_full_forward_keys():
    """K of (token, depth) in the cache = K that depth's core layer computes in the full forward."""
    model = model_for("whole", "duo-causal")
    cache = fill(model)
    li = model._ranges[1][1]
    layer = model.model.layers[li]
    captured = {}

    def grab(mod, args, kwargs):
        store = kwargs["cache"]
        captured.setdefault("store", store)

    h = layer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(IDS, depth=DEPTHS)
    finally:
        h.remove()
    store = captured["store"]
    for j in range(1, 4):
        k_full = store.kv[(li, j)][0]  # [B, KVH, T, hd]
        for b in range(IDS.shape[0]):
            seq, k, _ = cache.core.entries(li, j, b)
            torch.testing.assert_close(k, k_full[b][:, seq], atol=1e-5, rtol=0)


def test_padding_is_not_stored_in_the_core():
    model = model_for("middle")
    mask = torch.ones_like(IDS)
    mask[1, :4] = 0
    mask[2, :2] = 0
    cache = fill(model, attention_mask=mask, prefill=5)
    assert cache.executed_pairs() == int(DEPTHS[mask.bool()].sum())
    assert bool((cache.token_depths[~mask.bool()] == 0).all())


def test_kv_bytes_scale_with_mean_depth():
    model = model_for("whole")
    full = fill(model, depths=torch.full_like(DEPTHS, 3))
    mixed = fill(model)
    ratio = mixed.nbytes("core") / full.nbytes("core")
    assert ratio == int(DEPTHS.sum()) / (3 * DEPTHS.numel())


def test_repeat_and_select_rows_then_continue_decoding():
    model = model_for("middle", "same-depth")
    ids, dep = IDS[:2], DEPTHS[:2]
    # reference: the duplicated batch decoded from the start
    ref_ids, ref_dep = ids.repeat_interleave(2, 0), dep.repeat_interleave(2, 0)
    ref = fill(model, ref_ids, ref_dep, prefill=5)
    with torch.no_grad():
        ref_next = model(torch.tensor([[7], [7], [9], [9]]), depth=2, cache=ref).logits
    cache = fill(model, ids[:, :5], dep[:, :5], prefill=3)
    cache.batch_repeat_interleave(2)
    with torch.no_grad():
        for t in range(5, ids.shape[1]):
            model(ref_ids[:, t : t + 1], depth=ref_dep[:, t : t + 1], cache=cache)
        nxt = model(torch.tensor([[7], [7], [9], [9]]), depth=2, cache=cache).logits
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=0)
    assert cache.nbytes() == ref.nbytes()
    # keep rows 3 and 0 (beam-search style reorder)
    cache.reorder_cache(torch.tensor([3, 0]))
    ref.batch_select_indices(torch.tensor([3, 0]))
    with torch.no_grad():
        a = model(torch.tensor([[11], [12]]), cache=cache).logits
        b = model(torch.tensor([[11], [12]]), cache=ref).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cache_interface_for_generate():
    model = model_for("middle")
    cache = DepthKVCache(model.config)
    assert cache.get_seq_length() == 0 and not cache.is_compileable and not all(cache.is_linear)
    cache = fill(model)
    assert cache.get_seq_length() == IDS.shape[1] and cache.batch_size == IDS.shape[0]
    with pytest.raises(ValueError, match="rows"), torch.no_grad():
        model(IDS[:1, :1], cache=cache)
    with pytest.raises(RuntimeError, match="decode path"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)
    with pytest.raises(ValueError, match="part"):
        cache.nbytes("everything")
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


def test_pack_gathers_active_tokens_per_row():
    act = torch.tensor([[True, False, True, True], [False, False, False, False], [False, True, False, False]])
    p = _Pack(act)
    x = torch.arange(12.0).view(3, 4, 1)
    packed = p.gather(x)
    assert packed.shape == (2, 3, 1)
    assert packed[0, :, 0].tolist() == [0.0, 2.0, 3.0] and packed[1, 0, 0].item() == 9.0
    assert p.take(packed)[:, 0].tolist() == [0.0, 2.0, 3.0, 9.0]
    assert p.rows.tolist() == [0, 2]
