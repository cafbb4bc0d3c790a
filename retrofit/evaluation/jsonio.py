"""Strict JSON for evaluation results (NumPy and torch values understood, NaN -> null), written atomically by
``retrofit.hub.atomic_io.write_text_atomic`` (the project's one atomic writer)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

__all__ = ["atomic_write_text", "to_jsonable", "write_json"]


# ----------------------------------------------------------------------------------------------


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
    raise TypeError(f"write_json: dict key {k!r} of type {type(k).__name__} at {loc} is not a JSON key")


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
    raise TypeError(f"write_json: object of type {type(obj).__name__} at {_loc} is not JSON serializable")


def atomic_write_text(text: str, path: str | os.PathLike) -> str:
    """Write ``text`` atomically (``retrofit.hub.atomic_io.write_text_atomic``: temp file, fsync, ``os.replace``,
    fsync of the folder); returns ``path`` as a string."""
    from ..hub.atomic_io import write_text_atomic

    return str(write_text_atomic(path, text))


def write_json(obj: Any, path: str | os.PathLike, indent: int = 2) -> str:
    """Serialize ``obj`` to strict JSON at ``path`` atomically.

    The whole document is serialized in memory first (see :func:`to_jsonable`), then written
    through the project's one atomic writer (``retrofit.hub.atomic_io.write_text_atomic``); a
    failure at any point leaves a previous file at ``path`` untouched and no partial file.

    Args:
        obj: results (dicts, lists, NumPy/torch values, ...).
        path: destination; parent directories are created.
        indent: JSON indentation.

    Returns:
        ``path`` as a string.

    Raises:
        TypeError: if a value cannot be converted (the message names its type and location).
    """
    text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False, ensure_ascii=False) + "\n"
    return atomic_write_text(text, path)
