"""Chat / SFT data: load rows from disk, and the SFT formatting entry point for data_prep users.

:func:`load_rows` reads a ``.jsonl`` / ``.json`` / ``.parquet`` file, a ``save_to_disk`` folder, a
Dataset / DatasetDict or a list of dicts into a list of row dicts (the recipes read ``--data_file``
through it). :func:`to_sft_dataset` is a thin alias of the project's one SFT formatter,
``retrofit.training.format_sft_dataset``, applied to those rows: rows need ``prompt`` and
``completion`` (or ``answer``, as the task rows of ``data_prep.tasks`` have) strings.
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


class DataError(ValueError):
    """A data problem the user can fix; names the row (or file line) and what is allowed.

    Attributes:
        row_index: Index of the offending row, or None for file-level problems.
        reason: A short tag of a row problem, or None.
    """

    def __init__(self, message: str, row_index: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.row_index = row_index
        self.reason = reason


# --- loading -----------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object") from None
    return rows


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # Many ".json" chat files are really JSON Lines.
        return _read_jsonl(path)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: top-level JSON must be a list of row objects, got {type(data).__name__}")
    return data


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


def load_rows(source: Any, split: str | None = None) -> list[dict]:
    """Loads raw rows from a file, a saved dataset folder, a Dataset, or a list.

    Args:
        source: A path to a ``.jsonl``/``.ndjson`` file, a ``.json`` file (a list of objects, or
            JSON Lines), a ``.parquet`` file, or a folder written by ``save_to_disk``
            (``Dataset`` or ``DatasetDict``); or a ``datasets.Dataset`` / ``DatasetDict``; or a
            list of dicts (returned as a list).
        split: Split to take from a DatasetDict; defaults to ``train`` (or the only split).

    Returns:
        A list of rows (dicts, unvalidated; :func:`to_sft_dataset` validates them).

    Raises:
        DataError: missing path, unsupported file type, unreadable file or invalid JSON line.
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
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise DataError(
        f"{path}: unsupported file type {suffix!r}; supported: .jsonl, .ndjson, .json, .parquet, a save_to_disk folder"
    )


# --- SFT formatting ----------------------------------------------------------------------------


def to_sft_dataset(source: Any, chat: bool = False, split: str | None = None):
    """Rows from any source :func:`load_rows` reads, formatted for TRL by the project's one SFT formatter.

    A thin alias: ``retrofit.training.format_sft_dataset(datasets.Dataset.from_list(load_rows(source, split)),
    chat=chat)``. Rows need ``prompt`` and ``completion`` (or ``answer``) strings; the formatter
    skips rows with an empty or non-string completion, counting them in its report.

    Args:
        source: a file, a ``save_to_disk`` folder, a Dataset / DatasetDict or a list of dicts.
        chat: emit conversational rows (one user and one assistant message) for a tokenizer
            with a chat template; else plain strings.
        split: the split of a DatasetDict (default ``train`` or the only split).

    Returns:
        ``(dataset, report)`` as ``format_sft_dataset`` returns them.

    Raises:
        DataError: the source cannot be read.
        retrofit.training.BadDataError: a required column is missing or no row is usable.
    """
    from retrofit.training import format_sft_dataset

    return format_sft_dataset(datasets.Dataset.from_list(load_rows(source, split)), chat=chat)


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes rows as JSON Lines (UTF-8, one object per line)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
