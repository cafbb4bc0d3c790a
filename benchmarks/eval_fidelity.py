"""Before/after figures of the evaluation's fidelity changes, on one tiny checkpoint; prints JSON (not a test).

    python benchmarks/eval_fidelity.py             # trains the checkpoint once (~4 min on an idle core), then measures
    python benchmarks/eval_fidelity.py --ckpt DIR  # the cached checkpoint (default /tmp/retrofit_fidelity_ckpt)

The checkpoint: a small character-level Llama (4 layers, hidden 128) trained from scratch, in one
process and seeded, on BREVO (N = 3..5), LANO (length 6..8) and MANO (L = 1..2) rows (loss on the
answer and its newline), then converted to a looped model (D = 3, TaH2) whose updater and decider
are drawn at random (seeded) so that depths vary. Its depths are therefore *not trained*: the LANO
figures show how the measurement changes, not whether depth follows difficulty.

Figures, each measured both ways on the same checkpoint and rows:

1. BREVO accuracy: exact match with the one tie-broken reference order (before) vs any valid
   topological order of the dependencies (after).
2. LANO Spearman of expected depth with the parser proxies: gold strings, teacher-forced, "predict"
   alignment, chart-edge count as the "additions" proxy (before) vs the model's own strings, "input"
   alignment, the inside algorithm's additions (after).
3. MANO d̄ per level under "predict" (before) vs "input" (after) alignment.
4. MANO default split: training and held-out levels of ``build_splits("mano", ...)`` (before: the
   previous defaults, written here; after: the task's defaults now).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

TASK_LEVELS = {"brevo": [3, 4, 5], "lano": [6, 7, 8], "mano": [1, 2]}


def build_checkpoint(path: Path, steps: int, seed: int = 0):
    from data_prep.tasks import build_dataset
    from retrofit.testing import char_tokenizer, seeded_llama

    tok = char_tokenizer()
    rows = []
    for task, levels in TASK_LEVELS.items():
        rows += build_dataset(task, levels, 600, seed=seed).to_list()
    random.Random(seed).shuffle(rows)
    seqs = []
    for r in rows:
        p = tok(r["prompt"])["input_ids"]
        a = tok(" " + r["answer"] + "\n", add_special_tokens=False)["input_ids"]
        seqs.append((p, a))
    model = seeded_llama(
        seed,
        None,
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    rng = random.Random(seed)
    model.train()
    t0 = time.time()
    for step in range(steps):
        batch = rng.sample(seqs, 32)
        L = max(len(p) + len(a) for p, a in batch)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            s = p + a
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            labels[i, len(p) : len(s)] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)


def looped_from(path: Path, seed: int = 0):
    from transformers import LlamaForCausalLM

    import retrofit
    from retrofit.testing import spread_decider

    base = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # the residual updater and the core state: the model this benchmark measured (docs/evaluation.md)
        loop = retrofit.LoopConfig(
            max_depth=3,
            method="tah2",
            updater="residual",
            decider_state="core",
            options={"decider_arch": "ffn", "decider_top_k": 10},
        )
        m = retrofit.convert(base, loop).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.updater.w2.weight.copy_(torch.randn(m.updater.w2.weight.shape, generator=g) * 0.3)
        spread_decider(m, std=1.0, generator=g)
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/retrofit_fidelity_ckpt")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n", type=int, default=40, help="evaluation rows per level")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint(ckpt, args.steps)
    from data_prep.common import first_line
    from data_prep.tasks import build_splits
    from retrofit.evaluation import EvalOptions, evaluate
    from retrofit.testing import char_tokenizer

    tok = char_tokenizer()
    model = looped_from(ckpt)
    common = dict(progress=False, forced_depths=False, exit_policies=False, html_samples=0)
    out: dict = {"checkpoint": str(ckpt), "rows_per_level": args.n}

    # 1. BREVO: the same generations scored both ways
    res = evaluate(model, tok, "brevo", levels=TASK_LEVELS["brevo"], n=args.n, seed=1, options=EvalOptions(**common))
    from retrofit.evaluation.decoding import greedy_generate
    from retrofit.evaluation.rows import prepare, task_rows

    rows = task_rows("brevo", TASK_LEVELS["brevo"], args.n, seed=1)
    exs = prepare(rows, tok, EvalOptions())
    gens = greedy_generate(model, tok, [e.prompt_ids for e in exs], max(len(e.answer_ids) for e in exs) + 2)
    before = {}
    for lvl in TASK_LEVELS["brevo"]:
        hits = [first_line(g["text"]) == first_line(r["answer"]) for g, r in zip(gens, rows) if r["difficulty"] == lvl]
        before[lvl] = sum(hits) / len(hits)
    after = {lvl: e["accuracy"] for lvl, e in res["models"]["model"]["tasks"]["brevo"]["levels"].items()}
    out["brevo_accuracy"] = {"before_exact_reference_order": before, "after_any_valid_order": after}

    # 2. LANO Spearman
    lano = {}
    for label, opts in (
        ("before_gold_predict", EvalOptions(structure_strings="gold", alignment="predict", **common)),
        ("after_generated_input", EvalOptions(**common)),
    ):
        r = evaluate(model, tok, "lano", levels=TASK_LEVELS["lano"], n=args.n, seed=1, options=opts)
        t = r["models"]["model"]["tasks"]["lano"]
        sp = {k: round(v["rho"], 3) if v["rho"] == v["rho"] else None for k, v in t.get("spearman", {}).items()}
        lano[label] = {
            "spearman": sp,
            "n_words": next(iter(t["spearman"].values()))["n"] if t.get("spearman") else 0,
            "strings": t.get("structure_strings"),
            "accuracy": t["overall"]["accuracy"],
        }
    lano["note"] = (
        "before: the 'additions' proxy was the chart-edge count (row chart_edges); after: the inside "
        "algorithm's additions (row additions)"
    )
    out["lano"] = lano

    # 3. MANO d̄ by alignment
    mano = {}
    for align in ("predict", "input"):
        r = evaluate(
            model,
            tok,
            "mano",
            levels=TASK_LEVELS["mano"],
            n=args.n,
            seed=1,
            options=EvalOptions(alignment=align, **common),
        )
        mano[align] = {
            lvl: round(e["mean_depth"], 3) for lvl, e in r["models"]["model"]["tasks"]["mano"]["levels"].items()
        }
    out["mano_mean_depth"] = {"before_predict": mano["predict"], "after_input": mano["input"]}

    # 4. MANO default split
    dd = build_splits("mano", 1, 1, seed=0)
    out["mano_default_split"] = {
        "before": {
            "train": [3, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16],
            "held_out_interp": [7, 11, 15],
            "held_out_extrap": [18, 20, 24],
        },
        "after": {
            "train": sorted(set(dd["train"]["difficulty"])),
            "held_out_interp": sorted(set(dd["eval_interp"]["difficulty"])) if "eval_interp" in dd else [],
            "held_out_extrap": sorted(set(dd["eval_extrap"]["difficulty"])),
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
