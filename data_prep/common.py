"""Shared pieces of the complexity-controlled task generators (docs/evaluation.md).

Every task module builds one :class:`Task`; ``data_prep.tasks.TASKS`` is the single registry.

The contract every task honours:

* ``generate(level, n, seed) -> list[dict]``: rows with ``prompt`` (str, ends so that the answer
  follows directly), ``answer`` (short, single line), ``difficulty`` (int, equal to ``level``) and
  ``task`` (str).  Tasks with per-answer-token features add ``token_features``: a list with one
  dict per whitespace-separated answer token.
* The same ``(level, n, seed)`` gives identical rows, and each level draws from its own RNG
  stream (:func:`level_rng`), so adding or removing levels never changes the rows of another.
* ``score(prediction, answer, prompt=None) -> bool``; a task whose answer alone cannot judge a
  prediction (BREVO: any valid topological order is right, and the order's constraints are in
  the prompt) sets ``score_uses_prompt`` and requires the prompt.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ANSWER_SEP", "Task", "check_level", "derive_seed", "exact_match", "first_line", "level_rng"]

#: Text between a task row's ``prompt`` and its ``answer`` when they are joined into one raw (non-chat) string:
#: SFT formatting (``retrofit.training.sft_data.format_sft_dataset``), ``retrofit eval``
#: (``EvalOptions.answer_sep``) and the lm-eval task folders all use it, so a model is evaluated on the text it
#: was trained on ("+ 3 4 = 7").
ANSWER_SEP = " "


def derive_seed(*parts: object) -> int:
    """Returns a stable 63-bit integer seed derived from ``parts``.

    Python's ``hash()`` of a str is salted per process (PYTHONHASHSEED), so it must never feed a
    seed; SHA-256 of the parts' ``repr`` is stable across processes and machines.

    Args:
        *parts: Anything with a deterministic ``repr`` (ints, strs, tuples of them).

    Returns:
        An int in ``[0, 2**63)``.
    """
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def level_rng(name: str, level: int, seed: int) -> random.Random:
    """Returns the RNG stream of one ``(task, level, seed)``.

    ``random.Random`` seeded with a str hashes it with SHA-512 (not the salted ``hash()``), so the
    stream is reproducible across processes.
    """
    return random.Random(f"{name}-{level}-{seed}")


def first_line(text: str) -> str:
    """Returns the first non-empty line of ``text`` with runs of whitespace collapsed to one space.

    Generations often run on after the answer (a newline, then more text); scoring only the first
    line makes exact match robust to that without accepting a wrong first line.
    """
    for line in str(text).splitlines():
        if line.strip():
            return " ".join(line.split())
    return ""


def exact_match(prediction: str, answer: str) -> bool:
    """Exact match after whitespace normalisation.

    Both sides are reduced with :func:`first_line` (strip, collapse internal whitespace runs), so
    trailing text after the first line of ``prediction`` is ignored; anything else on the first
    line counts as wrong.

    Args:
        prediction: Model output.
        answer: Gold answer (single line).

    Returns:
        True when the normalised first line of ``prediction`` equals the normalised ``answer``.
    """
    if not isinstance(prediction, str):
        return False
    return first_line(prediction) == first_line(answer)


def check_level(name: str, level: int, min_level: int, max_level: int | None) -> None:
    """Raises ValueError when ``level`` is outside ``[min_level, max_level]`` (or not an int)."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"{name}: level must be an int, got {level!r}")
    upper = "inf" if max_level is None else str(max_level)
    if level < min_level or (max_level is not None and level > max_level):
        raise ValueError(f"{name}: level {level} is outside the allowed range [{min_level}, {upper}]")


@dataclass(frozen=True)
class Task:
    """One complexity-controlled task.

    Attributes:
        name: Registry key, also written into each row's ``task`` column.
        knob: Name of the difficulty knob that ``level`` sets (e.g. ``"L"`` operators for MANO).
        default_train_levels: Levels used for training by default.
        interp_levels: Held-out levels inside the training range (interpolation).
        extrap_levels: Held-out levels outside the training range (extrapolation).
        generate_fn: ``(level, n, seed) -> list[dict]``; called through :meth:`generate`, which
            validates ``level`` and ``n`` first.
        score_fn: ``(prediction, answer) -> bool``, or ``(prediction, answer, prompt) -> bool`` when
            ``score_uses_prompt``; defaults to :func:`exact_match`.
        min_level: Smallest valid level.
        max_level: Largest valid level, or None when unbounded.
        has_token_features: Whether rows carry a ``token_features`` column.
        dedup_on_answer: When the prompt does not identify an instance (LANO's prompt only states
            the length), train/eval de-duplication keys on ``prompt + answer`` instead of the
            prompt alone.
        score_uses_prompt: ``score_fn`` needs the row's prompt (BREVO).
        description: One line for ``--help`` and summaries.
        level_names: Optional display names of levels (GSM: 0 -> "MAIN-like", ...).
    """

    name: str
    knob: str
    default_train_levels: list[int]
    interp_levels: list[int]
    extrap_levels: list[int]
    generate_fn: Callable[[int, int, int], list[dict]]
    score_fn: Callable[[str, str], bool] = exact_match
    min_level: int = 1
    max_level: int | None = None
    has_token_features: bool = False
    dedup_on_answer: bool = False
    score_uses_prompt: bool = False
    description: str = ""
    level_names: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        overlap = set(self.default_train_levels) & (set(self.interp_levels) | set(self.extrap_levels))
        if overlap:
            raise ValueError(f"{self.name}: held-out levels {sorted(overlap)} are also training levels")
        for level in self.default_levels:
            check_level(self.name, level, self.min_level, self.max_level)

    @property
    def default_levels(self) -> list[int]:
        """All default levels (train, interpolation and extrapolation), sorted."""
        return sorted(set(self.default_train_levels) | set(self.interp_levels) | set(self.extrap_levels))

    def generate(self, level: int, n: int, seed: int) -> list[dict]:
        """Generates ``n`` rows at difficulty ``level`` (deterministic in ``seed``).

        Raises:
            ValueError: ``level`` outside ``[min_level, max_level]`` or ``n`` negative.
        """
        check_level(self.name, level, self.min_level, self.max_level)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.name}: n must be a non-negative int, got {n!r}")
        return self.generate_fn(level, n, seed)

    def score(self, prediction: str, answer: str, prompt: str | None = None) -> bool:
        """Whether ``prediction`` is correct for gold ``answer`` (see the task module).

        Raises:
            ValueError: the task judges with the prompt (``score_uses_prompt``) and none was given.
        """
        if self.score_uses_prompt:
            if prompt is None:
                raise ValueError(
                    f"{self.name}: scoring needs the row's prompt (score(prediction, answer, prompt=row['prompt'])): "
                    "the answer alone cannot tell which other answers are also right"
                )
            return bool(self.score_fn(prediction, answer, prompt))
        return bool(self.score_fn(prediction, answer))

    def dedup_key(self, row: dict) -> str:
        """The string that identifies an instance for train/eval de-duplication."""
        if self.dedup_on_answer:
            return f"{row['prompt']}\x00{row['answer']}"
        return row["prompt"]
