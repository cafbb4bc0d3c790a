"""Evaluation rows: generated per task and level, then tokenized into prompt + gold answer.

Rows come from ``build_dataset(task, levels, n, derive_seed(seed, "retrofit-eval"))``: fresh
instances from a stream distinct from ``build_splits``' training stream (which uses ``seed``
itself). They are not de-duplicated against a training set; pass ``rows=`` (e.g. the
``eval``/``eval_interp``/``eval_extrap`` splits of ``build_splits``) for held-out instances.

Input format. By default the prompt is continued raw: the model sees ``prompt`` (with the
tokenizer's own special tokens, e.g. BOS) and the gold answer text is ``answer_sep + answer``
(``"+ 3 4 =" → " 7"``). With ``chat`` the prompt is the user turn of the tokenizer's chat template
with the generation prompt appended, and the answer follows directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import analysis as A
from .options import DEFAULT_N, EvalOptions

__all__ = ["Example", "levels_for", "prepare", "split_of", "task_rows"]


def levels_for(task, levels) -> list[int] | None:
    """``levels`` for ``task``: a list for every task, or ``{task name: list}`` (None = not given)."""
    if levels is None:
        return None
    if isinstance(levels, Mapping):
        levels = levels.get(task.name)
        if levels is None:
            return None
    return [int(x) for x in levels]


def split_of(level, train_levels: Sequence[int]) -> str:
    """``"train"``, ``"interp"`` (held out inside the training range) or ``"extrap"``."""
    if level in train_levels:
        return "train"
    if train_levels and min(train_levels) < level < max(train_levels):
        return "interp"
    return "extrap"


def task_rows(task, levels=None, n: int = DEFAULT_N, seed: int = 0, limit: int | None = None) -> list[dict]:
    """The evaluation rows of one task (seed: module docstring).

    Args:
        task: registry key or ``data_prep`` Task.
        levels: difficulty levels; default: the task's default levels (train + held out).
        n: examples per level.
        seed: base seed.
        limit: at most this many rows in total, spread round-robin over the levels (evenly
            spaced levels when ``limit`` is below the number of levels), for quick looks.

    Returns:
        Rows with ``prompt``, ``answer``, ``difficulty``, ``task`` (+ ``token_features`` JSON).
    """
    from data_prep.common import derive_seed
    from data_prep.tasks import build_dataset, get_task

    task = get_task(task)
    levels = task.default_levels if levels is None else list(levels)
    if not levels:
        raise ValueError(f"{task.name}: no levels to evaluate")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (examples per level) must be a positive int, got {n!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or a positive int, got {limit!r}")
    levels = sorted(set(levels))
    if limit is not None and limit < len(levels):
        keep = np.unique(np.round(np.linspace(0, len(levels) - 1, limit)).astype(int))
        levels = [levels[i] for i in keep]
    per_level = n if limit is None else min(n, math.ceil(limit / len(levels)))
    rows = build_dataset(task, levels, per_level, derive_seed(seed, "retrofit-eval")).to_list()
    if limit is not None and len(rows) > limit:
        by_level: dict[int, list[dict]] = {}
        for r in rows:
            by_level.setdefault(r["difficulty"], []).append(r)
        picked: list[dict] = []
        k = 0
        while len(picked) < limit:
            for lvl in levels:
                if k < len(by_level.get(lvl, [])) and len(picked) < limit:
                    picked.append(by_level[lvl][k])
            k += 1
        rows = sorted(picked, key=lambda r: levels.index(r["difficulty"]))
    return rows


@dataclass
class Example:
    """One row, tokenized: ``prompt_ids`` then ``answer_ids`` (the gold answer segment).

    Attributes:
        row: the row as given.
        level: its difficulty.
        prompt_ids: ``[P]`` prompt tokens (with the tokenizer's special tokens or the chat template).
        answer_ids: ``[m]`` tokens of ``segment``.
        segment: the answer text as tokenized (``answer_sep + answer``, or the answer in chat mode).
        owner: ``[m]`` answer word owning each answer token, -1 = whitespace only.
        first_tok: ``[n_words]`` each answer word's first token (-1 = none of its own).
        features: per-word ``token_features`` (BREVO, LANO) or None.
    """

    row: dict
    level: Any
    prompt_ids: list[int]
    answer_ids: list[int]
    segment: str
    owner: np.ndarray
    first_tok: np.ndarray
    features: list[dict] | None

    @property
    def content(self) -> np.ndarray:
        """``[m]`` bool: answer tokens that hold a non-whitespace character."""
        return self.owner >= 0


def prepare(rows: Sequence[Mapping[str, Any]], tokenizer, opts: EvalOptions) -> list[Example]:
    """Tokenize rows into :class:`Example` (format: module docstring).

    Raises:
        ValueError: a row without ``prompt``/``answer``/``difficulty``, an empty prompt or answer, a
            ``token_features`` list of the wrong length, or ``chat`` with a tokenizer without a template.
    """
    from data_prep.tasks import decode_features

    out = []
    for i, row in enumerate(rows):
        for key in ("prompt", "answer", "difficulty"):
            if key not in row:
                raise ValueError(f"row {i} has no {key!r} column; rows need prompt, answer and difficulty")
        prompt, answer = str(row["prompt"]), str(row["answer"])
        if opts.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            segment = answer
        else:
            prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
            segment = opts.answer_sep + answer
        if not prompt_ids:
            raise ValueError(f"row {i}: the prompt tokenizes to nothing")
        ids, offsets = A.encode_with_offsets(tokenizer, segment)
        owner = A.token_word_owner(segment, offsets)
        if not (owner >= 0).any():
            raise ValueError(f"row {i}: the answer {answer!r} has no non-whitespace token")
        feats = decode_features(dict(row))
        n_words = len(A.word_spans(answer))
        if feats is not None and len(feats) != n_words:
            raise ValueError(f"row {i}: {len(feats)} token_features for {n_words} answer words")
        out.append(
            Example(
                row=dict(row),
                level=row["difficulty"],
                prompt_ids=prompt_ids,
                answer_ids=list(ids),
                segment=segment,
                owner=owner,
                first_tok=A.first_tokens_of_words(segment, offsets),
                features=feats,
            )
        )
    return out
