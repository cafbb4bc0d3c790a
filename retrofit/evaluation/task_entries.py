"""The entries of one task's result, from the passes :mod:`.task_eval` ran: the per-level table, the training
vs held-out split, the overall figures, the ``samples.html`` samples, the LANO / BREVO structure analysis, and
the paired comparisons by split (also used across models by :mod:`.runner`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import analysis as A
from .metrics import accuracy_by_level, cost_exec, flops_ratio
from .models import flops_per_token
from .options import EvalOptions
from .policies import cat, mean, seq_acc
from .rows import split_of
from .stats import paired_comparison, spearman, wilson_interval

__all__ = [
    "ci",
    "gen_depths",
    "html_samples",
    "level_table",
    "overall_entry",
    "paired_by_split",
    "split_table",
    "structure_analysis",
]


def gen_depths(steps) -> np.ndarray:
    """The decoding steps' depths of every row, concatenated."""
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in steps]) if steps else np.zeros(0, np.int64)


def ci(c: np.ndarray, confidence: float) -> list[float]:
    """The Wilson interval of the accuracy of the outcomes ``c``."""
    return list(wilson_interval(int(c.sum()), int(c.size), confidence))


def level_table(model, info, examples, tf, correct, steps, train, confidence: float) -> dict[Any, dict[str, Any]]:
    """Per level: accuracy (and its interval), split, token and sequence accuracy; for a looped model the depth,
    its cost and the compute per token."""
    D = info.max_depth
    levels_sorted = sorted({e.level for e in examples})
    by_level = accuracy_by_level([{"level": e.level, "correct": bool(c)} for e, c in zip(examples, correct)])
    level_entries: dict[Any, dict[str, Any]] = {}
    for lvl in levels_sorted:
        idx = [i for i, e in enumerate(examples) if e.level == lvl]
        exs = [examples[i] for i in idx]
        tfs = [tf[i] for i in idx]
        entry = {
            "n": by_level[lvl]["n"],
            "accuracy": by_level[lvl]["accuracy"],
            "accuracy_se": by_level[lvl]["accuracy_se"],
            "accuracy_ci": ci(correct[idx], confidence),
            "split": split_of(lvl, train),
            "token_accuracy": mean(cat(tfs, "correct", exs)),
            "sequence_accuracy_tf": seq_acc([t["correct"][e.content] for t, e in zip(tfs, exs)]),
        }
        if info.looped:
            depths = cat(tfs, "tok_depth", exs)
            c = cost_exec(depths, max_depth=D)
            per_ex = [float(t["tok_depth"][e.content].mean()) for t, e in zip(tfs, exs)]
            entry.update(
                mean_depth=c["mean_depth"],
                mean_depth_se=float(np.std(per_ex, ddof=1) / math.sqrt(len(per_ex)))
                if len(per_ex) > 1
                else float("nan"),
                cost_exec=c["cost_exec"],
                saving=c["saving"],
                depth_histogram=c["depth_histogram"],
                expected_depth=mean(cat(tfs, "tok_exp_depth", exs)),
                gen_mean_depth=mean(gen_depths([steps[i] for i in idx])),
                layers_per_token=info.layers(c["mean_depth"]),
                flops_per_token=flops_per_token(model, info, depths),
            )
        else:
            entry.update(layers_per_token=float(info.n_layers), flops_per_token=flops_per_token(model, info, []))
        level_entries[lvl] = entry
    return level_entries


def split_table(examples, correct, is_train, train, confidence: float) -> dict[str, Any]:
    """Training vs held-out levels, pooled."""
    levels_sorted = sorted({e.level for e in examples})
    return {
        name: {
            "levels": [lv for lv in levels_sorted if (split_of(lv, train) == "train") == want],
            "n": int(mask.sum()),
            "accuracy": float(correct[mask].mean()),
            "accuracy_ci": ci(correct[mask], confidence),
        }
        for name, want, mask in (("train", True, is_train), ("held_out", False, ~is_train))
        if mask.any()
    }


def overall_entry(model, info, examples, tf, correct, steps, confidence: float) -> dict[str, Any]:
    """All rows: accuracy, token accuracy, compute; for a looped model the depth and whether it follows the
    level (Spearman of each example's mean answer depth with its level)."""
    D = info.max_depth
    overall: dict[str, Any] = {
        "n": len(examples),
        "accuracy": float(correct.mean()),
        "accuracy_ci": ci(correct, confidence),
        "token_accuracy": mean(cat(tf, "correct", examples)),
        "layers_base": float(info.n_layers),
    }
    if info.looped:
        depths = cat(tf, "tok_depth", examples)
        c = cost_exec(depths, max_depth=D)
        gd = mean(gen_depths(steps))
        overall.update(
            mean_depth=c["mean_depth"],
            saving=c["saving"],
            cost_exec=c["cost_exec"],
            expected_depth=mean(cat(tf, "tok_exp_depth", examples)),
            gen_mean_depth=gd,
            flops=flops_ratio(c["mean_depth"], D, info.n_layers, info.prelude, info.core, info.coda),
            gen_layers_per_token=info.layers(gd) if math.isfinite(gd) else float("nan"),
            gen_flops_per_token=flops_per_token(model, info, gen_depths(steps)),
            layers_per_token=info.layers(c["mean_depth"]),
            flops_per_token=flops_per_token(model, info, depths),
        )
    else:
        overall.update(
            gen_layers_per_token=float(info.n_layers),
            gen_flops_per_token=flops_per_token(model, info, []),
            layers_per_token=float(info.n_layers),
            flops_per_token=flops_per_token(model, info, []),
        )
    if info.looped and len({e.level for e in examples}) > 1:
        # does depth follow difficulty? rank correlation of each example's mean answer depth
        # (teacher-forced exit depths) with its difficulty level
        ex_depth = [float(t["tok_depth"][e.content].mean()) for t, e in zip(tf, examples)]
        overall["depth_difficulty_spearman"] = spearman([e.level for e in examples], ex_depth)
    return overall


def _token_texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(t)]) for t in ids]


def html_samples(name, task, tokenizer, examples, gens, correct, steps, max_depth: int, per_level: int) -> list[dict]:
    """The first ``per_level`` rows of each level for ``samples.html``: tokens and the depth of each step."""
    samples = []
    for lvl in sorted({e.level for e in examples}):
        idx = [i for i, e in enumerate(examples) if e.level == lvl][:per_level]
        for i in idx:
            e = examples[i]
            if gens is not None:
                shown, what = gens[i]["ids"], f"generated {gens[i]['text'].strip()!r}"
            else:
                shown, what = e.answer_ids, "teacher-forced gold, greedy output == gold + stop:"
            samples.append(
                {
                    "title": (
                        f"{name} · {task.name} {task.knob}={lvl} · gold {e.row['answer']!r} · "
                        f"{what} {'correct' if correct[i] else 'wrong'}"
                    ),
                    "tokens": _token_texts(tokenizer, e.prompt_ids) + _token_texts(tokenizer, shown),
                    "depths": [0] * len(e.prompt_ids) + [int(x) for x in steps[i][: len(shown)]],
                    "max_depth": max_depth,
                }
            )
    return samples


def structure_analysis(task, examples, tf, result, notes) -> None:
    """LANO Spearman / BREVO regression of per-word depth on the task's per-word features."""
    if not examples:
        notes.append(f"{task.name}: no row has a valid word to analyse; correlation analysis skipped")
        return
    key = "tok_exp_depth" if task.name == "lano" else "tok_depth"
    word_depths = [A.word_values(t[key], e.first_tok) for t, e in zip(tf, examples)]
    feats = [e.features for e in examples]
    if any(f is None for f in feats):
        notes.append(f"{task.name}: rows without token_features; correlation analysis skipped")
        return
    if task.name == "lano":
        # ANIRA Table 1 correlates the per-token EXPECTED depth with the parser proxies; chart_edges
        # (the parser's edge count) is shown next to them
        proxies = A.LANO_PROXIES + tuple(k for k in ("chart_edges",) if all(k in f for fs in feats for f in fs))
        result["spearman"] = A.lano_spearman(word_depths, feats, proxies)
    else:
        regs = {}
        for label, k in (("exit_depth", "tok_depth"), ("expected_depth", "tok_exp_depth")):
            wd = [A.word_values(t[k], e.first_tok) for t, e in zip(tf, examples)]
            try:
                regs[label] = A.brevo_regression(wd, feats, [e.level for e in examples])
            except ValueError as err:
                notes.append(f"brevo regression on {label} skipped: {err}")
        if regs:
            result["regression"] = regs
    n_unaligned = sum(int((e.first_tok < 0).sum()) for e in examples)
    if n_unaligned:
        notes.append(f"{n_unaligned} answer words share a token with the previous word and were dropped")


def paired_by_split(a, b, row_level, levels, is_train, opts: EvalOptions) -> dict[str, Any]:
    """``paired_comparison(a, b)`` per level, over the training and held-out levels (when both exist) and over
    all rows; ``row_level[i]`` is row ``i``'s level and ``is_train[i]`` whether it is a training level."""
    row_level = np.asarray(row_level, dtype=object)

    def cmp(mask):
        return paired_comparison(
            a[mask], b[mask], n_boot=opts.bootstrap_samples, seed=opts.stats_seed, confidence=opts.confidence
        )

    out: dict[str, Any] = {"levels": {lvl: cmp(row_level == lvl) for lvl in levels}}
    if is_train.any() and (~is_train).any():
        out["train"], out["held_out"] = cmp(is_train), cmp(~is_train)
    out["all"] = cmp(np.ones(len(row_level), dtype=bool))
    return out
