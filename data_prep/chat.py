"""Chat / SFT data: load rows from disk and convert them to TRL's prompt-completion format.

Accepted input rows (one of):

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` — the last message must be the
  assistant reply (it becomes the completion; everything before it is the prompt, which must not
  be empty).
* ``{"prompt": ..., "completion": ...}`` — strings (standard) or lists of messages
  (conversational); a string paired with a list is wrapped as a user / assistant message.
* ``{"prompt": ..., "answer": ...}`` — our task rows (``data_prep.tasks``); ``answer`` is the
  completion.  ``completion`` wins when a row has both.

Roles allowed: ``system``, ``user``, ``assistant``, ``tool``; contents must be strings; only the
``role`` and ``content`` keys of a message are kept, and the output has only the ``prompt`` and
``completion`` columns (other columns such as ``difficulty`` are dropped), so the Arrow schema
stays uniform.

Emitted format (the ``format`` entry of the report says which):

* ``tokenizer=None``: TRL *standard* prompt-completion (``{"prompt": str, "completion": str}``)
  when every row is a string pair; otherwise TRL *conversational* prompt-completion
  (``{"prompt": [messages], "completion": [assistant message]}``) for all rows, string pairs
  wrapped as one user and one assistant message.  TRL then applies the chat template itself.
* a tokenizer with a chat template: standard strings with the template already applied to every
  row (string pairs wrapped as user / assistant first): ``prompt`` is
  ``apply_chat_template(prompt_messages, add_generation_prompt=True)`` and ``completion`` is the
  rest of ``apply_chat_template(prompt_messages + [reply])`` (the reply plus the template's
  end-of-turn text).  If a template renders the prompt differently inside the full conversation
  (so the prompt is not a prefix), the completion falls back to the reply text plus
  ``eos_token`` and a warning is logged once.
* a tokenizer without a chat template: standard strings; conversational rows are flattened as
  ``"<role>: <content>\\n"`` lines followed by ``"assistant: "``, the completion is the reply.

Bad rows raise :class:`DataError` (row index, problem, what is allowed) or, with
``on_bad_row="skip"``, are dropped, counted per reason in the report and logged.  Reasons:
``not_a_dict``, ``missing_columns``, ``bad_messages``, ``unknown_role``, ``non_string_content``,
``empty_completion``, ``too_long`` (more than ``max_length`` tokens; needs a tokenizer) and
``chat_template_error``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets

logger = logging.getLogger(__name__)

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
BAD_ROW_REASONS = (
    "not_a_dict",
    "missing_columns",
    "bad_messages",
    "unknown_role",
    "non_string_content",
    "empty_completion",
    "too_long",
    "chat_template_error",
)
_ACCEPTED = "'messages', or 'prompt' + 'completion', or 'prompt' + 'answer'"
_MAX_SKIP_LOGS = 20  # individual skip warnings before only the summary is logged


def _user_error_base():
    try:  # one-line reporting by retrofit's entry points (retrofit.errors.run_cli)
        from retrofit.errors import RetrofitUserError
    except ImportError:  # data_prep used without retrofit
        return Exception
    return RetrofitUserError


class DataError(_user_error_base(), ValueError):
    """A data problem the user can fix; names the row (or file line) and what is allowed.

    Attributes:
        row_index: Index of the offending row, or None for file-level problems.
        reason: One of ``BAD_ROW_REASONS`` for row problems, None otherwise.
    """

    def __init__(self, message: str, row_index: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.row_index = row_index
        self.reason = reason


# --- loading -----------------------------------------------------------------------------------


def _decode(raw: bytes, path: Path, lineno: int | None = None) -> str:
    try:
        return raw.decode("utf-8-sig" if lineno in (None, 1) else "utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{lineno}" if lineno is not None else str(path)
        raise DataError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the file as UTF-8"
        ) from None


def _read_jsonl(path: Path, lines: list[int] | None = None) -> list[dict]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object") from None
            if lines is not None:
                lines.append(lineno)
    return rows


def _read_json(path: Path, lines: list[int] | None = None) -> list[dict]:
    text = _decode(path.read_bytes(), path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a JSON list, broken (not JSON Lines)
            raise DataError(
                f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json file must hold one "
                "list of row objects, or one JSON object per line"
            ) from None
        # Many ".json" chat files are really JSON Lines.
        return _read_jsonl(path, lines)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: top-level JSON must be a list of row objects, got {type(data).__name__}")
    return data


def _kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _check_file_rows(rows: list, path: Path, lines: list[int] | None) -> None:
    """What a table needs from file rows: at least one, each a JSON object, and one JSON type per
    column (and per nested field), so that ``datasets.Dataset.from_list`` can build the Arrow table."""

    def where(i: int) -> str:
        return f"line {lines[i]}" if lines and i < len(lines) else f"row {i}"

    def at(i: int) -> str:
        return f"{path}:{lines[i]}" if lines and i < len(lines) else f"{path}: row {i}"

    if not rows:
        raise DataError(f"{path}: no rows (the file is empty); give one JSON object per row with {_ACCEPTED}")
    seen: dict[str, tuple[str, int]] = {}

    def visit(field: str, v: Any, i: int) -> None:
        k = _kind(v)
        if k is None:
            return
        prev = seen.setdefault(field, (k, i))
        if prev[0] != k:
            raise DataError(
                f"{at(i)}: field '{field}' is a {k} here but a {prev[0]} in {where(prev[1])}; "
                "every row must give a field the same type (e.g. all strings)",
                i,
                "mixed_types",
            )
        if k == "list":
            for x in v:
                visit(field + "[]", x, i)
        elif k == "object":
            for key, x in v.items():
                visit(f"{field}.{key}", x, i)

    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"{at(i)}: a row must be a JSON object with {_ACCEPTED}, got a {_kind(row) or 'null'} ({json.dumps(row)[:60]})",
                i,
                "not_a_dict",
            )
        for key, v in row.items():
            visit(key, v, i)


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None


def _from_hf(obj, split: str | None, where: str) -> list[dict]:
    if isinstance(obj, datasets.DatasetDict):
        names = sorted(obj.keys())
        name = split if split is not None else ("train" if "train" in obj else (names[0] if len(names) == 1 else None))
        if name is None or name not in obj:
            raise DataError(f"{where}: choose a split with split=...; available splits: {', '.join(names)}")
        obj = obj[name]
    return obj.to_list()


def load_rows(source: Any, split: str | None = None, check_rows: bool = True) -> list[dict]:
    """Loads raw rows from a file, a saved dataset folder, a Dataset, or a list.

    Args:
        source: A path to a ``.jsonl``/``.ndjson`` file, a ``.json`` file (a list of objects, or
            JSON Lines), a ``.parquet`` file, or a folder written by ``save_to_disk``
            (``Dataset`` or ``DatasetDict``); or a ``datasets.Dataset`` / ``DatasetDict``; or a
            list of dicts (returned as a list).
        split: Split to take from a DatasetDict; defaults to ``train`` (or the only split).
        check_rows: for JSON / JSON Lines files, also require at least one row, every row a JSON
            object and one JSON type per field across rows (what ``datasets.Dataset.from_list``
            needs). :func:`to_sft_dataset` passes False: it validates rows itself and may skip bad ones.

    Returns:
        A list of rows (their contents unvalidated; :func:`to_sft_dataset` validates them).

    Raises:
        DataError: missing path, unsupported file type, unreadable or non-UTF-8 file, invalid JSON,
            and with ``check_rows`` an empty file, a row that is not an object, or a field whose type
            changes between rows. The message names the file and line, and what is allowed.
    """
    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        return _from_hf(source, split, "dataset")
    if isinstance(source, (list, tuple)):
        return list(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(
            f"cannot load rows from {type(source).__name__}; pass a path, a datasets.Dataset/DatasetDict or a list"
        )
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        if not any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise DataError(
                f"{path}: folder is not a dataset saved with save_to_disk (no dataset_info.json / dataset_dict.json)"
            )
        try:
            obj = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - surface as a data problem, not a deep datasets traceback
            raise DataError(f"{path}: cannot load with datasets.load_from_disk ({e})") from None
        return _from_hf(obj, split, str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        lines: list[int] = []
        try:
            rows = _read_jsonl(path, lines) if suffix != ".json" else _read_json(path, lines)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
        if check_rows:
            _check_file_rows(rows, path, lines)
        return rows
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise DataError(
        f"{path}: unsupported file type {suffix!r}; supported: .jsonl, .ndjson, .json, .parquet, a save_to_disk folder"
    )


# --- validation --------------------------------------------------------------------------------


def _check_messages(messages: Any, i: int, field: str) -> list[dict]:
    """Validates a message list; returns copies with only role/content."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"row {i}: '{field}' must be a non-empty list of {{'role', 'content'}} messages, got {type(messages).__name__}",
            i,
            "bad_messages",
        )
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"row {i}: {field}[{j}] must be a dict with 'role' and 'content' keys, got {m!r:.80}", i, "bad_messages"
            )
        if m["role"] not in ALLOWED_ROLES:
            raise DataError(
                f"row {i}: {field}[{j}] has unknown role {m['role']!r}; allowed roles: {', '.join(ALLOWED_ROLES)}",
                i,
                "unknown_role",
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"row {i}: {field}[{j}] content must be a string, got {type(m['content']).__name__}",
                i,
                "non_string_content",
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _check_reply(msg: dict, i: int, field: str) -> dict:
    if msg["role"] != "assistant":
        raise DataError(
            f"row {i}: the last message of '{field}' must have role 'assistant', got {msg['role']!r}", i, "bad_messages"
        )
    if not msg["content"].strip():
        raise DataError(
            f"row {i}: the assistant reply in '{field}' is empty; a completion must contain text", i, "empty_completion"
        )
    return msg


def _normalise(row: Any, i: int) -> tuple[str, Any, Any]:
    """Returns ``("standard", prompt_str, completion_str)`` or ``("conv", prompt_msgs, reply_msg)``."""
    if not isinstance(row, dict):
        raise DataError(f"row {i}: must be a dict with {_ACCEPTED}, got {type(row).__name__}", i, "not_a_dict")
    if "messages" in row and row["messages"] is not None:
        msgs = _check_messages(row["messages"], i, "messages")
        reply = _check_reply(msgs[-1], i, "messages")
        if len(msgs) < 2:
            raise DataError(
                f"row {i}: 'messages' needs at least one message before the assistant reply", i, "bad_messages"
            )
        return "conv", msgs[:-1], reply
    if "prompt" in row and ("completion" in row or "answer" in row):
        prompt = row["prompt"]
        col = "completion" if "completion" in row else "answer"
        completion = row[col]
        if isinstance(prompt, list) or isinstance(completion, list):
            p_msgs = _check_messages(prompt, i, "prompt") if isinstance(prompt, list) else None
            c_msgs = _check_messages(completion, i, col) if isinstance(completion, list) else None
            if p_msgs is None:
                if not isinstance(prompt, str):
                    raise DataError(
                        f"row {i}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}",
                        i,
                        "non_string_content",
                    )
                p_msgs = [{"role": "user", "content": prompt}]
            if c_msgs is None:
                if not isinstance(completion, str):
                    raise DataError(
                        f"row {i}: '{col}' must be a string or a list of messages, got {type(completion).__name__}",
                        i,
                        "non_string_content",
                    )
                c_msgs = [{"role": "assistant", "content": completion}]
            if len(c_msgs) != 1:
                raise DataError(
                    f"row {i}: '{col}' must hold exactly one assistant message, got {len(c_msgs)}", i, "bad_messages"
                )
            return "conv", p_msgs, _check_reply(c_msgs[0], i, col)
        for name, value in (("prompt", prompt), (col, completion)):
            if not isinstance(value, str):
                raise DataError(
                    f"row {i}: '{name}' must be a string (or a list of messages), got {type(value).__name__}",
                    i,
                    "non_string_content",
                )
        if not completion.strip():
            raise DataError(f"row {i}: '{col}' is empty; a completion must contain text", i, "empty_completion")
        return "standard", prompt, completion
    raise DataError(f"row {i}: missing columns; found {sorted(row)!r}, need {_ACCEPTED}", i, "missing_columns")


# --- conversion --------------------------------------------------------------------------------


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _count_tokens(tokenizer, prompt: str, completion: str, templated: bool) -> int:
    # A rendered chat template already contains its special tokens as text.
    n_prompt = len(tokenizer(prompt, add_special_tokens=not templated)["input_ids"])
    return n_prompt + len(tokenizer(completion, add_special_tokens=False)["input_ids"])


def to_sft_dataset(
    rows: Any,
    tokenizer=None,
    max_length: int | None = None,
    on_bad_row: str = "error",
) -> tuple[datasets.Dataset, dict]:
    """Validates rows and converts them to TRL prompt-completion data (format: module docstring).

    Args:
        rows: Anything :func:`load_rows` accepts (list of dicts, Dataset, path).
        tokenizer: Optional HF tokenizer.  With a chat template, the template is applied to every
            row; needed for ``max_length``.
        max_length: Maximum tokens per row (prompt + completion as emitted); longer rows are bad.
        on_bad_row: ``"error"`` raises :class:`DataError` on the first bad row; ``"skip"`` drops
            bad rows and counts them in the report.

    Returns:
        ``(dataset, report)`` with report keys ``rows_in``, ``rows_out``, ``skipped`` (reason ->
        count), ``format`` (``"standard"`` or ``"conversational"``) and
        ``chat_template_applied``.

    Raises:
        DataError: a bad row (``on_bad_row="error"``) or an unloadable source.
        ValueError: invalid ``on_bad_row`` / ``max_length``, or ``max_length`` without tokenizer.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if tokenizer is None:
            raise ValueError("max_length needs a tokenizer to count tokens; pass tokenizer=...")
    raw = load_rows(rows, check_rows=False)
    templated = tokenizer is not None and _has_chat_template(tokenizer)
    skipped: dict[str, int] = {}

    def bad(err: DataError) -> None:
        if on_bad_row == "error":
            raise err
        skipped[err.reason] = skipped.get(err.reason, 0) + 1
        if sum(skipped.values()) <= _MAX_SKIP_LOGS:
            logger.warning("skipping bad row: %s", err)

    normal: list[tuple[int, str, Any, Any]] = []
    for i, row in enumerate(raw):
        try:
            normal.append((i, *_normalise(row, i)))
        except DataError as err:
            bad(err)

    conversational = tokenizer is None and any(kind == "conv" for _, kind, _, _ in normal)
    out_prompt: list[Any] = []
    out_completion: list[Any] = []
    warned_prefix = False
    for i, kind, prompt, reply in normal:
        if conversational:
            if kind == "standard":
                prompt, reply = [{"role": "user", "content": prompt}], {"role": "assistant", "content": reply}
            out_prompt.append(prompt)
            out_completion.append([reply])
            continue
        if tokenizer is None:  # all standard
            out_prompt.append(prompt)
            out_completion.append(reply)
            continue
        if templated:
            msgs = [{"role": "user", "content": prompt}] if kind == "standard" else prompt
            reply_msg = {"role": "assistant", "content": reply} if kind == "standard" else reply
            try:
                p_text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                full = tokenizer.apply_chat_template(msgs + [reply_msg], tokenize=False)
            except Exception as e:  # noqa: BLE001 - jinja errors, e.g. templates demanding alternating roles
                bad(
                    DataError(
                        f"row {i}: the tokenizer's chat template rejected this conversation ({e})",
                        i,
                        "chat_template_error",
                    )
                )
                continue
            if full.startswith(p_text):
                c_text = full[len(p_text) :]
            else:
                if not warned_prefix:
                    logger.warning(
                        "chat template output of the prompt is not a prefix of the full conversation; "
                        "using reply + eos_token as the completion"
                    )
                    warned_prefix = True
                c_text = reply_msg["content"] + (tokenizer.eos_token or "")
        elif kind == "conv":
            p_text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
            c_text = reply["content"]
        else:
            p_text, c_text = prompt, reply
        if max_length is not None:
            n_tokens = _count_tokens(tokenizer, p_text, c_text, templated)
            if n_tokens > max_length:
                bad(
                    DataError(
                        f"row {i}: {n_tokens} tokens exceeds max_length={max_length}; shorten the row or raise max_length",
                        i,
                        "too_long",
                    )
                )
                continue
        out_prompt.append(p_text)
        out_completion.append(c_text)

    if skipped:
        logger.warning("skipped %d of %d rows: %s", sum(skipped.values()), len(raw), skipped)
    if conversational:
        msg = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
        features = datasets.Features({"prompt": msg, "completion": msg})
    else:
        features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"prompt": out_prompt, "completion": out_completion}, features=features)
    report = {
        "rows_in": len(raw),
        "rows_out": len(ds),
        "skipped": skipped,
        "format": "conversational" if conversational else "standard",
        "chat_template_applied": templated,
    }
    return ds, report


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes rows as JSON Lines (UTF-8, one object per line)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
