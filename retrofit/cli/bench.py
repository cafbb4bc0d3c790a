"""``retrofit bench``: run the speed/memory benchmarks of ``benchmarks/`` and print their JSON.

    retrofit bench                       # benchmarks/decode.py with its defaults (~4-5 min, 2 threads)
    retrofit bench --quick               # a short smoke run
    retrofit bench --out bench.json --args "--batch 16 --new-tokens 32"   # --args go to the script

The benchmark scripts live in the repository (``benchmarks/``, STYLE.md: outside the library, they
print ratios, not pass/fail) and are not part of the installed package. This command runs them
only from the source checkout the package itself was imported from (an editable install, or
``python -m retrofit.cli`` inside a clone): the ``benchmarks/`` folder next to the ``retrofit/``
package, in a folder whose ``setup.cfg`` names the ``retrofit`` distribution. It never looks in
the current directory — that would execute whatever a ``benchmarks/decode.py`` there holds. With a
wheel install it says how to get the scripts (clone the repository and ``pip install -e .``).
"""

from __future__ import annotations

import argparse
import configparser
import runpy
import shlex
from pathlib import Path

from ..model.errors import RetrofitUserError

BENCHMARKS = {"decode": "decode.py"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name", nargs="?", default="decode", choices=sorted(BENCHMARKS), help="which benchmark (default: decode)"
    )
    p.add_argument("--quick", action="store_true", help="the benchmark's short smoke configuration")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument(
        "--args", default="", help='more arguments for the benchmark script, as one string (e.g. "--batch 16")'
    )


class BenchmarkNotFoundError(RetrofitUserError, FileNotFoundError):
    """The benchmark scripts are not installed (they ship with the source repository only)."""


def source_checkout(package_dir: Path | None = None) -> Path | None:
    """The retrofit source checkout the package was imported from, or None (a wheel install).

    A checkout is the folder above the ``retrofit/`` package whose ``setup.cfg`` declares
    ``name = retrofit`` (a ``site-packages`` folder has neither).
    """
    pkg = Path(__file__).resolve().parent.parent if package_dir is None else Path(package_dir).resolve()
    root = pkg.parent
    cfg = root / "setup.cfg"
    if not cfg.is_file():
        return None
    parser = configparser.ConfigParser()
    try:
        parser.read(cfg, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        return None
    return root if parser.get("metadata", "name", fallback=None) == "retrofit" else None


def find_script(name: str, package_dir: Path | None = None) -> Path:
    """The benchmark script ``name`` of the checkout the package came from (never the current directory)."""
    fname = BENCHMARKS[name]
    root = source_checkout(package_dir)
    if root is not None and (root / "benchmarks" / fname).is_file():
        return root / "benchmarks" / fname
    where = (
        f"the checkout {root} has no benchmarks/{fname}"
        if root is not None
        else ("retrofit is installed as a package, and the benchmarks ship with the source repository only")
    )
    raise BenchmarkNotFoundError(
        f"cannot run the {name} benchmark: {where}; clone the retrofit repository and run "
        f"`pip install -e .` there (then `retrofit bench`), or `python benchmarks/{fname}` inside the clone"
    )


def run(args: argparse.Namespace) -> int:
    script = find_script(args.name)
    argv = shlex.split(args.args)
    if args.quick:
        argv.append("--quick")
    if args.out:
        argv += ["--out", args.out]
    module = runpy.run_path(str(script), run_name="retrofit_bench")
    module["main"](argv)
    return 0
