"""Local lm-eval task folders for the complexity-controlled tasks (data from ``data_prep``, no hub).

:func:`write_tasks` writes, for each task (default: ``mano``, ``brevo``, ``lano``, ``rg_chain_sum``,
``gsm``) and each difficulty level ``L``::

    FOLDER/
      data/<task>_L<L>.jsonl          the rows (prompt, answer, difficulty, task[, token_features])
      retrofit_<task>_L<L>.yaml       generate_until; acc = the data_prep task's score (retrofit eval's accuracy)
      retrofit_<task>_L<L>_ll.yaml    loglikelihood of " " + answer; acc = greedy match, perplexity
      retrofit_<task>.yaml            group over the levels (acc weighted by rows = retrofit eval's overall)
      retrofit_<task>_ll.yaml         group over the loglikelihood levels
      utils.py                        process_results -> retrofit.lm_eval.tasks.process_results
      retrofit_tasks.json             what was written: seed, rows per level, budgets, task names

``L`` is the value of the task's difficulty knob (MANO's operators, BREVO's nodes, LANO's length,
chain-sum's terms, GSM's step bucket 0-2). Rows are ``retrofit eval``'s own rows
(:func:`retrofit.evaluation.rows.task_rows`: the same ``--n`` and ``--seed`` give the same
instances), or rows you pass (e.g. a held-out split of ``python -m data_prep.build``).

Scoring. Each generation task's ``process_results`` calls ``data_prep``'s ``Task.score`` on the
generated text — the function ``retrofit eval`` scores with — so the two accuracies cannot drift
apart (BREVO's order rule, LANO's grammaticality check and GSM's first-number rule included).
Generation is greedy and stops at a newline (``until: ["\\n"]``) or EOS, ``retrofit eval``'s stop
rule. ``max_gen_toks`` defaults to the characters of the longest ``answer_sep + answer`` of the
task + 2: for byte-level BPE and character tokenizers (Llama 3, SmolLM2, Qwen3, the test
tokenizer) at least ``retrofit eval``'s default budget (longest gold answer in tokens + 2), and
equal to it for the character tokenizer; pass ``max_gen_toks`` = ``retrofit eval
--max-new-tokens`` to make the two runs identical for any tokenizer.

The YAML files hold absolute paths to the data files: write the folder again after moving it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data_prep.common import ANSWER_SEP

__all__ = ["DEFAULT_TASKS", "process_results", "task_name", "write_tasks"]

#: The complexity-controlled tasks written by default.
DEFAULT_TASKS = ("mano", "brevo", "lano", "rg_chain_sum", "gsm")
PREFIX = "retrofit_"
MANIFEST = "retrofit_tasks.json"

_UTILS = '''"""process_results of the retrofit task folder (written by `retrofit lm-eval write-tasks`).

Kept as an import so the lm-eval tasks score with the data_prep task scorer retrofit eval uses.
"""

from retrofit.lm_eval.tasks import process_results  # noqa: F401
'''


def task_name(task: str, level: int, loglikelihood: bool = False) -> str:
    """lm-eval task name of one level: ``retrofit_<task>_L<level>`` (``_ll`` for the loglikelihood variant)."""
    return f"{PREFIX}{task}_L{level}" + ("_ll" if loglikelihood else "")


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of the generation tasks: ``acc`` = the ``data_prep`` task's score.

    Args:
        doc: one row (``task`` names the ``data_prep`` task, ``answer`` is the gold answer, ``prompt`` the
            prompt: BREVO accepts any valid order of the dependencies the prompt lists).
        results: lm-eval's responses for the row; the first is the generated text.

    Returns:
        ``{"acc": 1.0 or 0.0}``.
    """
    from data_prep.tasks import get_task

    return {"acc": float(get_task(doc["task"]).score(results[0], doc["answer"], prompt=doc["prompt"]))}


def _q(text: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def _task_yaml(name: str, data_file: Path, generation: bool, max_gen_toks: int, answer_sep: str) -> str:
    lines = [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {_q(str(data_file))}",
        "test_split: test",
        "doc_to_text: prompt",
    ]
    if generation:
        lines += [
            "doc_to_target: answer",
            "output_type: generate_until",
            "generation_kwargs:",
            f"  until: [{_q(chr(10))}]",
            f"  max_gen_toks: {max_gen_toks}",
            "  do_sample: false",
            "  temperature: 0.0",
            "process_results: !function utils.process_results",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
        ]
    else:
        lines += [
            # lm-eval scores a loglikelihood target as given: the separator belongs to it (as in retrofit
            # eval's answer segment); few-shot examples then need no extra delimiter
            f"doc_to_target: {_q(answer_sep + '{{answer}}')}",
            'target_delimiter: ""',
            "output_type: loglikelihood",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "  - metric: perplexity",
            "    aggregation: perplexity",
            "    higher_is_better: false",
        ]
    lines += ["metadata:", "  version: 1.0"]
    return "\n".join(lines) + "\n"


def _group_yaml(name: str, members: Sequence[str]) -> str:
    return (
        "\n".join(
            [
                f"group: {name}",
                "task:",
                *[f"  - {m}" for m in members],
                "aggregate_metric_list:",
                "  - metric: acc",
                "    aggregation: mean",
                "    weight_by_size: true",
                "metadata:",
                "  version: 1.0",
            ]
        )
        + "\n"
    )


def write_tasks(
    out_dir: str | os.PathLike,
    tasks: Sequence[str] = DEFAULT_TASKS,
    levels=None,
    n: int | None = None,
    seed: int = 0,
    rows: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    max_gen_toks: int | None = None,
    answer_sep: str = ANSWER_SEP,
) -> dict[str, Any]:
    """Write an lm-eval task folder for ``tasks`` (layout and scoring: module docstring).

    Args:
        out_dir: the folder (created; files of the same names are replaced).
        tasks: ``data_prep`` task keys.
        levels: ``None`` (each task's default levels), a list (every task) or ``{task: levels}``.
        n: rows per level (default ``retrofit eval``'s, 20).
        seed: data seed (``retrofit eval --seed``).
        rows: ``{task: rows}`` to write instead of generating (rows need ``prompt``, ``answer``,
            ``difficulty``); ``levels``/``n``/``seed`` then do not apply to that task.
        max_gen_toks: generation budget of every generation task (default: module docstring).
        answer_sep: text between prompt and answer in the loglikelihood variants (``retrofit eval
            --answer-sep``).

    Returns:
        The manifest written to ``retrofit_tasks.json``: per task its levels, rows per level,
        ``max_gen_toks``, group and task names.

    Raises:
        ValueError: an unknown task, a level outside the task's range, a bad ``n`` / budget, or a
            row without ``prompt`` / ``answer`` / ``difficulty``.
    """
    from data_prep.tasks import get_task
    from retrofit.evaluation.options import DEFAULT_N
    from retrofit.evaluation.rows import levels_for, task_rows

    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("no task given; allowed: any data_prep task, e.g. " + ", ".join(DEFAULT_TASKS))
    if max_gen_toks is not None and (
        isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1
    ):
        raise ValueError(f"max_gen_toks must be a positive int, got {max_gen_toks!r}")
    n = DEFAULT_N if n is None else n
    out = Path(out_dir).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    # tasks written earlier into the same folder stay (their manifest entries too)
    manifest: dict[str, Any] = {"tasks": {}}
    if (out / MANIFEST).exists():
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    for key in tasks:
        task = get_task(key)
        given = rows.get(task.name) if rows is not None else None
        t_rows = [dict(r) for r in given] if given is not None else task_rows(task, levels_for(task, levels), n, seed)
        if not t_rows:
            raise ValueError(f"{task.name}: no rows to write")
        by_level: dict[int, list[dict]] = {}
        for i, r in enumerate(t_rows):
            for col in ("prompt", "answer", "difficulty"):
                if col not in r:
                    raise ValueError(
                        f"{task.name} row {i} has no {col!r} column; rows need prompt, answer and difficulty"
                    )
            r.setdefault("task", task.name)
            if r["task"] != task.name:
                raise ValueError(f"{task.name} row {i} belongs to task {r['task']!r}")
            by_level.setdefault(int(r["difficulty"]), []).append(r)
        for stale in [*out.glob(f"{PREFIX}{task.name}_L*.yaml"), *(out / "data").glob(f"{task.name}_L*.jsonl")]:
            stale.unlink()  # levels of an earlier write of this task
        budget = max_gen_toks or max(len(answer_sep + str(r["answer"])) for r in t_rows) + 2
        gen_names, ll_names = [], []
        for level in sorted(by_level):
            data_file = out / "data" / f"{task.name}_L{level}.jsonl"
            with open(data_file, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in by_level[level])
            for ll in (False, True):
                name = task_name(task.name, level, ll)
                (out / f"{name}.yaml").write_text(
                    _task_yaml(name, data_file, not ll, budget, answer_sep), encoding="utf-8"
                )
                (ll_names if ll else gen_names).append(name)
        group = f"{PREFIX}{task.name}"
        (out / f"{group}.yaml").write_text(_group_yaml(group, gen_names), encoding="utf-8")
        (out / f"{group}_ll.yaml").write_text(_group_yaml(f"{group}_ll", ll_names), encoding="utf-8")
        manifest["tasks"][task.name] = {
            "knob": task.knob,
            "levels": sorted(by_level),
            "rows_per_level": {str(k): len(v) for k, v in sorted(by_level.items())},
            "source": "given rows" if given is not None else f"retrofit eval rows: n={n} per level, seed={seed}",
            "answer_sep": answer_sep,
            "stop": "a newline or EOS",
            "max_gen_toks": budget,
            "group": group,
            "tasks": gen_names,
            "loglikelihood_group": f"{group}_ll",
            "loglikelihood_tasks": ll_names,
        }
    (out / "utils.py").write_text(_UTILS, encoding="utf-8")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest
