"""Moved to ``retrofit.hub.loading``; this old import path stays an alias of that module (same object)."""

import sys

from .hub import loading as _module

sys.modules[__name__] = _module
