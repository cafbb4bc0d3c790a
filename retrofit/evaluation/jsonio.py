"""Strict JSON for evaluation results: the old import path of ``to_jsonable`` and ``write_json``.

The one JSON writer is ``retrofit.hub.atomic_io.write_json_atomic(path, obj, strict=True)`` (NumPy and torch
values understood, NaN -> null, written atomically); ``write_json(obj, path)`` is kept for callers of earlier
versions, with their argument order.
"""

from __future__ import annotations

import os
from typing import Any

from ..hub.atomic_io import to_jsonable, write_json_atomic

__all__ = ["to_jsonable", "write_json"]


def write_json(obj: Any, path: str | os.PathLike, indent: int = 2) -> str:
    """``write_json_atomic(path, obj, indent, strict=True)``; returns ``path`` as a string."""
    return str(write_json_atomic(path, obj, indent, strict=True))
