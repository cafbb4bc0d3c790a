"""A YAML file the user gave (a recipe's ``--config``, a study file), read with one clear error.

Not in ``retrofit.model.errors``: that module is bundled into exported checkpoints, which import only torch,
transformers and the hub client."""

from __future__ import annotations

from pathlib import Path

from ..model.errors import RetrofitUserError


def read_yaml(path, what: str):
    """The YAML file ``path`` parsed (``yaml.safe_load``); a missing file or a syntax error is a
    :class:`RetrofitUserError` naming ``what`` (e.g. ``"--config"``), the file, and the line and column of the
    problem, instead of a traceback through the YAML parser."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RetrofitUserError(f"{what} {path} does not exist (or is not a file)")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        if "mapping values are not allowed" in problem:
            problem += " (a value with ': ' in it needs quotes)"
        raise RetrofitUserError(f"{what} {path} is not valid YAML{where}: {problem}") from None
