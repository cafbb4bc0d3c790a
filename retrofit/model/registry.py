"""The halting-method registry: one entry per method, ``name -> class`` (docs/architecture.md, "adding a method").

A method is one module in ``retrofit/model/halting/`` defining a ``HaltingMethod`` subclass; its entry is one
``register(...)`` line in ``retrofit/model/halting/__init__.py``. Everything else asks the class what it needs
(``HaltingMethod``'s declarations: its default attention, its options dataclass, its decision threshold and
rule, how often its decider runs, its model-card rows, whether the vLLM plugin serves it).

This module imports nothing, so ``retrofit.model.config`` can validate a ``LoopConfig`` against the registry
while the methods themselves import ``config``. The entries are made when ``retrofit.model.halting`` is
imported, which every entry point does first (``import retrofit``, the model classes, an exported folder's
bundled code).
"""

from __future__ import annotations

_METHODS: dict[str, type] = {}


class UnknownMethodError(ValueError):
    """A method name that is not registered (the message lists the registered ones)."""


def register(cls: type) -> type:
    """Add a ``HaltingMethod`` subclass under its ``name`` (a second class under the same name is an error)."""
    name = getattr(cls, "name", "")
    if not name:
        raise ValueError(f"{cls.__name__} has no `name`: a halting method needs one to be registered")
    if _METHODS.get(name, cls) is not cls:
        raise ValueError(f"method {name!r} is already registered as {_METHODS[name].__name__}")
    _METHODS[name] = cls
    return cls


def names() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    if not _METHODS:
        raise RuntimeError("no halting method is registered: import retrofit (or retrofit.model.halting) first")
    return tuple(_METHODS)


def option_fields() -> dict[str, tuple[object, tuple[str, ...]]]:
    """Every registered method's options: ``{option name: (its dataclass field, the methods that have it)}`` (the
    recipes' and ``retrofit convert``'s flags are made from these)."""
    import dataclasses

    out: dict[str, tuple[object, tuple[str, ...]]] = {}
    for name, cls in _METHODS.items():
        for f in dataclasses.fields(cls.Options):
            field, owners = out.get(f.name, (f, ()))
            out[f.name] = (field, (*owners, name))
    return out


def method_class(name: str) -> type:
    """The class registered under ``name``.

    Raises:
        UnknownMethodError: ``name`` is not registered; the message lists the methods that are.
    """
    try:
        return _METHODS[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}; allowed: {', '.join(names())}") from None
