"""Diagnostic: one test trial of a study arm with some options changed; by default the default study's tah2 arm at its
chosen rate 1e-3, test seed 1, on 2 threads. Does the second pass train? (docs/studies/two_stage/README.md)

Run from the repository root (each ~6-10 min on 2 cores; writes outputs/ARM_NAME/ and OUT/NAME-lrLR-sSEED.json,
OUT = docs/studies/two_stage unless --out says otherwise)::

    python docs/studies/two_stage/variant.py heads_rate heads_lr_scale=1.0   # the release's single learning rate
    python docs/studies/two_stage/variant.py residual updater=residual       # an updater that is the identity at init

    python docs/studies/two_stage/variant.py --out docs/studies/exit_readout exit_two_stage updater=residual \
        mixture_output=false depth_warmup_steps=80 decider_phase_from=80     # docs/studies/exit_readout/README.md

    python docs/studies/two_stage/variant.py --study recipes/studies/exit_readout.yaml --arm tah2_exit_readout \
        --lr 5e-4 --seed 2 --threads 1 --out docs/studies/price rho0.5 rho=0.5    # docs/studies/price/README.md

Each KEY=VALUE replaces (or adds) one of the arm's recipe options; VALUE is read as YAML. With ``--threads 1`` and
no change the trial is the study's own (the same key), so the study's trial is the variant's reference.
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
    ap.add_argument("name", help="the diagnostic's name: outputs/ARM_NAME and OUT/NAME-lrLR-sSEED.json")
    ap.add_argument("--out", type=Path, default=Path("docs/studies/two_stage"), help="the folder of the result JSON")
    ap.add_argument("--study", type=Path, default=Path("recipes/studies/main.yaml"), help="the study file of the arm")
    ap.add_argument("--arm", default="tah2", help="the arm whose options change (default tah2)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the learning rate (default 1e-3, tah2's chosen rate)")
    ap.add_argument("--seed", type=int, default=1, help="the trial's seed (default 1, the first test seed)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2; the studies' trials ran 1)")
    ap.add_argument("set", nargs="+", metavar="KEY=VALUE", help="an option of --arm to replace or add")
    args = ap.parse_args(argv)
    changes = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"{item!r} is not KEY=VALUE")
        changes[key] = yaml.safe_load(value)
    cfg = load_study(args.study)
    cfg.arm(args.arm)  # an unknown arm: one error naming the study's arms

    def changed(arm):
        if arm.name != args.arm:
            return arm
        return dataclasses.replace(arm, flags=tuple({**dict(arm.flags), **changes}.items()))

    cfg = dataclasses.replace(cfg, arms=tuple(changed(a) for a in cfg.arms), threads=args.threads)
    trial = Trial("test", args.arm, args.lr, args.seed)
    tag = trial.id.removeprefix(f"test-{args.arm}-")  # lrLR-sSEED, as the study names the trial
    r = run_trial(cfg, trial, Path(f"outputs/{args.arm}_{args.name}/{tag}"), progress=False)
    (args.out / f"{args.name}-{tag}.json").write_text(json.dumps(r, indent=1) + "\n")
    print(json.dumps({k: r[k] for k in ("accuracy", "mean_depth", "forced_depth_accuracy")}))
    for row in second_pass({args.arm: {args.seed: r}}, [args.seed]).get(args.arm, []):  # none for an SFT arm
        print(json.dumps(row))


if __name__ == "__main__":
    main()
