"""The serving engine (retrofit.serving) against the model's own generate().

Reference: ``model.generate`` on each request alone (itself checked against the full-sequence forward
and a brute force in test_generation.py / test_modeling.py). With greedy decoding the engine must give
every request the same tokens and the same per-token exit depths, whatever else is in flight: random
arrival steps, mixed prompt and answer lengths, requests cancelled mid-way, mixed exit rules, both
attention modes, every method, forced depths, training-free exits and TAPS.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from retrofit import LoopConfig, convert
from retrofit.serving import Engine, SamplingParams
from retrofit.serving.layers import LAYER_OPS, KeyList, LayerRunner, layer_ops_for
from retrofit.testing import char_tokenizer, tiny_base

SPLITS = {"whole": {"prelude": 0, "core": None}, "middle": {"prelude": 1, "core": 3}}
TOK = char_tokenizer()
WORDS = ["hello world", "hi", "abc def g", "x", "the quick brown fox", "12 + 7 =", "looped", "q"]


def looped(
    family="llama", method="fixed", split="whole", attention=None, max_depth=3, head_seed=1, scale=0.5, **loop_kw
):
    """A tiny looped model with random (perturbed) heads, so that exits really mix across tokens."""
    loop = LoopConfig.from_fields(
        dict(max_depth=max_depth, method=method, attention=attention, **SPLITS[split], **loop_kw)
    )
    model = convert(tiny_base(family, seed=0), loop)
    g = torch.Generator().manual_seed(head_seed)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def reference(model, prompt: list[int], max_tokens: int, exit_kwargs: dict):
    """``generate`` on one request alone: (tokens, depths of the steps that produced them)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, return_dict_in_generate=True, **exit_kwargs
    )
    toks = out.sequences[0, len(prompt) :].tolist()
    return toks, out.depths[0, : len(toks)].tolist()


def run_trace(model, requests, seed=0, max_seqs=3, **engine_kw):
    """Feed ``requests`` (dicts: prompt, max_tokens, exit, arrive, cancel) to an engine step by step."""
    engine_kw.setdefault("kv_budget_bytes", 8 << 20)
    eng = Engine(model, TOK, max_seqs=max_seqs, **engine_kw)
    pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrive"])
    handles = {}
    step = 0
    while pending or eng.has_work():
        while pending and requests[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            r = requests[i]
            handles[i] = eng.add_request(
                r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"]), **r["exit"]
            )
        for i, r in enumerate(requests):
            if r.get("cancel") == step and i in handles:
                eng.cancel(handles[i].request_id)
        eng.step()
        step += 1
        assert step < 5000
    return eng, [handles[i] for i in range(len(requests))]


def random_requests(rng: random.Random, exits: list[dict], n: int = 7, cancel: int = 2):
    reqs = []
    for i in range(n):
        text = rng.choice(WORDS) + rng.choice(["", " again", "!?"])
        reqs.append(
            {
                "prompt": TOK(text).input_ids,
                "max_tokens": rng.randint(1, 9),
                "exit": exits[i % len(exits)],
                "arrive": rng.randint(0, 12),
            }
        )
    for i in rng.sample(range(n), cancel):  # long enough to still be in flight when it is cancelled
        reqs[i]["max_tokens"] = 9
        reqs[i]["cancel"] = reqs[i]["arrive"] + rng.randint(1, 4)
    return reqs


def check_against_generate(model, eng, reqs, handles):
    depths_seen = set()
    for r, h in zip(reqs, handles):
        toks, depths = reference(model, r["prompt"], r["max_tokens"], r["exit"])
        assert h.done.is_set()
        if h.finish_reason == "cancelled":
            assert h.output == toks[: len(h.output)], (r, h.output, toks)
            assert h.depths == depths[: len(h.depths)]
        else:
            assert h.output == toks, (r["exit"], h.output, toks)
            assert h.depths == depths, (r["exit"], h.depths, depths)
            assert h.finish_reason in ("stop", "length")
        depths_seen.update(h.depths)
    # everything was given back
    assert eng.kv.blocks_in_use() == 0
    assert all(p.reserved == 0 for p in eng.kv.pools.values())
    assert len(eng.free_rows) == eng.max_rows and len(eng.free_seqs) == eng.max_seqs
    return depths_seen


# ------------------------------------------------------------------------------------------------
# the layer runner == the layer's own forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [7, 20])  # 20 rows: the projections run as ``W @ x.T`` (SMALL_GEMM_ROWS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_layer_runner_matches_the_layers_forward(family, T):
    base = tiny_base(family, seed=3)
    model = convert(base, LoopConfig(max_depth=1, method="fixed"))
    layer = model.model.layers[2]
    H = model.config.hidden_size
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)[None]
    pe = model.model.rotary_emb(x, pos)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=pe)[0]
        runner = LayerRunner(layer_ops_for(model))
        a = layer.self_attn
        kvh = model.config.num_key_value_heads
        for single in (False, True):
            kp = torch.zeros(T + 3, kvh, a.head_dim)
            vp = torch.zeros(T + 3, kvh, a.head_dim)
            slots = torch.arange(T) + 2  # somewhere in the pool
            if single:  # each row its own unit with its own prefix of keys (the decode layout)
                idx = slots[None].expand(T, T)
                valid = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
                keys = KeyList(idx, valid, torch.arange(T)[None].expand(T, T), [(i, 1) for i in range(T)], pos[0], True)
            else:  # one unit of T rows, causal inside
                keys = KeyList(
                    slots[None], torch.ones(1, T, dtype=torch.bool), torch.arange(T)[None], [(0, T)], pos[0], False
                )
            out = runner.run(layer, x[0], pe[0][0], pe[1][0], kp, vp, slots, keys)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


SPREAD = [1] * 40  # one-row units with key counts from 1 to 64: attention calls bucketed by key count


@pytest.mark.parametrize("layout", ["decode", "mixed", "padded", "ragged", "spread", "spread-mixed"])
def test_attend_matches_per_row_softmax(layout):
    """``LayerRunner.attend`` (its planned calls: one-row units batched or bucketed by key count, prompts
    padded or one by one, keys trimmed) == a per-row softmax over exactly the keys each row may see, for any
    mix of unit sizes."""
    g = torch.Generator().manual_seed(5)
    Hq, kvh, hd, n_slots = 4, 2, 8, 64
    sizes = {
        "decode": [1, 1, 1],
        "mixed": [1, 3, 1, 4, 1],
        "padded": [3, 4],
        "ragged": [1, 9, 2, 2],
        "spread": SPREAD,
        "spread-mixed": SPREAD + [3, 4],
    }[layout]
    N, U = sum(sizes), len(sizes)
    L = 64 if layout.startswith("spread") else 12
    kp, vp = torch.randn(n_slots, kvh, hd, generator=g), torch.randn(n_slots, kvh, hd, generator=g)
    q = torch.randn(N, Hq, hd, generator=g)
    idx = torch.randint(0, n_slots, (U, L), generator=g)
    kpos = torch.randint(0, 10, (U, L), generator=g)
    valid = torch.rand(U, L, generator=g) < 0.6
    valid[:, L - 1] = False  # trailing masked columns (trimmed by the plan)
    if layout.startswith("spread"):  # unit u sees keys up to a column of its own, 1 … L - 1
        last = torch.randint(1, L, (U,), generator=g)
        valid &= torch.arange(L)[None, :] < last[:, None]
    unit_rows, start = [], 0
    for n in sizes:
        unit_rows.append((start, n))
        start += n
    qpos = torch.randint(5, 12, (N,), generator=g)
    for u, (s, n) in enumerate(unit_rows):
        valid[u, 0], kpos[u, 0] = True, 0  # every row sees at least one key
    keys = KeyList(idx, valid, kpos, unit_rows, qpos, all(n == 1 for n in sizes))
    one_row_calls = sum(1 for p in keys.plan() if p.rows is None and (p.q_rows is None or p.q_rows.dim() == 1))
    if layout.startswith("spread"):
        assert one_row_calls > 1, "spread key counts should be bucketed into several calls"

    class Attn:
        scaling = hd**-0.5

    class Layer:
        self_attn = Attn()

    out = LayerRunner(LAYER_OPS["llama"]).attend(Layer(), q, kp, vp, keys).view(N, Hq, hd)
    for u, (s, n) in enumerate(unit_rows):
        for r in range(s, s + n):
            see = valid[u] & ((kpos[u] <= qpos[r]) if n > 1 else True)
            K = kp[idx[u][see]].repeat_interleave(Hq // kvh, 1)  # [l, Hq, hd]
            V = vp[idx[u][see]].repeat_interleave(Hq // kvh, 1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[r], K) * Attn.scaling, -1)
            torch.testing.assert_close(out[r], torch.einsum("hl,lhd->hd", w, V), atol=1e-5, rtol=1e-5)


def test_buckets_split_one_row_units_by_key_count():
    """``_buckets`` partitions the units, at most ``MAX_ONE_ROW_CALLS`` groups, each split saving more than
    ``CALL_COST_SLOTS`` padded slots: close lengths stay one call, far-apart clusters are split, and the
    padded slots never exceed one call's."""
    from retrofit.serving.layers import CALL_COST_SLOTS, MAX_ONE_ROW_CALLS, _buckets

    def padded(groups, lengths):
        return sum(len(g) * max(lengths[u] for u in g) for g in groups)

    assert _buckets([10, 11, 12, 10]) == [[0, 3, 1, 2]]  # saving ≤ CALL_COST_SLOTS: one call
    assert [sorted(g) for g in _buckets([5] * 20 + [60] * 20)] == [list(range(20)), list(range(20, 40))]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, rng.choice([8, 64, 512])) for _ in range(rng.randint(1, 80))]
        groups = _buckets(lengths)
        assert sorted(u for g in groups for u in g) == list(range(len(lengths)))
        assert 1 <= len(groups) <= MAX_ONE_ROW_CALLS
        one = len(lengths) * max(lengths)
        assert padded(groups, lengths) <= one - (len(groups) - 1) * CALL_COST_SLOTS


# ------------------------------------------------------------------------------------------------
# exactness against generate()
# ------------------------------------------------------------------------------------------------
EXITS = {
    "decider": {},
    "forced1": {"depth": 1},
    "forced3": {"depth": 3},
    "kl": {"exit_policy": "kl", "exit_threshold": 5e-2},
    "state": {"exit_policy": "state", "exit_threshold": 0.5},
    "taps": {"step_schedule": "taps"},
    "taps_forced": {"step_schedule": "taps", "depth": 3},
}


CONFIGS = [
    ("llama", "tah2", "whole", 3),
    ("qwen3", "tah2", "middle", 2),
    ("llama", "anira-e", "middle", 1),
    ("qwen3", "anira-o", "whole", 1),
    ("llama", "fixed", "middle", 2),
    ("qwen3", "ouro", "whole", 2),
]


@pytest.mark.parametrize("attention", ["duo-causal", "same-depth"])
@pytest.mark.parametrize("family,method,split,head_seed", CONFIGS)
def test_greedy_tokens_equal_generate_alone(family, method, split, head_seed, attention):
    if attention == "same-depth":  # each method meets both families across the two modes
        family = {"llama": "qwen3", "qwen3": "llama"}[family]
    model = looped(family, method, split, attention, head_seed=head_seed)
    # a stable seed: str hashes change with PYTHONHASHSEED, so hash() would draw a different trace per process
    rng = random.Random(zlib.crc32(f"{family}-{method}-{attention}".encode()))
    exits = list(EXITS.values())
    rng.shuffle(exits)
    reqs = random_requests(rng, exits, n=8, cancel=2)
    eng, handles = run_trace(model, reqs)
    seen = check_against_generate(model, eng, reqs, handles)
    assert len(seen) > 1, "the trace needs mixed exit depths"
    assert any(h.finish_reason == "cancelled" for h in handles)


@pytest.mark.parametrize(
    "options",
    [
        {"updater": "residual", "decider_state": "core"},  # retrofit's own choices
        {"updater": "release", "decider_state": "core"},
        {"updater": "residual", "decider_state": "final_norm"},
    ],
)
def test_tah2_release_options_serve_like_generate(options):
    """The updater and the state it and the decider read (the TaH2 release's defaults run in the CONFIGS above):
    every other combination, token for token and depth for depth as ``generate``."""
    model = looped("qwen3", "tah2", "middle", head_seed=2, **options)
    assert {k: model.loop.to_dict()[k] for k in options} == options
    reqs = random_requests(random.Random(11), list(EXITS.values()), n=8, cancel=2)
    eng, handles = run_trace(model, reqs)
    seen = check_against_generate(model, eng, reqs, handles)
    assert len(seen) > 1, "the trace needs mixed exit depths"


def test_tah2_exit_depth_output_ablation_equals_generate():
    """TaH2 with ``mixture_output=False``: the engine's combiner is the exit depth's logits (``ExitLogits``),
    for every exit rule, token for token as ``generate``."""
    model = looped("llama", "tah2", "whole", head_seed=3, mixture_output=False)
    assert not model.halting.mixture_output
    reqs = random_requests(random.Random(5), list(EXITS.values()), n=8, cancel=2)
    eng, handles = run_trace(model, reqs)
    seen = check_against_generate(model, eng, reqs, handles)
    assert len(seen) > 1, "the trace needs mixed exit depths"


def test_core_runs_once_per_step_on_rows_of_every_depth():
    """Depth-wise batching: one core call per step, holding rows of different requests at different depths."""
    model = looped("llama", "anira-e", "middle", head_seed=1)
    calls = []
    # the runner calls the layer's input norm once per layer call (q_proj itself may run as ``W @ x.T``)
    hook = model.core_layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    eng = Engine(model, TOK, max_seqs=4, kv_budget_bytes=8 << 20)
    mixed_steps = 0
    try:
        for w in WORDS[:6]:
            eng.add_request(TOK(w).input_ids, SamplingParams(temperature=0, max_tokens=6))
        while eng.has_work():
            before = len(calls)
            eng.last_core = []
            eng.step()
            rows = eng.last_core
            if rows:
                assert len(calls) == before + 1  # one call of the core's first layer per step
                assert calls[-1] == len(rows)
                if len({m for _, m in rows}) > 1 and len({s for s, _ in rows}) > 1:
                    mixed_steps += 1
    finally:
        hook.remove()
    assert mixed_steps > 0, "some step should hold rows of several requests at several depths"


def test_lm_head_padding_keeps_each_rows_logits():
    """``StepExecutor.logits`` pads 7–15 rows to 16 on CPU (a faster MKL path) and returns, for any row count,
    each row's own final norm + LM head (brute force: one row at a time)."""
    from retrofit.serving.step import LM_HEAD_PAD_FROM, LM_HEAD_PAD_ROWS

    model = looped("qwen3", "anira-e", "middle", head_seed=1)
    eng = Engine(model, TOK, max_seqs=2, kv_budget_bytes=1 << 20)
    seen = []
    lin = eng.runner.linear

    def spy(mod, x):
        if mod is model.lm_head:
            seen.append(x.shape[0])
        return lin(mod, x)

    eng.runner.linear = spy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in list(range(1, 21)) + [63, 64, 70]:
            y = torch.randn(n, model.config.hidden_size, generator=g)
            seen.clear()
            got = eng.executor.logits(y)
            padded = LM_HEAD_PAD_FROM <= n < LM_HEAD_PAD_ROWS
            assert seen == [LM_HEAD_PAD_ROWS if padded else n]
            assert got.shape == (n, model.config.vocab_size)
            for i in range(n):
                want = model.lm_head(model.model.norm(y[i : i + 1]))[0]
                torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_small_gemm_linear_equals_the_module():
    """``linear`` (``W @ x.T`` for 16–63 rows on CPU) == the module's own call at every row count across both
    edges, with and without bias; modules that are not a plain ``nn.Linear`` are called as they are."""
    from torch import nn

    from retrofit.serving.layers import SMALL_GEMM_ROWS, linear

    lo, hi = SMALL_GEMM_ROWS
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        mod = nn.Linear(24, 40, bias=bias)
        for n in (1, lo - 1, lo, 33, hi - 1, hi, hi + 7):
            x = torch.randn(n, 24, generator=g)
            torch.testing.assert_close(linear(mod, x), mod(x), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(linear(mod, x, small_gemm=False), mod(x), atol=0, rtol=0)

    class Scaled(nn.Linear):  # a subclass with its own forward (an adapter, say) must run that forward
        def forward(self, x):
            return 2 * super().forward(x)

    mod = Scaled(24, 40)
    x = torch.randn(lo + 4, 24, generator=g)
    torch.testing.assert_close(linear(mod, x), mod(x))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_runner_mlp_equals_the_layers_mlp(family):
    """``LayerRunner.mlp`` (the gated MLP's projections through ``linear``) == the MLP's own forward, at row
    counts inside and outside ``SMALL_GEMM_ROWS``; an MLP of another kind is called as it is."""
    from torch import nn

    model = convert(tiny_base(family, seed=2), LoopConfig(max_depth=1, method="fixed"))
    runner = LayerRunner(layer_ops_for(model))
    mlp = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (3, 20, 70):
            x = torch.randn(n, model.config.hidden_size, generator=g)
            torch.testing.assert_close(runner.mlp(mlp, x), mlp(x), atol=1e-5, rtol=1e-5)
        other = nn.Sequential(nn.Linear(model.config.hidden_size, 5))
        x = torch.randn(20, model.config.hidden_size, generator=g)
        torch.testing.assert_close(runner.mlp(other, x), other(x))


def test_admission_waits_for_the_kv_budget():
    """With room for one request's worst case only, requests wait in the queue and run one after another."""
    model = looped("qwen3", "tah2", "middle", head_seed=2)
    probe = Engine(model, TOK, max_seqs=4, max_model_len=64, kv_budget_bytes=8 << 20)
    need = probe.kv.worst_case(32, readout=True)  # every request below has <= 32 positions
    one = sum(n * probe.kv.pools[p].bytes_per_block for p, n in need.items())
    eng = Engine(model, TOK, max_seqs=4, max_model_len=64, kv_budget_bytes=int(1.5 * one))
    reqs = [eng.add_request(TOK(w).input_ids, SamplingParams(temperature=0, max_tokens=20)) for w in WORDS[:3]]
    max_running = 0
    while eng.has_work():
        eng.step()
        max_running = max(max_running, len(eng.seqs))
        if eng.seqs:
            assert eng.metrics()["queue_length"] >= 3 - len(eng.seqs) - sum(r.done.is_set() for r in reqs)
    assert max_running == 1, "the budget holds one request at a time"
    for w, r in zip(WORDS[:3], reqs):
        assert r.finish_reason in ("stop", "length")
        assert r.output == reference(model, TOK(w).input_ids, 20, {})[0]


def test_kv_blocks_follow_executed_depths():
    """Core entries = executed (token, depth) pairs; core blocks = ⌈entries / block⌉ of the sequence's stream."""
    model = looped("llama", "anira-e", "whole", head_seed=1)
    eng = Engine(model, TOK, max_seqs=2, block_size=4, core_block_size=4, kv_budget_bytes=8 << 20)
    r = eng.add_request(TOK("the quick brown fox").input_ids, SamplingParams(temperature=0, max_tokens=9))
    checked = 0
    while eng.has_work():
        eng.step()
        seq = eng.seqs.get(r.request_id)
        if seq is None:
            continue
        g = seq.group
        # tokens of the current step: exited ones ran their exit depth, running ones ran 1 … m - 1
        running = sum(d if d else g.m - 1 for d in g.exit_depth) if g not in eng.entering else 0
        counts = eng.kv.count_py[seq.slot]
        assert sum(counts) == sum(r.position_depths) + running
        assert eng.kv.seq_blocks(seq.slot, "core") == -(-sum(counts) // 4)
        checked += 1
    assert checked > 5
    assert 1 < len(set(r.position_depths))  # mixed depths: fewer entries than every position at D


@pytest.mark.parametrize("attention,core_bs", [("duo-causal", 3), ("same-depth", 1), ("same-depth", 16)])
def test_core_kv_layout_matches_a_brute_force_log(attention, core_bs):
    """One core stream per sequence, checked at every step against a brute-force log of the core rows written:
    entries and their (depth, position, last) tags, blocks = ⌈entries / core block⌉ per sequence, the pool's
    blocks in use, reservations and ``/metrics`` figures, the keys each unit reads (slots and depth-major
    order), and the blocks given back when a request finishes or is cancelled."""
    model = looped("llama", "anira-e", "middle", attention, head_seed=1)
    S = 3
    eng = Engine(model, TOK, max_seqs=S, block_size=4, core_block_size=core_bs, kv_budget_bytes=8 << 20)
    kv = eng.kv
    pool = kv.pools["core"]
    assert pool.block_size == core_bs and kv.pools["pre"].block_size == 4
    with pytest.raises(ValueError, match="core_block_size must be an integer >= 1; got 0"):
        Engine(model, TOK, max_seqs=S, core_block_size=0)

    def nblocks(n):
        return -(-n // core_bs)

    log = {s: [] for s in range(S)}  # per sequence slot: (depth, position) of each core row written, in order
    running = {}  # per slot: positions of the rows running in this step's core call
    executed = {}  # request id -> core entries when it ended
    orig_write, orig_keys, orig_finish = kv.core_write, kv.core_keys, eng._finish_seq

    def brute_last(s):
        top = {}
        for d, p in log[s]:
            top[p] = max(top.get(p, 0), d)
        return [d == top[p] and p not in running.get(s, ()) for d, p in log[s]]

    def core_write(groups, s, d, rank, pos):
        running.clear()
        for si, di, pi in zip(s.tolist(), d.tolist(), pos.tolist()):
            log[si].append((di, pi))
            running.setdefault(si, set()).add(pi)
        return orig_write(groups, s, d, rank, pos)

    def core_keys(unit_s, unit_m, unit_qmax, unit_rows, qpos, single):
        keys = orig_keys(unit_s, unit_m, unit_qmax, unit_rows, qpos, single)
        for u, (s, m, qmax) in enumerate(zip(unit_s.tolist(), unit_m.tolist(), unit_qmax.tolist())):
            E = len(log[s])
            last = brute_last(s)
            assert int(kv.count[s]) == kv.n_entries_py[s] == E
            assert kv.depth[s, :E].tolist() == [d for d, _ in log[s]]
            assert kv.pos[s, :E].tolist() == [p for _, p in log[s]]
            assert kv.last[s, :E].tolist() == last
            want = []  # (depth, entry) of every key the model's own forward reads, depth-major
            for k, (d, p) in enumerate(log[s]):
                sees = d <= m if attention == "duo-causal" else d == m or (d < m and last[k])
                if p <= qmax and sees:
                    want.append((d, k))
            want.sort()
            bl = kv.core.blocks[s][0]
            v = keys.valid[u]
            assert keys.idx[u][v].tolist() == [bl[k // core_bs] * core_bs + k % core_bs for _, k in want]
            assert keys.kpos[u][v].tolist() == [log[s][k][1] for _, k in want]
        return keys

    def finish_seq(seq, reason):
        s, E = seq.slot, len(log[seq.slot])
        assert kv.seq_blocks(s, "core") == nblocks(E)
        free_before = len(pool.free)
        orig_finish(seq, reason)
        assert len(pool.free) - free_before == nblocks(E)  # every core block of the request is given back
        assert kv.core.blocks[s][0] == [] and int(kv.count[s]) == 0 and not bool(kv.last[s].any())
        assert all(kv.seq_blocks(s, p) == 0 for p in kv.pools)
        executed[seq.req.request_id] = E
        log[s] = []

    kv.core_write, kv.core_keys, eng._finish_seq = core_write, core_keys, finish_seq
    rng = random.Random(5)
    reqs = random_requests(rng, [{}], n=7, cancel=3)
    handles = {}
    step = 0
    while len(handles) < len(reqs) or eng.has_work():
        for i, r in enumerate(reqs):
            if r["arrive"] == step:
                handles[i] = eng.add_request(r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"]))
            if r.get("cancel") == step and i in handles:
                eng.cancel(handles[i].request_id)
        eng.step()
        step += 1
        assert step < 2000
        # after every step: the tables hold exactly the brute-force count of every live sequence
        live = {seq.slot: seq for seq in eng.seqs.values()}
        for s in range(S):
            assert kv.seq_blocks(s, "core") == nblocks(len(log[s]))
            if s not in live:
                assert log[s] == []
        assert pool.in_use == sum(nblocks(len(log[s])) for s in range(S))
        owned = [b for s in range(S) for b in kv.core.blocks[s][0]]
        assert len(set(owned)) == len(owned) and not set(owned) & set(pool.free)
        assert len(owned) + len(pool.free) == pool.num_blocks
        for seq in live.values():  # admission reserved the worst case, which covers what is allocated
            n_pos = len(seq.req.prompt) + seq.req.params.max_tokens
            assert seq.res.blocks["core"] == nblocks(n_pos * kv.D) >= kv.seq_blocks(seq.slot, "core")
        assert pool.reserved == sum(seq.res.blocks["core"] for seq in live.values())
        met = eng.metrics()
        assert met["kv_blocks_in_use"] == sum(kv.seq_blocks(s, p) for s in range(S) for p in kv.pools)
        assert met["kv_bytes_in_use"] == sum(
            kv.seq_blocks(s, p) * kv.pools[p].bytes_per_block for s in range(S) for p in kv.pools
        )
    assert kv.blocks_in_use() == 0 and pool.reserved == 0
    depths = set()
    for i, h in handles.items():
        depths.update(h.position_depths)
        if h.finish_reason == "cancelled":
            assert executed.get(h.request_id, 0) >= sum(h.position_depths)
        else:  # one entry per executed (token, depth) pair, nothing more
            assert executed[h.request_id] == sum(h.position_depths) > 0
    assert len(depths) > 1, "the trace needs mixed exit depths"
    assert any(h.finish_reason == "cancelled" and executed.get(h.request_id) for h in handles.values())


def test_sampling_is_reproducible_per_seed_whatever_the_batch():
    model = looped("llama", "tah2", "whole", head_seed=4)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=8, seed=123, ignore_eos=True)  # 8 tokens

    def alone():
        eng = Engine(model, TOK, max_seqs=2, kv_budget_bytes=8 << 20)
        r = eng.add_request(TOK("hello").input_ids, p)
        eng.run_until_done()
        return r.output

    eng = Engine(model, TOK, max_seqs=4, kv_budget_bytes=8 << 20)
    others = [
        eng.add_request(TOK(w).input_ids, SamplingParams(temperature=1.0, max_tokens=5, seed=i))
        for i, w in enumerate(WORDS[:3])
    ]
    r = eng.add_request(TOK("hello").input_ids, p)
    eng.run_until_done()
    assert r.output == alone() and len(r.output) == 8
    assert all(o.done.is_set() for o in others)


def test_stop_strings_and_bad_requests():
    model = looped("llama", "fixed", "whole")
    eng = Engine(model, TOK, max_seqs=2, max_model_len=32, kv_budget_bytes=8 << 20)
    full = eng.add_request(TOK("hello").input_ids, SamplingParams(temperature=0, max_tokens=12))
    eng.run_until_done()
    text = TOK.decode(full.output, skip_special_tokens=True)
    assert len(text) >= 4
    stop = text[2:4]
    cut = eng.add_request(TOK("hello").input_ids, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    eng.run_until_done()
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.add_request(TOK("x" * 30).input_ids, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="non-empty list"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="depth"):
        eng.add_request(TOK("x").input_ids, SamplingParams(), depth=7)
    with pytest.raises(ValueError, match="exit_policy"):
        eng.add_request(TOK("x").input_ids, SamplingParams(), exit_policy="nope")
