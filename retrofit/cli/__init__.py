"""The ``retrofit`` command: one subcommand per capability, each implemented in its own module.

Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; this file only
dispatches (one explicit table, imported lazily so ``retrofit --help`` stays fast), checks that no
output path overlaps an input (``OUTPUT_PATHS``, ``retrofit.hub.output_paths``) and reports user errors as
one ``error: ...`` line with exit code 2 (``retrofit.model.errors.run_cli``; ``RETROFIT_DEBUG=1`` shows
the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..model.errors import run_cli

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": (
        "retrofit.cli.convert",
        "convert a base checkpoint (hub id, folder or GGUF) into an untrained looped checkpoint",
    ),
    "export": ("retrofit.hub.export", "export a looped checkpoint as a self-contained Hub folder (optionally push it)"),
    "generate": ("retrofit.cli.generate", "generate text with per-token adaptive depth; show each token's exit depth"),
    "eval": ("retrofit.evaluation.cli", "complexity-controlled evaluation: accuracy and depth per difficulty level"),
    "lm-eval": ("retrofit.lm_eval.cli", "lm-eval with --model retrofit (d̄, FLOPs); write-tasks: local task folders"),
    "bench": ("retrofit.cli.bench", "run the speed/memory benchmarks and print JSON"),
    "serve": (
        "retrofit.serving.cli",
        "OpenAI-compatible server with continuous depth-wise batching (FastAPI + uvicorn)",
    ),
    "params": ("retrofit.cli.params", "report the heads' parameter share at real model shapes (meta device)"),
    "study": (
        "retrofit.cli.study",
        "tuned, equal-budget, multi-seed study of looped arms vs their controls (resumable; docs/study.md)",
    ),
}


# subcommand -> (its output path options, its input path options): an output may not be, contain or
# lie inside an input (convert and export also apply the --overwrite rule to their folder)
OUTPUT_PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "convert": (("out",), ("model",)),
    "export": (("out",), ("ckpt", "tokenizer")),
    "eval": (("out",), ("model", "compare")),
    "generate": (("html",), ("model",)),
    "study": (("out",), ("config",)),
}


def check_paths(command: str, args: argparse.Namespace) -> None:
    """Refuse an output option that overlaps an input option (``retrofit.hub.output_paths.check_no_overlap``)."""
    from ..hub.output_paths import check_no_overlap

    outs, ins = OUTPUT_PATHS.get(command, ((), ()))
    inputs = [getattr(args, name, None) for name in ins]
    for name in outs:
        value = getattr(args, name, None)
        if value:
            check_no_overlap(value, inputs, flag="--" + name.replace("_", "-"))


def build_parser(load: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrofit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if load:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``retrofit ARGV``; returns the exit code (2 after printing a one-line error for bad input)."""
    return run_cli(_main, sys.argv[1:] if argv is None else list(argv))


def _main(argv: list[str]) -> int:
    # top-level --help must not import every subcommand's dependencies
    load = not (len(argv) == 0 or argv[0] in ("-h", "--help"))
    if load and argv[0] in SUBCOMMANDS:
        parser = argparse.ArgumentParser(prog="retrofit")
        sub = parser.add_subparsers(dest="command")
        module, help_ = SUBCOMMANDS[argv[0]]
        p = sub.add_parser(argv[0], help=help_, description=help_)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    else:
        parser = build_parser(load=False)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    check_paths(args.command, args)
    return int(args._run(args) or 0)
