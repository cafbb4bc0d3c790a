"""Diagnostic: the study's Ouro arm, seed 1, Stage I for all 240 steps (no Stage II). Is depth 2 already broken?

Run from the repository root: ``python docs/studies/ouro_stage1/run.py 2e-3`` (writes outputs/ouro_stage1/).
"""

import dataclasses
import json
import sys
from pathlib import Path

from retrofit.study.config import load_study
from retrofit.study.trial import Trial, run_trial

cfg = load_study(Path("recipes/studies/full.yaml"))
lr = float(sys.argv[1]) if len(sys.argv) > 1 else 2e-3
arms = []
for a in cfg.arms:
    if a.name == "ouro":  # Stage II would start at step 240: never, in 240 steps
        a = dataclasses.replace(a, flags=tuple((k, 240 if k == "decider_phase_from" else v) for k, v in a.flags))
    arms.append(a)
cfg = dataclasses.replace(cfg, arms=tuple(arms), keep_models=True)
r = run_trial(cfg, Trial("test", "ouro", lr, 1), Path(f"outputs/ouro_stage1/lr{lr}-s1"), progress=False)
print(json.dumps({k: r[k] for k in ("accuracy", "mean_depth", "forced_depth_accuracy")}), r["train"]["loss"])
