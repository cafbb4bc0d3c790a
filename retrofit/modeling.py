"""Moved to ``retrofit.model.modeling``; this old import path stays an alias of that module (same object)."""

import sys

from .model import modeling as _module

sys.modules[__name__] = _module
