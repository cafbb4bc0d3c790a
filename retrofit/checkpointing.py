"""Checkpoints that are either complete or absent.

A checkpoint is written into a hidden staging folder next to its final place and renamed into
place only once every file is on disk (``os.rename`` of a directory is atomic on POSIX). An
interrupted save (a crash, a kill, a full disk) therefore leaves at most a ``.staging-*`` folder,
which no resume logic ever picks up; ``checkpoint-N`` folders are always complete.

Weights are safetensors only (transformers 5 writes nothing else for the model and PEFT
adapters); ``assert_safetensors_only`` checks it. The Trainer's resume state (optimizer,
scheduler, RNG) stays in its own files next to the weights.

Used by ``retrofit.training.RetrofitSFTTrainer`` for periodic checkpoints and by the recipes for
the final model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# files that hold a model's (or adapter's) weights, in either a plain or a DeepSpeed save
_WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")


def staging_path(final: str | os.PathLike) -> Path:
    """Where the contents of ``final`` are written before the rename: a hidden sibling."""
    final = Path(final)
    return final.parent / f"{STAGING_PREFIX}{final.name}"


def commit(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move a finished ``staging`` folder to ``final`` atomically.

    An existing ``final`` (e.g. a checkpoint of the same step written before a resume) is first
    renamed aside and deleted after the swap, so at no moment does an incomplete ``final`` exist.
    """
    staging, final = Path(staging), Path(final)
    if not staging.is_dir():
        raise FileNotFoundError(f"nothing to commit: {staging} is not a folder")
    old = None
    if final.exists():
        old = final.parent / f"{STAGING_PREFIX}old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike):
    """Context manager: yields a staging folder; on normal exit it becomes ``final``.

    On an exception the staging folder is removed and the exception propagates; ``final`` is
    untouched (a previous version, if any, survives).

    Example::

        with atomic_dir("out/final") as tmp:
            model.save_pretrained(tmp)
    """
    final = Path(final)
    tmp = staging_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(tmp, final)


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """A Trainer checkpoint folder with its trainer state and model (or adapter, or DeepSpeed) weights."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        return False
    if any((path / name).is_file() for name in _WEIGHT_PATTERNS):
        return True
    return (path / "latest").is_file()  # DeepSpeed engine checkpoint (global_stepN/ + latest)


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir``, or ``None``.

    Staging folders never match; an incomplete ``checkpoint-N`` (written by a tool that does not
    stage) is skipped with a warning.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = []
    for p in output_dir.iterdir():
        m = _CHECKPOINT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    for _, p in sorted(found, reverse=True):
        if is_complete_checkpoint(p):
            return str(p)
        logger.warning("skipping incomplete checkpoint %s", p)
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


def assert_safetensors_only(path: str | os.PathLike) -> None:
    """Raise if ``path`` holds pickled weights (``*.bin`` model or adapter files)."""
    bad = [name for name in _PICKLED_WEIGHTS if (Path(path) / name).exists()]
    if bad:
        raise AssertionError(f"{path} holds pickled weights {bad}; retrofit saves safetensors only")


def _fsync_dir(path: Path) -> None:
    # make the rename itself durable; not all platforms allow opening a directory
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
