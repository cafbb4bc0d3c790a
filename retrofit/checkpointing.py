"""Checkpoints that are either complete or absent.

A checkpoint is written into a hidden staging folder next to its final place and renamed into
place only once every file is on disk (``os.rename`` of a directory is atomic on POSIX). An
interrupted save (a crash, a kill, a full disk) therefore leaves at most a ``.staging-*`` folder,
which no resume logic ever picks up; ``checkpoint-N`` folders are always complete.

Weights are safetensors only (transformers 5 writes nothing else for the model and PEFT
adapters); ``assert_safetensors_only`` checks it. The Trainer's resume state (optimizer,
scheduler, RNG) stays in its own files next to the weights.

Durability: before the rename every file of the staging folder is ``fsync``-ed (and the folders
themselves), and after it the parent folder is, so a power cut never leaves a ``checkpoint-N``
whose name reached the disk before its contents. Small files (JSON) go through
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

import contextlib
import json
import logging
import math
import os
import re
import shutil
import struct
import uuid
import zipfile
from pathlib import Path
from typing import Any

from .errors import RetrofitUserError

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


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2, **dumps_kw) -> Path:
    """Serialize ``obj`` as JSON (then a newline) and write it atomically (``write_bytes_atomic``).

    ``dumps_kw`` go to ``json.dumps`` (e.g. ``default=str``, ``sort_keys=True``). The text is built
    completely before anything touches the disk, so a value that cannot be serialized leaves the
    old file as it was.
    """
    return write_text_atomic(path, json.dumps(obj, indent=indent, **dumps_kw) + "\n")


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


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
class InvalidCheckpointError(RetrofitUserError, ValueError):
    """A checkpoint (or one of its files) is unreadable; the message names the file and why."""


#: bytes per element of each safetensors dtype (sub-byte types are not size-checked)
_ST_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
#: torch files the Trainer restores with torch.load(weights_only=True): loaded (memory-mapped) to validate
_TORCH_LOADED = ("optimizer.pt", "scheduler.pt", "scaler.pt")
_CRC_ALL_BELOW = 256 * 1024 * 1024  # torch files smaller than this get every member's CRC checked


def safetensors_header(path: str | os.PathLike) -> dict:
    """Parse and check a ``.safetensors`` file's header against the file's size.

    Checks: the 8-byte header length, the JSON header, every tensor's dtype, shape and byte range,
    and that the tensors' byte ranges tile the data section exactly (a truncated file fails here,
    without reading any tensor data).

    Returns:
        The header dict (tensor name -> ``{"dtype", "shape", "data_offsets"}``, plus ``__metadata__``).

    Raises:
        InvalidCheckpointError: the message says what is wrong (empty, truncated, corrupt header…).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if size == 0:
                raise InvalidCheckpointError(f"{path} is empty (0 bytes)")
            if len(head) < 8:
                raise InvalidCheckpointError(f"{path} is truncated: {size} bytes, shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _ST_MAX_HEADER:
                raise InvalidCheckpointError(f"{path} is not a safetensors file (header length {n})")
            if 8 + n > size:
                raise InvalidCheckpointError(
                    f"{path} is truncated: its header alone needs {8 + n} bytes, the file has {size}"
                )
            raw = f.read(n)
    except OSError as e:
        raise InvalidCheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpointError(f"{path} has a corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise InvalidCheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in [*shape, b, e]) or e < b:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise InvalidCheckpointError(
                f"{path} has a corrupt safetensors header (tensor {name!r}: {info!r:.120})"
            ) from None
        if dtype in _ST_ITEMSIZE and math.prod(shape) * _ST_ITEMSIZE[dtype] != e - b:
            raise InvalidCheckpointError(
                f"{path} has a corrupt safetensors header (tensor {name!r}: {dtype}{shape} cannot occupy {e - b} bytes)"
            )
        spans.append((b, e, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            raise InvalidCheckpointError(
                f"{path} has a corrupt safetensors header (tensor {name!r} starts at {b}, expected {pos})"
            )
        pos = e
    data = size - 8 - n
    if pos > data:
        raise InvalidCheckpointError(
            f"{path} is truncated: its header lists {pos} bytes of tensor data, the file holds {data}"
        )
    if pos < data:
        raise InvalidCheckpointError(f"{path} is corrupt: {data - pos} bytes follow the last tensor")
    return header


def _weights_files(folder: Path) -> list[Path]:
    """The safetensors files that hold a folder's model (or adapter) weights, shards included.

    Raises:
        InvalidCheckpointError: an index that cannot be read, or a shard it names is missing.
    """
    files = []
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (folder / name).is_file():
            files.append(folder / name)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise InvalidCheckpointError(f"weights index {index} has no 'weight_map'")
        for shard in sorted(set(wmap.values())):
            if not (folder / shard).is_file():
                raise InvalidCheckpointError(f"weights index {index} names the shard {shard}, which is missing")
            files.append(folder / shard)
    return files


def validate_weights(folder: str | os.PathLike) -> list[Path]:
    """Check the headers and sizes of every safetensors weight file of a model folder.

    Returns:
        The files checked (empty when the folder holds no safetensors weights).

    Raises:
        InvalidCheckpointError: the first unreadable file, and why.
    """
    files = _weights_files(Path(folder))
    for f in files:
        safetensors_header(f)
    return files


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


def weights_are_finite(folder: str | os.PathLike) -> bool | None:
    """Whether every floating-point weight in the folder's safetensors files is finite.

    Streams one tensor at a time. Returns None when the folder has no safetensors weights (a
    DeepSpeed-only checkpoint): unknown.
    """
    import torch
    from safetensors import safe_open

    files = _weights_files(Path(folder))
    if not files:
        return None
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = st.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return False
    return True
