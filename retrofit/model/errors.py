"""Errors the user can fix, and how every entry point reports them: one line, exit code 2.

A bad input (a missing model path, a truncated GGUF file, a malformed ``--data_file``, an invalid
``LoopConfig``, an ``--out`` that would overwrite the input…) must end in *one* line that names the
input and the fix, never in a traceback through transformers, safetensors or Arrow. The library
raises a :class:`RetrofitUserError` subclass at the point where it knows what went wrong (it
checks inputs before handing them to third-party code, whose own messages rarely name the real
cause), and every entry point runs through :func:`run_cli`::

    # a recipe
    if __name__ == "__main__":
        sys.exit(run_cli(main))

    # the `retrofit` command (retrofit.cli.main) does the same for every subcommand

``run_cli`` prints ``error: <message>`` on stderr and returns 2 for a ``RetrofitUserError`` (and
for ``SystemExit("message")``, the older way of failing with a message); anything else is a bug
and keeps its traceback. ``RETROFIT_DEBUG=1`` prints the full traceback of user errors too.

Under ``accelerate launch`` the recipe process itself behaves the same (one line, exit code 2),
but the launcher then reports the child's failure in its own way: the single-process launcher
raises ``subprocess.CalledProcessError`` (a traceback, exit 1) unless it runs with
``accelerate launch -q`` (``--quiet``: nothing more, exit 1), and the multi-process launchers
(torchrun, DeepSpeed) print their ``ChildFailedError`` summary. The launcher is not retrofit's
code; the recipe's one line is always the last line it prints.

This module imports nothing heavy, so a failing entry point does not pay for torch first.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

DEBUG_ENV = "RETROFIT_DEBUG"
USER_ERROR_EXIT_CODE = 2


class RetrofitUserError(Exception):
    """A problem with the user's input or environment that the user can fix.

    The message is one sentence (or a few, on one line) that names the input and says what is
    allowed or what to do. Subclasses also derive from the builtin exception that fits
    (``ValueError``, ``FileNotFoundError``, ``RuntimeError``…), so existing ``except`` clauses keep
    working.
    """


def debug_enabled() -> bool:
    """``RETROFIT_DEBUG`` is set to a true value (1/true/yes): show full tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def one_line(message: object) -> str:
    """``message`` as one line: internal newlines and runs of whitespace become single spaces."""
    return " ".join(str(message).split())


def format_error(err: BaseException | str) -> str:
    """The line printed for a user error: ``error: <message>`` (a leading ``error:`` is not doubled)."""
    msg = one_line(err)
    if isinstance(err, BaseException) and not msg:
        msg = type(err).__name__
    while msg.lower().startswith("error:"):
        msg = msg[len("error:") :].strip()
    prefix = ""
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit() and int(world) > 1:  # several processes print: say which one
        prefix = f"[rank {os.environ.get('RANK', '?')}] "
    return f"{prefix}error: {msg}"


def _third_party_user_errors() -> tuple[type[BaseException], ...]:
    """User-error classes defined in modules that cannot depend on this one, when already imported."""
    found = []
    fam = sys.modules.get("retrofit.model.families")
    if fam is not None and hasattr(fam, "UnsupportedArchitectureError"):
        found.append(fam.UnsupportedArchitectureError)
    chat = sys.modules.get("data_prep.chat")  # data_prep never imports retrofit: its DataError is a user error
    if chat is not None and hasattr(chat, "DataError"):
        found.append(chat.DataError)
    return tuple(found)


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is a problem the user can fix (reported as one line, exit code 2)."""
    return isinstance(err, (RetrofitUserError, *_third_party_user_errors()))


def report_user_error(err: BaseException | str, file=None) -> int:
    """Print ``err`` as one ``error:`` line (after the traceback with ``RETROFIT_DEBUG=1``); returns 2."""
    file = sys.stderr if file is None else file
    if debug_enabled() and isinstance(err, BaseException):
        traceback.print_exception(type(err), err, err.__traceback__, file=file)
    print(format_error(err), file=file, flush=True)
    return USER_ERROR_EXIT_CODE


def run_cli(main: Callable[..., int | None], *args, **kwargs) -> int:
    """Run an entry point and turn user errors into one line and exit code 2.

    Args:
        main: the entry point (``main()`` of a recipe, a subcommand's ``run(args)``…).
        *args, **kwargs: passed to ``main``.

    Returns:
        ``main``'s return value (``None`` -> 0), or 2 after printing ``error: <message>`` on stderr
        when it raised a :class:`RetrofitUserError` or ``SystemExit`` with a message. Other
        exceptions propagate unchanged (they are bugs: their traceback is wanted), and so does
        ``SystemExit`` with an integer code (argparse's usage errors already print their message).

    Example::

        if __name__ == "__main__":
            sys.exit(run_cli(main))
    """
    try:
        rc = main(*args, **kwargs)
    except SystemExit as e:
        if isinstance(e.code, str):
            if debug_enabled():
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            return report_user_error(e.code)
        raise
    except BaseException as e:
        if not is_user_error(e):
            raise
        return report_user_error(e)
    return int(rc or 0)


def boolean_flag(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``) -> bool: the ``type`` of the command lines' true/false
    flags (``retrofit convert``, ``retrofit eval``)."""
    import argparse

    low = str(text).strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
