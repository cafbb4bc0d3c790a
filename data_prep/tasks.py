"""The task registry and dataset assembly for complexity-controlled evaluation (docs/evaluation.md).

``TASKS`` is the one explicit registry; :func:`get_task` raises with the valid keys.

Columns of every built dataset: ``prompt`` (str), ``answer`` (str), ``difficulty`` (int, the
level), ``task`` (str), plus ``token_features`` (a JSON string; decode with
:func:`decode_features`) for tasks that have per-answer-token features (BREVO, LANO).  Storing the
features as JSON keeps the Arrow schema identical across tasks and levels.

Example::

    from data_prep.tasks import build_splits
    dd = build_splits("mano", n_train=1000, n_eval=100, seed=0)
    # DatasetDict with "train", "eval" (training levels, fresh instances), "eval_interp",
    # "eval_extrap" (held-out levels)
"""

from __future__ import annotations

import json
import logging

import datasets

from data_prep import brevo, clrs, gsm, lano, mano, rg_tasks
from data_prep.common import Task, derive_seed

logger = logging.getLogger(__name__)

# reasoning-gym has all four requested generators (chain_sum, maze, sudoku, path_star), so none
# is skipped.
TASKS: dict[str, Task] = {
    "mano": mano.TASK,
    "brevo": brevo.TASK,
    "lano": lano.TASK,
    **clrs.TASKS,
    "gsm": gsm.TASK,
    **rg_tasks.TASKS,
}

BASE_COLUMNS = ("prompt", "answer", "difficulty", "task")
# Extra rounds build_splits may spend topping up an eval split after de-duplication; small
# levels (e.g. MANO L=1 has 1,587 distinct prompts) can run out of fresh instances.
_MAX_FILL_ROUNDS = 8


def get_task(task: str | Task) -> Task:
    """Returns the registered :class:`Task` for a key (a Task passes through).

    Raises:
        ValueError: unknown key; the message lists the valid keys.
    """
    if isinstance(task, Task):
        return task
    try:
        return TASKS[task]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(sorted(TASKS))}") from None


def _features(task: Task) -> datasets.Features:
    cols = {
        "prompt": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "difficulty": datasets.Value("int64"),
        "task": datasets.Value("string"),
    }
    if task.has_token_features:
        cols["token_features"] = datasets.Value("string")
    return datasets.Features(cols)


def rows_to_dataset(task: str | Task, rows: list[dict]) -> datasets.Dataset:
    """Converts generator rows into a Dataset with the fixed schema (token_features as JSON)."""
    task = get_task(task)
    cols: dict[str, list] = {c: [r[c] for r in rows] for c in BASE_COLUMNS}
    if task.has_token_features:
        cols["token_features"] = [json.dumps(r["token_features"], sort_keys=True) for r in rows]
    return datasets.Dataset.from_dict(cols, features=_features(task))


def decode_features(row: dict) -> list[dict] | None:
    """Returns a row's per-answer-token features as a list of dicts.

    Accepts a dataset row (``token_features`` is a JSON string) or a generator row (already a
    list).  Returns None for tasks without token features.
    """
    value = row.get("token_features")
    if value is None:
        return None
    if isinstance(value, str):
        return json.loads(value)
    return list(value)


def _check_levels(task: Task, levels, what: str) -> list[int]:
    levels = list(levels)
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, int):
            raise ValueError(f"{task.name}: {what} must be ints, got {level!r}")
    if len(set(levels)) != len(levels):
        raise ValueError(f"{task.name}: {what} has duplicates: {levels}")
    return levels


def build_dataset(task: str | Task, levels, n_per_level: int, seed: int) -> datasets.Dataset:
    """Generates ``n_per_level`` rows at each level and returns one Dataset.

    Args:
        task: Registry key or Task.
        levels: Difficulty levels (values of the task's knob).
        n_per_level: Rows per level.
        seed: Base seed; each level uses its own stream, so the rows of a level do not depend on
            which other levels are requested.

    Returns:
        A Dataset with ``prompt, answer, difficulty, task`` (+ ``token_features`` as JSON).
    """
    task = get_task(task)
    rows = []
    for level in _check_levels(task, levels, "levels"):
        rows.extend(task.generate(level, n_per_level, seed))
    return rows_to_dataset(task, rows)


def _fresh_rows(task: Task, level: int, n: int, seed: int, tag: str, exclude: set[str]) -> list[dict]:
    """Up to ``n`` rows at ``level`` whose dedup keys are not in ``exclude`` (updated in place)."""
    rows: list[dict] = []
    for attempt in range(_MAX_FILL_ROUNDS):
        need = n - len(rows)
        if need <= 0:
            break
        # Ask for a few extra each round so one round usually suffices after dedup.
        batch = task.generate(level, need + max(4, need // 4), derive_seed(seed, tag, attempt))
        for row in batch:
            key = task.dedup_key(row)
            if key not in exclude:
                exclude.add(key)
                rows.append(row)
                if len(rows) == n:
                    break
    if len(rows) < n:
        logger.warning(
            "%s level %s (%s): only %d of %d unseen instances after %d rounds; the level has few distinct prompts",
            task.name,
            level,
            tag,
            len(rows),
            n,
            _MAX_FILL_ROUNDS,
        )
    return rows


def build_splits(
    task: str | Task,
    n_train: int,
    n_eval: int,
    seed: int,
    train_levels=None,
    interp_levels=None,
    extrap_levels=None,
    n_valid: int = 0,
) -> datasets.DatasetDict:
    """Builds train and evaluation splits with held-out difficulty levels.

    Splits: ``train`` (``n_train`` rows per training level), ``eval`` (``n_eval`` fresh rows per
    training level), ``eval_interp`` and ``eval_extrap`` (``n_eval`` rows per held-out level).  A
    split with no levels is omitted.  Train may repeat an instance (small levels have few); every
    eval split is de-duplicated and shares no instance with train or with another eval split
    (instance = prompt, or prompt + answer for tasks whose prompt does not identify the instance,
    i.e. LANO).  When a level has too few distinct instances an eval split gets fewer rows and a
    warning is logged.

    Args:
        task: Registry key or Task.
        n_train: Training rows per training level.
        n_eval: Evaluation rows per level in each eval split.
        seed: Base seed; train uses it directly (same rows as :func:`build_dataset`), each eval
            split uses derived, independent seeds.
        train_levels: Defaults to ``task.default_train_levels`` minus any level given in
            ``interp_levels`` / ``extrap_levels`` (so holding a level out is one argument).
        interp_levels: Defaults to ``task.interp_levels``; pass ``[]`` to omit the split.
        extrap_levels: Defaults to ``task.extrap_levels``; pass ``[]`` to omit the split.
        n_valid: Validation rows per level (train, interp and extrap levels) in a ``valid`` split, drawn
            after the eval splits and disjoint from all of them: settings are chosen on ``valid`` and
            reported on the eval splits. 0 omits the split.

    Returns:
        A DatasetDict.

    Raises:
        ValueError: unknown task, invalid or overlapping levels, or no training levels.
    """
    task = get_task(task)
    interp_levels = _check_levels(task, task.interp_levels if interp_levels is None else interp_levels, "interp_levels")
    extrap_levels = _check_levels(task, task.extrap_levels if extrap_levels is None else extrap_levels, "extrap_levels")
    if train_levels is None:
        held_out = set(interp_levels) | set(extrap_levels)
        train_levels = [lv for lv in task.default_train_levels if lv not in held_out]
    train_levels = _check_levels(task, train_levels, "train_levels")
    if not train_levels:
        raise ValueError(f"{task.name}: train_levels is empty")
    for a_name, a, b_name, b in [
        ("train_levels", train_levels, "interp_levels", interp_levels),
        ("train_levels", train_levels, "extrap_levels", extrap_levels),
        ("interp_levels", interp_levels, "extrap_levels", extrap_levels),
    ]:
        if set(a) & set(b):
            raise ValueError(f"{task.name}: {a_name} and {b_name} overlap at {sorted(set(a) & set(b))}")

    # Train uses ``seed`` itself, so it equals build_dataset(task, train_levels, n_train, seed).
    train_rows = []
    for level in train_levels:
        train_rows.extend(task.generate(level, n_train, seed))
    seen = {task.dedup_key(r) for r in train_rows}

    splits = {"train": rows_to_dataset(task, train_rows)}
    for split, levels in [("eval", train_levels), ("eval_interp", interp_levels), ("eval_extrap", extrap_levels)]:
        if not levels:
            continue
        rows = []
        for level in levels:
            rows.extend(_fresh_rows(task, level, n_eval, seed, split, seen))
        splits[split] = rows_to_dataset(task, rows)
    if n_valid > 0:
        rows = []
        for level in [*train_levels, *interp_levels, *extrap_levels]:
            rows.extend(_fresh_rows(task, level, n_valid, seed, "valid", seen))
        splits["valid"] = rows_to_dataset(task, rows)
    return datasets.DatasetDict(splits)
