"""Weight files: safetensors only, and readable.

``safetensors_header`` checks a ``.safetensors`` header against the file's size (dtypes, shapes and
byte ranges); ``validate_weights`` checks every weights file of a folder (or the shards of an index),
``weights_are_finite`` whether they hold NaN/inf, and ``assert_safetensors_only`` that no pickled
weights are present (transformers 5 writes nothing else for the model and PEFT adapters).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from .atomic_io import InvalidCheckpointError, read_json

# files that hold a model's (or adapter's) weights, in either a plain or a DeepSpeed save
_WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")

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


def assert_safetensors_only(path: str | os.PathLike) -> None:
    """Raise if ``path`` holds pickled weights (``*.bin`` model or adapter files)."""
    bad = [name for name in _PICKLED_WEIGHTS if (Path(path) / name).exists()]
    if bad:
        raise AssertionError(f"{path} holds pickled weights {bad}; retrofit saves safetensors only")


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
