"""Build a complexity-controlled dataset and save it with ``save_to_disk``.

Examples::

    # defaults of the task: train levels, interpolation and extrapolation levels
    python -m data_prep.build --task mano --n 1000 --n-eval 100 --seed 0 --out data/mano

    # explicit training levels only (splits: train, eval)
    python -m data_prep.build --task mano --levels 1 2 3 --n 100 --seed 0 --out data/mano_small

    python -m data_prep.build --list
"""

from __future__ import annotations

import argparse
import collections
import sys

from data_prep.tasks import TASKS, build_splits, get_task


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.build",
        description="Generate a complexity-controlled task dataset (train / eval / eval_interp / eval_extrap) "
        "and save it as a datasets.DatasetDict with save_to_disk.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="tasks:\n" + "\n".join(f"  {k:22s} {t.knob:>11s}  {t.description}" for k, t in TASKS.items()),
    )
    p.add_argument("--task", choices=sorted(TASKS), help="task key (see the list below)")
    p.add_argument(
        "--levels",
        type=int,
        nargs="+",
        help="training levels (values of the task's knob). When given, held-out splits are built only "
        "from --interp-levels / --extrap-levels; when omitted, the task's default train, "
        "interpolation and extrapolation levels are used",
    )
    p.add_argument("--interp-levels", type=int, nargs="*", help="held-out levels inside the training range")
    p.add_argument("--extrap-levels", type=int, nargs="*", help="held-out levels outside the training range")
    p.add_argument("--n", type=int, default=1000, help="training rows per level (default: 1000)")
    p.add_argument(
        "--n-eval", type=int, default=None, help="rows per level in each eval split (default: max(1, n // 10))"
    )
    p.add_argument("--seed", type=int, default=0, help="base seed (default: 0)")
    p.add_argument("--out", help="output folder for DatasetDict.save_to_disk")
    p.add_argument("--list", action="store_true", help="list the tasks with their knob and default levels, then exit")
    return p


def summarize(dd) -> str:
    """One line per split: rows and rows per difficulty level."""
    lines = []
    for name, ds in dd.items():
        counts = collections.Counter(ds["difficulty"])
        per_level = ", ".join(f"{k}:{counts[k]}" for k in sorted(counts))
        lines.append(f"  {name:12s} {len(ds):7d} rows  levels {{{per_level}}}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for key, t in TASKS.items():
            print(
                f"{key:22s} knob={t.knob:11s} train={t.default_train_levels} "
                f"interp={t.interp_levels} extrap={t.extrap_levels}"
            )
        return 0
    if not args.task or not args.out:
        parser.error("--task and --out are required (or use --list)")
    if args.n < 1:
        parser.error("--n must be >= 1")
    n_eval = args.n_eval if args.n_eval is not None else max(1, args.n // 10)
    task = get_task(args.task)
    if args.levels is not None:
        interp = args.interp_levels or []
        extrap = args.extrap_levels or []
    else:
        interp, extrap = args.interp_levels, args.extrap_levels
    try:
        dd = build_splits(task, args.n, n_eval, args.seed, args.levels, interp, extrap)
    except ValueError as e:
        parser.error(str(e))
    dd.save_to_disk(args.out)
    train = sorted({int(x) for x in dd["train"]["difficulty"]})
    held_out = sorted({int(x) for name, ds in dd.items() if name != "train" for x in ds["difficulty"]} - set(train))
    print(f"task {task.name} (knob {task.knob}), seed {args.seed} -> {args.out}")
    print(f"  training levels {train}; held-out levels {held_out or 'none'}")
    print(summarize(dd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
