"""Issue 29's probe, as a script: does the CPU flex-attention path give the same logits on every forward of a
left-padded batch? Prints JSON (not a test; the guard is tests/model/test_determinism.py). docs/long-context.md,
"Padding rows", has what it found on each machine it ran on.

    python benchmarks/flex_padding_probe.py --threads 1
    python benchmarks/flex_padding_probe.py --threads 2 --forwards 10

Three cases, each ``--forwards`` forwards in one process:

- ``kernel``: PyTorch's compiled ``flex_attention`` alone, on a mask whose padding queries see *no* key (the empty
  rows issue 29 suspected), with the heap filled with NaN between calls: is an empty row's output 0, NaN or stale
  memory?
- ``plain_llama``: a tiny Llama on transformers' own flex path (no retrofit code) against the same weights on sdpa.
- ``looped``: retrofit's fixed and TaH2 loops (duo-causal, M = 3, forced depths) on flex against the dense reference
  (``tests/attention_setup.py``: the determinism tests' model and batch; fixed at forced mixed depths, TaH2 on
  its own decider).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _kernel(forwards: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fa = torch.compile(flex_attention)
    B, H, T, D = 3, 4, 24, 16
    pad = torch.tensor([0, 9, 17])

    def mask_mod(b, h, q, k):
        return (k <= q) & (k >= pad[b]) & (q >= pad[b])  # a padding query sees nothing

    bm = create_block_mask(mask_mod, B, 1, T, T, device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    runs = []
    for _ in range(forwards):
        junk = [torch.full((B, H, T, D), float("nan")) for _ in range(50)]
        del junk
        o = fa(q, k, v, block_mask=bm)
        empty = torch.cat([o[b, :, : int(pad[b])].flatten() for b in (1, 2)])
        runs.append(
            {
                "empty_rows_nan": int(empty.isnan().sum()),
                "empty_rows_nonzero": int((empty != 0).sum()),
                "real_rows_finite": bool(torch.isfinite(o[0]).all()),
            }
        )
    return {"empty_row_values": int(empty.numel()), "forwards": runs}


def _plain_llama(forwards: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (3, 24), generator=g)
    att = torch.ones(3, 24, dtype=torch.long)
    att[1, :9] = 0
    att[2, :17] = 0
    models = {}
    for impl in ("sdpa", "flex_attention"):
        torch.manual_seed(1)
        m = LlamaForCausalLM(copy.deepcopy(cfg)).eval()  # a config each: set_attn_implementation writes into it
        m.set_attn_implementation(impl)
        models[impl] = m
    models["flex_attention"].load_state_dict(models["sdpa"].state_dict())
    real = att.bool()
    with torch.no_grad():
        ref = models["sdpa"](input_ids=ids, attention_mask=att).logits
        runs = []
        for _ in range(forwards):
            out = models["flex_attention"](input_ids=ids, attention_mask=att).logits
            runs.append(_diff(out, ref, real))
    return {"forwards": runs}


def _looped(forwards: int) -> dict:
    from attention_setup import attention_looped

    import retrofit.model.depth_attention as da

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 104, (2, 24), generator=g)
    att = torch.ones_like(ids)
    att[1, :7] = 0
    real = att.bool()
    depths = torch.randint(1, 4, ids.shape, generator=torch.Generator().manual_seed(2))
    out = {}
    for method in ("fixed", "tah2"):
        model = attention_looped(method, "duo-causal", 3, impl="flex_attention", train=False)
        kw = dict(input_ids=ids, attention_mask=att, **({"depth": depths} if method == "fixed" else {}))
        with torch.no_grad():
            with da.dense_reference():
                ref = model(**kw).logits
            out[method] = [_diff(model(**kw).logits, ref, real) for _ in range(forwards)]
    return out


def _diff(out, ref, real) -> dict:
    d = (out - ref)[real]
    return {"max_abs_diff_real": float(d.abs().max()), "nan_real": bool(torch.isnan(out[real]).any())}


def main() -> None:
    from retrofit.study.env import cpu_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--forwards", type=int, default=6, help="forwards per case, in one process (default 6)")
    p.add_argument("--cases", default="kernel,plain_llama,looped", help="comma-separated subset of the cases")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cases = {"kernel": _kernel, "plain_llama": _plain_llama, "looped": _looped}
    result = {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": a.threads,
    }
    for name in a.cases.split(","):
        result[name] = cases[name](a.forwards)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
