"""The recipe's data: the task's splits (``data_prep``) or a ``--data_file``, formatted as TRL
prompt/completion rows (``retrofit.training.sft_data``)."""

from __future__ import annotations

from ..model.errors import RetrofitUserError
from .args import ScriptArgs, parse_levels


def task_splits(args: ScriptArgs):
    """The task's train / eval (test) / eval_interp / eval_extrap (/ valid) splits. Deterministic: the
    report rebuilds exactly the rows training held out."""
    from data_prep.tasks import build_splits

    return build_splits(
        args.task,
        n_train=args.n_train,
        n_eval=max(args.n_eval, 1),
        seed=args.task_seed,
        train_levels=parse_levels(args.train_levels),
        extrap_levels=parse_levels(args.extrap_levels),
        interp_levels=parse_levels(args.interp_levels) if args.interp_levels else ([] if args.train_levels else None),
        n_valid=args.n_valid,
    )


def use_chat(args: ScriptArgs, tokenizer) -> bool:
    if args.chat not in ("auto", "true", "false"):
        raise RetrofitUserError(f"--chat must be auto, true or false, got {args.chat!r}")
    return args.chat == "true" or (args.chat == "auto" and tokenizer.chat_template is not None)


def load_data(args: ScriptArgs, tokenizer, splits=None):
    """-> ``(train, eval or None, reports)``: TRL prompt/completion rows and the counts of skipped rows.

    ``splits``: the task's ``task_splits(args)`` when the caller already built them (``--task`` runs)."""
    import datasets

    from data_prep.chat import load_rows

    from ..training.sft_data import format_sft_dataset

    if args.data_file:
        train = datasets.Dataset.from_list(load_rows(args.data_file))
        evals = datasets.Dataset.from_list(load_rows(args.eval_file)) if args.eval_file else None
    else:
        splits = task_splits(args) if splits is None else splits
        train = splits["train"]
        evals = splits["valid"] if "valid" in splits else None
    chat = use_chat(args, tokenizer)
    train, report = format_sft_dataset(train, chat=chat)
    reports = {"train_rows": report}
    if evals is not None:
        evals, reports["eval_rows"] = format_sft_dataset(evals, chat=chat)
    return train, evals, reports
