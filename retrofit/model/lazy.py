"""Lazy re-exports for a package ``__init__`` (``retrofit.training``, ``retrofit.recipe``): each name is imported
from its defining module on first use, so importing one submodule of the package stays light."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for module ``package`` whose ``exports`` map a name to the (relative) module
    that defines it; a name is cached in the package's globals once imported."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
