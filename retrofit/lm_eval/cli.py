"""``retrofit lm-eval`` (also ``python -m retrofit.lm_eval``): lm-eval's command line with the ``retrofit`` model.

::

    retrofit lm-eval write-tasks --out lm_tasks/ --tasks mano,gsm --levels mano=3,5,8 --n 50
    retrofit lm-eval --model retrofit --model_args pretrained=outputs/tah2_llama/final,exit_policy=decider \\
        --include_path lm_tasks/ --tasks retrofit_mano --output_path lm_results/

``write-tasks`` writes a local task folder (:mod:`retrofit.lm_eval.tasks`). Anything else is passed
unchanged to lm-eval's own command line (``lm-eval run|ls|validate ...`` or the legacy form without
a subcommand) after the ``retrofit`` model is registered; after the run the per-task d̄ and FLOPs
per token are printed (they are also in lm-eval's results JSON under ``config.retrofit``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["add_arguments", "main", "run", "run_lm_eval", "write_tasks_main"]

USAGE = """\
usage: retrofit lm-eval write-tasks --out FOLDER [--tasks T1,T2] [--levels 3,5 | TASK=3,5] [--n N] [--seed S]
                                    [--max-gen-toks N] [--answer-sep SEP] [--rows FILE [--split NAME]]
       retrofit lm-eval LM_EVAL_ARGS...    lm-eval's command line, with --model retrofit registered

  write-tasks   write local lm-eval tasks (data from data_prep, no hub) for the complexity-controlled tasks
  LM_EVAL_ARGS  e.g. --model retrofit --model_args pretrained=DIR,exit_policy=kl,threshold=5e-4
                     --include_path FOLDER --tasks retrofit_mano --output_path OUT
                model_args: pretrained, exit_policy (decider | kl | state | depth), threshold, depth,
                step_schedule, batch_size, device, dtype, max_length, max_gen_toks
                lm-eval's own help: retrofit lm-eval run --help

See docs/lm-eval.md.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``retrofit lm-eval``: every argument belongs to lm-eval (or to ``write-tasks``)."""
    # The arguments after `lm-eval` are lm-eval's (`--model ...`) and must reach it untouched. argparse
    # would read a leading `--model` as an option of this parser; with no prefix characters it cannot.
    parser.prefix_chars = "\0"
    parser.add_argument("args", nargs=argparse.REMAINDER, help="write-tasks ... or lm-eval's arguments")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``retrofit lm-eval``."""
    return main(args.args)


def main(argv: Sequence[str] | None = None) -> int:
    """``retrofit lm-eval`` / ``python -m retrofit.lm_eval`` with ``argv`` (default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "write-tasks":
        return write_tasks_main(argv[1:])
    return run_lm_eval(argv)


def run_lm_eval(argv: Sequence[str]) -> int:
    """Register the ``retrofit`` model, run lm-eval's command line with ``argv``, print d̄ and FLOPs per task."""
    from lm_eval.__main__ import cli_evaluate

    from . import register
    from .model import last_report

    register()
    before = last_report()
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv (and inserts `run` for the legacy form)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    report = last_report()
    if report is not None and report is not before:
        print(format_report(report))
    return 0


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The depth/FLOPs report of :meth:`RetrofitLM.report` as a markdown table."""
    m = report["model"]
    policy = m["exit_policy"] + (f", threshold={m['threshold']}" if m["threshold"] is not None else "")
    policy += f", depth={m['depth']}" if m["depth"] is not None else ""
    head = (
        f"retrofit: {m['pretrained']} ({m['class']}, D = {m['max_depth']}, exit_policy={policy}). "
        "answer = positions that produced a scored or generated token; all = every position run. "
        "FLOPs: matmul FLOPs per token; vs fixed = / every token at depth D; vs base = / the pretrained stack."
    )
    cols = [
        "task",
        "requests",
        "answer tok",
        "d̄ answer",
        "FLOPs/tok answer",
        "all tok",
        "d̄ all",
        "FLOPs/tok all",
        "vs fixed (all)",
        "vs base (all)",
    ]
    rows = []
    entries = list(report["tasks"].items()) + [("total", {"requests": {}, **report["total"]})]
    for name, e in entries:
        a, al = e["answer_tokens"], e["all_tokens"]
        req = ", ".join(f"{k} {v}" for k, v in sorted(e["requests"].items()))
        rows.append(
            [
                name,
                req,
                str(a["n_tokens"]),
                _fmt(a.get("mean_depth"), ".3f"),
                _fmt(a.get("flops_per_token"), ".4g"),
                str(al["n_tokens"]),
                _fmt(al.get("mean_depth"), ".3f"),
                _fmt(al.get("flops_per_token"), ".4g"),
                _fmt(al.get("flops_vs_fixed"), ".3f"),
                _fmt(al.get("flops_vs_base"), ".3f"),
            ]
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([head, "", line(cols), sep, *(line(r) for r in rows), ""])


def write_tasks_main(argv: Sequence[str]) -> int:
    """``retrofit lm-eval write-tasks``: write a local task folder and print the command that runs it."""
    from data_prep.common import ANSWER_SEP
    from retrofit.evaluation.cli import _levels_arg, add_row_arguments

    from .tasks import DEFAULT_TASKS, write_tasks

    p = argparse.ArgumentParser(
        prog="retrofit lm-eval write-tasks",
        description="Write lm-eval tasks (one per difficulty level, plus a group per task) for complexity-controlled "
        "tasks; data generated offline by data_prep, scored by the data_prep task's scorer (as retrofit eval).",
    )
    p.add_argument("--out", required=True, help="output folder (pass it to lm-eval as --include_path)")
    add_row_arguments(p, default_tasks=",".join(DEFAULT_TASKS))  # as retrofit eval takes them
    p.add_argument(
        "--max-gen-toks",
        type=int,
        default=None,
        help="generation budget; default: characters of the longest ' ' + answer + 2 (set it to retrofit "
        "eval's --max-new-tokens for identical runs)",
    )
    p.add_argument(
        "--answer-sep",
        default=ANSWER_SEP,
        help="text between prompt and answer in the loglikelihood tasks (default: a space, as SFT formatting and "
        "retrofit eval use)",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="write these rows (a .jsonl/.json/.parquet file or a save_to_disk folder, e.g. from "
        "python -m data_prep.build) instead of generating; needs exactly one --tasks",
    )
    p.add_argument("--split", default=None, help="split of a saved DatasetDict given with --rows (e.g. eval_extrap)")
    args = p.parse_args(list(argv))
    tasks = [t.strip() for v in (args.tasks or [",".join(DEFAULT_TASKS)]) for t in v.split(",") if t.strip()]
    try:
        levels = _levels_arg(args.levels, "--levels")
        rows = None
        if args.rows is not None:
            if len(tasks) != 1:
                raise ValueError(f"--rows needs exactly one --tasks value, got {len(tasks)}: {', '.join(tasks)}")
            from data_prep.chat import load_rows

            rows = {tasks[0]: load_rows(args.rows, split=args.split)}
        manifest = write_tasks(
            args.out,
            tasks,
            levels=levels,
            n=args.n,
            seed=args.seed,
            rows=rows,
            max_gen_toks=args.max_gen_toks,
            answer_sep=args.answer_sep,
        )
    except (ValueError, OSError) as e:
        print(f"retrofit lm-eval write-tasks: error: {e}", file=sys.stderr)
        return 2
    groups = []
    for name in tasks:
        e = manifest["tasks"][name]
        groups.append(e["group"])
        per = ", ".join(f"L{k}: {v}" for k, v in e["rows_per_level"].items())
        print(
            f"{name:14s} {e['group']} ({per} rows; max_gen_toks {e['max_gen_toks']}); loglikelihood: "
            f"{e['loglikelihood_group']}"
        )
    print(
        f"wrote {args.out}. Run:\n  retrofit lm-eval --model retrofit --model_args pretrained=CHECKPOINT "
        f"--include_path {args.out} --tasks {','.join(groups)}"
    )
    return 0
