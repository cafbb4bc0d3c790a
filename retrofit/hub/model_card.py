"""Model cards for exported looped checkpoints: ``README.md`` with Hub YAML metadata.

The card's front matter (what the Hub indexes)::

    base_model: <the base checkpoint>       # when known
    library_name: transformers
    license: <carried from the base>        # else DEFAULT_LICENSE ("other": see the base's terms)
    pipeline_tag: text-generation
    tags: [retrofit, looped-transformer, adaptive-depth, <method>]

followed by the loop spec, the heads' parameter share (``retrofit.parameter_report``), d̄ and an
evaluation summary when available, and how to load the folder with and without retrofit.

Where the facts come from
-------------------------
- **base model** and **license**: the ``retrofit_base_model`` / ``retrofit_base_license`` fields
  of the looped config (``retrofit convert`` records them from the base: a hub id or folder, the
  base folder's own ``README.md`` front matter, a GGUF file's ``general.*`` metadata), unless
  given explicitly. Fields of a config survive training and ``save_pretrained``.
- **evaluation** (the convention, ``EVAL_FILES``): a checkpoint folder may hold

  * ``retrofit_eval.json`` — the results dict of ``retrofit eval`` (schema in
    ``retrofit.evaluation.report``: ``models -> tasks -> levels -> {accuracy, mean_depth, n}``),
    optionally with a top-level ``"mean_depth"`` (the headline d̄) and ``"max_depth"``;
  * ``eval_results.json`` — the flat ``{name: number}`` dict that ``Trainer.save_metrics("eval",
    ...)`` writes (``eval_loss``, ``eval_mean_depth``, …).

  * neither: the last ``eval_*`` entry of a Trainer checkpoint's ``trainer_state.json``
    ``log_history`` (not copied).

  The card shows per (model, task) the ``n``-weighted accuracy and d̄ over levels, and the flat
  metrics as a list. Headline d̄: a top-level ``mean_depth``, else ``eval_mean_depth`` /
  ``mean_depth`` of the flat file, else the ``n``-weighted d̄ of the one evaluated model that has
  depths. The files themselves are copied into the exported folder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..model import registry

DEFAULT_LICENSE = "other"
EVAL_FILES = ("retrofit_eval.json", "eval_results.json")
BASE_TAGS = ("retrofit", "looped-transformer", "adaptive-depth")


# ------------------------------------------------------------------------------------------------
# Reading facts
# ------------------------------------------------------------------------------------------------
def split_front_matter(text: str) -> tuple[dict, str]:
    """Split a Markdown card into ``(YAML front matter dict, body)``; ``({}, text)`` when it has none."""
    if not text.startswith("---"):
        return {}, text
    lines = text.splitlines(keepends=True)
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            try:
                meta = yaml.safe_load("".join(lines[1:i])) or {}
            except yaml.YAMLError:
                return {}, text
            return (meta if isinstance(meta, dict) else {}), "".join(lines[i + 1 :])
    return {}, text


def card_metadata(folder: str | Path) -> dict:
    """The YAML front matter of ``folder/README.md`` (``{}`` when absent or unreadable)."""
    p = Path(folder) / "README.md"
    if not p.is_file():
        return {}
    return split_front_matter(p.read_text(encoding="utf-8", errors="replace"))[0]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _weighted(pairs: list[tuple[float, float]]) -> float | None:
    """n-weighted mean of ``(value, n)`` pairs (n = 1 when unknown)."""
    tot = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / tot if tot > 0 else None


def read_eval_summary(folder: str | Path) -> dict | None:
    """Summarize the evaluation files of a checkpoint folder (see the module docstring).

    Returns:
        None when there is none, else ``{"files": [names], "rows": [{"model", "task", "accuracy",
        "mean_depth", "max_depth", "n"}], "metrics": {name: number}, "mean_depth": float | None,
        "max_depth": int | None}``.

    Raises:
        ValueError: an evaluation file is not valid JSON (named in the message).
    """
    folder = Path(folder)
    found = [name for name in EVAL_FILES if (folder / name).is_file()]
    if not found:
        return _from_trainer_state(folder)
    out: dict[str, Any] = {"files": found, "rows": [], "metrics": {}, "mean_depth": None, "max_depth": None}
    for name in found:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{folder / name} is not valid JSON ({e}); fix or remove it") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{folder / name} must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004
        if name == "retrofit_eval.json":
            _read_results(data, out)
        else:
            metrics = {k: v for k, v in data.items() if _num(v) is not None}
            out["metrics"].update(metrics)
            if out["mean_depth"] is None:
                out["mean_depth"] = _num(metrics.get("eval_mean_depth", metrics.get("mean_depth")))
    if out["mean_depth"] is None:
        by_model: dict[str, list[tuple[float, float]]] = {}
        for r in out["rows"]:
            if r["mean_depth"] is not None:
                by_model.setdefault(r["model"], []).append((r["mean_depth"], r["n"] or 1))
        if len(by_model) == 1:
            out["mean_depth"] = _weighted(next(iter(by_model.values())))
    return out


def _from_trainer_state(folder: Path) -> dict | None:
    """The last evaluation logged in a Trainer checkpoint's ``trainer_state.json``, if any."""
    p = folder / "trainer_state.json"
    if not p.is_file():
        return None
    try:
        history = json.loads(p.read_text(encoding="utf-8")).get("log_history") or []
    except (json.JSONDecodeError, AttributeError):
        return None
    evals = [e for e in history if isinstance(e, Mapping) and any(str(k).startswith("eval_") for k in e)]
    if not evals:
        return None
    metrics = {k: v for k, v in evals[-1].items() if _num(v) is not None and (k.startswith("eval_") or k == "step")}
    return {
        "files": ["trainer_state.json"],
        "rows": [],
        "metrics": metrics,
        "mean_depth": _num(metrics.get("eval_mean_depth")),
        "max_depth": None,
    }


def _read_results(data: Mapping, out: dict) -> None:
    out["mean_depth"] = _num(data.get("mean_depth"))
    if isinstance(data.get("max_depth"), int):
        out["max_depth"] = data["max_depth"]
    models = data.get("models")
    if not isinstance(models, Mapping):
        return
    for model_name, model in models.items():
        if not isinstance(model, Mapping):
            continue
        tasks = model.get("tasks") if isinstance(model.get("tasks"), Mapping) else {}
        for task_name, task in tasks.items():
            if not isinstance(task, Mapping):
                continue
            levels = task.get("levels") if isinstance(task.get("levels"), Mapping) else {}
            acc, depth, n_total = [], [], 0
            for lv in levels.values():
                if not isinstance(lv, Mapping):
                    continue
                n = _num(lv.get("n")) or 1.0
                n_total += int(n)
                if _num(lv.get("accuracy")) is not None:
                    acc.append((_num(lv["accuracy"]), n))
                if _num(lv.get("mean_depth")) is not None:
                    depth.append((_num(lv["mean_depth"]), n))
            if not acc and not depth:
                continue
            out["rows"].append(
                {
                    "model": str(model_name),
                    "task": str(task_name),
                    "accuracy": _weighted(acc),
                    "mean_depth": _weighted(depth),
                    "max_depth": task.get("max_depth", model.get("max_depth")),
                    "n": n_total,
                }
            )


# ------------------------------------------------------------------------------------------------
# Writing the card
# ------------------------------------------------------------------------------------------------
def card_front_matter(method: str, base_model: str | None, license: str | None) -> dict:
    """The YAML metadata dict (key order as written)."""
    meta: dict[str, Any] = {}
    if base_model:
        meta["base_model"] = base_model
    meta["library_name"] = "transformers"
    meta["license"] = license or DEFAULT_LICENSE
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = [*BASE_TAGS, method]
    return meta


def _fmt(v: Any, digits: int = 2) -> str:
    x = _num(v)
    return "—" if x is None else f"{x:.{digits}f}"


def render_model_card(
    config,
    params: Mapping[str, Any],
    *,
    base_model: str | None = None,
    license: str | None = None,
    eval_summary: Mapping[str, Any] | None = None,
    repo_id: str | None = None,
    remote_code_files: list[str] | None = None,
    has_tokenizer: bool = True,
    run_folder: bool = False,
) -> str:
    """The full ``README.md`` text for an exported looped checkpoint, or for a training run's folder.

    Args:
        config: the looped config (``LoopedLlamaConfig`` / ``LoopedQwen3Config``).
        params: ``retrofit.parameter_report(model)``.
        base_model: the base checkpoint's id (front matter ``base_model``); None = unknown.
        license: the base's license; None = ``DEFAULT_LICENSE``.
        eval_summary: ``read_eval_summary`` output, or None.
        repo_id: where the folder will live on the Hub (used in the usage snippet).
        remote_code_files: the bundled modeling files (listed in the card).
        has_tokenizer: whether tokenizer files are part of the folder.
        run_folder: the card of a training output folder (``RetrofitSFTTrainer`` writes it in place of
            TRL's automatic card): its checkpoints load with retrofit installed, and ``retrofit export``
            makes a self-contained folder of one.
    """
    loop = config.loop_config
    n_layers = config.num_hidden_layers
    pre, core, coda = loop.layer_ranges(n_layers)
    license_known = license is not None
    meta = card_front_matter(loop.method, base_model, license)
    where = repo_id or ("RUN_DIR" if run_folder else "PATH_OR_REPO_ID")
    family = config.model_type.removeprefix("looped_")

    def layers(r: range) -> str:
        if len(r) == 0:
            return "none"
        return f"1 layer: {r.start}" if len(r) == 1 else f"{len(r)} layers: {r.start}–{r.stop - 1}"

    title = (
        repo_id.split("/")[-1]
        if repo_id
        else "Looped " + (base_model.split("/")[-1] if base_model else family + " model")
    )
    method_line = registry.method_class(loop.method).description or loop.method
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {title}",
        "",
        (
            f"A looped version of [{base_model}](https://huggingface.co/{base_model})"
            if base_model and "/" in base_model
            else f"A looped version of {base_model or 'a pretrained ' + family + ' model'}"
        )
        + ", retrofitted with retrofit: a block of its pretrained layers is run up to `max_depth` times, "
        f"and each token decides how many iterations it needs. Method: {method_line}.",
        "",
        "## Loop specification",
        "",
        "| field | value |",
        "|---|---|",
        f"| method | `{loop.method}` |",
        f"| layers | {n_layers} |",
        f"| prelude (run once) | {layers(pre)} |",
        f"| core (looped) | {layers(core)} |",
        f"| coda (run once) | {layers(coda)} |",
        f"| max depth D | {loop.max_depth} |",
        f"| attention across depths | `{loop.attention}` |",
    ]
    lines += [f"| {k} | {v} |" for k, v in registry.method_class(loop.method).card_rows(loop)]
    lines += [
        "",
        "Full spec (`config.loop`):",
        "",
        "```json",
        json.dumps(loop.to_dict(), indent=2, sort_keys=True),
        "```",
        "",
        "## Parameters",
        "",
        "| part | parameters |",
        "|---|---|",
        f"| base model | {int(params['base']):,} |",
        f"| updater | {int(params['updater']):,} |",
        f"| decider | {int(params['decider']):,} |",
        f"| heads (updater + decider) | {int(params['heads']):,} "
        f"({100 * float(params['heads_share']):.2f}% of the base) |",
        "",
    ]
    lines += _eval_section(eval_summary, loop.max_depth)
    lines += _run_folder_usage(where) if run_folder else _export_usage(where, remote_code_files, has_tokenizer)
    if not license_known:
        lines += [
            "",
            (
                f"License: the base model's license was not recorded; the metadata says `{DEFAULT_LICENSE}`. "
                "The base model's terms apply."
            ),
        ]
    return "\n".join(lines) + "\n"


def write_run_card(model, output_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write the card of a training run's folder (``RetrofitSFTTrainer`` does, in place of TRL's)."""
    from ..model.heads import parameter_report

    cfg = model.config
    card = render_model_card(
        cfg,
        parameter_report(model),
        base_model=getattr(cfg, "retrofit_base_model", None),
        license=getattr(cfg, "retrofit_base_license", None),
        repo_id=repo_id,
        run_folder=True,
    )
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(card, encoding="utf-8")
    return path


def _export_usage(where: str, remote_code_files: list[str] | None, has_tokenizer: bool) -> list[str]:
    lines = [
        "## Usage",
        "",
        "Without retrofit (the modeling code ships in this repository):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        "```",
        "",
        (
            "With the retrofit package installed, `trust_remote_code` is not needed: `import retrofit` registers the "
            "looped classes."
        ),
        "",
        "```python",
        "import retrofit  # noqa: F401",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{where}")',
        "out = model(input_ids)          # out.logits [B, T, V], out.depths [B, T] (1-based exit depths)",
        "out = model(input_ids, depth=1)  # force every token to exit at depth 1",
        "```",
        "",
        "## Files",
        "",
        "- `model.safetensors`: weights (safetensors only; no pickled files).",
        "- `config.json`: the base model's config plus `loop` (the spec above) and `auto_map`.",
    ]
    if remote_code_files:
        lines.append(
            "- remote code: "
            + ", ".join(f"`{f}`" for f in remote_code_files)
            + " — retrofit's modeling modules, bundled into flat files (relative imports rewritten)."
        )
    lines.append(
        "- `generation_config.json`" + (", tokenizer files." if has_tokenizer else "; no tokenizer was exported.")
    )
    return lines


def _run_folder_usage(where: str) -> list[str]:
    return [
        "## Usage",
        "",
        "This is a training run's folder: `final/` (or a `checkpoint-N/`) holds a looped checkpoint that loads with "
        "the retrofit package installed (`import retrofit` registers the looped classes).",
        "",
        "```python",
        "import retrofit  # noqa: F401",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{where}/final")',
        "out = model(input_ids)          # out.logits [B, T, V], out.depths [B, T] (1-based exit depths)",
        "```",
        "",
        f"`retrofit export {where}/final --out DIR` writes a self-contained folder (bundled modeling code, "
        "`trust_remote_code=True` without retrofit) for the Hub.",
    ]


def _eval_section(summary: Mapping[str, Any] | None, max_depth: int) -> list[str]:
    if not summary:
        return []
    lines = ["## Evaluation", ""]
    md = _num(summary.get("mean_depth"))
    if md is not None:
        lines += [f"Mean exit depth d̄ = **{md:.2f}** of D = {summary.get('max_depth') or max_depth}.", ""]
    rows = summary.get("rows") or []
    if rows:
        lines += ["| model | task | accuracy | d̄ | n |", "|---|---|---|---|---|"]
        for r in rows:
            acc = "—" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
            lines.append(f"| {r['model']} | {r['task']} | {acc} | {_fmt(r['mean_depth'])} | {r['n']} |")
        lines.append("")
    metrics = summary.get("metrics") or {}
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v, 4)} |" for k, v in metrics.items()]
        lines.append("")
    files = summary.get("files", [])
    if files == ["trainer_state.json"]:
        lines += ["Source: the last evaluation in the training checkpoint's `trainer_state.json`.", ""]
    else:
        lines += [f"Source: {', '.join(f'`{f}`' for f in files)} (included in this folder).", ""]
    return lines
