"""LANO and BREVO per-word analyses on the strings a model generates (ANIRA §5.2, Tables 1–2).

ANIRA correlates depth with the parser's work on *model-generated* LANO strings, and regresses
BREVO depth on features of the model's own answer. The gold string is a different string: its
parser proxies, and the frontier of its emission order, describe work the model did not do.

For each row the model's greedy answer (up to its stop token) is split into words; the analysis
keeps its longest *valid* prefix, the part the features are defined on:

* LANO: the words that are terminals and form a viable prefix of the grammar
  (``data_prep.lano.viable_prefix_length``); features by ``lano.token_features`` on that prefix;
* BREVO: the words that continue a valid answer (each a not-yet-listed dependency whose own
  dependencies are listed, ``data_prep.brevo.valid_prefix_length``); features by
  ``brevo.order_features`` along the model's order.

Depths come from one teacher-forced forward over ``prompt + generated answer`` (the depth rules
are causal, so these are the depths the model used while generating), at the position the
``alignment`` option names (ANIRA's "input" by default), one value per word (its first token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import analysis as A
from .rows import Example

__all__ = ["generated_examples", "prefix_offsets"]


def prefix_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]] | None:
    """The decoded text of ``ids`` and each token's character span, from decoding growing prefixes.

    Returns None when a prefix's text is not a prefix of the next one's (a tokenizer that rewrites
    earlier characters as more tokens arrive), where no span can be given.
    """
    texts = [tokenizer.decode(list(ids[:k]), skip_special_tokens=True) for k in range(len(ids) + 1)]
    for a, b in zip(texts, texts[1:]):
        if not b.startswith(a):
            return None
    return texts[-1], [(len(texts[k]), len(texts[k + 1])) for k in range(len(ids))]


def _valid_words(task_name: str, row: dict, words: list[str]) -> tuple[int, list[dict]]:
    if task_name == "lano":
        from data_prep import lano

        k = lano.viable_prefix_length(words)
        return k, (lano.token_features(words[:k]) if k else [])
    from data_prep import brevo

    edges, query = brevo.parse_prompt(row["prompt"])
    k = brevo.valid_prefix_length(edges, query, words)
    return k, brevo.order_features(edges, query, words[:k])


def generated_examples(
    task_name: str, examples: Sequence[Example], gens: Sequence[dict], tokenizer, is_stop
) -> tuple[list[Example], dict[str, Any]]:
    """Examples whose answer is the model's own generation, with features on its valid prefix.

    Args:
        task_name: ``"lano"`` or ``"brevo"``.
        examples: the rows, tokenized (prompts are reused).
        gens: per row, ``greedy_generate``'s output (``ids``).
        tokenizer: to decode the generations.
        is_stop: the stop rule (the stop token is not part of the answer).

    Returns:
        ``(examples, stats)``: one Example per row with at least one valid word (``features`` = one
        dict per valid word, ``first_tok`` cut to those words); stats ``{"rows", "rows_used",
        "words_generated", "words_valid", "rows_fully_valid"}`` (fully valid: every generated word
        valid; for BREVO that is a correct answer or a correct start of one).
    """
    out: list[Example] = []
    stats = {"rows": len(examples), "rows_used": 0, "words_generated": 0, "words_valid": 0, "rows_fully_valid": 0}
    for e, g in zip(examples, gens):
        ids = list(g["ids"])
        if ids and is_stop(ids[-1]):
            ids = ids[:-1]
        decoded = prefix_offsets(tokenizer, ids) if ids else None
        if decoded is None:
            continue
        text, offsets = decoded
        words = [text[s:t] for s, t in A.word_spans(text)]
        k, feats = _valid_words(task_name, e.row, words)
        stats["words_generated"] += len(words)
        stats["words_valid"] += k
        stats["rows_fully_valid"] += int(bool(words) and k == len(words))
        if k == 0:
            continue
        first = A.first_tokens_of_words(text, offsets)[:k]
        out.append(
            Example(
                row=e.row,
                level=e.level,
                prompt_ids=e.prompt_ids,
                answer_ids=ids,
                segment=text,
                owner=A.token_word_owner(text, offsets),
                first_tok=np.asarray(first),
                features=feats,
            )
        )
    stats["rows_used"] = len(out)
    return out, stats
