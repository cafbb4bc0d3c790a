"""Chat / SFT data: load rows from disk.

:func:`load_rows` reads a ``.jsonl`` / ``.json`` / ``.parquet`` file, a ``save_to_disk`` folder, a
Dataset / DatasetDict or a list of dicts into a list of row dicts (the recipes read ``--data_file``
through it). Formatting them for TRL is retrofit's job (``retrofit.training.sft_data.to_sft_dataset``):
``data_prep`` never imports ``retrofit``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets

logger = logging.getLogger(__name__)

_ACCEPTED = "'prompt' + 'completion' or 'prompt' + 'answer'"


class DataError(ValueError):
    """A data problem the user can fix; names the row (or file line) and what is allowed.

    retrofit's entry points report it as one ``error:`` line with exit code 2 like their own user errors
    (``retrofit.model.errors.is_user_error`` recognises it; ``data_prep`` does not import ``retrofit``).

    Attributes:
        row_index: Index of the offending row, or None for file-level problems.
        reason: A short tag of a row problem, or None.
    """

    def __init__(self, message: str, row_index: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.row_index = row_index
        self.reason = reason


# --- loading -----------------------------------------------------------------------------------


def _decode(raw: bytes, path: Path, lineno: int | None = None) -> str:
    try:
        return raw.decode("utf-8-sig" if lineno in (None, 1) else "utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{lineno}" if lineno is not None else str(path)
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the file as UTF-8"
        ) from None


def _read_jsonl(path: Path, lines: list[int] | None = None) -> list[dict]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object") from None
            if lines is not None:
                lines.append(lineno)
    return rows


def _read_json(path: Path, lines: list[int] | None = None) -> list[dict]:
    text = _decode(path.read_bytes(), path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a JSON list, broken (not JSON Lines)
            raise DataError(
                f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json file must hold one "
                "list of row objects, or one JSON object per line"
            ) from None
        # Many ".json" chat files are really JSON Lines.
        return _read_jsonl(path, lines)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: top-level JSON must be a list of row objects, got {type(data).__name__}")
    return data


def _kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _check_file_rows(rows: list, path: Path, lines: list[int] | None) -> None:
    """What a table needs from file rows: at least one, each a JSON object, and one JSON type per
    column (and per nested field), so that ``datasets.Dataset.from_list`` can build the Arrow table."""

    def where(i: int) -> str:
        return f"line {lines[i]}" if lines and i < len(lines) else f"row {i}"

    def at(i: int) -> str:
        return f"{path}:{lines[i]}" if lines and i < len(lines) else f"{path}: row {i}"

    if not rows:
        raise DataError(f"{path}: no rows (the file is empty); give one JSON object per row with {_ACCEPTED}")
    seen: dict[str, tuple[str, int]] = {}

    def visit(field: str, v: Any, i: int) -> None:
        k = _kind(v)
        if k is None:
            return
        prev = seen.setdefault(field, (k, i))
        if prev[0] != k:
            raise DataError(
                f"{at(i)}: field '{field}' is a {k} here but a {prev[0]} in {where(prev[1])}; "
                "every row must give a field the same type (e.g. all strings)",
                i,
                "mixed_types",
            )
        if k == "list":
            for x in v:
                visit(field + "[]", x, i)
        elif k == "object":
            for key, x in v.items():
                visit(f"{field}.{key}", x, i)

    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"{at(i)}: a row must be a JSON object with {_ACCEPTED}, "
                f"got a {_kind(row) or 'null'} ({json.dumps(row)[:60]})",
                i,
                "not_a_dict",
            )
        for key, v in row.items():
            visit(key, v, i)


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None


def _from_hf(obj, split: str | None, where: str) -> list[dict]:
    if isinstance(obj, datasets.DatasetDict):
        names = sorted(obj.keys())
        name = split if split is not None else ("train" if "train" in obj else (names[0] if len(names) == 1 else None))
        if name is None or name not in obj:
            raise DataError(f"{where}: choose a split with split=...; available splits: {', '.join(names)}")
        obj = obj[name]
    return obj.to_list()


def load_rows(source: Any, split: str | None = None, check_rows: bool = True) -> list[dict]:
    """Loads raw rows from a file, a saved dataset folder, a Dataset, or a list.

    Args:
        source: A path to a ``.jsonl``/``.ndjson`` file, a ``.json`` file (a list of objects, or
            JSON Lines), a ``.parquet`` file, or a folder written by ``save_to_disk``
            (``Dataset`` or ``DatasetDict``); or a ``datasets.Dataset`` / ``DatasetDict``; or a
            list of dicts (returned as a list).
        split: Split to take from a DatasetDict; defaults to ``train`` (or the only split).
        check_rows: for JSON / JSON Lines files, also require at least one row, every row a JSON
            object and one JSON type per field across rows (what ``datasets.Dataset.from_list``
            needs). :func:`to_sft_dataset` keeps it on: it builds a Dataset from the rows.

    Returns:
        A list of rows (their contents unvalidated; the SFT formatter checks prompt and completion).

    Raises:
        DataError: missing path, unsupported file type, unreadable or non-UTF-8 file, invalid JSON,
            and with ``check_rows`` an empty file, a row that is not an object, or a field whose type
            changes between rows. The message names the file and line, and what is allowed.
    """
    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        return _from_hf(source, split, "dataset")
    if isinstance(source, (list, tuple)):
        return list(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(
            f"cannot load rows from {type(source).__name__}; pass a path, a datasets.Dataset/DatasetDict or a list"
        )
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        if not any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise DataError(
                f"{path}: folder is not a dataset saved with save_to_disk (no dataset_info.json / dataset_dict.json)"
            )
        try:
            obj = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - surface as a data problem, not a deep datasets traceback
            raise DataError(f"{path}: cannot load with datasets.load_from_disk ({e})") from None
        return _from_hf(obj, split, str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        lines: list[int] = []
        try:
            rows = _read_jsonl(path, lines) if suffix != ".json" else _read_json(path, lines)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
        if check_rows:
            _check_file_rows(rows, path, lines)
        return rows
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise DataError(
        f"{path}: unsupported file type {suffix!r}; supported: .jsonl, .ndjson, .json, .parquet, a save_to_disk folder"
    )


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes rows as JSON Lines (UTF-8, one object per line)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
