"""A study's numbers from its trials' result JSONs alone: the tuning choice, the effects per seed and across seeds,
the frontier per seed, the claims (docs/study.md).

Nothing here trains or evaluates: ``analyze`` reads what ``trial.run_trial`` wrote, so a study whose checkpoints
are gone still gives the same ``study.json``. Every test is one of ``retrofit.evaluation.stats``: per seed the
engine's own paired tests (exact McNemar and the paired bootstrap; the exact sign-flip test of decider vs random),
across seeds ``seed_row_bootstrap`` — the mean difference over seeds and rows with a 95% interval from a bootstrap
that resamples seeds and rows (crossed: one row draw for every seed, since every seed is scored on the same test
rows) — and the sign of the effect in each seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..evaluation import stats as S
from ..evaluation.frontier import NOT_WORSE_MARGIN
from ..evaluation.token_difficulty import depth_vs_token_difficulty
from .config import StudyConfig
from .trial import Trial, bits

#: how the tuning choice is made, in study.json and study.md
CHOICE_RULE = (
    "the highest validation accuracy (greedy exact match over every validation row; with several tuning seeds its "
    "mean over them); ties by the lower mean teacher-forced loss of the answer tokens, then by the smaller learning "
    "rate"
)
#: resamples of the across-seed bootstrap of a mean difference, and of a Spearman (which is recomputed per resample)
N_BOOT = 10_000
N_BOOT_SPEARMAN = 1_000
#: the study's claims: each is checked on the test rows across seeds
CLAIMS = {
    "beats_tuned_sft": "the arm beats the tuned SFT control over all test rows: across-seed 95% lower bound > 0 and "
    "a positive difference in every seed",
    "adaptive_not_worse_than_fixed_at_equal_flops": "the adaptive arm's decider, at a frontier point costing no more "
    f"FLOPs per answer token than the fixed-depth arm, is not worse: across-seed lower bound > -{NOT_WORSE_MARGIN:g}",
    "decider_beats_random": "the decider beats random allocation at the same d̄ (own threshold, frontier rows): "
    "across-seed lower bound > 0",
    "depth_follows_difficulty": "Spearman(per-example d̄, level) or Spearman(per-token depth, the SFT arm's token "
    "loss) >= 0.3 across seeds, with its lower bound > 0",
}


def choose(cfg: StudyConfig, results: dict[Trial, dict], arms=None) -> dict[str, dict[str, Any]]:
    """Each arm's learning rate from its tuning trials (``CHOICE_RULE``; ``arms``: these of the config's, default
    all). With several tuning seeds a rate's accuracy and loss are the means over them, and its row lists each
    seed's accuracy and trial."""
    out = {}
    several = len(cfg.tuning_seeds) > 1
    for arm in cfg.arms if arms is None else arms:
        rows = []
        for lr in arm.learning_rates:
            rs = [results[Trial("tune", arm.name, lr, s)] for s in cfg.tuning_seeds]
            nlls = [r.get("mean_token_nll") for r in rs]
            row = {
                "lr": lr,
                "accuracy": float(np.mean([r["accuracy"] for r in rs])) if several else rs[0]["accuracy"],
                "mean_token_nll": None if None in nlls else (float(np.mean(nlls)) if several else nlls[0]),
                "trial": rs[0]["trial"]["id"],
                "n": rs[0]["rows"]["n"],
            }
            if several:
                row["per_seed"] = [
                    {"seed": s, "accuracy": r["accuracy"], "trial": r["trial"]["id"]}
                    for s, r in zip(cfg.tuning_seeds, rs)
                ]
            rows.append(row)
        best = min(
            rows,
            key=lambda t: (-t["accuracy"], np.inf if t["mean_token_nll"] is None else t["mean_token_nll"], t["lr"]),
        )
        out[arm.name] = {"chosen_lr": best["lr"], "trials": rows}
    return out


def _shape(r: dict) -> tuple | None:
    loop = r.get("loop")
    return None if loop is None else (loop.get("prelude"), loop.get("core"), loop.get("max_depth"))


def _point(r: dict, key: str) -> dict | None:
    return next((p for p in (r.get("frontier") or {}).get("points", []) if p["key"] == key), None)


def _fcorrect(r: dict, key: str) -> np.ndarray:
    c = r["frontier"]["correct"][key]
    return bits(c) if isinstance(c, str) else np.stack([bits(x) for x in c])


def _per_seed_pair(a: np.ndarray, b: np.ndarray, seed: int, **extra) -> dict[str, Any]:
    cmp = S.paired_comparison(a, b)
    return {
        "seed": seed,
        "accuracy_a": cmp["accuracy_a"],
        "accuracy_b": cmp["accuracy_b"],
        "difference": cmp["difference"],
        "a_only": cmp["a_only"],
        "b_only": cmp["b_only"],
        "mcnemar_p": cmp["mcnemar_p"],
        "bootstrap_ci": cmp["bootstrap"]["ci"],
        **extra,
    }


def _effect(name, a, b, rows, per_seed, diffs, claim=None, met=None, family=1, **extra) -> dict[str, Any]:
    """An effect: per seed, and across seeds the crossed bootstrap of the per-row differences ``diffs`` (one
    ``[n]`` array per seed); with a ``claim`` (a key of ``CLAIMS``) whether ``met(effect)`` holds.

    ``family``: how many effects test the same question against the same control (several arms against the SFT
    control). With two or more the effect also gets its interval at the Bonferroni level ``1 - 0.05 / family``
    (the same resamples), as ``across_seeds_family``: reported beside the claim, which stays the one docs/study.md
    states."""
    e = {"effect": name, "a": a, "b": b, "rows": rows, "per_seed": per_seed, **extra}
    if diffs is not None and len(diffs):
        e["across_seeds"] = S.seed_row_bootstrap(np.stack(diffs), n_boot=N_BOOT, seed=0)
        if family >= 2:
            conf = 1.0 - 0.05 / family
            fam = S.seed_row_bootstrap(np.stack(diffs), n_boot=N_BOOT, seed=0, confidence=conf)
            e["across_seeds_family"] = {
                "rule": "Bonferroni",
                "comparisons": family,
                "confidence": conf,
                "ci": fam["ci"],
            }
    if claim is not None:
        e["claim_key"], e["claim"] = claim, CLAIMS[claim]
        e["met"] = bool(met(e)) if "across_seeds" in e else False
    return e


def _lower(e) -> float:
    return e["across_seeds"]["ci"][0]


def effects(cfg: StudyConfig, test: dict[str, dict[int, dict]]) -> list[dict[str, Any]]:
    """Every paired effect of the study (module docstring), per seed and across seeds."""
    seeds = list(cfg.test_seeds)
    kinds = {a.name: a.kind for a in cfg.arms}
    sft = [a for a in test if kinds[a] == "sft"]
    fixed = [a for a in test if kinds[a] == "fixed"]
    adaptive = [a for a in test if kinds[a] == "looped"]
    out = []
    family = len(sft) * len([x for x in test if kinds[x] != "sft"])  # the comparisons with an SFT control
    for a in [x for x in test if kinds[x] != "sft"]:
        for b in sft:
            per, diffs = [], []
            for s in seeds:
                x, y = bits(test[a][s]["correct"]), bits(test[b][s]["correct"])
                per.append(_per_seed_pair(x, y, s))
                diffs.append(x.astype(float) - y)
            met = lambda e: _lower(e) > 0 and all(v > 0 for v in e["across_seeds"]["signs"])  # noqa: E731
            out.append(
                _effect("vs_tuned_sft", a, b, "all test rows", per, diffs, "beats_tuned_sft", met, family=family)
            )
            out += _depth_one_split(a, b, test, seeds)
    for a in adaptive:
        for f in [f for f in fixed if _shape(test[f][seeds[0]]) == _shape(test[a][seeds[0]])]:
            per, diffs = [], []
            for s in seeds:
                ra, rf = test[a][s], test[f][s]
                x, y = bits(ra["correct"]), bits(rf["correct"])
                per.append(_per_seed_pair(x, y, s, flops_ratio=ra["flops_per_token"] / rf["flops_per_token"]))
                diffs.append(x.astype(float) - y)
            out.append(_effect("adaptive_vs_fixed", a, f, "all test rows (own threshold)", per, diffs))
            out.append(_equal_flops(a, f, test, seeds))
        if all("frontier" in test[a][s] and "decider_vs_random" in test[a][s]["frontier"] for s in seeds):
            out.append(_vs_random(a, test, seeds))
        if all("decider_vs_oracle" in (test[a][s].get("frontier") or {}) for s in seeds):
            out.append(_vs_oracle(a, test, seeds))
        out += _depth_effects(a, sft[0] if sft else None, test, seeds)
    return out


def _own_key(r: dict) -> str:
    """The frontier point of the arm's own inference: the decider at its own threshold, or a fixed arm's depth M."""
    return "decider:own" if _point(r, "decider:own") is not None else f"forced:{r['model']['max_depth']}"


def _depth_one_split(a: str, sft: str, test, seeds) -> list[dict[str, Any]]:
    """Where a looped arm's difference from the SFT control comes from, on the frontier rows: its own inference
    minus the SFT control = (its own inference minus itself at depth 1: what the extra passes buy at inference,
    ``own_vs_depth1``) + (itself at depth 1 minus the SFT control, both at the SFT control's FLOPs: what training
    through the loop did to the single pass, ``depth1_vs_sft``). Needs every seed's frontier of both arms (the
    depth-1 point and the SFT control's plain point); otherwise nothing is reported."""
    ra = [test[a][s] for s in seeds]
    if not all(_point(r, "forced:1") is not None for r in ra) or not all(
        _point(test[sft][s], "plain") is not None for s in seeds
    ):
        return []
    found = []
    for name, key_a, b, key_b in (
        ("depth1_vs_sft", lambda r: "forced:1", sft, lambda s: "plain"),
        ("own_vs_depth1", _own_key, "depth 1", lambda s: "forced:1"),
    ):
        per, diffs = [], []
        for s, r in zip(seeds, ra):
            rb = test[sft][s] if b == sft else r
            ka, kb = key_a(r), key_b(s)
            pa, pb = _point(r, ka), _point(rb, kb)
            x, y = _fcorrect(r, ka), _fcorrect(rb, kb)
            extra = {"point": ka, "flops_ratio": pa["flops_per_token"] / pb["flops_per_token"]}
            per.append(_per_seed_pair(x, y, s, **extra))
            diffs.append(x.astype(float) - y)
        rows = "frontier rows, both at the SFT control's FLOPs" if name == "depth1_vs_sft" else "frontier rows"
        found.append(_effect(name, a, b, rows, per, diffs))
    return found


def _equal_flops(a: str, f: str, test, seeds) -> dict[str, Any]:
    """The adaptive arm's decider point with the most FLOPs per answer token not above the fixed arm's own (depth M)
    point, against that point, on the frontier rows (a seed without such a point has none: the effect is then
    not estimated across seeds)."""
    per, diffs = [], []
    for s in seeds:
        ra, rf = test[a][s], test[f][s]
        M = rf["model"]["max_depth"]
        fp = _point(rf, f"forced:{M}")
        if fp is None:
            per.append({"seed": s, "point": None, "reason": "the fixed arm has no frontier (testing.eval.frontier)"})
            continue
        pts = [p for p in (ra.get("frontier") or {}).get("points", []) if p["policy"] == "decider"]
        ok = [p for p in pts if p["flops_per_token"] <= fp["flops_per_token"]]
        if not ok:
            per.append({"seed": s, "point": None, "reason": "no decider point at <= the fixed arm's FLOPs"})
            continue
        p = max(ok, key=lambda p: (p["flops_per_token"], p["key"]))
        x, y = _fcorrect(ra, p["key"]), _fcorrect(rf, f"forced:{M}")
        per.append(
            _per_seed_pair(
                x,
                y,
                s,
                point=p["key"],
                mean_depth=p["mean_depth"],
                flops_ratio=p["flops_per_token"] / fp["flops_per_token"],
            )
        )
        diffs.append(x.astype(float) - y)
    claim = "adaptive_not_worse_than_fixed_at_equal_flops"
    return _effect(
        "adaptive_vs_fixed_at_equal_flops",
        a,
        f,
        "frontier rows",
        per,
        diffs if len(diffs) == len(seeds) else None,
        claim,
        lambda e: _lower(e) > -NOT_WORSE_MARGIN,
    )


def _vs_random(a: str, test, seeds) -> dict[str, Any]:
    per, diffs = [], []
    for s in seeds:
        r = test[a][s]
        t = r["frontier"]["decider_vs_random"]["own"]
        dec, rnd = _fcorrect(r, "decider:own"), _fcorrect(r, "random:own")
        per.append(
            {
                "seed": s,
                "accuracy_a": t["accuracy_a"],
                "accuracy_b": t["accuracy_b"],
                "difference": t["difference"],
                "sign_flip_p": t["sign_flip_p"],
                "bootstrap_ci": t["bootstrap"]["ci"],
                "mean_depth": t["decider_mean_depth"],
                "random_mean_depth": t["random_mean_depth"],
                "draws": t["draws"],
            }
        )
        diffs.append(dec.astype(float) - rnd.reshape(-1, dec.size).mean(0))
    return _effect(
        "decider_vs_random", a, "random", "frontier rows", per, diffs, "decider_beats_random", lambda e: _lower(e) > 0
    )


def _vs_oracle(a: str, test, seeds) -> dict[str, Any]:
    per, diffs, acc = [], [], {"decider": [], "random": [], "oracle": []}
    for s in seeds:
        r = test[a][s]
        t = r["frontier"]["decider_vs_oracle"]["own"]
        c = t["decider_vs_oracle"]
        per.append(
            {
                "seed": s,
                "accuracy_a": t["accuracy_decider"],
                "accuracy_b": t["accuracy_oracle"],
                "accuracy_random": t["accuracy_random"],
                "difference": c["difference"],
                "a_only": c["a_only"],
                "b_only": c["b_only"],
                "mcnemar_p": c["mcnemar_p"],
                "bootstrap_ci": c["bootstrap"]["ci"],
                "gap_closed": t["gap_closed"],
                "n_continues": t["n_continues"],
            }
        )
        diffs.append(_fcorrect(r, "decider:own").astype(float) - _fcorrect(r, "oracle:own"))
        for k, v in (
            ("decider", t["accuracy_decider"]),
            ("random", t["accuracy_random"]),
            ("oracle", t["accuracy_oracle"]),
        ):
            acc[k].append(np.nan if v is None else v)
    m = {k: float(np.mean(v)) for k, v in acc.items()}
    from ..evaluation.oracle import gap_closed

    return _effect(
        "decider_vs_oracle",
        a,
        "oracle",
        "frontier rows",
        per,
        diffs,
        gap_closed_pooled=gap_closed(m["decider"], m["random"], m["oracle"]),
        mean_accuracy=m,
    )


def _spearman_or_nan(x, y) -> float:
    try:
        return S.spearman(x, y)
    except ValueError:  # fewer than two finite pairs
        return float("nan")


def _row_means(depth_strings: list[str]) -> np.ndarray:
    return np.array([np.mean([int(c) for c in d]) if d else np.nan for d in depth_strings])


def _depth_effects(a: str, sft: str | None, test, seeds) -> list[dict[str, Any]]:
    """Depth vs difficulty: per example (d̄ of its content tokens vs its level) and per token (exit depth vs the SFT
    arm's loss on the token, the same seed), per seed and across seeds (``seed_row_bootstrap_stat``: rows are the
    examples, a resampled example brings its tokens)."""
    levels = np.array(test[a][seeds[0]]["rows"]["levels"], dtype=float)
    depth = [test[a][s]["tokens"]["depth"] for s in seeds]
    row_d = [_row_means(d) for d in depth]
    per = [{"seed": s, "spearman": _spearman_or_nan(levels, rd)} for s, rd in zip(seeds, row_d)]

    def by_example(i, rows):
        return S.spearman(levels[rows], row_d[i][rows])

    out = [
        _spearman_effect(
            "depth_vs_level", a, "level", "all test rows, per example", per, by_example, len(seeds), levels.size
        )
    ]
    if sft is None:
        return out
    D = test[a][seeds[0]]["model"]["max_depth"]
    nll = [test[sft][s]["tokens"]["nll"] for s in seeds]
    toks_d = [[np.array([int(c) for c in x], dtype=float) for x in d] for d in depth]
    toks_l = [[np.asarray(x, dtype=float) for x in n] for n in nll]
    if any(len(x) != len(y) for d, n in zip(toks_d, toks_l) for x, y in zip(d, n)):
        return out + [{"effect": "depth_vs_token_loss", "a": a, "b": sft, "skipped": "answers tokenized differently"}]
    per = []
    for s, d, n in zip(seeds, toks_d, toks_l):
        td = depth_vs_token_difficulty(np.concatenate(d), np.concatenate(n), D)
        per.append({"seed": s, "spearman": td["spearman"], "easy": td.get("easy"), "hard": td.get("hard")})

    def by_token(i, rows):
        return S.spearman(np.concatenate([toks_d[i][r] for r in rows]), np.concatenate([toks_l[i][r] for r in rows]))

    out.append(
        _spearman_effect(
            "depth_vs_token_loss", a, sft, "all test rows, per token", per, by_token, len(seeds), levels.size
        )
    )
    return out


def _spearman_effect(name, a, b, rows, per, stat, n_seeds, n_rows) -> dict[str, Any]:
    def safe(i, r):
        try:
            return stat(i, r)
        except ValueError:  # fewer than two finite pairs in a resample
            return float("nan")

    across = S.seed_row_bootstrap_stat(safe, n_seeds, n_rows, n_boot=N_BOOT_SPEARMAN, seed=0)
    if not np.isfinite(across["estimate"]):  # undefined in some seed (every depth alike): no interval either
        across["ci"] = [float("nan"), float("nan")]
        across["note"] = "undefined in a seed whose depths (or losses) are all equal"
    across["per_seed"] = [p["spearman"] for p in per]
    across["signs"] = [int(np.sign(v)) if v is not None and v == v else None for v in across["per_seed"]]
    return {"effect": name, "a": a, "b": b, "rows": rows, "per_seed": per, "across_seeds": across}


def claims(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"<claim>:<arm>": {"claim", "met", "effect", "b"}}``; depth follows difficulty once per adaptive arm."""
    out: dict[str, dict[str, Any]] = {}
    for e in found:
        if "claim_key" in e:
            out[f"{e['claim_key']}:{e['a']}"] = {
                "claim": e["claim"],
                "met": e["met"],
                "effect": e["effect"],
                "b": e["b"],
            }
    for a in sorted({e["a"] for e in found if e["effect"] in ("depth_vs_level", "depth_vs_token_loss")}):
        mine = [e for e in found if e["a"] == a and "across_seeds" in e]
        mine = [e for e in mine if e["effect"] in ("depth_vs_level", "depth_vs_token_loss")]
        met = any(e["across_seeds"]["estimate"] >= 0.3 and e["across_seeds"]["ci"][0] > 0 for e in mine)
        out[f"depth_follows_difficulty:{a}"] = {
            "claim": CLAIMS["depth_follows_difficulty"],
            "met": bool(met),
            "effect": "depth_vs_level, depth_vs_token_loss",
            "b": None,
        }
    return out


def second_pass(test: dict[str, dict[int, dict]], seeds) -> dict[str, list[dict[str, Any]]]:
    """Per adaptive arm and seed, what its second pass does and what its decider sees, from the frontier's forced
    depths, ceiling and gain deciles: is a flat frontier a blind decider or a pass that helps no token?

    ``forced`` (exact match on the frontier rows with every token at each depth), ``ceiling_bound`` (exact match if
    every answer step ran to its first right depth: the most any allocation can reach), and over the decider's
    ``n_decisions`` at the answer steps (``gain_by_decile``): its continue probability (min, max and mean),
    the mean realized gain of one more iteration in nats (teacher-forced loss at depth d minus d + 1; > 0 helps),
    the share of decisions with a positive gain, and the Spearman of the deciles' probability against their gain."""
    out = {}
    for arm, by_seed in test.items():
        rows = []
        for s in seeds:
            fr = by_seed[s].get("frontier") or {}
            g = fr.get("gain_by_decile")
            if not g or not g.get("bins"):
                continue
            bins = g["bins"]
            n = np.array([b["n"] for b in bins], dtype=float)
            rows.append(
                {
                    "seed": s,
                    "forced": {str(p["depth"]): p["accuracy"] for p in fr["points"] if p["policy"] == "forced"},
                    "ceiling_bound": (fr.get("ceiling") or {}).get("exact_match_bound"),
                    "n_decisions": g["n_decisions"],
                    "continue_prob": {
                        "min": min(b["prob_min"] for b in bins),
                        "max": max(b["prob_max"] for b in bins),
                        "mean": float(np.average([b["prob_mean"] for b in bins], weights=n)),
                    },
                    "gain_mean": float(np.average([b["gain_mean"] for b in bins], weights=n)),
                    "share_gain_positive": float(np.average([b["share_gain_positive"] for b in bins], weights=n)),
                    "decile_spearman": g.get("spearman"),
                }
            )
        if rows:
            out[arm] = rows
    return out


def frontier_summary(test: dict[str, dict[int, dict]], seeds) -> dict[str, list[dict[str, Any]]]:
    """Per arm, every frontier point across seeds (matched by policy and stop share / depth / own threshold):
    accuracy, FLOPs per answer token and d̄ per seed, their mean, min and max."""
    out = {}
    for arm, by_seed in test.items():
        groups: dict[str, dict] = {}
        for s in seeds:
            fr = by_seed[s].get("frontier")
            if not fr:
                continue
            share = {p["key"].split(":", 1)[1]: p.get("stop_share") for p in fr["points"] if p["policy"] == "decider"}
            for p in fr["points"]:
                suffix = p["key"].split(":", 1)[1] if ":" in p["key"] else ""
                if p["policy"] == "forced":
                    label = f"forced d={p['depth']}"
                elif suffix == "own" or p["policy"] == "ceiling":
                    label = f"{p['policy']} (own)" if p["policy"] != "ceiling" else "ceiling"
                elif share.get(suffix) is not None:
                    label = f"{p['policy']} stop share {share[suffix]:g}"
                else:
                    label = p["key"]
                g = groups.setdefault(label, {"label": label, "policy": p["policy"], "per_seed": []})
                g["per_seed"].append(
                    {
                        "seed": s,
                        "accuracy": p["accuracy"],
                        "flops_per_token": p["flops_per_token"],
                        "mean_depth": p.get("mean_depth"),
                    }
                )
        for g in groups.values():
            for k in ("accuracy", "flops_per_token", "mean_depth"):
                v = np.array([np.nan if x[k] is None else x[k] for x in g["per_seed"]], dtype=float)
                g[k] = (
                    {"mean": float(np.nanmean(v)), "min": float(np.nanmin(v)), "max": float(np.nanmax(v))}
                    if np.isfinite(v).any()
                    else None
                )
        out[arm] = list(groups.values())
    return out
