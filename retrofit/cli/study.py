"""``retrofit study CONFIG``: tune every arm on the validation rows with the same grid, test each at its chosen
learning rate with several seeds, and report the effects per seed and across seeds (docs/study.md).

::

    retrofit study recipes/studies/main.yaml --out docs/studies/main --jobs 2   # run, or resume after a kill
    retrofit study recipes/studies/main.yaml --dry-run                   # which trials are done, which would run
    retrofit study recipes/studies/main.yaml --finished-only             # the report of the finished trials only
    retrofit study recipes/studies/full.yaml --arms sft,fixed,tah2 --seeds 1,2,3   # a part first; the rest later
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="The study's YAML file (recipes/studies/*.yaml; docs/study.md lists its keys).")
    p.add_argument(
        "--out",
        default=None,
        help="Study folder: trials/<trial>/result.json, study.json, study.md, study.png, timings.json. Default: the "
        "config's out, else outputs/studies/<name>. Rerunning with the same folder resumes: finished trials are kept.",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="Trials run at a time, each in its own process with the config's threads (results do not depend on it; "
        "keep jobs x threads at or below the cores).",
    )
    p.add_argument(
        "--arms",
        type=_comma_list(str, "arm names"),
        default=None,
        metavar="A,B",
        help="Only these of the config's enabled arms (comma-separated). Their trials are the whole study's: run the "
        "same command without --arms later into the same --out and only the missing trials run. The report says "
        "which arms it leaves out.",
    )
    p.add_argument(
        "--seeds",
        type=_comma_list(int, "integers"),
        default=None,
        metavar="1,2,3",
        help="Only these of the config's test seeds (comma-separated); like --arms, the rest can run later.",
    )
    p.add_argument(
        "--no-reuse",
        action="store_true",
        help="Take no finished trial from the study folders the config lists under reuse: run those trials into --out "
        "as well (without it, a trial there with the same key counts as done; study.json lists which).",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Print which trials are done (done in NAME: found in that reuse folder) and which would run; run none.",
    )
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="Run nothing: write study.json, study.md and the plot from the finished trials (the tuning complete; "
        "the test seeds at which every arm has finished, with a warning when that is fewer than the config lists).",
    )
    p.add_argument(
        "--readme",
        default=None,
        metavar="FILE",
        help="Also write the study's tables (grid, test accuracy per seed, effects and claims, the plot) into FILE "
        "between the lines <!-- study:NAME:begin --> and <!-- study:NAME:end --> (NAME: the study's name), or where "
        "FILE has none for it, between <!-- study:begin --> and <!-- study:end --> (README.md keeps the default "
        "study's there).",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="No progress bars, and no library output from the trials (dataset maps, the trainer's log lines); "
        "warnings still show. --jobs workers always run this way.",
    )


def _comma_list(cast, what: str):
    """An argparse type: a comma-separated list of ``cast`` values, at least one."""

    def parse(value: str) -> list:
        try:
            items = [cast(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            items = []
        if not items:
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {value!r}")
        return items

    return parse


def run(args: argparse.Namespace) -> int:
    from ..study.runner import plan, report_finished, run_study

    part = {"arms": args.arms, "seeds": args.seeds, "reuse": not args.no_reuse}
    if args.dry_run:
        for trial, state in plan(args.config, args.out, **part):
            print(f"{state:>13}  {trial}")
        return 0
    if args.finished_only:
        study = report_finished(args.config, args.out, **part)
    else:
        study = run_study(args.config, args.out, jobs=args.jobs, progress=not args.quiet, **part)
    if args.readme is not None:
        _write_readme(args, study)
    for key, c in study["claims"].items():
        print(f"[{'met' if c['met'] else 'NOT met'}] {key}: {c['claim']}")
    return 0


def _write_readme(args: argparse.Namespace, study: dict) -> None:
    """The study's tables into ``args.readme`` (paths in the block relative to the README's folder)."""
    import os

    from ..study.config import load_study
    from ..study.report import readme_markdown, write_readme_block
    from ..study.runner import default_out

    here = os.path.dirname(os.path.abspath(args.readme))
    out = args.out if args.out is not None else default_out(load_study(args.config))
    block = readme_markdown(study, os.path.relpath(args.config, here), os.path.relpath(out, here))
    write_readme_block(args.readme, block, study["name"])
    print(f"wrote the study's tables into {args.readme}")
