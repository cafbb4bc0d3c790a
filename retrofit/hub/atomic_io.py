"""Atomic, durable file I/O: a folder or a file is either complete or absent.

A folder is written into a hidden staging folder next to its final place and renamed into place only
once every file is on disk (``os.rename`` of a directory is atomic on POSIX): ``atomic_dir`` /
``commit``. An interrupted save (a crash, a kill, a full disk) therefore leaves at most a
``.staging-*`` folder. Before the rename every file of the staging folder is ``fsync``-ed (and the
folders themselves), and after it the parent folder is, so a power cut never leaves a folder whose name
reached the disk before its contents. Small files (JSON) go through ``write_json_atomic`` /
``write_text_atomic``: a temporary file in the same folder, ``fsync``, ``os.replace``, ``fsync`` of the
folder. ``read_json`` names a truncated or malformed file (``InvalidCheckpointError``).

The project's one atomic writer: checkpoints (``retrofit.training.checkpointing``), exports
(``retrofit.hub.export``) and evaluation reports (``retrofit.evaluation``) all write through it;
``write_json_atomic(path, obj, strict=True)`` writes strict JSON of NumPy / torch values (``to_jsonable``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from ..model.errors import RetrofitUserError

STAGING_PREFIX = ".staging-"


class InvalidCheckpointError(RetrofitUserError, ValueError):
    """A checkpoint (or one of its files) is unreadable; the message names the file and why."""


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
    fsync_tree(staging)  # contents on disk before the name that says "complete"
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


# ------------------------------------------------------------------------------------------------
# Durable writes
# ------------------------------------------------------------------------------------------------
def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """``fsync`` every file under ``folder``, then every folder (deepest first), so that a rename of
    ``folder`` afterwards never publishes contents that are still only in the page cache."""
    folder = Path(folder)
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                fsync_file(p)
        _fsync_dir(Path(root))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that ``path`` holds either its old contents or all of ``data``.

    A temporary file in the same folder is written and ``fsync``-ed, renamed over ``path``
    (``os.replace``, atomic on POSIX), and the folder is ``fsync``-ed. Parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """``write_bytes_atomic`` for text."""
    return write_bytes_atomic(path, text.encode(encoding))


def write_json_atomic(
    path: str | os.PathLike, obj: Any, indent: int | None = 2, *, strict: bool = False, **dumps_kw
) -> Path:
    """Serialize ``obj`` as JSON (then a newline) and write it atomically (``write_bytes_atomic``): the
    project's one JSON writer.

    ``dumps_kw`` go to ``json.dumps`` (e.g. ``default=str``, ``sort_keys=True``). The text is built
    completely before anything touches the disk, so a value that cannot be serialized leaves the
    old file as it was.

    ``strict=True`` (evaluation results): NumPy / torch values, dataclasses, enums and paths are converted
    (``to_jsonable``), NaN and ±inf become ``null`` and non-ASCII text stays as it is; the output is
    strict JSON (a ``TypeError`` names the location of a value that cannot be converted).
    """
    if strict:
        obj = to_jsonable(obj)
        dumps_kw = {"allow_nan": False, "ensure_ascii": False, **dumps_kw}
    return write_text_atomic(path, json.dumps(obj, indent=indent, **dumps_kw) + "\n")


def _is_tensor(o: Any) -> bool:
    return type(o).__module__.startswith("torch") and hasattr(o, "detach") and hasattr(o, "tolist")


def _is_numpy(o: Any) -> bool:
    return type(o).__module__.startswith("numpy")


def _json_key(k: Any, loc: str) -> str:
    if _is_numpy(k) or _is_tensor(k):
        k = k.item()
    if isinstance(k, str):
        return k
    if isinstance(k, bool):
        return "true" if k else "false"
    if isinstance(k, (int, float)):
        return str(k)
    if k is None:
        return "null"
    raise TypeError(f"strict JSON: dict key {k!r} of type {type(k).__name__} at {loc} is not a JSON key")


def to_jsonable(obj: Any, _loc: str = "$") -> Any:
    """Convert ``obj`` into plain JSON-compatible Python values.

    Handles dicts (keys stringified like ``json`` does), lists/tuples/sets, NumPy arrays and
    scalars, torch tensors (any device/dtype, via ``.tolist()``), dataclasses, enums and paths.
    Non-finite floats (NaN, ±inf) become ``None`` (JSON ``null``): strict JSON has no NaN.

    Raises:
        TypeError: naming the type and the location (``$.models.x.tasks``) of the first value
            that cannot be converted.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if _is_tensor(obj):
        obj = obj.detach().cpu()
        return to_jsonable(obj.item() if obj.dim() == 0 else obj.tolist(), _loc)
    if _is_numpy(obj) and hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist(), _loc)
    if isinstance(obj, Mapping):
        return {_json_key(k, _loc): to_jsonable(v, f"{_loc}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, f"{_loc}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        items = list(obj)
        try:
            items.sort()
        except TypeError:
            items.sort(key=repr)
        return [to_jsonable(v, f"{_loc}[{i}]") for i, v in enumerate(items)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj), _loc)
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value, _loc)
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"strict JSON: object of type {type(obj).__name__} at {_loc} is not JSON serializable")


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file, raising ``InvalidCheckpointError`` (one line: the path and why) when it is
    missing, empty, not UTF-8 or not valid JSON (a truncated write)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InvalidCheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    if not raw.strip():
        raise InvalidCheckpointError(f"{path} is empty (an interrupted write?)")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidCheckpointError(f"{path} is not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise InvalidCheckpointError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; a truncated write?)"
        ) from e
