"""Diagnostic: the default study's tah2 arm with the release's single learning rate (heads_lr_scale 1: updater and
decider at the backbone's rate instead of 20x), at the arm's chosen rate 1e-3, test seed 1. Does the second pass
still never train? (docs/studies/two_stage/README.md)

Run from the repository root: ``python docs/studies/two_stage/heads_rate.py`` (writes outputs/tah2_heads_rate/ and
docs/studies/two_stage/heads_rate-lr0.001-s1.json; ~8 min on 2 cores).
"""

import dataclasses
import json
from pathlib import Path

from retrofit.study.analysis import second_pass
from retrofit.study.config import load_study
from retrofit.study.trial import Trial, run_trial

cfg = load_study(Path("recipes/studies/main.yaml"))
arms = tuple(
    dataclasses.replace(a, flags=(*a.flags, ("heads_lr_scale", 1.0))) if a.name == "tah2" else a for a in cfg.arms
)
cfg = dataclasses.replace(cfg, arms=arms, threads=2)
r = run_trial(cfg, Trial("test", "tah2", 1e-3, 1), Path("outputs/tah2_heads_rate/lr0.001-s1"), progress=False)
Path("docs/studies/two_stage/heads_rate-lr0.001-s1.json").write_text(json.dumps(r, indent=1) + "\n")
print(json.dumps({k: r[k] for k in ("accuracy", "mean_depth", "forced_depth_accuracy")}))
print(json.dumps(second_pass({"tah2": {1: r}}, [1])["tah2"][0]))
