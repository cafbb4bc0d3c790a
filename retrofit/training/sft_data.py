"""SFT rows: validation and formatting of a dataset into TRL prompt/completion rows, the trainer's
length filter, and what to do when there is no evaluation set.

Bad rows (missing columns, empty completions, rows longer than ``max_length``) are a clear error
(``BadDataError``) or a counted, logged skip (``format_sft_dataset`` before tokenization,
``drop_bad_rows`` after it). ``retrofit.training`` re-exports these names.
"""

from __future__ import annotations

import logging
from typing import Any

from ..model.errors import RetrofitUserError

logger = logging.getLogger(__name__)


class BadDataError(RetrofitUserError, ValueError):
    """The dataset cannot be used for SFT; the message says what is wrong and what is expected."""


def format_sft_dataset(
    dataset, chat: bool = False, completion_column: str | None = None, answer_sep: str | None = None
):
    """Validate rows and turn them into TRL prompt/completion rows.

    TRL joins a plain prompt and completion with nothing between them (``prompt + completion``), so
    a task row's separator goes into the completion: plain rows whose target is an ``answer`` column
    get ``completion = answer_sep + answer`` — the text ``retrofit eval`` scores after the prompt
    (``EvalOptions.answer_sep``, both default ``data_prep.common.ANSWER_SEP`` = ``" "``). A
    ``completion`` column is taken verbatim (TRL's convention: it holds its own leading space, if
    any), and chat rows need no separator (the template separates the turns).

    Args:
        dataset: a ``datasets.Dataset`` with a ``prompt`` column and a ``completion`` or ``answer``
            column (``data_prep.tasks.build_splits`` gives ``prompt, answer, difficulty, task``).
        chat: make conversational rows (``[{"role": "user", ...}]`` / ``[{"role": "assistant", ...}]``)
            for a tokenizer with a chat template; else plain strings (TRL appends EOS).
        completion_column: which column holds the target; default ``completion``, else ``answer``.
        answer_sep: text put before a plain ``answer`` target; None = ``ANSWER_SEP``. Ignored for a
            ``completion`` column and with ``chat``.

    Returns:
        ``(dataset, report)``: the formatted dataset (other columns kept) and a dict of counts
        ``{"rows", "kept", "empty_completion", "malformed"}``.

    Raises:
        BadDataError: a required column is missing, or no row is usable.
    """
    cols = list(dataset.column_names)
    if completion_column is None:
        completion_column = "completion" if "completion" in cols else "answer"
    missing = [c for c in ("prompt", completion_column) if c not in cols]
    if missing:
        raise BadDataError(
            f"the dataset lacks column(s) {missing}; it has {cols}. SFT rows need 'prompt' and "
            f"'completion' (or 'answer'), both strings"
        )
    n = len(dataset)
    kinds = []
    for p, c in zip(dataset["prompt"], dataset[completion_column]):
        if not isinstance(p, str) or not isinstance(c, str):
            kinds.append("malformed")
        elif not c.strip():
            kinds.append("empty_completion")
        else:
            kinds.append("ok")
    report = {
        "rows": n,
        "kept": kinds.count("ok"),
        "empty_completion": kinds.count("empty_completion"),
        "malformed": kinds.count("malformed"),
    }
    if report["kept"] == 0:
        raise BadDataError(f"no usable row in the dataset: {report}")
    if report["kept"] < n:
        logger.warning(
            "skipped %d of %d rows: %d with an empty completion, %d malformed (prompt/completion not strings)",
            n - report["kept"],
            n,
            report["empty_completion"],
            report["malformed"],
        )
        keep = [i for i, k in enumerate(kinds) if k == "ok"]
        dataset = dataset.select(keep)

    if answer_sep is None:
        from data_prep.common import ANSWER_SEP as answer_sep
    sep = answer_sep if completion_column == "answer" else ""

    def to_row(ex):
        p, c = ex["prompt"], ex[completion_column]
        if chat:
            return {"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}]}
        return {"prompt": p, "completion": sep + c}

    drop = [completion_column] if completion_column != "completion" else []
    if chat:
        drop += [c for c in ("prompt", "completion") if c in cols and c not in drop]
    dataset = dataset.map(to_row, remove_columns=drop or None)
    return dataset, report


def drop_bad_rows(dataset, max_length: int | None, name: str):
    """Drop (and count) tokenized rows longer than ``max_length`` or without a trainable token.

    TRL truncates long rows silently, which would cut answers; the trainer prepares rows untruncated
    and filters them here instead.

    Args:
        dataset: a tokenized ``datasets.Dataset`` (``input_ids``, optionally ``labels`` with -100 for
            positions that are not trained). Anything else (None, an iterable dataset, untokenized rows)
            is returned as is.
        max_length: the longest row kept, in tokens; None = no length limit.
        name: the split's name, for the log line and the error.

    Returns:
        ``(dataset, report)``: the kept rows and the counts ``{"rows", "kept", "too_long",
        "no_trainable_token"}``; ``report`` is None where the dataset was returned as is.

    Raises:
        BadDataError: no row is left.
    """
    import datasets

    if dataset is None or not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return dataset, None
    n = len(dataset)
    lengths = [len(x) for x in dataset["input_ids"]]
    has_labels = "labels" in dataset.column_names
    trainable = [any(t != -100 for t in x[1:]) for x in dataset["labels"]] if has_labels else [True] * n
    too_long = [max_length is not None and L > max_length for L in lengths]
    keep = [i for i in range(n) if trainable[i] and not too_long[i]]
    report = {"rows": n, "kept": len(keep), "too_long": sum(too_long), "no_trainable_token": n - sum(trainable)}
    if len(keep) < n:
        logger.warning(
            "%s: skipped %d of %d rows: %d longer than max_length=%s tokens, %d without a trainable token",
            name,
            n - len(keep),
            n,
            report["too_long"],
            max_length,
            report["no_trainable_token"],
        )
    if not keep:
        raise BadDataError(
            f"{name}: no row left after filtering ({report}); raise --max_length (longest row: {max(lengths)} tokens)"
        )
    return (dataset.select(keep) if len(keep) < n else dataset), report


def no_eval_without_eval_set(args, eval_dataset) -> None:
    """Turn periodic evaluation off, with a warning, when there is no evaluation set.

    A preset that evaluates every N steps (``eval_strategy: steps``) then still runs with
    ``--data_file`` and no ``--eval_file`` (the recipes' documented smoke commands) instead of
    failing in ``Trainer.__init__``. With ``load_best_model_at_end`` evaluation is needed: a clear error.
    """
    from transformers.trainer_utils import IntervalStrategy

    if eval_dataset is not None or args.eval_strategy in (None, IntervalStrategy.NO, "no"):
        return
    if args.load_best_model_at_end:
        raise BadDataError(
            "load_best_model_at_end needs an evaluation set, and none was given "
            "(--eval_file, or --n_eval > 0 for a task)"
        )
    logger.warning("no evaluation set: turning off periodic evaluation (eval_strategy %s -> no)", args.eval_strategy)
    args.eval_strategy = IntervalStrategy.NO
    args.do_eval = False


def to_sft_dataset(source: Any, chat: bool = False, split: str | None = None):
    """Rows from any source ``data_prep.chat.load_rows`` reads, formatted for TRL by the project's one SFT
    formatter: ``format_sft_dataset(datasets.Dataset.from_list(load_rows(source, split)), chat=chat)``.

    Rows need ``prompt`` and ``completion`` (or ``answer``) strings; the formatter skips rows with an empty
    or non-string completion, counting them in its report.

    Args:
        source: a file, a ``save_to_disk`` folder, a Dataset / DatasetDict or a list of dicts.
        chat: emit conversational rows (one user and one assistant message) for a tokenizer
            with a chat template; else plain strings.
        split: the split of a DatasetDict (default ``train`` or the only split).

    Returns:
        ``(dataset, report)`` as ``format_sft_dataset`` returns them.

    Raises:
        data_prep.chat.DataError: the source cannot be read.
        BadDataError: a required column is missing or no row is usable.
    """
    import datasets

    from data_prep.chat import load_rows

    return format_sft_dataset(datasets.Dataset.from_list(load_rows(source, split)), chat=chat)
