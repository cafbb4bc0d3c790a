"""Depth masks vs a nested-loop reference over explicit (token, depth) key sets."""

import itertools

import pytest
import torch

from retrofit.model.attention import base_visibility, depth_key_visibility


def reference(depths, m, mode, pad):
    """Visibility for queries at depth m given exit depths d* (only executed depths exist). A padding query
    sees itself only (no row is empty), as a real query always sees itself."""
    B, T = depths.shape
    out = torch.zeros(B, T, m * T, dtype=torch.bool)
    for b, t, s, j in itertools.product(range(B), range(T), range(T), range(1, m + 1)):
        if s > t or (not pad[b, s] and s != t):  # padding keys are invisible, except to themselves
            continue
        ds = int(depths[b, s])
        if s == t:  # a token sees its own states as if it continued (lookahead row)
            ok = j <= m if mode == "duo-causal" else j == m
        elif mode == "duo-causal":
            ok = j <= min(m, ds)
        else:
            ok = j == min(m, ds)
        out[b, t, (j - 1) * T + s] = ok
    return out


@pytest.mark.parametrize("mode", ["duo-causal", "same-depth"])
def test_depth_visibility_matches_reference(mode):
    g = torch.Generator().manual_seed(0)
    B, T, D = 3, 6, 4
    depths = torch.randint(1, D + 1, (B, T), generator=g)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[2, :2] = False
    active = torch.stack([depths >= j for j in range(1, D + 1)])
    base = base_visibility(B, T, "cpu", pad)
    for m in range(1, D + 1):
        got = depth_key_visibility(active, m, mode, base)
        assert torch.equal(got, reference(depths, m, mode, pad)), m


def test_base_visibility_segments_and_padding():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    vis = base_visibility(1, 5, "cpu", None, pos)[0]
    assert vis[4].tolist() == [False, False, False, True, True]
    assert vis[2].tolist() == [True, True, True, False, False]
    pad = torch.tensor([[0, 1, 1, 1, 1]])
    vis = base_visibility(1, 5, "cpu", pad)[0]
    assert not vis[1:, 0].any() and vis[4, 1:].all()  # no real query sees the padding key
    assert vis[0].tolist() == [True, False, False, False, False]  # the padding query sees itself only
    assert vis.any(-1).all()  # no empty row
