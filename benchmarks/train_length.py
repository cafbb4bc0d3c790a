"""Peak memory and time of one training step against sequence length: looped models vs their plain base.

For each length ``T`` and model (``base``: the plain Llama; ``fixed``: a fixed-depth loop; ``tah2`` at
initialisation; ``tah2-mixed``: the decider redrawn by ``retrofit.testing.spread_decider`` for mixed exit
depths, with their lookahead rows; ``anira-e``: ANIRA's early-exit method, same-depth attention), one
training step: forward + backward of the model's own loss (next-token loss, plus the method's auxiliary
loss), batch 1, fp32, one thread.

- **Memory**: one step in a **fresh subprocess** per (model, length, path), after a short warm-up step
  (T = 64): the step's peak resident-set growth (the process's high-water mark is reset right before it,
  ``/proc/self/clear_refs``), so what the model and inputs hold before the step does not count. The workers
  run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that the resident set follows live tensors (glibc's default
  dynamic threshold keeps freed activations in its heap: the figure then depends on the order of frees,
  ±15%). The memory worker's single-step times are in ``memory_runs`` too, but not used for ratios.
- **Time**: per length, one process holds every configuration and runs their steps interleaved, round by
  round in a shuffled order (as ``benchmarks/train_step.py``), so that the load of a shared machine falls on
  all of them alike; the fastest of ``--rounds`` steps, process CPU time (``cpu_time``, the steadier) and
  wall time (``time``).

``--paths new,dense`` also runs the looped models on the original dense-mask implementation
(``retrofit.model.depth_attention.dense_reference()``: ``[T, T]`` masks for the prelude and coda, ``[T, m·T]``
for the core): the "before" figures, in the same run. The base model has one path.

The figure of merit: ``ratios[path][model][T]`` = looped ÷ base, for memory and time; on the
long-context path they should stay flat as ``T`` grows (docs/long-context.md).

    python benchmarks/train_length.py                                   # T = 512 … 8192, all models, both paths
    python benchmarks/train_length.py --lengths 1024,8192 --models base,tah2 --paths new --out len.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

# tiny Llama: hidden 128, 4 layers, GQA 4 query / 2 key-value heads (head_dim 32), looped 1 / 2 / 1, M = 2
SHAPES = dict(
    vocab_size=104,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
LOOP = dict(prelude=1, core=2, max_depth=2)
MODELS = {"base": None, "fixed": "fixed", "tah2": "tah2", "tah2-mixed": "tah2", "anira-e": "anira-e"}


def _status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}  # kB


def build(model_name: str, T: int):
    """The model of ``model_name`` (same base weights for every name), in train mode."""
    import torch

    import retrofit
    from retrofit.testing import seeded_llama

    model = seeded_llama(0, **SHAPES, max_position_embeddings=max(T, 64))
    method = MODELS[model_name]
    if method is not None:
        model = retrofit.convert(model, retrofit.LoopConfig(**LOOP, method=method))
    if model_name == "tah2-mixed":  # continue logits spread ≈ N(0, 1): mixed exit depths
        from retrofit.testing import spread_decider

        spread_decider(model, logit_std=1.0, generator=torch.Generator().manual_seed(0))
    return model.train()


def make_step(model, path: str):
    """One training step of ``model`` on ``n`` random tokens, on the ``new`` or the ``dense`` path."""
    import torch

    from retrofit.model.depth_attention import dense_reference, settings

    ctx = dense_reference if path == "dense" else settings

    def step(n):
        ids = torch.randint(4, SHAPES["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        with ctx():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out

    return step


def memory_worker(model_name: str, T: int, path: str, threads: int) -> dict:
    """One step in this (fresh) process: its peak resident-set growth and its times."""
    import gc

    import torch

    torch.set_num_threads(threads)
    step = make_step(build(model_name, T), path)
    step(64)  # warm-up: kernels' first-call setup
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
    before = _status()["VmRSS"]
    t, c = time.perf_counter(), time.process_time()
    out = step(T)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    peak = _status()["VmHWM"]
    depths = getattr(out, "depths", None)
    return {
        "model": model_name,
        "T": T,
        "path": path,
        "peak_mb": round((peak - before) / 1024, 1),
        "sec": round(wall, 3),
        "cpu_sec": round(cpu, 3),
        "mean_depth": None if depths is None else round(depths.float().mean().item(), 3),
    }


def timing_worker(T: int, configs: list[tuple[str, str]], threads: int, rounds: int) -> dict:
    """Every (model, path) of ``configs`` in this one process, their steps interleaved round by round in a
    shuffled order (as ``benchmarks/train_step.py``), so that the load of a shared machine falls on all of
    them alike; the fastest round's process CPU time and wall time per configuration."""
    import random

    import torch

    torch.set_num_threads(threads)
    steps = {}
    for name, path in configs:
        steps[(name, path)] = make_step(build(name, T), path)
        steps[(name, path)](64)
    cpu = {k: [] for k in steps}
    wall = {k: [] for k in steps}
    order = list(steps)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for k in order:
            t, c = time.perf_counter(), time.process_time()
            steps[k](T)
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return {f"{n}:{p}": {"cpu_sec": round(min(cpu[(n, p)]), 3), "sec": round(min(wall[(n, p)]), 3)} for n, p in steps}


def _run(cmd: list[str], env: dict) -> dict:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--paths", default="new,dense", help="new (long-context kernels), dense (the original masks)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (0: no timing process)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)  # model:T:path (internal)
    ap.add_argument("--timing-worker", default=None, help=argparse.SUPPRESS)  # T/model:path,... (internal)
    args = ap.parse_args()
    if args.memory_worker:
        name, T, path = args.memory_worker.split(":")
        print(json.dumps(memory_worker(name, int(T), path, args.threads)))
        return
    if args.timing_worker:
        T, configs = args.timing_worker.split("/")
        pairs = [tuple(c.split(":")) for c in configs.split(",")]
        print(json.dumps(timing_worker(int(T), pairs, args.threads, args.rounds)))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    models = args.models.split(",")
    paths = args.paths.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    # every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed: the RSS high-water
    # mark then follows live tensors, not glibc's reuse of its heap (whose dynamic mmap threshold otherwise
    # keeps freed activations resident and makes the figure depend on the order of frees)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    me = [sys.executable, __file__, "--threads", str(args.threads), "--rounds", str(args.rounds)]
    runs, timing = [], {}
    for T in lengths:
        configs = [(name, path) for name in models for path in (["new"] if name == "base" else paths)]
        for name, path in configs:
            rec = _run([*me, "--memory-worker", f"{name}:{T}:{path}"], env)
            print(json.dumps(rec), file=sys.stderr, flush=True)
            runs.append(rec)
        if args.rounds:
            spec = ",".join(f"{n}:{p}" for n, p in configs)
            timing[str(T)] = _run([*me, "--timing-worker", f"{T}/{spec}"], env)
            print(json.dumps({"T": T, "timing": timing[str(T)]}), file=sys.stderr, flush=True)

    base = {r["T"]: r for r in runs if r["model"] == "base"}
    ratios: dict = {}
    for r in runs:
        if r["model"] == "base" or r["T"] not in base:
            continue
        T, b = str(r["T"]), base[r["T"]]
        entry = {"memory": round(r["peak_mb"] / max(b["peak_mb"], 1e-9), 2)}
        if T in timing:
            t, tb = timing[T][f"{r['model']}:{r['path']}"], timing[T]["base:new"]
            entry["cpu_time"] = round(t["cpu_sec"] / tb["cpu_sec"], 2)
            entry["time"] = round(t["sec"] / tb["sec"], 2)
        ratios.setdefault(r["path"], {}).setdefault(r["model"], {})[T] = entry
    result = {
        "benchmark": "train_length",
        "shapes": SHAPES,
        "loop": LOOP,
        "threads": args.threads,
        "rounds": args.rounds,
        "batch": 1,
        "dtype": "float32",
        "malloc_mmap_threshold": env["MALLOC_MMAP_THRESHOLD_"],
        "memory_runs": runs,
        "timing": timing,
        "ratios": ratios,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
