"""``retrofit bench``: run the speed/memory benchmarks of ``benchmarks/`` and print their JSON.

    retrofit bench                       # benchmarks/decode.py with its defaults (~4-5 min, 2 threads)
    retrofit bench --quick               # a short smoke run
    retrofit bench --out bench.json --args "--batch 16 --new-tokens 32"   # --args go to the script

The benchmark scripts live in the repository (``benchmarks/``, STYLE.md: outside the library, they
print ratios, not pass/fail); this command finds them next to the installed package or in the
current directory and runs one's ``main``.
"""

from __future__ import annotations

import argparse
import runpy
import shlex
import sys
from pathlib import Path

BENCHMARKS = {"decode": "decode.py"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="decode", choices=sorted(BENCHMARKS), help="which benchmark (default: decode)")
    p.add_argument("--quick", action="store_true", help="the benchmark's short smoke configuration")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--args", default="", help='more arguments for the benchmark script, as one string (e.g. "--batch 16")')


def find_script(name: str) -> Path:
    fname = BENCHMARKS[name]
    candidates = [Path(__file__).resolve().parent.parent / "benchmarks" / fname, Path.cwd() / "benchmarks" / fname]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"benchmarks/{fname} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
        "run from a checkout of the retrofit repository"
    )


def run(args: argparse.Namespace) -> int:
    try:
        script = find_script(args.name)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    argv = shlex.split(args.args)
    if args.quick:
        argv.append("--quick")
    if args.out:
        argv += ["--out", args.out]
    module = runpy.run_path(str(script), run_name="retrofit_bench")
    module["main"](argv)
    return 0
