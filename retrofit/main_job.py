"""The report step of a recipe run with ``--report``: the looped model, its same-budget controls and the
untrained base, side by side on the held-out test rows.

``main_job_report`` evaluates every model on the same test rows of every level (``retrofit.evaluation``:
greedy exact match, Wilson intervals, d̄ and compute per answer token, exact McNemar and a paired bootstrap of
the looped model against each other model, per-example depth vs level and per-token depth vs the SFT
control's loss), exports the looped checkpoint, and writes ``summary.json``: every figure README's results
table quotes, plus the three claims the main job tests (``targets``) with whether this run met them.

Test rows come from ``data_prep.tasks.build_splits`` with the run's seed: instances never seen in training,
disjoint from the validation split that settings are chosen on (``--n_valid``; the sweep in
``scripts/sweep_main_job.py`` reads only validation rows).
"""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The main job's claims (issue 15): each is checked on the run's own test rows and reported as met or not.
TARGETS = {
    "control_learns": "the SFT control reaches >= 40% mean accuracy over the training levels",
    "looped_beats_control": "the looped model beats the SFT control on mean accuracy over all test rows, "
    "exact McNemar p < 0.05",
    "depth_follows_difficulty": "Spearman(per-example d̄, level) >= 0.3 or Spearman(per-token depth, SFT control's "
    "token loss) >= 0.3",
}


def test_rows(script, splits) -> tuple[list[dict], list[int]]:
    """The report's rows (test splits only, at most ``--eval_n`` per level) and the training levels."""
    from .recipe import parse_levels

    rows = [dict(r) for name in ("eval", "eval_interp", "eval_extrap") if name in splits for r in splits[name]]
    wanted = parse_levels(script.eval_levels)
    per_level: dict[int, list] = {}
    for r in rows:
        lv = int(r["difficulty"])
        if wanted is not None and lv not in wanted:
            continue
        bucket = per_level.setdefault(lv, [])
        if script.eval_n is None or len(bucket) < script.eval_n:
            bucket.append(r)
    train_levels = sorted({int(x) for x in splits["train"]["difficulty"]})
    return [r for lv in sorted(per_level) for r in per_level[lv]], train_levels


def _level(entry: dict, lv) -> dict:
    levels = entry.get("levels", {})
    return levels.get(lv) or levels.get(str(lv)) or {}


def summarize(results: dict, task: str, train_levels: list[int], models: list[str]) -> dict[str, Any]:
    """The per-level table, paired tests and depth figures of ``summary.json`` from ``evaluate``'s results."""
    tasks = {m: results["models"][m]["tasks"][task] for m in models}
    levels = sorted({int(lv) for e in tasks.values() for lv in e.get("levels", {})})
    table = {}
    for lv in levels:
        row: dict[str, Any] = {"split": "train" if lv in train_levels else "held_out"}
        for m in models:
            L = _level(tasks[m], lv)
            row[m] = {
                k: L.get(k)
                for k in (
                    "accuracy",
                    "accuracy_ci",
                    "n",
                    "mean_depth",
                    "layers_per_token",
                    "flops_per_token",
                    "cost_exec",
                    "forced_accuracy",
                )
                if L.get(k) is not None
            }
        table[str(lv)] = row
    out: dict[str, Any] = {"levels": table}
    looped = tasks["looped"]
    overall = looped.get("overall", {})
    out["looped_mean_depth"] = overall.get("mean_depth")
    # every token forced to depth d (all test rows): equal to the adaptive accuracy at d = 1 means the gain
    # over the control comes from how the weights were trained, not from depth spent at inference
    out["looped_forced_depth_accuracy"] = looped.get("forced_depth_accuracy")
    # the adaptive exits vs each forced depth on the same rows (exact McNemar, bootstrap): does depth at
    # inference add anything over the depth-1 network the looped weights already are?
    out["adaptive_vs_forced_depth"] = {
        d: {k: c.get(k) for k in ("all", "train", "held_out") if c.get(k) is not None}
        for d, c in (looped.get("adaptive_vs_forced") or {}).items()
    }
    out["spearman_depth_vs_level"] = overall.get("depth_difficulty_spearman")
    td = looped.get("token_difficulty") or {}
    out["spearman_token_depth_vs_control_loss"] = td.get("spearman")
    out["token_difficulty"] = td
    comps = (results.get("comparisons") or {}).get(task, {})
    out["paired_tests"] = {
        other: {k: c.get(k) for k in ("all", "train", "held_out") if c.get(k) is not None} for other, c in comps.items()
    }
    # the evaluator's pooled figures: every test row, and the rows of the training levels
    out["mean_accuracy"] = {
        m: {
            "all_rows": tasks[m].get("overall", {}).get("accuracy"),
            "train_levels": ((tasks[m].get("splits") or {}).get("train") or {}).get("accuracy"),
        }
        for m in models
    }
    return out


def check_targets(summary: dict) -> dict[str, dict]:
    """Whether this run met each of ``TARGETS`` (never tuned on: the figures are the test rows')."""
    acc = summary["mean_accuracy"]
    sft = acc.get("sft", {})
    out = {}
    if sft:
        v = sft.get("train_levels")
        out["control_learns"] = {"value": v, "met": v is not None and v >= 0.40}
        test = (summary["paired_tests"].get("sft") or {}).get("all") or {}
        diff, p = test.get("difference"), test.get("mcnemar_p")
        out["looped_beats_control"] = {
            "difference": diff,
            "mcnemar_p": p,
            "met": diff is not None and p is not None and diff > 0 and p < 0.05,
        }
    r1, r2 = summary.get("spearman_depth_vs_level"), summary.get("spearman_token_depth_vs_control_loss")
    r1v = r1.get("rho") if isinstance(r1, dict) else r1
    r2v = r2.get("rho") if isinstance(r2, dict) else r2
    out["depth_follows_difficulty"] = {
        "spearman_example_depth_vs_level": r1v,
        "spearman_token_depth_vs_control_loss": r2v,
        "met": any(v is not None and v == v and v >= 0.3 for v in (r1v, r2v)),
    }
    for k, v in out.items():
        v["claim"] = TARGETS[k]
    return out


def main_job_report(
    looped,
    tokenizer,
    pristine,
    controls: dict,
    out: Path,
    script,
    splits,
    identity_err,
    t_start: float,
    timings: dict,
) -> dict:
    """Evaluate, export and summarize (see the module docstring). Returns the summary dict.

    ``splits`` are the run's ``task_splits`` (the rows training held out are its test splits)."""
    from .evaluation import evaluate
    from .evaluation.jsonio import write_json
    from .evaluation.options import EvalOptions
    from .export import export_model

    rows, train_levels = test_rows(script, splits)
    looped.eval()
    compare = [(name, c.model, tokenizer) for name, c in controls.items()]
    compare.append(("base", pristine, tokenizer))
    names = ["looped", *[c[0] for c in compare]]
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        forced_depths=True,  # the looped model with every token at depth 1..M: where its accuracy comes from
        exit_policies=False,
        policy_generation=False,
        difficulty_reference="sft" if "sft" in controls else None,
        html_samples=2,
    )
    t_eval = time.time()
    results = evaluate(
        looped,
        tokenizer,
        tasks=script.task,
        rows={script.task: rows},
        out_dir=out / "report",
        name="looped",
        compare=compare,
        train_levels=train_levels,
        options=opts,
        print_summary=True,
        config={
            "identity_at_init_max_abs_diff": identity_err,
            "loop": looped.loop.to_dict(),
            "controls": list(controls),
            "test_rows_per_level": script.eval_n or script.n_eval,
        },
    )
    timings["evaluation_s"] = round(time.time() - t_eval, 1)
    write_json(results, out / "final" / "retrofit_eval.json")  # feeds the model card; atomic, strict JSON
    t_exp = time.time()
    export_model(looped, out / "export", tokenizer=tokenizer, overwrite=True)
    timings["export_s"] = round(time.time() - t_exp, 1)

    summary: dict[str, Any] = {
        "wall_time_s": round(time.time() - t_start, 1),
        "timings_s": timings,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "identity_at_init_max_abs_diff": identity_err,
        "task": script.task,
        "train_levels": train_levels,
        "models": names,
        "loop": looped.loop.to_dict(),
        **summarize(results, script.task, train_levels, names),
    }
    summary["targets"] = check_targets(summary)
    summary["outputs"] = {
        "checkpoint": str(out / "final"),
        "export": str(out / "export"),
        "report": str(out / "report"),
        **{f"control_{k}": str(c.path) for k, c in controls.items()},
    }
    write_json(summary, out / "summary.json")
    _print_summary(summary)
    return summary


def _print_summary(summary: dict) -> None:
    lines = [f"main job: {summary['task']}, wall {summary['wall_time_s']:.0f} s, peak RSS {summary['peak_rss_mb']} MB"]
    for name, t in summary["targets"].items():
        lines.append(
            f"  [{'met' if t['met'] else 'NOT met'}] {t['claim']}: "
            + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in t.items()
                if k not in ("claim", "met")
            )
        )
    forced = summary.get("looped_forced_depth_accuracy") or {}
    if forced:
        adaptive = summary["mean_accuracy"]["looped"]["all_rows"]
        lines.append(
            f"  looped accuracy over all rows: adaptive {adaptive:.3f}; every token forced to depth "
            + ", ".join(f"{d}: {a:.3f}" for d, a in sorted(forced.items(), key=lambda kv: int(kv[0])))
        )
    for d, c in sorted((summary.get("adaptive_vs_forced_depth") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"  adaptive vs every token at depth {d}: "
            + ", ".join(
                f"{k} {t['difference']:+.3f} (McNemar p={t['mcnemar_p']:.3g})"
                for k, t in c.items()
                if isinstance(t, dict) and "difference" in t
            )
        )
    print("\n".join(lines))
