"""Where a command may write: outputs never overlap inputs, and ``--overwrite`` never deletes data
that retrofit did not write.

Rules, the same for every command that writes a folder (``retrofit convert`` / ``export`` /
``eval`` / ``generate --html``, and the recipes' ``--output_dir``):

1. The output is refused when it *is*, *contains* or *lies inside* an input (the checkpoint
   being exported, the model being converted or trained…). An input that sits in a training
   run's folder (``run/checkpoint-N``, ``run/final``…) protects that run folder too: the output
   may not be it or contain it. A new folder *inside* the run folder (``run/export``) is fine —
   the main job writes its export there — since rule 2 keeps the run's own entries safe.
2. ``--overwrite`` replaces only an empty folder or one that retrofit wrote: folders written by
   ``retrofit convert`` and ``retrofit export`` carry a small marker file, ``.retrofit-output``
   (``write_marker``). Exports written before the marker existed are recognised by their bundled
   code. Anything else must be removed by hand, on purpose.

Paths are compared after resolving symlinks and ``..``, so ``--out ckpt/..`` is caught too.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..model.errors import RetrofitUserError

MARKER = ".retrofit-output"
# entries that make a folder a training run's output folder (see `run_folder_of`)
_RUN_CHILD = re.compile(r"^(checkpoint-\d+|final|final-merged)$")
_RUN_FILES = ("data_report.json", "summary.json", "trainer_state.json")


class OutputTargetError(RetrofitUserError, ValueError):
    """An output path that would overwrite or mix with an input, or a folder ``--overwrite`` may not replace."""


def _resolve(p: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(p))).resolve()


def relation(out: str | os.PathLike, src: str | os.PathLike) -> str | None:
    """How ``out`` overlaps ``src``: ``"is"``, ``"contains"``, ``"lies inside"`` or None (resolved paths)."""
    o, s = _resolve(out), _resolve(src)
    if o == s:
        return "is"
    if s.is_relative_to(o):
        return "contains"
    if o.is_relative_to(s):
        return "lies inside"
    return None


def run_folder_of(src: str | os.PathLike) -> Path | None:
    """The training run folder an input belongs to, or None.

    ``run/checkpoint-N``, ``run/final`` and ``run/final-merged`` belong to ``run``; so does any
    folder whose parent holds ``checkpoint-N`` folders, a ``runs/`` TensorBoard folder or a run's
    report files.
    """
    s = _resolve(src)
    parent = s.parent
    if parent == s:
        return None
    if _RUN_CHILD.match(s.name):
        return parent
    try:
        names = {p.name for p in parent.iterdir()}
    except OSError:
        return None
    if (
        any(_RUN_CHILD.match(n) and n.startswith("checkpoint-") for n in names)
        or ("runs" in names and (parent / "runs").is_dir())
        or any(f in names for f in _RUN_FILES)
    ):
        return parent
    return None


def local_inputs(specs: Iterable[str | os.PathLike | None]) -> list[Path]:
    """The inputs among ``specs`` that are local files or folders (hub ids and built-in names such
    as ``smollm2`` are not paths and cannot be overwritten)."""
    out = []
    for s in specs:
        if s is None or str(s) == "":
            continue
        p = Path(os.path.expanduser(str(s)))
        if p.exists():
            out.append(_resolve(p))
    return out


def check_no_overlap(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], flag: str = "--out") -> Path:
    """Refuse an output that is, contains or lies inside an input, or is or contains an input's run folder.

    Args:
        out: the output file or folder.
        inputs: the command's inputs (non-local ones are ignored, see ``local_inputs``).
        flag: how the output is named on the command line (for the message).

    Returns:
        ``out``, resolved.

    Raises:
        OutputTargetError: naming the input and what to do instead.
    """
    o = _resolve(out)
    for s in local_inputs(inputs):
        rel = relation(o, s)
        if rel is None:
            continue
        run = run_folder_of(s)
        if rel == "contains" and run is not None and relation(o, run) in ("is", "contains"):
            raise OutputTargetError(
                f"{flag} {o} {relation(o, run)} the training run folder {run} of the input {s}; writing there "
                f"would replace the run (its checkpoints, logs and the input itself). Choose a new folder, "
                f"e.g. {run / 'export'}, or a path outside {run}"
            )
        raise OutputTargetError(
            f"{flag} {o} {rel} the input {s}; writing there would overwrite or mix with the input. "
            "Choose a path outside it"
        )
    return o


def written_by_retrofit(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` was written by a retrofit command (its marker, or a pre-marker export)."""
    folder = Path(folder)
    if (folder / MARKER).is_file():
        return True
    # exports made before the marker existed: config.json's auto_map points into the bundled code, either
    # a retrofit_*.py module or the entry module that picks retrofit's classes (retrofit.hub.bundle.ENTRY)
    from .bundle import ENTRY

    cfg = folder / "config.json"
    if cfg.is_file() and (folder / "retrofit_modeling.py").is_file():
        try:
            auto_map = json.loads(cfg.read_text(encoding="utf-8")).get("auto_map", {})
        except (OSError, ValueError, AttributeError):
            return False
        return isinstance(auto_map, dict) and any(
            str(v).startswith(("retrofit_", f"{ENTRY}.")) and (folder / f"{str(v).split('.')[0]}.py").is_file()
            for v in auto_map.values()
        )
    return False


def check_output_folder(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike | None] = (),
    *,
    overwrite: bool = False,
    flag: str = "--out",
) -> Path:
    """Check a folder a command is about to write (and, with ``overwrite``, replace).

    Args:
        out: the folder.
        inputs: the command's inputs: ``out`` may not overlap them (``check_no_overlap``).
        overwrite: the user asked to replace a non-empty ``out``; allowed only when retrofit wrote it.
        flag: the option's name for messages.

    Returns:
        ``out``, resolved.

    Raises:
        OutputTargetError: ``out`` overlaps an input, is a file, or is non-empty and not replaceable.
    """
    o = check_no_overlap(out, inputs, flag)
    if o.exists() and not o.is_dir():
        raise OutputTargetError(f"{flag} {o} exists and is not a folder")
    if o.is_dir():
        entries = sorted(p.name for p in o.iterdir())
        if entries and not overwrite:
            raise OutputTargetError(f"{flag} {o} is not empty; pass --overwrite (overwrite=True) to replace it")
        if entries and not written_by_retrofit(o):
            shown = ", ".join(entries[:4]) + (", …" if len(entries) > 4 else "")
            raise OutputTargetError(
                f"--overwrite replaces only an empty folder or one written by retrofit (it holds a {MARKER} file); "
                f"{o} holds other files ({shown}). Remove it yourself if it can go, or choose another {flag}"
            )
    return o


def write_marker(folder: str | os.PathLike, command: str) -> Path:
    """Mark ``folder`` as written by ``command`` (so that a later ``--overwrite`` may replace it)."""
    from .. import __version__

    path = Path(folder) / MARKER
    info = {
        "written_by": command,
        "retrofit_version": __version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 (3.10)
        "note": "retrofit may replace this folder when asked to (--overwrite); delete this file to protect it",
    }
    path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return path
