"""The serving engine's speed and KV memory on CPU; prints JSON (not a test).

    python benchmarks/serve.py                 # 16 layers, hidden 512, D = 4 (~10 min on 2 busy threads)
    python benchmarks/serve.py --quick         # smaller and shorter, for a smoke run

A random Llama-shaped model (the shapes of ``benchmarks/decode.py``) is converted twice on the same
weights: ``fixed`` (every token at depth D, forced) and ``mixed`` (ANIRA-E with a random decider: each
token picks a depth in 1..D from its embedding). Every figure is a ratio measured in one process,
configurations timed round-robin (``--repeats`` rounds, the minimum per configuration):

1. ``mixed_depth``: at batch (concurrent requests) 8, 32 and 256, the engine's time for the mixed
   model vs the FLOPs-proportional ideal ``t(depth D) · FLOPs(mixed) / FLOPs(D)`` (``retrofit.model.flops``),
   both through the engine with ``--waves`` × batch requests, same prompts and lengths.
   ``decode.py`` measures the same ratio for ``generate()`` (1.31–1.45 at batch 32).
   ``steady_time_over_ideal`` is the same ratio over the *steady state* only (batch < 128): the steps
   that began with requests still waiting, so every free slot was refilled at once — no start-up, no
   drain of the last requests (which finish at different steps in the mixed run and in lockstep at
   depth D) — time per FLOP of the positions those steps completed, mixed ÷ depth D.
   With equal answer lengths the depth-D run moves in lockstep: each wave of ``batch`` requests ends at
   one step and the next wave's prompts enter together, one call of ``batch × prompt`` rows, while the
   mixed run's requests end at different steps and their successors' prompts trickle into decode steps.
   ``--answer-spread K`` draws answer lengths from ``new-tokens ± K`` (the same for both runs), so that
   neither run is in lockstep.
2. ``kv_bytes``: per request, the core KV bytes allocated (whole blocks) vs executed (token, depth)
   pairs, mixed and depth D (``alloc_over_executed_*``), and the mixed ÷ D ratios of both: allocated ∝
   executed when ``alloc_ratio_over_executed_ratio`` ≈ 1. A count, not a timing (deterministic on any
   machine); ``by_core_block_size`` repeats it for other core block sizes (``--skip mixed,trace,unrolled``
   runs only this figure).
3. ``trace``: one request trace — Poisson arrivals, prompt and answer lengths drawn uniformly, mixed
   depths — served by the engine vs ``generate()`` in static batches of the same size (a batch starts
   when it is full or the trace has ended and the previous batch is done; it runs to its longest answer):
   useful tokens per second, ratio engine / static.
   ``throughput_ratio_plain_gemm``: the same with the engine's ``small_gemm=False`` (every linear through
   ``F.linear``, as ``generate()`` runs them): what scheduling alone gives.
4. ``fixed_vs_unrolled``: the engine at depth D vs the plain unrolled model — the base with its core layers
   repeated D times (the same weight tensors), HF ``generate`` with its own KV cache — same batch, prompts
   and lengths. The same layer calls, not the same function: the looped model also runs its updater
   between depths (a few % of a layer's FLOPs), so the tokens differ. ``time_ratio_plain_gemm``: the
   engine with ``small_gemm=False`` (``retrofit.serving.layers.SMALL_GEMM_ROWS``), the same GEMM calls
   as HF's.

Clocks: ``--clock cpu`` (default) is the process's CPU time (all threads): robust to other processes on
a shared machine; it sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) so that spinning threads do not count.
``--clock wall`` for an idle machine, with OpenMP's default policy (what ``retrofit serve`` runs with).
Arrivals of the trace are on the same clock.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(args):
    from retrofit.testing import benchmark_llama, fixed_and_mixed

    base = benchmark_llama(args)
    loop = {"prelude": args.prelude, "core": args.core, "max_depth": args.max_depth}
    fixed, mixed = fixed_and_mixed(base, args.decider_scale, **loop)
    return base, fixed, mixed


def unrolled(base, looped, D):
    """The base model with its core layers repeated D times: new layer objects sharing the weight tensors
    (each with its own layer index, for HF's KV cache)."""
    import torch
    from torch import nn
    from transformers import LlamaForCausalLM

    pre, core, coda = looped._ranges
    order = list(pre) + [i for _ in range(D) for i in core] + list(coda)
    cfg = copy.deepcopy(base.config)
    cfg.num_hidden_layers = len(order)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [base.config.layer_types[i] for i in order]
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    layers = []
    for new_idx, i in enumerate(order):
        src = base.model.layers[i]
        lay = copy.copy(src)
        lay._modules = dict(src._modules)
        attn = copy.copy(src.self_attn)
        attn.layer_idx = new_idx
        lay._modules["self_attn"] = attn
        layers.append(lay)
    m.model.layers = nn.ModuleList(layers)
    m.model.embed_tokens = base.model.embed_tokens
    m.model.norm = base.model.norm
    m.model.rotary_emb = base.model.rotary_emb
    m.lm_head = base.lm_head
    m.generation_config = copy.deepcopy(base.generation_config)
    return m.eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prelude", type=int, default=0, help="prelude layers (0 = whole-stack looping)")
    p.add_argument("--core", type=int, default=None, help="core layers (default: all after the prelude)")
    p.add_argument("--max-depth", type=int, default=4, help="D")
    p.add_argument("--batches", default="8,32,256", help="batch sizes of the mixed-depth figure")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (mixed-depth and unrolled figures)")
    p.add_argument("--new-tokens", type=int, default=16, help="answer tokens (mixed-depth and unrolled figures)")
    p.add_argument("--large-new-tokens", type=int, default=6, help="answer tokens at batch >= 128")
    p.add_argument(
        "--answer-spread",
        type=int,
        default=0,
        help="mixed-depth figure: answer lengths drawn uniformly from new-tokens ± this (the same for both "
        "models), so the depth-D run is not in lockstep either (0: every answer new-tokens long)",
    )
    p.add_argument(
        "--waves", type=int, default=2, help="requests = waves × batch for batch < 128 (keeps the batch full)"
    )
    p.add_argument("--trace-requests", type=int, default=96)
    p.add_argument("--trace-batch", type=int, default=16)
    p.add_argument("--trace-rate", type=float, default=40.0, help="Poisson arrival rate (requests per clock second)")
    p.add_argument("--trace-prompt", default="4,32", help="prompt length range (uniform)")
    p.add_argument("--trace-answer", default="4,48", help="answer length range (uniform)")
    p.add_argument("--unrolled-batch", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--core-block-size", type=int, default=1, help="core KV block in entries (default 1, the engine's)")
    p.add_argument("--kv-budget-mb", type=int, default=1024, help="KV budget of each engine (batch 256 needs ~1 GiB)")
    p.add_argument("--repeats", type=int, default=2, help="timing rounds (minimum per configuration)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decider-scale", type=float, default=1.0)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--skip", default="", help="comma list of figures to skip: mixed,kv,trace,unrolled")
    p.add_argument("--quick", action="store_true", help="8 layers, hidden 256, batches 8,32, short runs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab = 8, 256, 688, 8000
        args.batches, args.trace_requests, args.repeats, args.new_tokens = "8,32", 32, 1, 8
    skip = set(filter(None, args.skip.split(",")))
    if args.clock == "cpu":
        # idle OpenMP threads sleep instead of spinning, so the CPU-time clock counts work only (set before
        # torch loads OpenMP). Not for the wall clock: sleeping threads wake per parallel region, which costs
        # the engine's many small ops 1.6-2x in wall time (docs/serving.md)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch

    from retrofit.model.flops import cost_report
    from retrofit.serving import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    base, fixed, mixed = build(args)
    D = args.max_depth
    rng = random.Random(0)
    V = args.vocab
    budget = args.kv_budget_mb << 20

    def prompts(n, length):
        return [[rng.randrange(10, V) for _ in range(length)] for _ in range(n)]

    def engine_run(model, reqs, batch, depth=None, core_block_size=None, on_finish=None, window=None, small_gemm=True):
        """Serve ``reqs`` [(prompt, max_tokens)], all arriving at once; returns (time, per-position depths, engine).

        ``window``: a dict that receives the *steady state*: the time of the steps that began with requests
        still waiting (so the batch was refilled: no start-up, no drain) after the first step, and the exit
        depths of the positions those steps completed."""
        eng = Engine(
            model,
            None,
            max_seqs=batch,
            kv_budget_bytes=budget,
            block_size=args.block_size,
            core_block_size=core_block_size or args.core_block_size,
            max_model_len=max(len(pr) + n for pr, n in reqs) + 1,
            small_gemm=small_gemm,
        )
        if on_finish is not None:
            fin = eng._finish_seq

            def hooked(seq, reason):
                on_finish(eng, seq)
                fin(seq, reason)

            eng._finish_seq = hooked
        kw = {} if depth is None else {"depth": depth}
        hs = []
        with torch.no_grad():
            t0 = clock()
            for pr, n in reqs:
                hs.append(eng.add_request(pr, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), **kw))
            if window is None:
                eng.run_until_done()
                t = clock() - t0
            else:
                window.update(time=0.0, depths=[], steps=0)
                first, t = True, 0.0
                while eng.has_work():
                    steady = bool(eng.waiting) and not first
                    before = [len(h.position_depths) for h in hs] if steady else None
                    c = clock()
                    eng.step()
                    dt = clock() - c
                    t += dt
                    first = False
                    if steady:
                        window["time"] += dt
                        window["steps"] += 1
                        for h, b in zip(hs, before):
                            window["depths"].extend(h.position_depths[b:])
        depths = [d for h in hs for d in h.position_depths]
        return t, depths, eng

    result = {
        "command": "python benchmarks/serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
            "prelude": args.prelude,
            "core": args.core,
            "max_depth": D,
        },
        "setup": {
            "threads": args.threads,
            "clock": args.clock,
            "repeats": args.repeats,
            "load_avg_1m": os.getloadavg()[0],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "torch": torch.__version__,
            "note": "figures are ratios of runs interleaved in one process; load_avg_1m says how busy the machine was",
        },
    }
    t_start = time.perf_counter()

    # 1. mixed depths vs the FLOPs-proportional ideal --------------------------------------------
    if "mixed" not in skip:
        rows = []
        for B in [int(b) for b in args.batches.split(",")]:
            n_new = args.large_new_tokens if B >= 128 else args.new_tokens
            n_req = args.waves * B if B < 128 else B
            lens = [n_new] * n_req
            if args.answer_spread and B < 128:
                lrng = random.Random(B)
                lens = [max(1, n_new + lrng.randint(-args.answer_spread, args.answer_spread)) for _ in range(n_req)]
            reqs = list(zip(prompts(n_req, args.prompt), lens))
            times = {"mixed": [], "D": []}
            dep = {}
            steady = {"mixed": [], "D": []}  # seconds per FLOP in the steady-state window, per round
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, model, depth in (("mixed", mixed, None), ("D", fixed, D)):
                    win = {} if n_req > B else None
                    t, d, _ = engine_run(model, reqs, B, depth, window=win)
                    times[name].append(t)
                    dep[name] = d
                    if win and win["depths"]:
                        f = cost_report(model, torch.tensor(win["depths"]), readout=False)["flops"]
                        steady[name].append((win["time"] / f, win["steps"], len(win["depths"])))
            tm, tD = min(times["mixed"][1:]), min(times["D"][1:])
            cm = cost_report(mixed, torch.tensor(dep["mixed"]), readout=False)
            cD = cost_report(fixed, torch.tensor(dep["D"]), readout=False)
            ideal = tD * cm["flops"] / cD["flops"]
            if steady["mixed"][1:] and steady["D"][1:]:
                sm, sD = min(steady["mixed"][1:]), min(steady["D"][1:])
                steady_fig = {
                    "steady_time_over_ideal": sm[0] / sD[0],
                    "steady_steps_mixed": sm[1],
                    "steady_steps_D": sD[1],
                    "steady_positions_mixed": sm[2],
                    "steady_positions_D": sD[2],
                }
            else:
                steady_fig = {"steady_time_over_ideal": None}
            rows.append(
                {
                    "batch": B,
                    "requests": n_req,
                    "prompt": args.prompt,
                    "new_tokens": n_new,
                    "answer_spread": args.answer_spread if B < 128 else 0,
                    "mean_depth": cm["mean_depth"],
                    "time_mixed_s": tm,
                    "time_D_s": tD,
                    "flops_ratio_vs_D": cm["flops"] / cD["flops"],
                    "time_ratio_vs_D": tm / tD,
                    "ideal_time_s": ideal,
                    "time_over_ideal": tm / ideal,
                    **steady_fig,
                }
            )
        result["mixed_depth"] = rows

    # 2. KV bytes: allocated vs executed -----------------------------------------------------------
    if "kv" not in skip:
        reqs = list(zip(prompts(32, args.prompt), [args.new_tokens] * 32))

        def kv_figures(core_bs):
            acc = {}
            for name, model, depth in (("mixed", mixed, None), ("D", fixed, D)):
                rec = {"alloc": 0, "exec": 0}

                def on_finish(eng, seq, rec=rec):
                    pool = eng.kv.pools["core"]
                    per_entry = pool.bytes_per_block // pool.block_size
                    rec["alloc"] += eng.kv.seq_blocks(seq.slot, "core") * pool.bytes_per_block
                    rec["exec"] += sum(eng.kv.count_py[seq.slot]) * per_entry
                    rec["core_block_size"] = pool.block_size

                _, d, _ = engine_run(model, reqs, 32, depth, core_block_size=core_bs, on_finish=on_finish)
                acc[name] = rec
                acc[name]["mean_depth"] = sum(d) / len(d)
            alloc_ratio = acc["mixed"]["alloc"] / acc["D"]["alloc"]
            exec_ratio = acc["mixed"]["exec"] / acc["D"]["exec"]
            return {
                "core_block_size": acc["D"]["core_block_size"],
                "core_alloc_bytes_mixed": acc["mixed"]["alloc"],
                "core_alloc_bytes_D": acc["D"]["alloc"],
                "core_exec_bytes_mixed": acc["mixed"]["exec"],
                "core_exec_bytes_D": acc["D"]["exec"],
                "alloc_over_executed_mixed": acc["mixed"]["alloc"] / acc["mixed"]["exec"],
                "alloc_over_executed_D": acc["D"]["alloc"] / acc["D"]["exec"],
                "alloc_ratio_mixed_vs_D": alloc_ratio,
                "executed_ratio_mixed_vs_D": exec_ratio,
                "alloc_ratio_over_executed_ratio": alloc_ratio / exec_ratio,
                "mean_depth_mixed": acc["mixed"]["mean_depth"],
            }

        main_fig = kv_figures(args.core_block_size)
        sweep = [kv_figures(c) for c in sorted({args.block_size, 4, 2, 1} - {main_fig["core_block_size"]})]
        result["kv_bytes"] = {
            "block_size": args.block_size,
            "requests": len(reqs),
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            **main_fig,
            "by_core_block_size": {
                f["core_block_size"]: {k: f[k] for k in ("alloc_ratio_mixed_vs_D", "alloc_over_executed_mixed")}
                for f in sorted([main_fig, *sweep], key=lambda f: f["core_block_size"])
            },
        }

    # 3. a Poisson trace: engine vs static generate() batches ------------------------------------------
    if "trace" not in skip:
        R, B = args.trace_requests, args.trace_batch
        p_lo, p_hi = map(int, args.trace_prompt.split(","))
        a_lo, a_hi = map(int, args.trace_answer.split(","))
        trng = random.Random(7)
        t = 0.0
        trace = []
        for _ in range(R):
            t += trng.expovariate(args.trace_rate)
            trace.append(
                (t, [trng.randrange(10, V) for _ in range(trng.randint(p_lo, p_hi))], trng.randint(a_lo, a_hi))
            )
        useful = sum(n for _, _, n in trace)

        def run_engine(small_gemm=True):
            eng = Engine(
                mixed,
                None,
                max_seqs=B,
                kv_budget_bytes=budget,
                block_size=args.block_size,
                core_block_size=args.core_block_size,
                max_model_len=p_hi + a_hi + 1,
                small_gemm=small_gemm,
            )
            i = 0
            with torch.no_grad():
                t0 = clock()
                while i < R or eng.has_work():
                    now = clock() - t0
                    while i < R and trace[i][0] <= now:
                        eng.add_request(
                            trace[i][1], SamplingParams(temperature=0, max_tokens=trace[i][2], ignore_eos=True)
                        )
                        i += 1
                    if not eng.step() and i < R and not eng.has_work():
                        # idle until the next arrival (the clock must move: cpu time does not while sleeping)
                        t0 -= trace[i][0] - now
                return clock() - t0

        def run_static():
            from retrofit.model.cache import DepthKVCache

            done = 0.0  # clock time the previous batch ended
            with torch.no_grad():
                for s in range(0, R, B):
                    batch = trace[s : s + B]
                    start = max(done, batch[-1][0])
                    L = max(len(pr) for _, pr, _ in batch)
                    ids = torch.zeros(len(batch), L, dtype=torch.long)
                    am = torch.zeros(len(batch), L, dtype=torch.long)
                    for j, (_, pr, _) in enumerate(batch):
                        ids[j, L - len(pr) :] = torch.tensor(pr)
                        am[j, L - len(pr) :] = 1
                    n = max(k for _, _, k in batch)
                    c0 = clock()
                    mixed.generate(
                        ids,
                        attention_mask=am,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                        cache=DepthKVCache(mixed.config),
                    )
                    done = start + (clock() - c0)
            return done

        te, ts, tp = [], [], []
        for _ in range(args.repeats):
            te.append(run_engine())
            ts.append(run_static())
            tp.append(run_engine(small_gemm=False))
        result["trace"] = {
            "requests": R,
            "batch": B,
            "rate_per_s": args.trace_rate,
            "prompt_range": [p_lo, p_hi],
            "answer_range": [a_lo, a_hi],
            "useful_tokens": useful,
            "last_arrival_s": trace[-1][0],
            "engine_makespan_s": min(te),
            "static_makespan_s": min(ts),
            "engine_tokens_per_s": useful / min(te),
            "static_tokens_per_s": useful / min(ts),
            "throughput_ratio": min(ts) / min(te),
            "engine_plain_gemm_makespan_s": min(tp),
            "throughput_ratio_plain_gemm": min(ts) / min(tp),
        }

    # 4. fixed depth D vs the unrolled base model ------------------------------------------------------
    if "unrolled" not in skip:
        B = args.unrolled_batch
        N = args.new_tokens
        plist = prompts(B, args.prompt)
        unr = unrolled(base, fixed, D)
        ids = torch.tensor(plist)
        reqs = [(pr, N) for pr in plist]
        times = {"engine": [], "unrolled": [], "plain": []}
        for r in range(args.repeats + 1):
            times["engine"].append(engine_run(fixed, reqs, B, D)[0])
            times["plain"].append(engine_run(fixed, reqs, B, D, small_gemm=False)[0])
            with torch.no_grad():
                c0 = clock()
                unr.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
                times["unrolled"].append(clock() - c0)
        te, tu, tp = min(times["engine"][1:]), min(times["unrolled"][1:]), min(times["plain"][1:])
        result["fixed_vs_unrolled"] = {
            "batch": B,
            "prompt": args.prompt,
            "new_tokens": N,
            "depth": D,
            "time_engine_s": te,
            "time_unrolled_generate_s": tu,
            "time_ratio": te / tu,
            "time_engine_plain_gemm_s": tp,
            "time_ratio_plain_gemm": tp / tu,
            "note": "same weights and layer calls; not the same function (the looped "
            "model's updater re-injects the prelude output at every depth)",
        }

    result["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
