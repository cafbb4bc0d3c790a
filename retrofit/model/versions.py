"""Supported versions of the Hugging Face stack, checked once when ``retrofit`` is imported.

retrofit subclasses transformers' configs and models, hands its own cache object to the base
decoder layers and plugs into TRL's and PEFT's trainers and adapters; each of these leans on
internals that change between major versions (transformers 5 renamed ``past_key_values`` to
``cache`` and turned configs into dataclasses, for instance). An untested major version
therefore fails early, on ``import retrofit``, with a message that names the package, the
version found and the range that works — instead of failing later with an obscure error deep
inside a forward or a trainer.

The ranges here are the ones declared in ``setup.cfg`` (``install_requires``); the versions they
were tested with are in ``TESTED``. A package that is not installed is not checked (TRL and PEFT
are only needed by training and adapters; using them then fails at their own import).

Bypass, at your own risk (for example to try a new release)::

    RETROFIT_SKIP_VERSION_CHECK=1 python -c "import retrofit"
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

SKIP_ENV = "RETROFIT_SKIP_VERSION_CHECK"

#: package -> (minimum, exclusive maximum), as in setup.cfg's install_requires
SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.0", "6"),
    "trl": ("1.0", "2"),
    "peft": ("0.17", "1"),
}

#: the versions the test suite ran with (shown in the error message)
TESTED: dict[str, str] = {"transformers": "5.24", "trl": "1.16", "peft": "0.21"}


class UnsupportedVersionError(ImportError):
    """An installed dependency is outside the range retrofit supports."""


@dataclass(frozen=True)
class VersionProblem:
    """One installed package outside its supported range."""

    package: str
    found: str
    minimum: str
    maximum: str

    @property
    def requirement(self) -> str:
        return f"{self.package}>={self.minimum},<{self.maximum}"

    def message(self) -> str:
        tested = TESTED.get(self.package)
        tested = f", tested with {tested}" if tested else ""
        return f"{self.package} {self.found} is installed, but retrofit supports {self.requirement}{tested}"


def installed_version(package: str) -> str | None:
    """The installed distribution version of ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(v: str) -> tuple[int, ...]:
    # Compare release numbers only, so pre-releases of a supported line count as that line
    # (5.0.0rc1 is a transformers 5; 6.0.0.dev0 is a transformers 6).
    rel = Version(v).release
    return rel + (0,) * (3 - len(rel))


def find_problems(versions: dict[str, str | None] | None = None, packages=None) -> list[VersionProblem]:
    """Installed packages outside ``SUPPORTED``.

    Args:
        versions: package -> version string (None = not installed); defaults to what is installed.
        packages: check only these keys of ``SUPPORTED`` (default: all).

    Returns:
        One ``VersionProblem`` per package outside its range (empty when all is well).
    """
    wanted = {p: r for p, r in SUPPORTED.items() if packages is None or p in packages}
    if versions is None:
        versions = {p: installed_version(p) for p in wanted}
    problems = []
    for package, (lo, hi) in wanted.items():
        found = versions.get(package)
        if found is None:
            continue
        try:
            ok = _release(lo) <= _release(found) < _release(hi)
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(VersionProblem(package, found, lo, hi))
    return problems


def check_versions(
    action: str = "raise", versions: dict[str, str | None] | None = None, packages=None
) -> list[VersionProblem]:
    """Fail early on an untested version of transformers, TRL or PEFT.

    Args:
        action: ``"raise"`` (``UnsupportedVersionError``), ``"warn"`` (a ``UserWarning``) or
            ``"ignore"`` (only return the problems).
        versions: package -> version, overriding what is installed (tests).
        packages: check only these packages (default: all of ``SUPPORTED``); the modeling code,
            which also ships in exported folders, checks transformers only.

    Returns:
        The problems found (empty when every installed package is in range, or when the
        ``RETROFIT_SKIP_VERSION_CHECK=1`` environment variable is set).

    Raises:
        UnsupportedVersionError: with ``action="raise"``, when a package is out of range.
        ValueError: for an unknown ``action``.
    """
    if action not in ("raise", "warn", "ignore"):
        raise ValueError(f"action must be 'raise', 'warn' or 'ignore', got {action!r}")
    if os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes"):
        return []
    problems = find_problems(versions, packages)
    if not problems or action == "ignore":
        return problems
    pins = " ".join(f"'{p.requirement}'" for p in problems)
    msg = (
        "retrofit: unsupported dependency version(s):\n"
        + "\n".join(f"  - {p.message()}" for p in problems)
        + f"\nInstall a supported version (pip install {pins}), or set {SKIP_ENV}=1 to skip this check "
        "at your own risk."
    )
    if action == "raise":
        raise UnsupportedVersionError(msg)
    warnings.warn(msg, stacklevel=2)
    return problems
