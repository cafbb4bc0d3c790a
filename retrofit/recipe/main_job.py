"""The report step of a recipe run with ``--report``: the looped model, its same-budget controls and the
untrained base, side by side on the held-out test rows.

``main_job_report`` evaluates every model on the same test rows of every level (``retrofit.evaluation``:
greedy exact match, Wilson intervals, d̄ and compute per answer token, exact McNemar and a paired bootstrap of
the looped model against each other model, per-example depth vs level and per-token depth vs the SFT
control's loss), measures the accuracy–compute frontier (issue 24, ``retrofit.evaluation.frontier``: the
decider's threshold sweep, random allocation at the same d̄, the oracle at equal compute and the accuracy
ceiling, every forced depth, the controls and the base;
the decider's realized gain per decile of its continue probability; the break-even d̄; the fixed-depth
control comparison), exports the looped checkpoint, and writes ``summary.json``: every figure README's
results table quotes, plus the claims the main job tests (``targets``) with whether this run met them.

Test rows come from ``data_prep.tasks.build_splits`` with the run's seed: instances never seen in training,
disjoint from the validation split that settings are chosen on (``--n_valid``; ``retrofit study`` tunes on
validation rows only, docs/study.md).
"""

from __future__ import annotations

import logging
import resource
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model import registry

logger = logging.getLogger(__name__)

#: The frontier's size in the main job (``EvalOptions``), the same as the default study's test trials
#: (recipes/studies/main.yaml): its passes run on the first ``FRONTIER_ROWS_PER_LEVEL`` test rows of each level,
#: the decider placed by compute at three stop shares (d̄ 1.5 / 1.3 / 1.1 at M = 2; 0.9 is under this split's
#: break-even d̄ 1.15, the point comparable with the fixed loop), two random draws at each of the 4 decider
#: points (its own threshold included), the oracle at each and the ceiling: 3 + 8 + 4 + 1 + 1 passes, each
#: ~0.12 s per row on 2 AMD EPYC cores (the five shares and three draws of before cost 5 + 18 + 6 + 1 + 1 passes,
#: ~170 s more on that machine: issue 31's 20-minute budget).
FRONTIER_ROWS_PER_LEVEL = 25
FRONTIER_THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: ... placed by compute (evaluation/calibrate.py): the thresholds at which these shares of the decider's first
#: decisions on the frontier rows stop after depth 1 (a trained decider's probabilities can sit in a band a few
#: hundredths wide, where the fixed thresholds above all land at d̄ = 1 or M); replaces FRONTIER_THRESHOLDS
FRONTIER_STOP_SHARES = (0.5, 0.7, 0.9)
FRONTIER_RANDOM_DRAWS = 2

#: The main job's claims (issues 15 and 24): each is checked on the run's own test rows and reported as met or not.
TARGETS = {
    "control_learns": "the SFT control reaches >= 40% mean accuracy over the training levels",
    "looped_beats_control": "the looped model beats the SFT control on mean accuracy over all test rows, "
    "exact McNemar p < 0.05",
    "depth_follows_difficulty": "Spearman(per-example d̄, level) >= 0.3 or Spearman(per-token depth, SFT control's "
    "token loss) >= 0.3",
    "adaptive_not_worse_than_fixed": "the adaptive model (own threshold) is not worse than the fixed-depth control "
    "on all test rows (bootstrap 95% lower bound of adaptive − fixed > −3 points) at <= 0.85x its FLOPs per answer "
    "token (needs --control fixed)",
    "decider_beats_random": "the decider (own threshold) beats random allocation of the answer steps at the same d̄ "
    "on the same frontier rows: difference > 0, exact sign-flip p < 0.05",
    "gain_rises_with_continue_probability": "the realized gain of one more iteration rises with the decider's "
    "continue probability: Spearman(decile, mean gain) over the 10 deciles >= 0.8",
    "anira_depth_follows_level": "ANIRA: Spearman(per-example d̄, level) >= 0.3",
}
#: ``anira_depth_follows_level`` is checked for the methods that claim it (``HaltingMethod.paper_claims``)


def test_rows(script, splits) -> tuple[list[dict], list[int]]:
    """The report's rows (test splits only, at most ``--eval_n`` per level) and the training levels."""
    from .args import parse_levels

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
    # the accuracy-compute frontier (issue 24): every model and policy on the same frontier rows, the decider
    # against random allocation at the same d̄, its realized gain per decile, the break-even d̄, the fixed control
    out["looped_method"] = looped.get("method")
    fr = (results.get("frontier") or {}).get(task) or {}
    lf = looped.get("frontier") or {}
    out["frontier_rows"] = fr.get("rows")
    out["frontier"] = fr.get("points")
    out["decider_vs_random"] = lf.get("decider_vs_random")
    # the oracle at equal compute and the accuracy ceiling (evaluation/oracle.py): the roof over random's floor
    out["decider_vs_oracle"] = lf.get("decider_vs_oracle")
    out["accuracy_ceiling"] = lf.get("ceiling")
    out["gain_by_decile"] = lf.get("gain_by_decile")
    out["break_even_mean_depth"] = lf.get("break_even_mean_depth")
    out["fixed_control"] = fr.get("fixed_control")
    # what the frontier cost in this run (teacher-forced passes over the frontier rows, seconds), per model
    out["frontier_cost"] = {
        m: {k: tasks[m]["frontier"].get(k) for k in ("passes", "wall_s")} for m in models if tasks[m].get("frontier")
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
    fc = summary.get("fixed_control")
    out["adaptive_not_worse_than_fixed"] = (
        {
            "difference": fc["difference"],
            "lower_bound": fc["lower_bound"],
            "mcnemar_p": fc["mcnemar_p"],
            "flops_ratio": fc["flops_ratio"],
            "frontier_points_meeting": fc.get("frontier_points_meeting", []),
            "met": bool(fc["meets"]),
        }
        if fc
        else {"met": False, "reason": "no fixed-depth control in this run (--control sft,fixed)"}
    )
    own = (summary.get("decider_vs_random") or {}).get("own")
    out["decider_beats_random"] = (
        {
            "difference": own["difference"],
            "sign_flip_p": own["sign_flip_p"],
            "mean_depth": own["decider_mean_depth"],
            "random_mean_depth": own["random_mean_depth"],
            "draws": own["draws"],
            "met": bool(own["difference"] > 0 and own["sign_flip_p"] < 0.05),
        }
        if own
        else {"met": False, "reason": "no decider-vs-random test (no frontier, or no random draws)"}
    )
    g = summary.get("gain_by_decile")
    rho = g.get("spearman") if g else None
    out["gain_rises_with_continue_probability"] = (
        {"spearman": rho, "n_decisions": g["n_decisions"], "met": rho is not None and rho == rho and rho >= 0.8}
        if g
        else {"met": False, "reason": "no gain table (no frontier)"}
    )
    method = summary.get("looped_method")
    if method is not None and "depth_follows_level" in registry.method_class(method).paper_claims:
        out["anira_depth_follows_level"] = {
            "spearman_example_depth_vs_level": r1v,
            "met": r1v is not None and r1v == r1v and r1v >= 0.3,
        }
    for k, v in out.items():
        v["claim"] = TARGETS[k]
    return out


@dataclass
class ReportInputs:
    """What ``main_job_report`` takes: the run's models, rows and records, as ``run_recipe`` built them."""

    #: the trained looped model and its tokenizer
    looped: Any
    tokenizer: Any
    #: the untouched pretrained base
    pristine: Any
    #: the trained control arms: name -> ``recipe.controls.TrainedControl``
    controls: dict
    #: the run's output folder
    out: Path
    #: the parsed ``ScriptArgs`` (``task``, ``eval_levels``, ``eval_n``, ``n_eval``)
    script: Any
    #: the run's ``task_splits``: the rows training held out are its test splits
    splits: dict
    #: max |looped(depth=1) - base| at init, or None when not checked
    identity_err: float | None
    #: ``time.time()`` at the start of the run
    t_start: float
    #: seconds per phase so far; the report adds its own
    timings: dict
    #: the ``--calibrate_stop_share`` result, if any
    calibration: dict | None = None
    #: the base's checkpoint spec (``--model``) and load dtype: the reproducing command's ``base`` and ``--dtype``
    base: str | None = None
    dtype: str | None = None


def reproduce_command(inputs: ReportInputs, options, train_levels: list[int], rows_file: Path) -> list[str]:
    """The ``retrofit eval`` command that scores the saved models on the report's rows with the report's options:
    it gives the report's numbers again (tests/recipe/test_main_job.py checks it does)."""
    from ..evaluation.cli import option_flags

    out = inputs.out
    model = out / ("final-merged" if (out / "final-merged").is_dir() else "final")
    cmd = ["retrofit", "eval", "--model", str(model), "--name", "looped", "--task", inputs.script.task]
    cmd += ["--rows", str(rows_file), "--train-levels", ",".join(str(lv) for lv in train_levels)]
    compare = [f"{c.path}={name}" for name, c in inputs.controls.items()]
    if inputs.base is not None:
        compare.append(f"{inputs.base}=base")
    if compare:
        cmd += ["--compare", *compare]
    cmd += option_flags(options)
    if inputs.dtype not in (None, "float32"):
        cmd += ["--dtype", inputs.dtype]
    return [*cmd, "--out", str(out / "reproduce")]


def main_job_report(inputs: ReportInputs) -> dict:
    """Evaluate, export and summarize (see the module docstring). Returns the summary dict."""
    from ..evaluation import evaluate
    from ..evaluation.options import EvalOptions
    from ..hub.atomic_io import write_json_atomic
    from ..hub.export import export_model

    looped, tokenizer, controls, out, script = (
        inputs.looped,
        inputs.tokenizer,
        inputs.controls,
        inputs.out,
        inputs.script,
    )
    identity_err, timings = inputs.identity_err, inputs.timings

    rows, train_levels = test_rows(script, inputs.splits)
    looped.eval()
    compare = [(name, c.model, tokenizer) for name, c in controls.items()]
    compare.append(("base", inputs.pristine, tokenizer))
    names = ["looped", *[c[0] for c in compare]]
    opts = EvalOptions(
        accuracy="teacher_forced_argmax",
        forced_depths=True,  # the looped model with every token at depth 1..M: where its accuracy comes from
        exit_policies=False,
        policy_generation=False,
        difficulty_reference="sft" if "sft" in controls else None,
        html_samples=2,
        frontier=True,  # issue 24: every model and policy on one accuracy-vs-FLOPs plane (FRONTIER_* above)
        frontier_thresholds=FRONTIER_THRESHOLDS,
        frontier_stop_shares=FRONTIER_STOP_SHARES,
        frontier_random_draws=FRONTIER_RANDOM_DRAWS,
        frontier_rows_per_level=FRONTIER_ROWS_PER_LEVEL,
    )
    from ..evaluation.cli import write_rows

    rows_file = out / "report" / "test_rows.jsonl"
    write_rows(rows_file, rows)
    reproduce = reproduce_command(inputs, opts, train_levels, rows_file)
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
    # feeds the model card; atomic, strict JSON
    write_json_atomic(out / "final" / "retrofit_eval.json", results, strict=True)
    t_exp = time.time()
    export_model(looped, out / "export", tokenizer=tokenizer, overwrite=True)
    timings["export_s"] = round(time.time() - t_exp, 1)

    summary: dict[str, Any] = {
        "wall_time_s": round(time.time() - inputs.t_start, 1),
        "timings_s": timings,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "identity_at_init_max_abs_diff": identity_err,
        "task": script.task,
        "train_levels": train_levels,
        "models": names,
        "loop": looped.loop.to_dict(),
        "calibration": inputs.calibration,
        # the command that scores the saved models on the same rows with the same options (numbers equal)
        "reproduce": shlex.join(reproduce),
        **summarize(results, script.task, train_levels, names),
    }
    summary["targets"] = check_targets(summary)
    summary["outputs"] = {
        "checkpoint": str(out / "final"),
        "export": str(out / "export"),
        "report": str(out / "report"),
        **{f"control_{k}": str(c.path) for k, c in controls.items()},
    }
    write_json_atomic(out / "summary.json", summary, strict=True)
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
    cal = summary.get("calibration")
    if cal:
        lines.append(
            f"  threshold calibrated on {cal['n_rows']} training rows: {cal['field']} = {cal['threshold']:.4f} "
            f"(trained {cal['previous_threshold']:.4g}), {100 * cal['realized_stop_share']:.1f}% of "
            f"{cal['n_decisions']} answer steps stop after depth 1 (asked {100 * cal['stop_share']:.0f}%)"
        )
    lines += _frontier_lines(summary)
    print("\n".join(lines))


def _frontier_lines(summary: dict) -> list[str]:
    """The frontier table, the decider-vs-random tests, the gain-per-decile table, the break-even d̄."""
    points = summary.get("frontier") or []
    if not points:
        return []

    def num(v, fmt):
        return "–" if v is None or v != v else format(v, fmt)

    def pct(v):
        return num(None if v is None else 100 * v, ".1f")

    lines = [
        f"  accuracy-compute frontier ({summary.get('frontier_rows')} rows):",
        f"    {'model':<8} {'policy':<14} {'thr':>6} {'stop':>5} {'d̄':>5} {'MFLOPs/tok':>10}  accuracy [95% CI]",
    ]
    for p in points:
        lo, hi = p.get("accuracy_ci") or [None, None]
        policy = p["policy"] + (" (own)" if p.get("own") else "") + (f" d={p['depth']}" if "depth" in p else "")
        thr, d_bar, mflops = num(p.get("threshold"), ".4f"), num(p.get("mean_depth"), ".2f"), p["flops_per_token"] / 1e6
        stop = num(p.get("stop_share"), ".2f")
        lines.append(
            f"    {p['model']:<8} {policy:<14} {thr:>6} {stop:>5} {d_bar:>5} {mflops:>10.1f}  {pct(p['accuracy']):>5}% "
            f"[{pct(lo)}–{pct(hi)}]"
        )
    for k, t in (summary.get("decider_vs_random") or {}).items():
        lo, hi = t["bootstrap"]["ci"]
        lines.append(
            f"  decider vs random at the same d̄, threshold {k}: d̄ {t['decider_mean_depth']:.3f} vs "
            f"{num(t['random_mean_depth'], '.3f')} (rate {t['random_rate']:.3f}, {t['draws']} draws), "
            f"{100 * t['difference']:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}], "
            f"sign-flip p={t['sign_flip_p']:.3g}, McNemar per draw "
            + ", ".join(f"{d['mcnemar_p']:.3g}" for d in t["per_draw"])
        )
    for k, t in (summary.get("decider_vs_oracle") or {}).items():
        gap, cmp = t.get("gap_closed"), t["decider_vs_oracle"]
        lines.append(
            f"  decider vs the oracle at equal compute, threshold {k} ({t['n_continues']} continues): decider "
            f"{100 * t['accuracy_decider']:.1f}%, random {pct(t.get('accuracy_random'))}%, oracle "
            f"{100 * t['accuracy_oracle']:.1f}%, gap closed {num(gap, '.2f')}, McNemar p={cmp['mcnemar_p']:.3g}"
        )
    ceil = summary.get("accuracy_ceiling")
    if ceil:
        lines.append(
            f"  accuracy ceiling (each answer step at its first right depth, d̄ {num(ceil.get('mean_depth'), '.2f')}): "
            f"{pct(ceil['accuracy'])}% measured, bounds {pct(ceil['exact_match_bound'])}% exact match, "
            f"{pct(ceil['token_accuracy_bound'])}% of answer tokens (forced frame)"
        )
    g = summary.get("gain_by_decile")
    if g and g.get("bins"):
        lines.append(
            f"  realized gain per decile of the continue probability ({g['n_decisions']} decisions, "
            f"Spearman {num(g.get('spearman'), '.3f')}):"
        )
        for b in g["bins"]:
            lines.append(
                f"    decile {b['bin']:>2}: n {b['n']:>5}, mean p {b['prob_mean']:.3f}, mean gain {b['gain_mean']:+.4f}"
            )
    be = summary.get("break_even_mean_depth")
    if be:
        x = be.get("mean_depth")
        lines.append(
            f"  break-even d̄ (FLOPs of the fixed depth-{be['max_depth']} loop): "
            + (f"{x:.3f}" if x is not None else f"none ({be.get('reason')})")
        )
    fc = summary.get("fixed_control")
    if fc:
        lines.append(
            f"  adaptive vs fixed control: {100 * fc['difference']:+.1f} points [{100 * fc['ci'][0]:+.1f}, "
            f"{100 * fc['ci'][1]:+.1f}], McNemar p={fc['mcnemar_p']:.3g}, FLOPs ratio {fc['flops_ratio']:.3f}"
        )
    return lines
