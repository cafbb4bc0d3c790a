"""Peak memory and time of one training step against sequence length: looped models vs their plain base.

For each length ``T`` and model (``base``: the plain Llama; ``fixed``: a fixed-depth loop; ``tah2``;
``anira-e``: ANIRA's early-exit method, same-depth attention) one step, forward + backward of the model's
own loss (next-token loss, plus the method's auxiliary loss), runs in a **fresh subprocess** with one
thread. Memory is the step's peak resident-set growth (the process's high-water mark is reset right
before the step, ``/proc/self/clear_refs``), so what the model and the inputs hold before the step does
not count. Time is the step's wall time and the process CPU time (steadier on a shared machine); each
worker first runs a short warm-up step (T = 64) so one-off initialisation is not timed.

``--paths new,dense`` also runs the looped models on the original dense-mask implementation
(``retrofit.depth_attention.dense_reference()``: ``[T, T]`` masks for the prelude and coda, ``[T, m·T]``
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
MODELS = {"base": None, "fixed": "fixed", "tah2": "tah2", "anira-e": "anira-e"}


def _status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}  # kB


def worker(model_name: str, T: int, path: str, threads: int) -> dict:
    """One step in this process; returns its record."""
    import torch

    torch.set_num_threads(threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    import retrofit
    from retrofit.depth_attention import dense_reference, settings

    cfg = LlamaConfig(**SHAPES, max_position_embeddings=max(T, 64))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    method = MODELS[model_name]
    if method is not None:
        model = retrofit.convert(model, retrofit.LoopConfig(**LOOP, method=method))
    model.train()
    ctx = dense_reference if path == "dense" else settings

    def step(n):
        ids = torch.randint(4, SHAPES["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        with ctx():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out

    step(64)  # warm-up: kernels' first-call setup
    import gc

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--paths", default="new,dense", help="new (long-context kernels), dense (the original masks)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # model:T:path (internal)
    args = ap.parse_args()
    if args.worker:
        name, T, path = args.worker.split(":")
        print(json.dumps(worker(name, int(T), path, args.threads)))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    models = args.models.split(",")
    paths = args.paths.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    runs = []
    for T in lengths:
        for name in models:
            for path in ["new"] if name == "base" else paths:
                cmd = [sys.executable, __file__, "--worker", f"{name}:{T}:{path}", "--threads", str(args.threads)]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(f"worker {name} T={T} {path} failed:\n{res.stderr[-3000:]}")
                rec = json.loads(res.stdout.strip().splitlines()[-1])
                print(json.dumps(rec), file=sys.stderr, flush=True)
                runs.append(rec)

    base = {r["T"]: r for r in runs if r["model"] == "base"}
    ratios: dict = {}
    for r in runs:
        if r["model"] == "base" or r["T"] not in base:
            continue
        b = base[r["T"]]
        ratios.setdefault(r["path"], {}).setdefault(r["model"], {})[str(r["T"])] = {
            "memory": round(r["peak_mb"] / max(b["peak_mb"], 1e-9), 2),
            "time": round(r["sec"] / b["sec"], 2),
            "cpu_time": round(r["cpu_sec"] / b["cpu_sec"], 2),
        }
    result = {
        "benchmark": "train_length",
        "shapes": SHAPES,
        "loop": LOOP,
        "threads": args.threads,
        "batch": 1,
        "dtype": "float32",
        "runs": runs,
        "ratios": ratios,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
