"""What TaH2's decider is taught first, at init, on the real SmolLM2-135M: the lookahead labels of one batch of the
main job's rows under each updater (issue 30 row 1; docs/tah2.md "updater"). Prints JSON (not a test).

    python benchmarks/tah2_init_labels.py                 # 16 rows of insertion sort, 4-6 keys, the main job's split

With ``updater="residual"`` (retrofit's, zero-initialized output) depth 2 equals depth 1 at init, so every gain
δ = ℓ¹ − ℓ² is rounding noise and the "continue" labels are its sign; with ``updater="release"`` (the TaH2 release's
SwiGLU updater, PyTorch's init) depth 2 is a different function from the start. Reported per updater: max |δ|, the
number of decisions and of "continue" labels, and the mean cost weight of the continues.
"""

from __future__ import annotations

import json
import time

import torch


def main() -> None:
    import retrofit
    from data_prep.tasks import get_task
    from retrofit.hub.loading import load_model
    from retrofit.model.halting.lookahead import lookahead_labels, next_token_mask

    torch.set_num_threads(1)
    task = get_task("clrs_sorting")
    rows = [r for lv in (4, 5, 6) for r in task.generate(lv, 6, 0)][:16]
    out = {"rows": len(rows), "model": "smollm2", "split": "prelude 20 / core 6 / coda 4", "max_depth": 2}
    for updater in ("residual", "release"):
        t = time.time()
        base, tok = load_model("smollm2")
        torch.manual_seed(0)
        loop = retrofit.LoopConfig(prelude=20, core=6, max_depth=2, method="tah2", updater=updater)
        model = retrofit.convert(base, loop).eval()
        texts = [r["prompt"] + r["answer"] for r in rows]
        enc = tok(texts, return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        with torch.no_grad():
            res = model(**enc, labels=labels, output_depth_losses=True)
        lab = lookahead_labels(res.depth_nll, next_token_mask(labels), model.loop.method_options.rho)
        delta = lab.delta[lab.decided]
        cont = lab.labels.bool() & lab.decided
        w = lab.weights.clamp(min=model.loop.method_options.cost_min, max=model.loop.method_options.cost_max)[cont]
        out[updater] = {
            "max_abs_gain": float(delta.abs().max()),
            "decisions": int(lab.decided.sum()),
            "continue_labels": int(cont.sum()),
            "mean_continue_weight": float(w.mean()) if w.numel() else None,
            "depth_2_loss_minus_depth_1": float(
                (res.depth_nll[..., 1] - res.depth_nll[..., 0])[lab.decided[..., 0]].mean()
            ),
            "seconds": round(time.time() - t, 1),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
