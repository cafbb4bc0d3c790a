"""Checkpoints that are either complete or absent.

A checkpoint is written into a hidden staging folder next to its final place and renamed into
place only once every file is on disk (``os.rename`` of a directory is atomic on POSIX). An
interrupted save (a crash, a kill, a full disk) therefore leaves at most a ``.staging-*`` folder,
which no resume logic ever picks up; ``checkpoint-N`` folders are always complete.

Weights are safetensors only (``retrofit.hub.weights``). The Trainer's resume state (optimizer,
scheduler, RNG) stays in its own files next to the weights.

Durability (``retrofit.hub.atomic_io``): before the rename every file of the staging folder is
``fsync``-ed (and the folders themselves), and after it the parent folder is, so a power cut never
leaves a ``checkpoint-N`` whose name reached the disk before its contents. Small files (JSON) go through
``write_json_atomic`` / ``write_text_atomic``: a temporary file in the same folder, ``fsync``,
``os.replace``, ``fsync`` of the folder.

Validation: ``checkpoint_problems`` reads what a resume will read — the safetensors headers and
their sizes against the file (or the shards of an index), ``optimizer.pt`` / ``scheduler.pt`` /
``scaler.pt`` through ``torch.load`` (memory-mapped, ``weights_only``), the CRCs of the other
torch files, ``trainer_state.json`` as JSON — and names what is wrong. ``last_checkpoint`` skips
an invalid checkpoint with a warning that says why and falls back to the previous valid one;
``last_finite_checkpoint`` also skips checkpoints whose weights hold NaN/inf (the NaN stop of
``retrofit.training`` names it as the last good one).

Used by ``retrofit.training.RetrofitSFTTrainer`` for periodic checkpoints and by the recipes for
the final model.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import zipfile
from pathlib import Path

from ..hub.atomic_io import (  # noqa: F401  (re-exported: the checkpoint writers' one atomic I/O)
    STAGING_PREFIX,
    InvalidCheckpointError,
    atomic_dir,
    commit,
    fsync_file,
    fsync_tree,
    read_json,
    staging_path,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from ..hub.weights import (  # noqa: F401
    _WEIGHT_PATTERNS,
    _weights_files,
    assert_safetensors_only,
    safetensors_header,
    validate_weights,
    weights_are_finite,
)

logger = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
#: torch files the Trainer restores with torch.load(weights_only=True): loaded (memory-mapped) to validate
_TORCH_LOADED = ("optimizer.pt", "scheduler.pt", "scaler.pt")
_CRC_ALL_BELOW = 256 * 1024 * 1024  # torch files smaller than this get every member's CRC checked


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """A Trainer checkpoint folder with its trainer state and model (or adapter, or DeepSpeed) weights.

    Only checks that the files exist; ``checkpoint_problems`` checks that they are readable.
    """
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        return False
    if any((path / name).is_file() for name in _WEIGHT_PATTERNS):
        return True
    return (path / "latest").is_file()  # DeepSpeed engine checkpoint (global_stepN/ + latest)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders under ``output_dir``, newest (largest N) first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = _CHECKPOINT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def last_checkpoint(output_dir: str | os.PathLike, validate: bool = True) -> str | None:
    """The newest valid ``checkpoint-N`` under ``output_dir``, or ``None``.

    Staging folders never match. A checkpoint that is incomplete or, with ``validate``, unreadable
    (``checkpoint_problems``) is skipped with a warning naming why, and the previous one is tried.
    """
    for p in list_checkpoints(output_dir):
        problems = checkpoint_problems(p) if validate else ([] if is_complete_checkpoint(p) else ["incomplete"])
        if not problems:
            return str(p)
        logger.warning("skipping checkpoint %s: %s; falling back to an earlier checkpoint", p, "; ".join(problems))
    return None


def last_finite_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest valid ``checkpoint-N`` whose weights are all finite (no NaN/inf), or ``None``.

    Reads every weight of each candidate (only the failure path of the NaN stop calls it).
    """
    for p in list_checkpoints(output_dir):
        problems = checkpoint_problems(p)
        if problems:
            logger.warning("skipping checkpoint %s: %s", p, "; ".join(problems))
            continue
        finite = weights_are_finite(p)
        if finite is False:
            logger.warning("skipping checkpoint %s: its weights hold NaN or inf values", p)
            continue
        return str(p)
    return None


def remove_stale_staging(output_dir: str | os.PathLike) -> list[str]:
    """Delete staging folders left by an interrupted save; returns their paths."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    removed = []
    for p in output_dir.iterdir():
        if p.name.startswith(STAGING_PREFIX) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    if removed:
        logger.warning("removed %d staging folder(s) left by an interrupted save: %s", len(removed), removed)
    return removed


def torch_file_problem(path: str | os.PathLike, load: bool = False) -> str | None:
    """Why the ``torch.save`` file ``path`` cannot be read, or None when it can.

    Checks the zip structure (``torch.save`` writes a zip archive whose directory is at the end, so
    any truncation shows), the CRC of its pickle (and of every member for files below 256 MB) and,
    with ``load``, that ``torch.load(mmap=True, weights_only=True)`` accepts it — what the Trainer
    does on resume, without reading the tensor data.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or e})"
    if size == 0:
        return f"{path.name} is empty (0 bytes)"
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"{path.name} is truncated or corrupt ({size} bytes; {e})"
    with z:
        try:
            pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
            if not pkl:
                return f"{path.name} is not a torch.save file (no data.pkl)"
            for n in pkl:
                z.read(n)  # checks its CRC
            bad = z.testzip() if size < _CRC_ALL_BELOW else None
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            return f"{path.name} is corrupt ({e})"
        if bad is not None:
            return f"{path.name} is corrupt (member {bad} fails its CRC)"
    if load:
        import torch

        try:
            torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 (any failure to load is the answer)
            return f"{path.name} cannot be loaded ({type(e).__name__}: {_short(e)})"
    return None


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """Everything that would make a resume from the checkpoint folder ``path`` fail.

    Returns:
        One message per problem (empty = valid): missing or unparsable ``trainer_state.json``;
        missing weights; a safetensors file whose header or size is wrong (or a shard missing); a
        DeepSpeed ``latest`` tag whose folder is missing; ``optimizer.pt`` / ``scheduler.pt`` /
        ``scaler.pt`` that ``torch.load`` rejects; another torch file whose zip structure or CRC
        is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a folder"]
    problems = []
    state = path / "trainer_state.json"
    if not state.is_file():
        problems.append("trainer_state.json is missing")
    else:
        try:
            data = read_json(state)
            if not isinstance(data, dict) or not isinstance(data.get("global_step"), int):
                problems.append("trainer_state.json has no integer 'global_step'")
        except InvalidCheckpointError as e:
            problems.append(str(e))
    try:
        files = _weights_files(path)
        for f in files:
            safetensors_header(f)
    except InvalidCheckpointError as e:
        problems.append(str(e))
        files = [None]
    if not files:
        latest = path / "latest"
        if latest.is_file():
            tag = latest.read_text(errors="replace").strip()
            if not tag or not (path / tag).is_dir():
                problems.append(f"DeepSpeed 'latest' names {tag!r}, which is not a folder here")
            else:
                for f in sorted((path / tag).glob("*.pt")):
                    why = torch_file_problem(f)
                    if why:
                        problems.append(f"{tag}/{why}")
        elif (path / "pytorch_model.bin").is_file() or (path / "adapter_model.bin").is_file():
            problems.append("holds pickled weights only (retrofit saves and resumes from safetensors)")
        else:
            problems.append("no model weights (model.safetensors, adapter_model.safetensors or a DeepSpeed 'latest')")
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in (".pt", ".pth"):
            why = torch_file_problem(f, load=f.name in _TORCH_LOADED)
            if why:
                problems.append(why)
    return problems


def validate_checkpoint(path: str | os.PathLike) -> str:
    """Raise ``InvalidCheckpointError`` naming every problem of the checkpoint ``path``; returns ``path``."""
    problems = checkpoint_problems(path)
    if problems:
        raise InvalidCheckpointError(f"checkpoint {path} cannot be resumed from: {'; '.join(problems)}")
    return str(path)
