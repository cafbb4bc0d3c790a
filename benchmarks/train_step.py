"""Seconds per optimizer step of TaH2 training relative to fixed-depth looped training.

Same model, same batch, same maximum depth (2 by default), one process: the methods' steps are
interleaved round by round, in a shuffled order, so that machine load affects them alike; the
JSON gives the median and the minimum wall time per step and, on CPU, the median process CPU
time per step (with ``--threads 1`` the CPU time is the steadiest figure on a shared, busy
machine, where wall times swing by ±20%). A step is forward + backward +
AdamW update, with the loss each trainer uses (TaH2: mixture NLL + α_D · decider BCE with the
lookahead labels; fixed: NLL). Prints one JSON object; the figure of merit is ``ratio`` (target
≤ 1.3: TaH2 adds per-depth readouts, the output mixture and, for halted tokens, a gradient-free
lookahead readout, but no extra core iteration). As in ``RetrofitSFTTrainer``, the LM head and the
loss's vocabulary-wide work run at the labelled positions only (``labelled_logits_only``; the first
quarter of each row is an unlabelled prompt, except the decider's features at every position);
``--full_logits`` runs them at every position.

Two TaH2 cases are timed: ``tah2`` at initialization (the deciders start deep, so every token
runs both depths, as fixed does) and ``tah2_mixed`` with the decider re-biased so that about half
the tokens exit at depth 1 (their lookahead readout runs without gradient).

    python benchmarks/train_step.py                       # SmolLM2-135M shapes, random weights
    python benchmarks/train_step.py --model smollm2        # the real embedded SmolLM2 (slow to load)
    python benchmarks/train_step.py --layers 8 --batch 4 --seq 256 --device cuda
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import retrofit  # noqa: E402
from retrofit.cli.params import REAL_SHAPES  # noqa: E402
from retrofit.testing import spread_decider  # noqa: E402

# SmolLM2-135M's shapes (a Llama: 30 layers, hidden 576, vocab 49152), as `retrofit params` counts them
SMOLLM2_SHAPES = dict(REAL_SHAPES["HuggingFaceTB/SmolLM2-135M"][2], max_position_embeddings=2048, rms_norm_eps=1e-5)


def base_model(spec: str, layers: int | None):
    if spec == "smollm2-shape":
        from retrofit.testing import seeded_llama

        return seeded_llama(0, **{**SMOLLM2_SHAPES, **({"num_hidden_layers": layers} if layers else {})})
    from retrofit.hub.loading import load_model

    model, _ = load_model(spec)
    return model


def make_step(model, labelled_only: bool = True):
    """One AdamW step; the model computes its method's auxiliary loss itself (its options' defaults)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(ids, labels):
        out = model(input_ids=ids, labels=labels, labelled_logits_only=labelled_only)
        loss = out.loss  # next-token loss + the method's weighted auxiliary loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return out

    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default="smollm2-shape", help="smollm2-shape (random), smollm2, tiny-llama, a path or hub id"
    )
    ap.add_argument("--layers", type=int, default=None, help="smollm2-shape only: number of layers (default 30)")
    ap.add_argument("--max_depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--full_logits",
        action="store_true",
        help="run the LM head and the loss at every position (default: at the labelled ones, as RetrofitSFTTrainer)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    base = base_model(args.model, args.layers)
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, V, (args.batch, args.seq), generator=g).to(device)
    labels = ids.clone()
    labels[:, : args.seq // 4] = -100  # a prompt, as in SFT

    runs = {}
    for name, method in [("fixed", "fixed"), ("tah2", "tah2"), ("tah2_mixed", "tah2")]:
        torch.manual_seed(0)
        model = retrofit.convert(copy.deepcopy(base), retrofit.LoopConfig(max_depth=args.max_depth, method=method))
        model.to(device).train()
        if name == "tah2_mixed":
            with torch.no_grad():  # continue logit ≈ N(0, 1): about half the tokens exit at depth 1
                spread_decider(model, logit_std=1.0)
        runs[name] = {"step": make_step(model, not args.full_logits), "times": [], "cpu": [], "mean_depth": []}

    order = list(runs)
    for r in range(args.warmup + args.steps):
        random.Random(r).shuffle(order)  # no method always runs first (caches, load bursts)
        for name in order:
            run = runs[name]
            sync(device)
            t, c = time.perf_counter(), time.process_time()
            out = run["step"](ids, labels)
            sync(device)
            if r >= args.warmup:
                run["times"].append(time.perf_counter() - t)
                run["cpu"].append(time.process_time() - c)
                run["mean_depth"].append(out.depths.float().mean().item())

    sec = {n: statistics.median(r["times"]) for n, r in runs.items()}
    best = {n: min(r["times"]) for n, r in runs.items()}
    cpu = {n: statistics.median(r["cpu"]) for n, r in runs.items()}
    result = {
        "benchmark": "train_step",
        "model": args.model
        if args.model != "smollm2-shape"
        else f"smollm2-shape({base.config.num_hidden_layers} layers, random)",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq": args.seq,
        "max_depth": args.max_depth,
        "labelled_logits_only": not args.full_logits,
        "steps": args.steps,
        "sec_per_step": {n: round(s, 4) for n, s in sec.items()},
        "sec_per_step_min": {n: round(s, 4) for n, s in best.items()},
        "mean_depth": {n: round(statistics.mean(r["mean_depth"]), 3) for n, r in runs.items()},
        "ratio": round(sec["tah2"] / sec["fixed"], 3),
        "ratio_mixed": round(sec["tah2_mixed"] / sec["fixed"], 3),
        "ratio_min": round(best["tah2"] / best["fixed"], 3),
        "cpu_sec_per_step": {n: round(s, 4) for n, s in cpu.items()},
        "ratio_cpu": round(cpu["tah2"] / cpu["fixed"], 3),
        "ratio_mixed_cpu": round(cpu["tah2_mixed"] / cpu["fixed"], 3),
        "ratio_mixed_min": round(best["tah2_mixed"] / best["fixed"], 3),
        "target": 1.3,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
