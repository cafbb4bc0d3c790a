"""The model arguments of :class:`~.model.RetrofitLM` (``--model_args``) that need checking: the exit policy
with its threshold or depth, the batch size, the dtype, the tokenizer."""

from __future__ import annotations

import logging

import torch

from retrofit.evaluation.options import DEFAULT_BATCH_SIZE

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "EXIT_POLICIES", "check_batch_size", "check_policy", "load_tokenizer"]

#: Values of ``exit_policy``.
EXIT_POLICIES = ("decider", "kl", "state", "depth")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(tokenizer):
    """A tokenizer object, or one loaded by ``AutoTokenizer`` from a name or folder."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def check_policy(info, model_name: str, exit_policy, threshold, depth) -> tuple[str, float | None, int | None]:
    """``(exit_policy, threshold, depth)`` as the model arguments give them, checked against the model (``info``:
    ``retrofit.evaluation.models.model_info``; ``model_name`` for the messages) and completed."""
    if exit_policy is None:
        exit_policy = "depth" if depth is not None else "decider"
    if exit_policy not in EXIT_POLICIES:
        raise ValueError(f"exit_policy must be one of {', '.join(EXIT_POLICIES)}, got {exit_policy!r}")
    if not info.looped and exit_policy != "decider":
        raise ValueError(
            f"exit_policy={exit_policy} needs a looped checkpoint; {model_name} "
            "(allowed: decider, which runs it at its one depth)"
        )
    if exit_policy in ("kl", "state"):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"exit_policy={exit_policy} needs threshold=T with T > 0, got {threshold!r}")
        if depth is not None:
            raise ValueError(f"depth= goes with exit_policy=depth, not exit_policy={exit_policy}")
        return exit_policy, float(threshold), None
    if threshold is not None:
        raise ValueError(f"threshold= goes with exit_policy=kl or state, not exit_policy={exit_policy}")
    if exit_policy == "depth":
        D = info.max_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= D:
            raise ValueError(f"exit_policy=depth needs depth=K with K in 1..{D} (the model's max_depth), got {depth!r}")
        return exit_policy, None, depth
    if depth is not None:
        raise ValueError("depth= goes with exit_policy=depth (or alone), not exit_policy=decider")
    return exit_policy, None, None


def check_batch_size(batch_size) -> int:
    """``batch_size`` as an int (``auto...``: ``DEFAULT_BATCH_SIZE``)."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        logger.info("batch_size=%s: the retrofit model uses %d", batch_size, DEFAULT_BATCH_SIZE)
        return DEFAULT_BATCH_SIZE
    try:
        value = int(batch_size)
    except (TypeError, ValueError):
        value = 0
    if value < 1 or isinstance(batch_size, bool):
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
    return value
