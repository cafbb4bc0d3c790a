"""How the full-sequence forward attends: ``Settings`` (dense reference, query block size, chunk kernel),
changed for a block of code with ``settings(...)`` (tests and benchmarks; docs/long-context.md).
``retrofit.model.depth_attention`` reads them when a forward starts and re-exports these names.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Settings:
    """How the full-sequence forward attends (read when the forward starts).

    Args:
        dense: run the original dense-mask implementation (``dense_reference``): ``[B, 1, T, T]`` additive
            masks for the prelude and coda, ``[B, 1, T, m·T]`` ones for the core. The reference; O(T²) memory.
        query_chunk: queries per block of the chunked kernel. Larger blocks mean fewer kernel calls and
            a larger transient mask (``query_chunk × m·T`` per block).
        chunk_kernel: ``"auto"`` (PyTorch's flash-attention CPU kernels on CPU, else ``"math"``), ``"cpu"``
            or ``"math"`` (matmul + softmax per block, any device).
    """

    dense: bool = False
    query_chunk: int = 128
    chunk_kernel: str = "auto"

    def __post_init__(self):
        if not isinstance(self.query_chunk, int) or self.query_chunk < 1:
            raise ValueError(f"query_chunk must be an int >= 1, got {self.query_chunk!r}")
        if self.chunk_kernel not in ("auto", "cpu", "math"):
            raise ValueError(f"chunk_kernel must be 'auto', 'cpu' or 'math', got {self.chunk_kernel!r}")


_SETTINGS: contextvars.ContextVar[Settings] = contextvars.ContextVar("retrofit_depth_attention", default=Settings())


@contextlib.contextmanager
def settings(**changes):
    """Change ``Settings`` fields for the forwards started inside the block::

    with settings(query_chunk=8, chunk_kernel="math"):
        out = model(ids, labels=ids)
    """
    token = _SETTINGS.set(replace(_SETTINGS.get(), **changes))
    try:
        yield _SETTINGS.get()
    finally:
        _SETTINGS.reset(token)


def dense_reference():
    """Run the full-sequence forwards inside the block with the original dense masks (the reference)."""
    return settings(dense=True)
