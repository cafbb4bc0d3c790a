"""GPU checks of the long-context training path and of the serving engine on CUDA (run by gpu_check.sh).

One case per process (``python benchmarks/gpu_check.py CASE``), so that a failure or an out-of-memory in
one does not hide the others and every peak-memory figure starts from zero. Prints one JSON line.

Cases:

- ``train:MODEL:IMPL:T``: one training step (forward + backward of the model's own loss, gradient
  checkpointing on, batch 1, bf16) of a Qwen3-1.7B-shaped random model: ``MODEL`` is ``plain`` (the
  Qwen3ForCausalLM) or ``tah2`` (TaH2, M = 2, whole-stack looping: the README's "Scaling up" setting);
  ``IMPL`` the attention implementation (``flex_attention``: the core's depth attention on one BlockMask
  per depth; ``sdpa``: the chunked kernel's matmul blocks). The step runs twice (the first compiles flex
  attention for this length); the second is timed. Reports seconds, tokens/s and
  ``torch.cuda.max_memory_allocated``.
- ``flex_padded``: the determinism check of issue 29 on the flex path: a Qwen3-1.7B-width TaH2 model (4 layers,
  fp32, M = 2) and the same model with every token forced through both depths, on a left-padded batch; the
  forward runs 10 times and every result must equal the first and the sdpa model's (the chunked kernel) on the
  real positions: max differences and NaN counts per forward.
- ``serve``: the serving engine (``retrofit.serving.Engine``) decoding on CUDA, fp32, a 4-layer model of
  the same width: greedy tokens of 8 requests vs ``model.generate`` one by one (how many match), and the
  engine's tokens/s.

``--dry-run`` runs a case on CPU at tiny shapes (2 layers, hidden 256), fp32, to check the script itself on
a machine without a GPU (flex attention is then skipped: no backward on CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Qwen3-1.7B's shapes (config.json of Qwen/Qwen3-1.7B-Base)
QWEN3_1P7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
)


DRY = "--dry-run" in sys.argv
DEVICE = "cpu" if DRY else "cuda"
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _qwen3(impl: str, dtype, T: int, **over):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shapes = {**QWEN3_1P7B, **(TINY if DRY else {}), **over}
    cfg = Qwen3Config(**shapes, max_position_embeddings=max(T, 40960))
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model


def train(model_name: str, impl: str, T: int) -> dict:
    import retrofit

    model = _qwen3(impl, torch.float32 if DRY else torch.bfloat16, T)
    if model_name == "tah2":
        model = retrofit.convert(model, retrofit.LoopConfig(max_depth=2, method="tah2"))
    model.train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, QWEN3_1P7B["vocab_size"], (1, T), device=DEVICE)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out

    t = time.perf_counter()
    step()  # compiles flex attention for this length
    _sync()
    first = time.perf_counter() - t
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = step()
    _sync()
    sec = time.perf_counter() - t
    return {
        "case": "train",
        "model": model_name,
        "attn_implementation": impl,
        "T": T,
        "sec": round(sec, 3),
        "first_step_sec": round(first, 3),
        "tokens_per_sec": round(T / sec, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
        "mean_depth": None if getattr(out, "depths", None) is None else round(out.depths.float().mean().item(), 3),
        "loss": round(out.loss.item(), 4),
    }


def serve() -> dict:
    import retrofit
    from retrofit.serving.engine import Engine
    from retrofit.serving.sampling import SamplingParams
    from retrofit.testing import spread_decider

    torch.backends.cuda.matmul.allow_tf32 = False
    base = _qwen3("sdpa", torch.float32, 512, num_hidden_layers=4, vocab_size=32000)
    torch.manual_seed(1)
    model = retrofit.convert(base, retrofit.LoopConfig(prelude=1, core=2, max_depth=3, method="tah2")).eval()
    spread_decider(model, logit_std=2.0, generator=torch.Generator().manual_seed(0))  # mixed exit depths
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in torch.randint(8, 64, (8,), generator=g)
    ]
    new = 32
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)
            refs.append(out[0, len(p) :].tolist())
    eng = Engine(model, None, max_seqs=8, kv_budget_bytes=1 << 30, eos_token_id=[])
    t = time.perf_counter()
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in prompts]
    eng.run_until_done()
    _sync()
    sec = time.perf_counter() - t
    match = sum(r.output == ref for r, ref in zip(reqs, refs))
    return {
        "case": "serve",
        "requests": len(prompts),
        "new_tokens": new,
        "engine_tokens_per_sec": round(len(prompts) * new / sec, 1),
        "requests_equal_to_generate": f"{match}/{len(prompts)}",
        "mean_depth": round(sum(sum(r.depths) for r in reqs) / sum(len(r.depths) for r in reqs), 3),
    }


def flex_padded() -> dict:
    import retrofit
    import retrofit.model.depth_attention as da
    from retrofit.testing import spread_decider

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B, T = 4, (64 if DRY else 1000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (B, T), generator=g).to(DEVICE)
    mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    for b, n in enumerate((0, 7, T // 3, T - 1)):  # left padding, down to one real token
        mask[b, :n] = 0
    real = mask.bool()
    res = {"case": "flex_padded", "B": B, "T": T}
    for forced in (None, 2):
        models = {}
        for impl in ("sdpa", "flex_attention"):
            base = _qwen3(impl, torch.float32, T, num_hidden_layers=4, vocab_size=32000)
            torch.manual_seed(1)
            models[impl] = retrofit.convert(base, retrofit.LoopConfig(max_depth=2, method="tah2")).eval()
            spread_decider(models[impl], logit_std=2.0, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            models["flex_attention"].load_state_dict(models["sdpa"].state_dict())
            ref = models["sdpa"](ids, attention_mask=mask, depth=forced).logits[real]
            errs, nans = [], []
            for _ in range(10):
                with da.settings():
                    out = models["flex_attention"](ids, attention_mask=mask, depth=forced).logits[real]
                _sync()
                nans.append(int(torch.isnan(out).sum()))
                errs.append(float((out - ref).abs().max()))
        key = "decider" if forced is None else f"depth_{forced}"
        res[key] = {"max_abs_diff_per_forward": [f"{e:.2e}" for e in errs], "nan_per_forward": nans}
        res[key]["ok"] = max(errs) <= 1e-3 and not any(nans)
    return res


def main() -> None:
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device (or --dry-run)")
    case = sys.argv[1]
    try:
        if case == "serve":
            res = serve()
        elif case == "flex_padded":
            res = flex_padded()
        else:
            _, model_name, impl, T = case.split(":")
            res = train(model_name, impl, int(T))
    except torch.OutOfMemoryError as e:
        res = {"case": case, "error": "out of memory", "detail": str(e)[:300]}
    res["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run, tiny shapes)"
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
