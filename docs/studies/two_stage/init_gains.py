"""The gain of TaH2's second pass before any training (docs/study.md, "Why TaH2's frontier is flat").

The embedded SmolLM2-135M-Instruct converted as the default study's tah2 arm (prelude 20 / core 6 / coda 4, M = 2,
the release's updater and decider options), with its heads initialized under each seed. On the main job's first
training rows, every answer token's next-token loss with every token forced to depth 1 and to depth 2 (each depth's
own readout, as TaH2's lookahead labels read them): the gain of one more iteration is ℓ¹ − ℓ². Prints JSON.

    python docs/studies/two_stage/init_gains.py            # from the repository root; ~1 min on 2 cores
    python docs/studies/two_stage/init_gains.py --updater residual   # the identity-at-init updater instead
"""

import argparse
import json
import sys

import torch

import retrofit
from data_prep.tasks import build_splits
from retrofit.hub.loading import load_model

ROWS = 60  # the first training rows (levels 4-6 interleaved as the generator gives them)


def main(seeds=(1, 2, 3), updater: str = "release") -> dict:
    torch.set_num_threads(2)
    rows = build_splits(
        "clrs_sorting",
        n_train=400,
        n_eval=100,
        seed=0,
        train_levels=[4, 5, 6],
        extrap_levels=[8],
        interp_levels=[],
        n_valid=60,
    )["train"].select(range(ROWS))
    out = {"rows": ROWS, "updater": updater, "seeds": {}}
    for seed in seeds:
        torch.manual_seed(seed)
        base, tok = load_model("smollm2")
        cfg = retrofit.LoopConfig(
            prelude=20,
            core=6,
            max_depth=2,
            method="tah2",
            updater=updater,
            decider_state="final_norm",
            decider_width_rule="release",
            padding_stops=True,
            options={"decider_topk_grad": True, "decider_init": "torch", "decider_top_k": None},
        )
        model = retrofit.convert(base, cfg).eval()
        nll = {1: [], 2: []}
        with torch.no_grad():
            for r in rows:
                p = tok(r["prompt"]).input_ids
                ids = torch.tensor([p + tok(" " + r["answer"]).input_ids + [tok.eos_token_id]])
                tgt = ids[0, len(p) :]
                for d in (1, 2):
                    logp = torch.log_softmax(model(ids, depth=d).logits[0, len(p) - 1 : -1].float(), -1)
                    nll[d].append(-logp.gather(1, tgt[:, None])[:, 0])
        l1, l2 = torch.cat(nll[1]), torch.cat(nll[2])
        g = l1 - l2
        out["seeds"][seed] = {
            "answer_tokens": int(g.numel()),
            "loss_depth1": float(l1.mean()),
            "loss_depth2": float(l2.mean()),
            "gain_mean": float(g.mean()),
            "gain_median": float(g.median()),
            "share_gain_positive": float((g > 0).float().mean()),
        }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updater", choices=retrofit.model.config.UPDATERS, default="release", help="the loop's updater")
    json.dump(main(updater=ap.parse_args().updater), sys.stdout, indent=1)
    print()
