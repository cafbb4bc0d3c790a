"""Decode speed and KV memory of adaptive-depth generation on CPU; prints JSON (not a test).

    python benchmarks/decode.py                      # 16 layers, hidden 512, D = 4, batch 32 (~4 min on 2 threads)
    python benchmarks/decode.py --quick              # smaller and shorter, for a smoke run
    retrofit bench -- --batch 16                     # the same through the CLI

A random Llama-shaped model (16 layers, hidden 512, 8 heads, vocab 32000) is converted with
``max_depth = D``; every figure comes from one process, with the configurations timed round-robin
(``--repeats`` rounds, the minimum per configuration, so background load hits all alike):

1. ``fixed_depth``: ``generate(depth=k)`` vs ``generate(depth=D)``: the time ratio next to the FLOPs
   ratio (``retrofit.model.flops``) — exited work should cost nothing.
2. ``mixed_depth``: a batch whose tokens pick different depths (ANIRA-E with a random decider, mean
   ``d̄``): time vs the FLOPs-proportional ideal ``t(depth=D) · FLOPs(mixed) / FLOPs(D)``; also at
   ``--large-batch`` rows (``mixed_depth_large_batch``), where the layers are compute-bound.
3. ``depth1_vs_base``: ``generate(depth=1)`` of the looped model vs the base model's own
   ``generate`` (same weights, same tokens): time ratio (target ≤ 1.10), at ``--batch`` and at batch 1.
4. ``kv_bytes``: the core's K/V bytes of the mixed run vs the depth-``D`` run, next to the executed
   share ``Σ d*_t / (n · D)``.
5. ``fixed_depth_vs_unrolled``: ``generate(depth=D)`` of the looped model vs a plain *unrolled* model —
   the base with its core layers repeated ``D`` times (the same weight tensors, shared), decoded by
   transformers' own ``generate`` with its default dynamic cache — at batch 1 and 8
   (``--unrolled-batches``): the time ratio (target ≤ 1.05) next to the FLOPs ratio (the looped model
   also runs its updater between depths). ``--only-unrolled`` times this comparison alone. The two
   compute different functions (the updater feeds the core ``e + U(e, h)``, the unrolled stack feeds
   it ``h``), so their tokens differ; the work per step is the same but for the updater.

Timing: the ``decode`` figures cover the ``--new-tokens - 1`` one-token steps (a streamer stamps the
clock right after the prefill and after the last step); ``whole_generate`` adds the prefill of the
``--prompt`` tokens. FLOPs count the same positions. Clocks: ``--clock cpu`` (default) is the
process's CPU time (all threads): it measures work done and is robust to other processes sharing
the cores; ``--clock wall`` is wall time (meaningful on an idle machine); decode wall-time ratios
are reported too.

Batch size matters on CPU: a matrix product over few rows costs more per row than over many
(weights are streamed for every call), so a step's deeper depths, run by fewer rows, are less
efficient per token. ``--batch 32`` keeps the layers near the regime where time follows rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# idle OpenMP threads sleep instead of spinning: on a shared machine a spinning thread burns CPU time
# that is not work, and the CPU-time clock below must count work only
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build(args):
    from retrofit.testing import benchmark_llama, fixed_and_mixed

    base = benchmark_llama(args)
    # a second looped model on the same weights whose tokens choose their depth: ANIRA-E with a random
    # decider gives every token a depth in 1..D from its embedding
    fixed, mixed = fixed_and_mixed(base, args.decider_scale, max_depth=args.max_depth)
    return base, fixed, mixed


def unrolled_model(base, max_depth: int):
    """The base model with its layers repeated ``max_depth`` times (whole-stack looping unrolled): new
    decoder-layer objects (their own ``layer_idx`` for the cache) holding the base layers' parameters."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    L = base.config.num_hidden_layers
    cfg = copy.deepcopy(base.config)
    cfg.num_hidden_layers = L * max_depth
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.model.embed_tokens, model.model.norm = base.model.embed_tokens, base.model.norm
    model.model.rotary_emb, model.lm_head = base.model.rotary_emb, base.lm_head
    for i, layer in enumerate(model.model.layers):
        for name, p in base.model.layers[i % L].named_parameters():
            owner, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, leaf, p)
    assert not any(p.is_meta for p in model.parameters()), "an unrolled parameter was not shared"
    model.generation_config = base.generation_config
    return model.eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-depth", type=int, default=4, help="D")
    p.add_argument("--k", type=int, default=2, help="the shallower fixed depth compared with D (and depth 1)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--large-batch",
        type=int,
        default=256,
        help="also time the mixed batch against depth 1 and D at this batch size (0: skip)",
    )
    p.add_argument("--large-new-tokens", type=int, default=6, help="new tokens of the --large-batch runs")
    p.add_argument("--large-prompt", type=int, default=2, help="prompt tokens of the --large-batch runs")
    p.add_argument("--repeats", type=int, default=3, help="timing rounds (minimum per configuration)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--decider-scale", type=float, default=1.0, help="random decider weight scale (spread of depths)")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="process CPU time (robust on a shared machine) or wall time",
    )
    p.add_argument("--unrolled-batches", default="1,8", help="batch sizes of the fixed-depth vs unrolled comparison")
    p.add_argument("--only-unrolled", action="store_true", help="time only the fixed-depth vs unrolled comparison")
    p.add_argument("--quick", action="store_true", help="8 layers, batch 8, 8 new tokens, 2 rounds")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.batch, args.new_tokens, args.repeats, args.large_batch = 8, 8, 8, 2, 0
    if args.new_tokens < 2 or (args.large_batch and args.large_new_tokens < 2):
        p.error("--new-tokens and --large-new-tokens must be >= 2 (the decode phase starts after the first token)")

    import torch

    from retrofit.model.cache import DepthKVCache
    from retrofit.model.flops import cost_report, model_costs

    torch.set_num_threads(args.threads)
    base, fixed, mixed = build(args)
    D = args.max_depth
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, args.vocab, (args.batch, args.prompt), generator=g)
    ids1 = ids[:1]
    N = args.new_tokens
    gen_kw = {"max_new_tokens": N, "min_new_tokens": N, "do_sample": False, "pad_token_id": 0}

    caches = {}
    cpu = args.clock == "cpu"

    class Stamps:
        """A streamer that stamps the clocks at every ``put``: the first stamp is taken before the
        prefill, the second right after it (first new token), the last after the final step."""

        def __init__(self):
            self.wall, self.clock = [], []

        def put(self, value):
            self.wall.append(time.perf_counter())
            self.clock.append(time.process_time() if cpu else self.wall[-1])

        def end(self):
            pass

    def run(model, name, inp, looped=True, new_tokens=N, **kw):
        def f():
            st = Stamps()
            extra = {"cache": DepthKVCache(model.config)} if looped else {}
            t0, c0 = time.perf_counter(), (time.process_time() if cpu else None)
            gk = dict(gen_kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out = model.generate(inp, streamer=st, **gk, **extra, **kw)
            t1, c1 = time.perf_counter(), (time.process_time() if cpu else None)
            if looped:
                caches[name] = extra["cache"]
            total = (c1 - c0) if cpu else (t1 - t0)
            decode = st.clock[-1] - st.clock[1]  # the N - 1 decode steps
            return out, total, decode, st.wall[-1] - st.wall[1]

        return f

    unrolled = unrolled_model(base, D)
    ub = [int(b) for b in args.unrolled_batches.split(",") if b]
    idsU = torch.randint(10, args.vocab, (max(ub), args.prompt), generator=g)
    runs_u = {}
    for b in ub:
        runs_u[f"unrolled_b{b}"] = run(unrolled, f"unrolled_b{b}", idsU[:b], looped=False)
        runs_u[f"looped_b{b}"] = run(fixed, f"looped_b{b}", idsU[:b], depth=D)
    runs = (
        {}
        if args.only_unrolled
        else {
            "base": run(base, "base", ids, looped=False),
            "depth1": run(fixed, "depth1", ids, depth=1),
            f"depth{args.k}": run(fixed, f"depth{args.k}", ids, depth=args.k),
            f"depth{D}": run(fixed, f"depth{D}", ids, depth=D),
            "mixed": run(mixed, "mixed", ids),
            "base_b1": run(base, "base_b1", ids1, looped=False),
            "depth1_b1": run(fixed, "depth1_b1", ids1, depth=1),
        }
    )
    runs.update(runs_u)
    NL = args.large_new_tokens
    if args.large_batch and not args.only_unrolled:
        idsL = torch.randint(10, args.vocab, (args.large_batch, args.large_prompt), generator=g)
        runs.update(
            {
                "L_depth1": run(fixed, "L_depth1", idsL, new_tokens=NL, depth=1),
                f"L_depth{D}": run(fixed, f"L_depth{D}", idsL, new_tokens=NL, depth=D),
                "L_mixed": run(mixed, "L_mixed", idsL, new_tokens=NL),
            }
        )
    totals: dict[str, list[float]] = {k: [] for k in runs}
    decodes: dict[str, list[float]] = {k: [] for k in runs}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    outputs = {}
    t_start = time.perf_counter()
    with torch.no_grad():
        for k, f in runs.items():  # warm-up (allocator, first-call paths)
            outputs[k] = f()[0]
        for _ in range(args.repeats):
            for k, f in runs.items():
                _, total, decode, decode_wall = f()
                totals[k].append(total)
                decodes[k].append(decode)
                wall[k].append(decode_wall)
    t_dec = {k: min(v) for k, v in decodes.items()}
    t_tot = {k: min(v) for k, v in totals.items()}
    w_dec = {k: min(v) for k, v in wall.items()}

    def cost(name, part):
        c = caches[name]
        d = c.token_depths
        if part == "decode":  # positions fed by the decode steps
            n, P = (NL, args.large_prompt) if name.startswith("L_") else (N, args.prompt)
            d = d[:, P : P + n - 1]
        return cost_report(mixed if name.endswith("mixed") else fixed, d, d > 0, readout=False)

    def unrolled_row(b):
        c = cost(f"looped_b{b}", "decode")
        # the unrolled model runs the same layers (and head) without the updater between depths
        flops_ratio = c["flops"] / (c["flops"] - 2.0 * c["n_tokens"] * (D - 1) * model_costs(fixed)["updater"])
        t = t_dec[f"looped_b{b}"] / t_dec[f"unrolled_b{b}"]
        return {
            "batch": b,
            "time_looped_s": t_dec[f"looped_b{b}"],
            "time_unrolled_s": t_dec[f"unrolled_b{b}"],
            "time_ratio": t,
            "wall_ratio": w_dec[f"looped_b{b}"] / w_dec[f"unrolled_b{b}"],
            "flops_ratio": flops_ratio,
            "time_over_flops": t / flops_ratio,
            # per round: the spread shows how much the machine's load moved the figure
            "time_ratio_per_round": [
                round(a / u, 4) for a, u in zip(decodes[f"looped_b{b}"], decodes[f"unrolled_b{b}"])
            ],
        }

    unrolled_rows = [unrolled_row(b) for b in ub]
    setup = {
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg_1m": os.getloadavg()[0],
        "repeats": args.repeats,
        "clock": args.clock,
        "torch": torch.__version__,
        "prompt": args.prompt,
        "new_tokens": N,
    }
    model_row = {
        "layers": args.layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "max_depth": D,
    }
    if args.only_unrolled:
        result = {
            "command": "python benchmarks/decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": model_row,
            "setup": setup,
            "fixed_depth_vs_unrolled": unrolled_rows,
            "wall_s": time.perf_counter() - t_start,
        }
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
        return result

    def fixed_row(k, t, part):
        ck, cD = cost(f"depth{k}", part), cost(f"depth{D}", part)
        t_ratio = t[f"depth{k}"] / t[f"depth{D}"]
        f_ratio = ck["flops"] / cD["flops"]
        return {
            "k": k,
            "D": D,
            "time_s": t[f"depth{k}"],
            "time_D_s": t[f"depth{D}"],
            "time_ratio": t_ratio,
            "flops_ratio": f_ratio,
            "layer_pass_ratio": ck["layers_adaptive_vs_fixed"],
            "time_over_flops": t_ratio / f_ratio,
        }

    def mixed_row(t, part, pre=""):
        cm, cD = cost(pre + "mixed", part), cost(f"{pre}depth{D}", part)
        tm, t1, tD = t[pre + "mixed"], t[pre + "depth1"], t[f"{pre}depth{D}"]
        ideal = tD * cm["flops"] / cD["flops"]
        # the same ideal from the measured fixed-depth times: linear in the mean depth
        interp = t1 + (cm["mean_depth"] - 1) * (tD - t1) / (D - 1)
        return {
            "batch": args.large_batch if pre else args.batch,
            "mean_depth": cm["mean_depth"],
            "depth_histogram": [
                int(x) for x in torch.bincount(caches[pre + "mixed"].token_depths.flatten(), minlength=D + 1)[1:]
            ],
            "time_s": tm,
            "time_D_s": tD,
            "flops_ratio_vs_D": cm["flops"] / cD["flops"],
            "time_ratio_vs_D": tm / tD,
            "ideal_time_s": ideal,
            "time_over_ideal": tm / ideal,
            "time_over_interpolated_fixed": tm / interp,
        }

    same = bool(torch.equal(outputs["base"], outputs["depth1"])) and bool(
        torch.equal(outputs["base_b1"], outputs["depth1_b1"])
    )

    def base_row(t):
        return {
            "batch": args.batch,
            "time_base_s": t["base"],
            "time_depth1_s": t["depth1"],
            "time_ratio": t["depth1"] / t["base"],
            "batch1_time_base_s": t["base_b1"],
            "batch1_time_depth1_s": t["depth1_b1"],
            "batch1_time_ratio": t["depth1_b1"] / t["base_b1"],
            "same_tokens": same,
        }

    kv_m, kv_D = caches["mixed"], caches[f"depth{D}"]
    dm = kv_m.token_depths
    share = float(dm.sum()) / (dm.numel() * D)
    kv_row = {
        "core_bytes_mixed": kv_m.nbytes("core"),
        "core_bytes_D": kv_D.nbytes("core"),
        "core_bytes_ratio": kv_m.nbytes("core") / kv_D.nbytes("core"),
        "executed_share": share,
        "mean_depth": float(dm.float().mean()),
        "total_bytes_ratio": kv_m.nbytes() / kv_D.nbytes(),
        "allocated_bytes_ratio": kv_m.allocated_nbytes() / kv_D.allocated_nbytes(),
    }

    result = {
        "command": "python benchmarks/decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
            "max_depth": D,
        },
        "setup": {
            "batch": args.batch,
            "prompt": args.prompt,
            "new_tokens": N,
            "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_avg_1m": os.getloadavg()[0],
            "repeats": args.repeats,
            "clock": args.clock,
            "torch": torch.__version__,
        },
        "decode": {  # the N - 1 one-token steps (the figures the issue asks for)
            "fixed_depth": [fixed_row(k, t_dec, "decode") for k in (1, args.k)],
            "mixed_depth": mixed_row(t_dec, "decode"),
            "mixed_depth_large_batch": mixed_row(t_dec, "decode", "L_") if args.large_batch else None,
            "depth1_vs_base": base_row(t_dec),
        },
        "kv_bytes": kv_row,
        "fixed_depth_vs_unrolled": unrolled_rows,
        "whole_generate": {  # prefill of the prompt + decode
            "fixed_depth": [fixed_row(k, t_tot, "all") for k in (1, args.k)],
            "mixed_depth": mixed_row(t_tot, "all"),
            "depth1_vs_base": base_row(t_tot),
        },
        "decode_wall_ratios": {
            **{f"depth{k}_over_depth{D}": w_dec[f"depth{k}"] / w_dec[f"depth{D}"] for k in (1, args.k)},
            "mixed_over_depthD": w_dec["mixed"] / w_dec[f"depth{D}"],
            "depth1_over_base": w_dec["depth1"] / w_dec["base"],
            "depth1_over_base_batch1": w_dec["depth1_b1"] / w_dec["base_b1"],
        },
        "decode_times_s": {k: [round(x, 4) for x in v] for k, v in decodes.items()},
        "decode_time_spread": {k: (max(v) - min(v)) / max(min(v), 1e-12) for k, v in decodes.items()},
        "wall_s": time.perf_counter() - t_start,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
