"""study.md and study.png from a study dict (``runner.write_study``; docs/study.md)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _pct(v, digits: int = 1) -> str:
    return "–" if v is None or v != v else f"{100 * v:.{digits}f}"


def _pts(v) -> str:
    return "–" if v is None or v != v else f"{100 * v:+.1f}"


def _ci(ci, scale: float = 100) -> str:
    if not ci or ci[0] is None or ci[0] != ci[0]:
        return "–"
    return f"[{scale * ci[0]:+.1f}, {scale * ci[1]:+.1f}]" if scale == 100 else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _p(v) -> str:
    return "–" if v is None or v != v else f"{v:.2g}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows), ""]


def _mean_depth(per_seed) -> str:
    ds = [p["mean_depth"] for p in per_seed if p.get("mean_depth") is not None]
    return f"{np.mean(ds):.2f}" if ds else "–"


def _at_depth_one(per_seed) -> str:
    """A looped arm's accuracy over all test rows with every token forced to depth 1, mean over seeds."""
    acc = [(p.get("forced_depth_accuracy") or {}).get("1") for p in per_seed]
    return _pct(float(np.mean(acc))) if acc and None not in acc else "–"


def _signs(v) -> str:
    return " ".join({1: "+", 0: "0", -1: "−", None: "?"}[s] for s in v)


def _tuning_seeds(t: dict[str, Any]) -> str:
    """``seed 0``, or ``seeds 0, 6 (each rate: the mean)`` for a study tuned with several seeds."""
    if "seeds" in t:
        return f"seeds {', '.join(map(str, t['seeds']))} (each rate: the mean over them)"
    return f"seed {t['seed']}"


def _grid_table(t: dict[str, Any], with_loss: bool) -> list[str]:
    """The tuning grid: each arm's validation accuracy per learning rate (and its mean answer-token loss), the
    chosen rate in bold."""
    lrs = sorted({r["lr"] for a in t["arms"].values() for r in a["trials"]})
    rows = []
    for arm, a in t["arms"].items():
        by = {r["lr"]: r for r in a["trials"]}
        cells = []
        for lr in lrs:
            r = by.get(lr)
            txt = "" if r is None else f"{_pct(r['accuracy'])}%"
            if r is not None and with_loss:
                txt += f" ({r['mean_token_nll']:.3f})"
                if r.get("per_seed"):  # several tuning seeds: each one's accuracy
                    txt += " [" + " / ".join(_pct(s["accuracy"]) for s in r["per_seed"]) + "]"
            cells.append(f"**{txt}**" if r is not None and lr == a["chosen_lr"] else txt)
        rows.append([arm, *cells, f"{a['chosen_lr']:g}"])
    return _table(["arm", *[f"lr {x:g}" for x in lrs], "chosen"], rows)


def _seed_heads(te: dict[str, Any]) -> list[str]:
    """``seed 1``, ``seed 2``, … for the test seeds (every arm has the same)."""
    return [f"seed {p['seed']}" for p in next(iter(te["arms"].values()))["per_seed"]] if te["arms"] else []


def _test_table(te: dict[str, Any], readme: bool) -> list[str]:
    """Each arm's test accuracy per seed, its mean, d̄, its mean at depth 1 and FLOPs per answer token (study.md: in
    points with the rate in a column; README: in % with the rate beside the arm)."""
    pct = (lambda v: f"{_pct(v)}%" if _pct(v) != "–" else "–") if readme else _pct  # noqa: E731
    rows = []
    for arm, a in te["arms"].items():
        accs = [p["accuracy"] for p in a["per_seed"]]
        flops = np.mean([p["flops_per_token"] for p in a["per_seed"]]) / 1e6
        depth1 = _at_depth_one(a["per_seed"])
        rows.append(
            [
                *([f"{arm} ({a['lr']:g})"] if readme else [arm, f"{a['lr']:g}"]),
                *[pct(x) for x in accs],
                pct(float(np.mean(accs))),
                _mean_depth(a["per_seed"]),
                depth1 + ("%" if readme and depth1 != "–" else ""),
                f"{flops:.0f}" if readme else f"{flops:.1f}",
            ]
        )
    seeds = _seed_heads(te)
    if readme:
        head = ["arm (its rate)", *seeds, "mean", "d̄", "at depth 1"]
    else:
        head = ["arm", "lr", *seeds, "mean", "d̄ (mean)", "at depth 1 (mean)"]
    return _table([*head, "MFLOPs / answer token"], rows)


SPLITS = ("train", "held_out")


def _split_table(te: dict[str, Any]) -> list[str]:
    """Each arm's test accuracy on the training levels (mean over seeds) and on the held-out levels (per seed, and
    the mean): where the levels the training never saw decide a ranking, this shows it. Empty when the task has no
    held-out level."""
    arms = te["arms"]
    if not arms or not all(
        (p.get("splits") or {}).get(k, {}).get("n") for a in arms.values() for p in a["per_seed"] for k in SPLITS
    ):
        return []
    rows = []
    for arm, a in arms.items():
        train = [p["splits"]["train"]["accuracy"] for p in a["per_seed"]]
        held = [p["splits"]["held_out"]["accuracy"] for p in a["per_seed"]]
        rows.append([arm, f"{a['lr']:g}", _pct(float(np.mean(train))), *[_pct(x) for x in held], _pct(np.mean(held))])
    seeds = _seed_heads(te)
    return [
        "Training levels (mean over seeds) and held-out levels (per seed, and the mean), accuracy in points:",
        "",
        *_table(["arm", "lr", "training levels", *[f"held out, {s}" for s in seeds], "held out (mean)"], rows),
    ]


def study_markdown(study: dict[str, Any], timings: dict[str, Any]) -> str:
    """The tables of a study: the grid and each arm's choice, per-seed and across-seed effects with intervals and
    the claims met or not, the frontier across seeds, the environment and the times."""
    t, te = study["tuning"], study["testing"]
    out = [
        f"# Study `{study['name']}`",
        "",
        study.get("description") or "",
        "",
        f"Reproduce: `retrofit study {study['config']}` (the same command resumes). Tuning on {t['n_rows']} "
        f"validation rows with {_tuning_seeds(t)}; testing on {te['n_rows']} test rows with seeds "
        f"{', '.join(map(str, te['seeds']))}. Every figure is in study.json.",
        "",
    ]
    if study.get("reused"):
        took = ", ".join(f"{len(ids)} from `{name}`" for name, ids in study["reused"].items())
        out += [f"Trials this study reads from other study folders (its file's `reuse`; the same keys): {took}.", ""]
    for w in study.get("warnings") or []:
        out += [f"> **Warning:** {w}.", ""]
    out += ["## Claims", ""]
    out += _table(
        ["claim", "arm", "met"],
        [[c["claim"], k.split(":", 1)[1], "**yes**" if c["met"] else "no"] for k, c in study["claims"].items()],
    )
    out += ["## Tuning: the same grid for every arm", "", f"Choice: {t['rule']}.", ""]
    out += ["Validation accuracy (mean answer-token loss) per learning rate; bold: chosen.", ""]
    out += _grid_table(t, with_loss=True)
    out += ["## Testing: each arm at its chosen rate", ""]
    out += _test_table(te, readme=False)
    out += _split_table(te)

    b = study["bootstrap"]
    out += [
        "## Effects across seeds",
        "",
        f"Difference a − b in points (Spearman: ρ), mean over seeds; 95% interval from a bootstrap that resamples "
        f"seeds and rows ({b['across_seeds']}; {b['resamples']} resamples, {b['resamples_spearman']} for a "
        "Spearman); the sign of the effect in each seed.",
        "",
    ]
    rows = []
    for e in study["effects"]:
        acr = e.get("across_seeds")
        spearman = e["effect"].startswith("depth_vs")
        est = (
            "–"
            if not acr or acr["estimate"] is None or acr["estimate"] != acr["estimate"]
            else (f"{acr['estimate']:+.3f}" if spearman else _pts(acr["estimate"]))
        )
        ci = "–" if not acr else _ci(acr["ci"], 1 if spearman else 100)
        met = "" if "met" not in e else ("**yes**" if e["met"] else "no")
        rows.append(
            [
                e["effect"],
                f"{e['a']} vs {e['b']}",
                e.get("rows", ""),
                est,
                ci,
                _signs(acr["signs"]) if acr else "–",
                met,
            ]
        )
    out += _table(["effect", "arms", "rows", "mean", "95% CI (seeds × rows)", "sign per seed", "claim met"], rows)
    fam = [e for e in study["effects"] if e.get("across_seeds_family")]
    if fam:
        f = fam[0]["across_seeds_family"]
        out += [
            f"Several arms against one control: {f['comparisons']} comparisons with the SFT control. Their "
            f"intervals at the {f['rule']} level {100 * f['confidence']:.2f}% (the same resamples; the claims above "
            "keep the 95% rule docs/study.md states): "
            + "; ".join(f"{e['a']} vs {e['b']} {_ci(e['across_seeds_family']['ci'])}" for e in fam)
            + ".",
            "",
        ]
    if any(e["effect"] == "depth1_vs_sft" for e in study["effects"]):
        out += [
            "`depth1_vs_sft` and `own_vs_depth1` split a looped arm's difference from the SFT control on the frontier "
            "rows: the arm forced to depth 1 (the SFT control's FLOPs) against the control is what training through "
            "the loop did to the single pass; the arm's own inference against itself at depth 1 is what its extra "
            "passes buy.",
            "",
        ]

    out += ["## Effects per seed", "", "Paired on the same rows: exact McNemar (sign-flip for random allocation).", ""]
    rows = []
    for e in study["effects"]:
        for p in e.get("per_seed", []):
            if "spearman" in p:
                rho = "–" if p["spearman"] is None or p["spearman"] != p["spearman"] else f"{p['spearman']:+.3f}"
                rows.append([e["effect"], f"{e['a']} vs {e['b']}", str(p["seed"]), f"ρ {rho}", "", "", ""])
                continue
            if p.get("difference") is None:
                rows.append([e["effect"], f"{e['a']} vs {e['b']}", str(p["seed"]), "–", "", "", p.get("reason", "")])
                continue
            test = f"sign-flip {_p(p['sign_flip_p'])}" if "sign_flip_p" in p else f"McNemar {_p(p.get('mcnemar_p'))}"
            extra = []
            if p.get("point"):
                extra.append(f"{p['point']}, {p['flops_ratio']:.2f}× FLOPs")
            elif p.get("flops_ratio") is not None:
                extra.append(f"{p['flops_ratio']:.2f}× FLOPs")
            if "gap_closed" in p:
                extra.append(f"random {_pct(p['accuracy_random'])}%, gap closed {_p(p['gap_closed'])}")
            rows.append(
                [
                    e["effect"],
                    f"{e['a']} vs {e['b']}",
                    str(p["seed"]),
                    f"{_pct(p['accuracy_a'])} vs {_pct(p['accuracy_b'])} ({_pts(p['difference'])})",
                    test,
                    _ci(p.get("bootstrap_ci")),
                    "; ".join(extra),
                ]
            )
    out += _table(["effect", "arms", "seed", "accuracy a vs b (points)", "test p", "bootstrap 95% CI", "notes"], rows)

    out += ["## Frontier across seeds", "", "Frontier rows; mean over seeds [min–max].", ""]
    rows = []
    for arm, points in study["frontier"].items():
        for g in points:
            acc, fl, d = g["accuracy"], g["flops_per_token"], g["mean_depth"]
            rows.append(
                [
                    arm,
                    g["label"],
                    "–" if not d else f"{d['mean']:.2f}",
                    "–" if not fl else f"{fl['mean'] / 1e6:.1f}",
                    "–" if not acc else f"{_pct(acc['mean'])} [{_pct(acc['min'])}–{_pct(acc['max'])}]",
                ]
            )
    out += _table(["arm", "point", "d̄", "MFLOPs / answer token", "accuracy %"], rows)

    if study.get("second_pass"):
        out += [
            "## The second pass, per seed",
            "",
            "Is a flat frontier a blind decider or a pass that helps no token? Frontier rows: exact match with every "
            "token forced to each depth, and the ceiling (each answer step at its first right depth); over the "
            "decider's decisions at the answer steps: its continue probability, the realized gain of one more "
            "iteration (teacher-forced loss at depth d minus d + 1, nats; > 0 helps), the share of decisions it "
            "helps, and the Spearman of the deciles' probability against their mean gain.",
            "",
        ]
        rows = []
        for arm, per_seed in study["second_pass"].items():
            for r in per_seed:
                c = r["continue_prob"]
                rows.append(
                    [
                        arm,
                        str(r["seed"]),
                        " / ".join(_pct(a) for _, a in sorted(r["forced"].items(), key=lambda kv: int(kv[0]))),
                        _pct(r["ceiling_bound"]),
                        str(r["n_decisions"]),
                        f"{c['min']:.2g}–{c['max']:.2g} ({c['mean']:.2g})",
                        f"{r['gain_mean']:+.3g}",
                        _pct(r["share_gain_positive"]),
                        _p(r["decile_spearman"]),
                    ]
                )
        out += _table(
            [
                "arm",
                "seed",
                "forced depth 1 / 2 … %",
                "ceiling %",
                "decisions",
                "continue probability min–max (mean)",
                "mean gain (nats)",
                "gain > 0 %",
                "decile ρ",
            ],
            rows,
        )

    env = study["environment"]
    out += ["## Environment and time", ""]
    out += [f"- {k}: {', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in env.items()]
    tot = timings.get("total", {})
    out += [
        f"- time (timings.json; not in study.json): training {tot.get('train_s', 0) / 60:.1f} min, evaluation "
        f"{tot.get('eval_s', 0) / 60:.1f} min over {len(timings.get('trials', {}))} trials",
        "",
    ]
    return "\n".join(out)


#: the markers around the block ``write_readme_block`` writes into a README (``retrofit study --readme``): the
#: README's default study; another study may have its own pair (``readme_markers``)
README_BEGIN, README_END = "<!-- study:begin -->", "<!-- study:end -->"


def readme_markers(name: str) -> tuple[str, str]:
    """The markers around the block of the study ``name`` in a README that shows several studies."""
    return f"<!-- study:{name}:begin -->", f"<!-- study:{name}:end -->"


def readme_markdown(study: dict[str, Any], config: str, folder: str) -> str:
    """The README's tables of a study, every figure from ``study``: the grid and each arm's choice, each arm's
    test accuracy per seed, every effect across seeds (with the Bonferroni interval of the arms against the SFT
    control), its sign and figure per seed, and the claims. ``config`` and ``folder``: the study's YAML file and
    folder, relative to the README (the command to reproduce it; its study.md and plot are linked)."""
    t, te = study["tuning"], study["testing"]
    env = study["environment"]
    n_tune = len(t["seeds"]) if "seeds" in t else 1
    n_trials = n_tune * sum(len(a["trials"]) for a in t["arms"].values()) + len(te["arms"]) * len(te["seeds"])
    cpus, threads = env.get("cpus") or [], env.get("threads_per_trial")
    plural = "" if threads in (1, [1]) else "s"

    def words(v) -> str:
        return " and ".join(map(str, v)) if isinstance(v, list) else str(v)

    out = [
        f"`retrofit study {config} --out {folder}` ([{folder}/study.md]({folder}/study.md): "
        f"every figure, per seed and per frontier point; its `study.json`). {n_trials} trials: tuning on "
        f"{t['n_rows']} validation rows with {_tuning_seeds(t)}, testing on the {te['n_rows']} test rows with seeds "
        f"{', '.join(map(str, te['seeds']))}; {words(threads)} thread{plural} per trial, "
        f"torch {words(env.get('torch'))}, on {words(cpus)}.",
        "",
    ]
    for w in study.get("warnings") or []:
        out += [f"> **Warning:** {w}.", ""]
    out += ["Tuning, validation accuracy per learning rate (bold: chosen):", ""]
    out += _grid_table(t, with_loss=False)
    out += ["Testing, accuracy on the test rows per seed (each arm at its chosen rate):", ""]
    out += _test_table(te, readme=True)
    rows = []
    for e in study["effects"]:
        acr, spearman = e.get("across_seeds"), e["effect"].startswith("depth_vs")
        if not acr or acr["estimate"] is None or acr["estimate"] != acr["estimate"]:
            est = "–"
        elif spearman:
            est = f"ρ {acr['estimate']:+.3f} {_ci(acr['ci'], 1)}"
        else:
            est = f"{_pts(acr['estimate'])} {_ci(acr['ci'])}"
        fam = e.get("across_seeds_family")
        per = []
        for p in e.get("per_seed", []):
            if "spearman" in p:
                per.append("–" if p["spearman"] is None or p["spearman"] != p["spearman"] else f"{p['spearman']:+.2f}")
            elif p.get("difference") is None:
                per.append("–")
            else:
                pv = p.get("sign_flip_p", p.get("mcnemar_p"))
                per.append(f"{_pts(p['difference'])} (p {_p(pv)})")
        rows.append(
            [
                e["effect"],
                f"{e['a']} vs {e['b']}",
                e.get("rows", ""),
                est,
                _ci(fam["ci"]) if fam else "",
                _signs(acr["signs"]) if acr else "–",
                "; ".join(per),
                "" if "met" not in e else ("**yes**" if e["met"] else "no"),
            ]
        )
    fam = next((e["across_seeds_family"] for e in study["effects"] if e.get("across_seeds_family")), None)
    out += [
        "Effects, a − b in accuracy points (Spearman: ρ); across seeds the mean with its 95% interval from a bootstrap "
        "that resamples seeds and rows"
        + (
            f", and for the {fam['comparisons']} arms against the SFT control the {fam['rule']} "
            f"{100 * fam['confidence']:.2f}% interval"
            if fam
            else ""
        )
        + "; per seed exact McNemar (the sign-flip test against random allocation); claims as docs/study.md states "
        "them:",
        "",
    ]
    out += _table(
        ["effect", "arms", "rows", "across seeds [95% CI]", "family CI", "sign per seed", "per seed", "claim met"],
        rows,
    )
    out += [
        f"![study: accuracy vs FLOPs per answer token, every arm and policy, mean over seeds with min–max]"
        f"({folder}/study.png)"
    ]
    return "\n".join(out)


def write_readme_block(readme: str | os.PathLike, block: str, name: str | None = None) -> None:
    """Replace the text between the markers of the study ``name`` (``readme_markers``) in ``readme`` with ``block``
    (atomically), or between ``README_BEGIN`` and ``README_END`` where the README has no markers of its own for
    that study; a README with neither pair, in order, is refused and left as it is."""
    from ..hub.atomic_io import write_text_atomic
    from ..model.errors import RetrofitUserError

    text = open(readme, encoding="utf-8").read()
    for begin, end in ([readme_markers(name)] if name else []) + [(README_BEGIN, README_END)]:
        i, j = text.find(begin), text.find(end)
        if 0 <= i < j:
            write_text_atomic(readme, text[: i + len(begin)] + "\n" + block + "\n" + text[j:])
            return
    named = " or {} and {}".format(*readme_markers(name)) if name else ""
    raise RetrofitUserError(
        f"{readme}: --readme needs the lines {README_BEGIN} and {README_END}{named}, in that order, around the "
        "block the study writes; add them where the study's tables belong"
    )


def _spread(points: list[dict], key: str) -> np.ndarray:
    """``[2, n]``: each point's mean − min and max − mean of ``key`` over the seeds, for an error bar. A spread of
    0 can come out as −1e-16 (the mean of three equal floats is not always that float), which matplotlib rejects."""
    lo = [g[key]["mean"] - g[key]["min"] for g in points]
    hi = [g[key]["max"] - g[key]["mean"] for g in points]
    return np.clip(np.array([lo, hi], dtype=np.float64), 0.0, None)


def plot_study(study: dict[str, Any], path: str | os.PathLike) -> str:
    """Accuracy vs FLOPs per answer token on the frontier rows: every arm (colour) and policy (marker), each point
    the mean over seeds with the seeds' min–max as error bars in both directions; the decider's points joined."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    markers = {"decider": "o", "random": "D", "oracle": "^", "ceiling": "X", "forced": "s", "plain": "P"}
    fig = Figure(figsize=(7.4, 5.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    colors = [c["color"] for c in __import__("matplotlib").rcParams["axes.prop_cycle"]]
    for i, (arm, points) in enumerate(study["frontier"].items()):
        color = colors[i % len(colors)]
        for policy, marker in markers.items():
            mine = [g for g in points if g["policy"] == policy and g["accuracy"] and g["flops_per_token"]]
            if not mine:
                continue
            mine.sort(key=lambda g: g["flops_per_token"]["mean"])
            x = np.array([g["flops_per_token"]["mean"] for g in mine]) / 1e6
            y = np.array([g["accuracy"]["mean"] for g in mine])
            xerr = _spread(mine, "flops_per_token") / 1e6
            yerr = _spread(mine, "accuracy")
            filled = policy not in ("random", "forced")
            ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                fmt=("-" if policy == "decider" else "") + marker,
                color=color,
                mfc=color if filled else "none",
                ms=5,
                capsize=2,
                linewidth=0.9,
                label=f"{arm}: {policy}",
            )
    ax.set_xlabel("matmul MFLOPs per answer token")
    ax.set_ylabel("greedy exact-match accuracy (frontier rows)")
    ax.set_title(f"study {study['name']}: mean over {len(study['testing']['seeds'])} seeds, bars = min–max", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="best")
    fig.tight_layout()
    import io

    from ..hub.atomic_io import write_bytes_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_bytes_atomic(path, buf.getvalue())
    return os.fspath(path)
