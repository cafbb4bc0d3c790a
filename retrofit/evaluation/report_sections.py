"""The sections of the Markdown report (``retrofit.evaluation.report.write_markdown_report`` assembles them):
accuracy and depth per level, scaling, exit policies, correlations, loss change, comparisons, token difficulty,
the frontier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .report_format import (  # noqa: F401
    _fmt,
    _get,
    _int,
    _interval,
    _lookup,
    _md,
    _mflops,
    _models,
    _num,
    _pct,
    _pval,
    _section,
    _sort_keys,
    _table,
    _task,
    _tasks,
)


def _levels_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    per_model = {name: _section(_task(m, task), "levels") for name, m in models.items()}
    per_model = {k: v for k, v in per_model.items() if v}
    if not per_model:
        return []
    levels = _sort_keys([lvl for lv in per_model.values() for lvl in lv])

    def has(name: str, key: str) -> bool:
        return any(_num(_get(_lookup(per_model[name], lvl), key)) is not None for lvl in levels)

    has_split = any(_get(_lookup(lv, lvl), "split") for lv in per_model.values() for lvl in levels)
    # (header, model, key, formatter): accuracies of all models side by side, then depth columns.
    cols: list[tuple[str, str, str, Any]] = [(f"acc ({name})", name, "accuracy", _pct) for name in per_model]
    for name in per_model:
        if has(name, "mean_depth"):
            cols.append((f"d̄ ({name})", name, "mean_depth", _fmt))
        if has(name, "saving"):
            cols.append((f"d̄/D ({name})", name, "saving", _fmt))
        if has(name, "cost_exec"):
            cols.append((f"Cost_exec ({name})", name, "cost_exec", _int))
    # compute per answer token, comparable across looped and plain models
    for name in per_model:
        if has(name, "layers_per_token"):
            cols.append((f"layers/token ({name})", name, "layers_per_token", _fmt))
        if has(name, "flops_per_token"):
            cols.append((f"MFLOPs/token ({name})", name, "flops_per_token", _mflops))
    header = ["level"] + (["split"] if has_split else []) + ["n"] + [c[0] for c in cols]
    n_text = 2 if has_split else 1
    rows = []
    for lvl in levels:
        entries = {name: _lookup(lv, lvl) for name, lv in per_model.items()}
        row = [str(lvl)]
        if has_split:
            row.append(str(next((e["split"] for e in entries.values() if _get(e, "split")), "")))
        n = next((_get(e, "n") for e in entries.values() if _num(_get(e, "n")) is not None), None)
        row.append(_int(n))
        for _, name, key, fmt in cols:
            cell = fmt(_get(entries[name], key))
            if key == "accuracy" and cell != "–":
                cell += _interval(_get(entries[name], "accuracy_ci"), _get(entries[name], "accuracy_se"))
            row.append(cell)
        rows.append(row)
    return ["### Accuracy and depth by difficulty level", ""] + _table(header, rows, n_text)


def _scaling_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    per_model = {n: _section(_task(m, task), "forced_depth_accuracy") for n, m in models.items()}
    per_model = {k: v for k, v in per_model.items() if v}
    if not per_model:
        return []
    depths = _sort_keys([d for v in per_model.values() for d in v])
    rows = [[str(d)] + [_pct(_lookup(v, d)) for v in per_model.values()] for d in depths]
    return ["### Test-time scaling (forced depth)", ""] + _table(
        ["forced depth"] + [f"acc ({n})" for n in per_model], rows
    )


def _policies_table(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        for policy, p in _section(_task(m, task), "exit_policies").items():
            p = p if isinstance(p, Mapping) else {"accuracy": p}
            rows.append(
                [
                    name,
                    str(policy),
                    _pct(p.get("accuracy")),
                    _fmt(p.get("mean_depth")),
                    _fmt(p.get("saving")),
                ]
            )
    if not rows:
        return []
    return ["### Exit policies", ""] + _table(["model", "policy", "accuracy", "d̄", "d̄/D"], rows, n_text=2)


def _regressions(reg: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    if "coefficients" in reg:
        return {"": reg}
    return {str(k): v for k, v in reg.items() if isinstance(v, Mapping) and "coefficients" in v}


def _correlation_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    rows = []
    for name, m in models.items():
        for proxy, v in _section(_task(m, task), "spearman").items():
            rho = _get(v, "rho") if isinstance(v, Mapping) else v
            n = _get(v, "n") if isinstance(v, Mapping) else None
            rows.append([name, str(proxy), _fmt(rho, 3), _int(n)])
    if rows:
        out += ["**Spearman correlation of per-token depth with difficulty proxies**", ""]
        out += _table(["model", "proxy", "ρ", "n"], rows, n_text=2)
    reg_rows = []
    fit_rows = []
    for name, m in models.items():
        for reg_name, reg in _regressions(_section(_task(m, task), "regression")).items():
            label = f"{name} {reg_name}".strip()
            coefs = reg.get("coefficients") or {}
            for feat, b in coefs.items():
                reg_rows.append([label, str(feat), _fmt(b, 3)])
            fit_rows.append([label, _fmt(reg.get("r2"), 3), _fmt(reg.get("r2_controls"), 3), _int(reg.get("n"))])
    if reg_rows or fit_rows:
        out += ["**Linear regression of per-token depth on features**", ""]
        out += _table(["model", "feature", "coefficient"], reg_rows, n_text=2) if reg_rows else []
        out += _table(["model", "R²", "R² (controls only)", "n"], fit_rows)
    return (["### Depth–difficulty correlation and regression", ""] + out) if out else []


def _loss_change_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        s = _section(_task(m, task), "loss_change")
        if s:
            tol = _num(s.get("tol"))
            rows.append(
                [
                    name,
                    "–" if tol is None else f"{tol:g}",
                    _pct(s.get("share_unchanged")),
                    _pct(s.get("share_worse")),
                    _pct(s.get("share_improved")),
                    _fmt(s.get("mean_delta"), 4),
                    _int(s.get("n")),
                ]
            )
    if not rows:
        return []
    return ["### First-vs-last depth loss change", ""] + _table(
        ["model", "tol", "unchanged", "worse", "improved", "mean Δ", "tokens"], rows
    )


def _comparison_rows(label: str, c: Mapping[str, Any]) -> list[str]:
    boot = c.get("bootstrap") if isinstance(c.get("bootstrap"), Mapping) else {}
    ci = boot.get("ci") or [None, None]
    diff = _num(c.get("difference"))
    return [
        label,
        _int(c.get("n")),
        _pct(c.get("accuracy_a")),
        _pct(c.get("accuracy_b")),
        "–" if diff is None else f"{100 * diff:+.1f}",
        _int(c.get("a_only")),
        _int(c.get("b_only")),
        _pval(c.get("mcnemar_p")),
        "–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]",
        _pval(boot.get("p_value")),
    ]


def _comparisons_section(task: str, results: Mapping[str, Any]) -> list[str]:
    comps = _get(_get(results, "comparisons"), task)
    if not isinstance(comps, Mapping) or not comps:
        return []
    out = ["### Paired comparisons (same rows)", ""]
    for other, comp in comps.items():
        a, b = comp.get("a", "a"), comp.get("b", other)
        rows = [_comparison_rows(str(lvl), c) for lvl, c in _sort_keys_items(_section(comp, "levels"))]
        for key, label in (("train", "training levels"), ("held_out", "held-out levels"), ("all", "all rows")):
            if isinstance(comp.get(key), Mapping):
                rows.append(_comparison_rows(f"**{label}**", comp[key]))
        out += [f"**{a} vs {b}** (difference = {a} − {b}, percentage points)", ""]
        out += _table(
            [
                "level",
                "n",
                f"acc ({a})",
                f"acc ({b})",
                "difference",
                f"only {a} right",
                f"only {b} right",
                "McNemar p",
                "bootstrap 95% CI",
                "bootstrap p",
            ],
            rows,
        )
    return out


def _sort_keys_items(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return [(k, _lookup(mapping, k)) for k in _sort_keys(list(mapping))]


def _token_difficulty_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    rows = []
    for name, m in models.items():
        s = _section(_task(m, task), "token_difficulty")
        if not s:
            continue
        easy, hard = s.get("easy") or {}, s.get("hard") or {}
        share = " / ".join(_pct(x, 0) for x in (hard.get("depth_share") or []))
        rows.append(
            [
                name,
                str(s.get("reference", "")),
                _int(s.get("n_tokens")),
                _fmt(s.get("spearman"), 3),
                _fmt(s.get("median_loss"), 3),
                _fmt(easy.get("mean_depth")),
                _fmt(hard.get("mean_depth")),
                share,
            ]
        )
    if not rows:
        return []
    return [
        "### Per-token depth vs difficulty",
        "",
        "Difficulty of an answer token = the reference model's teacher-forced loss on it; depth = the looped "
        "model's exit depth at the position that predicts it. Easy: loss at or below the median; hard: above.",
        "",
    ] + _table(
        ["model", "reference", "tokens", "Spearman ρ", "median loss", "d̄ easy", "d̄ hard", "hard tokens per depth"],
        rows,
        n_text=2,
    )


def _length_section(task: str, models: dict[str, Mapping[str, Any]]) -> list[str]:
    """Accuracy at each output-length cutoff against decode FLOPs per row, and the slope per doubling."""
    rows = []
    for name, m in models.items():
        lc = _get(_task(m, task), "length_cutoffs")
        if not isinstance(lc, Mapping):
            continue
        for p in lc.get("points", []):
            rows.append(
                [
                    str(name),
                    _int(p.get("cutoff")),
                    _pct(p.get("accuracy")) + _interval(p.get("accuracy_ci"), None),
                    _fmt(p.get("mean_tokens"), 1),
                    _fmt(p.get("mean_depth")),
                    _mflops(p.get("decode_flops_per_row")),
                    _pct(p.get("stopped")),
                ]
            )
        slope = lc.get("slope_per_doubling")
        per_doubling = "–" if slope is None else f"{100 * slope:+.1f} points per doubling"
        rows.append([str(name), "slope", per_doubling, "", "", "", ""])
    if not rows:
        return []
    header = ["model", "cutoff (tokens)", "accuracy", "tokens run", "d̄", "decode MFLOPs / row", "stopped"]
    return ["### Accuracy by output length (one greedy generation, cut)", ""] + _table(header, rows, 2)


def _frontier_section(task: str, results: Mapping[str, Any]) -> list[str]:
    """The accuracy–compute frontier: every point, decider vs random and vs the oracle, the ceiling, gain per decile,
    break-even, fixed control."""
    fr = _get(_get(results, "frontier"), task)
    if not isinstance(fr, Mapping) or not fr.get("points"):
        return []
    out = [
        "### Accuracy–compute frontier",
        "",
        f"Frontier rows: {fr.get('rows')} (at most {fr.get('rows_per_level') or 'every'} per level). d̄ and FLOPs "
        "per answer token over the answer steps (the positions producing the answer tokens and the stop token).",
        "",
    ]
    rows = []
    for p in fr["points"]:
        thr = p.get("threshold")
        rows.append(
            [
                str(p.get("model")),
                str(p.get("policy")) + (" (own)" if p.get("own") else ""),
                "–" if thr is None else f"{thr:g}",
                str(p.get("depth", "")) if p.get("policy") == "forced" else "",
                _fmt(p.get("mean_depth")),
                _mflops(p.get("flops_per_token")),
                _pct(p.get("accuracy")) + _interval(p.get("accuracy_ci"), None),
                _int(p.get("n")),
            ]
        )
    out += _table(["model", "policy", "threshold", "depth", "d̄", "MFLOPs/token", "accuracy", "n"], rows, n_text=2)
    for name, m in _models(results).items():
        f = _section(_task(m, task), "frontier")
        vs = f.get("decider_vs_random") if f else None
        if vs:
            rows = []
            for key, t in vs.items():
                boot = t.get("bootstrap") or {}
                ci = boot.get("ci") or [None, None]
                diff = _num(t.get("difference"))
                rows.append(
                    [
                        str(key),
                        _fmt(t.get("decider_mean_depth")),
                        _fmt(t.get("random_mean_depth")),
                        _fmt(t.get("random_rate"), 3),
                        _pct(t.get("accuracy_a")),
                        _pct(t.get("accuracy_b")),
                        "–" if diff is None else f"{100 * diff:+.1f}",
                        "–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]",
                        _pval(t.get("sign_flip_p")),
                        ", ".join(_pval(d.get("mcnemar_p")) for d in t.get("per_draw") or []),
                    ]
                )
            out += [f"**{name}: decider vs random allocation at the same d̄** (same rows; difference in points)", ""]
            out += _table(
                [
                    "threshold",
                    "d̄ decider",
                    "d̄ random",
                    "continue rate",
                    "acc decider",
                    "acc random (mean of draws)",
                    "difference",
                    "bootstrap 95% CI",
                    "sign-flip p",
                    "McNemar p per draw",
                ],
                rows,
            )
        vo = f.get("decider_vs_oracle") if f else None
        if vo:
            rows = []
            for key, t in vo.items():
                cmp = t.get("decider_vs_oracle") or {}
                diff = _num(cmp.get("difference"))
                rows.append(
                    [
                        str(key),
                        _int(t.get("n_continues")),
                        _fmt(t.get("decider_mean_depth")),
                        _pct(t.get("accuracy_decider")),
                        _pct(t.get("accuracy_random")),
                        _pct(t.get("accuracy_oracle")),
                        _fmt(t.get("gap_closed")),
                        "–" if diff is None else f"{100 * diff:+.1f}",
                        _pval(cmp.get("mcnemar_p")),
                    ]
                )
            out += [
                f"**{name}: the oracle at equal compute** (the same continues on the answer steps whose next "
                "iteration lowers the gold token's loss most; gap closed = (decider − random) / (oracle − random))",
                "",
            ]
            out += _table(
                [
                    "threshold",
                    "continues",
                    "d̄",
                    "acc decider",
                    "acc random",
                    "acc oracle",
                    "gap closed",
                    "decider − oracle",
                    "McNemar p",
                ],
                rows,
            )
        ce = f.get("ceiling") if f else None
        if ce:
            out += [
                f"**{name}: accuracy ceiling** (each answer step at its first right depth, "
                f"d̄ {_fmt(ce.get('mean_depth'))}): "
                f"{_pct(ce.get('accuracy'))} measured; bounds in the forced frame {_pct(ce.get('exact_match_bound'))} "
                f"exact match, {_pct(ce.get('token_accuracy_bound'))} of answer tokens.",
                "",
            ]
        g = f.get("gain_by_decile") if f else None
        if g and g.get("bins"):
            rows = [
                [
                    str(b["bin"]),
                    _int(b["n"]),
                    _fmt(b["prob_mean"], 3),
                    _fmt(b["gain_mean"], 4),
                    _pct(b["share_gain_positive"], 0),
                ]
                for b in g["bins"]
            ]
            out += [
                f"**{name}: realized gain ℓ(d) − ℓ(d+1) per decile of the continue probability** "
                f"({g['n_decisions']} decisions; Spearman over the deciles {_fmt(g.get('spearman'), 3)})",
                "",
            ]
            out += _table(["decile", "decisions", "mean continue prob", "mean gain (nats)", "gain > 0"], rows)
        be = f.get("break_even_mean_depth") if f else None
        if be:
            x = _num(be.get("mean_depth"))
            out += [
                f"**{name}: break-even d̄** (FLOPs per token equal to the loop at fixed depth {be.get('max_depth')} "
                f"without decider or per-depth readout): "
                + (_fmt(x, 3) if x is not None else f"none — {be.get('reason')}"),
                "",
            ]
    fc = fr.get("fixed_control")
    if isinstance(fc, Mapping):
        ci = fc.get("ci") or [None, None]
        out += [
            f"**{fc.get('adaptive')} vs the fixed-depth control {fc.get('fixed')} (depth {fc.get('fixed_depth')})**, "
            f"all {fc.get('n')} rows: {_pct(fc.get('accuracy_adaptive'))} vs {_pct(fc.get('accuracy_fixed'))}, "
            f"difference {100 * (_num(fc.get('difference')) or 0):+.1f} points, bootstrap 95% CI "
            + ("–" if _num(ci[0]) is None else f"[{100 * _num(ci[0]):+.1f}, {100 * _num(ci[1]):+.1f}]")
            + f", McNemar p {_pval(fc.get('mcnemar_p'))}, FLOPs per answer token ratio {_fmt(fc.get('flops_ratio'), 3)}"
            f" — target (lower bound > −{100 * fc.get('margin', 0):.0f} points at ≤ {fc.get('max_flops_ratio')}× "
            f"FLOPs) {'met' if fc.get('meets') else 'not met'}.",
            "",
        ]
    return out
