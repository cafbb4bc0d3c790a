"""Diagnostic: the default study's tah2 arm with some options changed, at the arm's chosen rate 1e-3, test seed 1, on
2 threads. Does the second pass train? (docs/studies/two_stage/README.md)

Run from the repository root (each ~6-10 min on 2 cores; writes outputs/tah2_NAME/ and OUT/NAME-lr0.001-s1.json,
OUT = docs/studies/two_stage unless --out says otherwise)::

    python docs/studies/two_stage/variant.py heads_rate heads_lr_scale=1.0   # the release's single learning rate
    python docs/studies/two_stage/variant.py residual updater=residual       # an updater that is the identity at init

    python docs/studies/two_stage/variant.py --out docs/studies/exit_readout exit_two_stage updater=residual \
        mixture_output=false depth_warmup_steps=80 decider_phase_from=80     # docs/studies/exit_readout/README.md

Each KEY=VALUE replaces (or adds) one of the arm's recipe options; VALUE is read as YAML.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import yaml

from retrofit.study.analysis import second_pass
from retrofit.study.config import load_study
from retrofit.study.trial import Trial, run_trial


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="the diagnostic's name: outputs/tah2_NAME and OUT/NAME-lr0.001-s1.json")
    ap.add_argument("--out", type=Path, default=Path("docs/studies/two_stage"), help="the folder of the result JSON")
    ap.add_argument("set", nargs="+", metavar="KEY=VALUE", help="a tah2 arm option to replace or add")
    args = ap.parse_args(argv)
    changes = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"{item!r} is not KEY=VALUE")
        changes[key] = yaml.safe_load(value)
    cfg = load_study(Path("recipes/studies/main.yaml"))

    def changed(arm):
        if arm.name != "tah2":
            return arm
        kept = tuple((k, v) for k, v in arm.flags if k not in changes)
        return dataclasses.replace(arm, flags=(*kept, *changes.items()))

    cfg = dataclasses.replace(cfg, arms=tuple(changed(a) for a in cfg.arms), threads=2)
    r = run_trial(cfg, Trial("test", "tah2", 1e-3, 1), Path(f"outputs/tah2_{args.name}/lr0.001-s1"), progress=False)
    (args.out / f"{args.name}-lr0.001-s1.json").write_text(json.dumps(r, indent=1) + "\n")
    print(json.dumps({k: r[k] for k in ("accuracy", "mean_depth", "forced_depth_accuracy")}))
    print(json.dumps(second_pass({"tah2": {1: r}}, [1])["tah2"][0]))


if __name__ == "__main__":
    main()
