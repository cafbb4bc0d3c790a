"""``retrofit eval``: flags, model loading and the entry point (the work: :func:`.runner.evaluate`).

Example::

    retrofit eval --model out/looped --compare smollm2 --task mano --levels 3,5,8,12,16,20 --n 50 --out eval/
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch

from retrofit.model.errors import boolean_flag

from . import analysis as A
from .options import ACCURACY_MODES, DEFAULT_N, GENERATION_BACKENDS, STRUCTURE_STRINGS, EvalOptions
from .runner import as_list, evaluate

__all__ = ["add_arguments", "add_row_arguments", "run"]


def _int_list(text: str) -> list[int]:
    """``"3,4,8-10"`` -> ``[3, 4, 8, 9, 10]``."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError(f"empty range {part!r}")
            out += list(range(lo, hi + 1))
        else:
            out.append(int(part))
    return out


def _levels_arg(values: list[str] | None, what: str):
    """``["3,4,8-10"]`` -> list for all tasks; ``["mano=3,4", "brevo=5"]`` -> ``{task: list}``."""
    if not values:
        return None
    common: list[int] | None = None
    per: dict[str, list[int]] = {}
    for v in values:
        try:
            if "=" in v:
                t, lv = v.split("=", 1)
                per[t.strip()] = _int_list(lv)
            else:
                common = (common or []) + _int_list(v)
        except ValueError as e:
            raise ValueError(f"{what}: cannot parse {v!r} ({e}); use e.g. '3,4,8-12' or 'mano=3,4,8-12'") from None
    if per and common is not None:
        raise ValueError(f"{what}: use either one list for all tasks or TASK=LIST entries, not both")
    return per if per else common


def add_row_arguments(parser: argparse.ArgumentParser, default_tasks: str) -> None:
    """Which rows: ``--tasks``, ``--levels``, ``--n``, ``--seed`` (``retrofit eval`` and ``retrofit lm-eval
    write-tasks`` take the same; ``--levels`` is read by :func:`_levels_arg`)."""
    parser.add_argument(
        "--tasks",
        "--task",
        dest="tasks",
        action="append",
        default=None,
        help=f"data_prep task key(s), repeatable or comma-separated (default: {default_tasks})",
    )
    parser.add_argument(
        "--levels",
        action="append",
        default=None,
        help="difficulty levels, e.g. '3,4,8-12' for every task or 'mano=3,4' per task (repeatable); "
        "default: each task's train + held-out levels",
    )
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"rows per level (default {DEFAULT_N})")
    parser.add_argument(
        "--seed", type=int, default=0, help="data seed (evaluation rows use a stream derived from it; default 0)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``retrofit eval``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  retrofit eval --model out/looped --task mano --levels 3-8,12,16,20 --n 50 --out eval/\n"
        "  retrofit eval --model out/looped --compare out/sft=sft smollm2=base --task mano,brevo --limit 40\n"
        "  retrofit eval --model tiny-llama --task lano --levels lano=8,12 --n 5 --out /tmp/ev\n"
        "  retrofit eval --model out/looped --compare out/fixed=fixed out/sft=sft --task clrs_sorting \\\n"
        "      --accuracy teacher_forced_argmax --frontier --frontier-rows-per-level 25 --out eval/\n"
        "Tasks: mano, brevo, lano, clrs_sorting, clrs_string_matching, clrs_max_subarray, clrs_bfs, gsm,\n"
        "rg_chain_sum, rg_maze, rg_sudoku, rg_path_star (data_prep.tasks.TASKS)."
    )
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint: a folder (looped or base), a .gguf, 'smollm2', 'tiny-llama', 'tiny-qwen3' or a hub id",
    )
    add_row_arguments(parser, default_tasks="mano")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="at most this many examples per task, spread over the levels (quick look)",
    )
    parser.add_argument(
        "--rows",
        default=None,
        metavar="FILE.jsonl",
        help="score exactly these task rows (one JSON object per line, each with its 'difficulty') instead of "
        "generating --levels x --n rows; one task only. The main job writes the rows it scored to "
        "report/test_rows.jsonl, and summary.json's 'reproduce' is the command that scores them again",
    )
    parser.add_argument("--out", default="retrofit_eval", help="output folder (default ./retrofit_eval)")
    parser.add_argument(
        "--train-levels",
        action="append",
        default=None,
        help="levels to mark as training levels, same syntax as --levels (default: the task's default_train_levels)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="MODEL[=NAME]",
        help="models evaluated the same way on the same rows, side by side (controls, the untrained base): each a "
        "checkpoint spec as for --model, optionally '=NAME' for its name in the report (default: its folder/file "
        "name). --model is compared with each by paired tests.",
    )
    parser.add_argument("--name", default=None, help="name of --model in the report (default: its folder/file name)")
    parser.add_argument("--compare-name", default=None, help="name of a single --compare model (same as MODEL=NAME)")
    add_option_arguments(parser)
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', ...")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="load dtype (default: as stored)"
    )
    parser.add_argument("--quiet", dest="progress", action="store_false", help="no progress bars (--progress false)")


#: the choices of the ``EvalOptions`` fields that have a fixed set of values
_CHOICES = {
    "alignment": A.ALIGNMENTS,
    "accuracy": ACCURACY_MODES,
    "structure_strings": STRUCTURE_STRINGS,
    "backend": GENERATION_BACKENDS,
}
#: earlier spellings of generated flags, kept: ``--no-X`` switches a boolean off, the others are aliases
_ALIASES = {
    "forced_depths": ["--no-forced-depths", "--no-forced-generation"],
    "exit_policies": ["--no-exit-policies"],
    "policy_generation": ["--no-policy-generation"],
    "frontier_oracle": ["--no-frontier-oracle"],
    "frontier_random_draws": ["--frontier-draws"],
    "backend": ["--generation-backend"],
}


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EvalOptions`` field, made from the field (its type, default and help, declared once there):
    ``--field-name VALUE``; a boolean takes ``true``/``false`` or stands alone for true; a tuple of numbers takes
    ``0.1,0.5,0.9``. ``progress`` is ``--quiet``'s opposite. The main job's options all have one, so ``retrofit eval``
    can run any evaluation the main job runs."""
    import types
    import typing

    hints = typing.get_type_hints(EvalOptions)
    for f in dataclasses.fields(EvalOptions):
        name, hint, help_ = f.name, hints[f.name], f.metadata["help"]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kind = [a for a in typing.get_args(hint) if a is not type(None)][0] if union else hint
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag, dest=name, type=boolean_flag, nargs="?", const=True, default=f.default, help=help_
            )
            for alias in _ALIASES.get(name, []):
                parser.add_argument(alias, dest=name, action="store_false", help=f"{flag} false")
            continue
        if typing.get_origin(kind) is tuple and typing.get_args(kind)[0] is int:
            kw = dict(type=_positive_int_list, metavar="N1,N2,...")
        elif typing.get_origin(kind) is tuple:
            kw = dict(type=_float_list, metavar="X1,X2,...")
        else:
            kw = dict(type=kind if kind in (int, float, str) else str)
        if name in _CHOICES:
            kw["choices"] = _CHOICES[name]
        parser.add_argument(flag, *_ALIASES.get(name, []), dest=name, default=f.default, help=help_, **kw)


def option_flags(options: EvalOptions) -> list[str]:
    """The ``retrofit eval`` flags that give ``options`` (the fields that differ from their defaults): the inverse
    of :func:`add_option_arguments`, so a run that evaluated in code can print the command that evaluates again."""
    flags = []
    for f in dataclasses.fields(EvalOptions):
        value = getattr(options, f.name)
        if f.name == "progress" or value == f.default:
            continue
        if value is None:
            raise ValueError(f"EvalOptions.{f.name}=None has no flag (its default is {f.default!r})")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (tuple, list)):
            text = ",".join(str(v) if isinstance(v, int) else repr(float(v)) for v in value)
        else:
            text = str(value)
        flags += ["--" + f.name.replace("_", "-"), text]
    return flags


def _positive_int_list(text: str) -> tuple[int, ...]:
    """``"16,32,64"`` -> ``(16, 32, 64)``."""
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 16,32,64, got {text!r}") from None


def _float_list(text: str) -> tuple[float, ...]:
    """``"0.1,0.5,0.9"`` -> ``(0.1, 0.5, 0.9)``."""
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.1,0.5,0.9, got {text!r}"
        ) from None


def _help(name: str) -> str:
    """The ``help`` of an ``EvalOptions`` field (one text for the API and the CLI)."""
    return next(f.metadata["help"] for f in dataclasses.fields(EvalOptions) if f.name == name)


def _default(name: str):
    return next(f.default for f in dataclasses.fields(EvalOptions) if f.name == name)


def _compare_specs(values: list[str] | None, compare_name: str | None) -> list[tuple[str, str]]:
    """``["ckpt/sft=sft", "smollm2"]`` -> ``[("ckpt/sft", "sft"), ("smollm2", "smollm2")]``."""
    specs = []
    for v in values or []:
        spec, sep, nm = v.rpartition("=")
        if not sep or not nm or not spec:
            spec, nm = v, _spec_name(v)
        specs.append((spec, nm))
    if compare_name is not None:
        if len(specs) != 1:
            raise ValueError("--compare-name names a single --compare model; use MODEL=NAME for several")
        specs = [(specs[0][0], compare_name)]
    return specs


def read_rows(path: str) -> list[dict]:
    """``--rows``: one task row per line (JSON objects with an integer-valued ``difficulty``)."""
    import json

    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--rows {path}, line {i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "difficulty" not in row:
                raise ValueError(f"--rows {path}, line {i}: a row is a JSON object with a 'difficulty'")
            rows.append(row)
    if not rows:
        raise ValueError(f"--rows {path}: no rows")
    return rows


def write_rows(path, rows) -> None:
    """The rows a run scored, for ``--rows`` (atomic; strict JSON, one row per line)."""
    import json

    from ..hub.atomic_io import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(r, allow_nan=False, sort_keys=True) + "\n" for r in rows))


def _spec_name(spec: str) -> str:
    p = Path(spec)
    return p.stem if p.suffix == ".gguf" else (p.name or spec)


def _load(spec: str, device: str, dtype):
    from retrofit.hub.loading import load_model

    model, tok = load_model(spec, dtype=getattr(torch, dtype) if dtype else None)
    return model.to(device).eval(), tok


def run(args: argparse.Namespace) -> int:
    """Entry point of ``retrofit eval``."""
    from rich.console import Console

    from .report import summary_table

    console = Console(stderr=False)
    try:
        tasks = [t for v in (args.tasks or ["mano"]) for t in as_list(v)]
        levels = _levels_arg(args.levels, "--levels")
        train_levels = _levels_arg(args.train_levels, "--train-levels")
        from data_prep.tasks import get_task

        for t in tasks:
            get_task(t)
        rows = None
        if args.rows is not None:
            if len(tasks) != 1:
                raise ValueError(f"--rows scores one task's rows; got --tasks {','.join(tasks)}")
            if levels is not None or args.limit is not None:
                raise ValueError("--rows gives the rows: leave out --levels and --limit")
            rows = {tasks[0]: read_rows(args.rows)}
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        name = args.name or _spec_name(args.model)
        model, tok = _load(args.model, device, args.dtype)
        compare = [
            (nm, *_load(spec, device, args.dtype)) for spec, nm in _compare_specs(args.compare, args.compare_name)
        ]
        options = EvalOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalOptions)})
        results = evaluate(
            model,
            tok,
            tasks,
            levels=levels,
            n=args.n,
            seed=args.seed,
            rows=rows,
            out_dir=args.out,
            name=name,
            compare=compare or None,
            limit=args.limit,
            train_levels=train_levels,
            options=options,
            config={"model": args.model, "compare": args.compare, "device": device, "rows": args.rows},
        )
    except (ValueError, OSError) as e:
        print(f"retrofit eval: error: {e}", file=sys.stderr)
        return 2
    console.print(summary_table(results, title=f"retrofit eval → {args.out}"))
    console.print(f"wrote {args.out}/results.json, report.md, samples.html and the plots")
    return 0
