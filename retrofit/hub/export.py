"""``retrofit export``: a looped checkpoint as a self-contained Hugging Face folder (and Hub repo).

    retrofit export CKPT --out DIR [--push-to-hub REPO_ID] [--private] [--overwrite]

The folder holds ``model.safetensors`` (no pickle), ``config.json`` with an ``auto_map``, the
modeling code, tokenizer files, ``generation_config.json`` and a model card (``README.md``,
``retrofit.hub.model_card``). It loads

- anywhere: ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` in a process
  where retrofit is not installed (the code ships in the folder);
- with retrofit installed: ``AutoModelForCausalLM.from_pretrained(DIR)`` (``import retrofit``
  registers the classes), and with ``trust_remote_code=True`` too: the folder's entry module then
  returns retrofit's own classes, so there is one set of classes (``retrofit.hub.bundle``).

The modeling code is bundled by ``retrofit.hub.bundle`` (flat files with rewritten imports, an entry
module that prefers an installed retrofit's own classes, no TRL integration).

Atomicity and safety
--------------------
Everything is written into a temporary folder next to ``--out`` and renamed into place at the
end; a failure removes the temporary folder and leaves ``--out`` as it was. ``--out`` may not be,
contain or lie inside the checkpoint (nor be or contain its training run folder), and a non-empty
``--out`` is replaced only with ``--overwrite`` and only when retrofit wrote it (its
``.retrofit-output`` marker, ``retrofit.hub.output_paths``). The checkpoint's weights are checked
(safetensors headers and sizes) before loading, and an unreadable evaluation file is left out of
the card with a warning.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from huggingface_hub import HfApi

from ..model.errors import RetrofitUserError
from .bundle import ENTRY, PACKAGE, BundleError, bundle_modules, flat_name, write_remote_code  # noqa: F401
from .loading import has_tokenizer
from .output_paths import MARKER, OutputTargetError, check_output_folder, write_marker

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class ExportError(RetrofitUserError, RuntimeError):
    """The checkpoint cannot be exported (the message says why and what to do)."""


# ================================================================================================
# Loading the checkpoint
# ================================================================================================
def resolve_checkpoint(ckpt: str | Path) -> Path:
    """The folder that holds the model: ``ckpt`` itself, or for a training output directory
    without a top-level model, its latest ``checkpoint-N`` subfolder."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint folder not found: {ckpt}")
    if (ckpt / "config.json").is_file():
        return ckpt
    subs = [
        (int(m.group(1)), p)
        for p in ckpt.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / "config.json").is_file()
    ]
    if subs:
        _, path = max(subs)
        logger.warning("%s has no config.json; exporting its latest training checkpoint %s", ckpt, path.name)
        return path
    if (ckpt / "adapter_config.json").is_file():
        raise ExportError(
            f"{ckpt} holds a PEFT adapter; merge it first (PeftModel.from_pretrained(base, adapter)"
            ".merge_and_unload().save_pretrained(DIR)) and export DIR"
        )
    raise ExportError(f"{ckpt} is not a checkpoint folder: it has no config.json (nor checkpoint-N/config.json)")


def load_checkpoint(ckpt: str | Path, tokenizer: str | Path | None = None, *, folder: Path | None = None):
    """Load a looped checkpoint folder -> ``(model, tokenizer or None, folder)``.

    The weights are checked first (``retrofit.hub.weights.validate_weights``), so a truncated or
    corrupt ``model.safetensors`` is a one-line ``InvalidCheckpointError``, not a loader traceback.
    ``folder``: ``resolve_checkpoint(ckpt)`` when the caller already has it.
    """
    from transformers import AutoModelForCausalLM

    import retrofit  # noqa: F401  (registers the looped classes)

    from ..model.modeling import LoopedForCausalLM
    from .loading import load_tokenizer
    from .weights import validate_weights

    folder = resolve_checkpoint(ckpt) if folder is None else Path(folder)
    if not validate_weights(folder):
        raise ExportError(
            f"{folder} holds no model.safetensors (nor an index of shards); retrofit exports safetensors checkpoints"
        )
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    if not isinstance(model, LoopedForCausalLM):
        raise ExportError(
            f"{folder} holds a {type(model).__name__}, not a looped model; convert it first: "
            f"`retrofit convert --model {folder} --out LOOPED_DIR ...`"
        )
    tok_src = (
        tokenizer
        if tokenizer is not None
        else (folder if has_tokenizer(folder) else (Path(ckpt) if has_tokenizer(Path(ckpt)) else None))
    )
    tok = load_tokenizer(str(tok_src)) if tok_src is not None else None
    return model.eval(), tok, folder


# ================================================================================================
# Export
# ================================================================================================
def _check_target(out: Path, overwrite: bool, inputs=()) -> Path:
    """``retrofit.hub.output_paths.check_output_folder`` as an ``ExportError``: ``out`` may not overlap ``inputs``,
    and a non-empty ``out`` is replaced only with ``overwrite`` and only when retrofit wrote it."""
    try:
        return check_output_folder(out, inputs, overwrite=overwrite)
    except OutputTargetError as e:
        raise ExportError(str(e)) from e


def _read_eval_summary(source: Path):
    """The source's evaluation summary for the card, or None (with a warning) when a file is unreadable."""
    from .model_card import read_eval_summary

    try:
        return read_eval_summary(source)
    except (ValueError, OSError) as e:
        logger.warning("ignoring the evaluation files of %s for the model card: %s", source, e)
        return None


def _readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is replaced only once ``tmp`` is complete (and
    on disk: its files are ``fsync``-ed before the rename, the parent folder after it)."""
    from .atomic_io import _fsync_dir, fsync_tree

    fsync_tree(tmp)
    if not out.exists():
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        return
    trash = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, trash)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(trash, out)
        raise
    _fsync_dir(out.parent)
    shutil.rmtree(trash, ignore_errors=True)


def export_model(
    model,
    out: str | Path,
    *,
    tokenizer=None,
    source: str | Path | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
    license: str | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write ``model`` (a looped model in memory) as a self-contained folder.

    Args:
        model: a ``LoopedForCausalLM``.
        out: target folder; must be absent or empty unless ``overwrite``.
        tokenizer: saved alongside when given.
        source: the checkpoint folder it came from; its evaluation files (``model_card.EVAL_FILES``)
            and README front matter are used for the card and copied.
        overwrite: replace a non-empty ``out``.
        base_model / license: override what the config recorded (``retrofit_base_model`` /
            ``retrofit_base_license``) and the source card's metadata.
        repo_id: the Hub repo the folder is meant for (usage snippet in the card).

    Returns:
        ``out`` as a ``Path``.
    """
    from transformers import GenerationConfig

    from ..model.heads import parameter_report
    from ..model.modeling import LoopedForCausalLM
    from .model_card import (
        EVAL_FILES,
        card_metadata,
        render_model_card,
    )

    if not isinstance(model, LoopedForCausalLM):
        raise ExportError(f"export needs a looped model (retrofit.convert output), got {type(model).__name__}")
    out = _check_target(Path(out), overwrite, [source])
    out.parent.mkdir(parents=True, exist_ok=True)
    src_meta = card_metadata(source) if source is not None else {}
    base_model = base_model or getattr(model.config, "retrofit_base_model", None) or src_meta.get("base_model")
    if isinstance(base_model, list):
        base_model = base_model[0] if base_model else None
    license = license or getattr(model.config, "retrofit_base_license", None) or src_meta.get("license")
    eval_summary = _read_eval_summary(Path(source)) if source is not None else None

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if model.generation_config is None:
            model.generation_config = GenerationConfig.from_model_config(model.config)
        model.save_pretrained(str(tmp))
        pickled = [p.name for p in tmp.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickled or not any(p.name.endswith(".safetensors") for p in tmp.iterdir()):
            raise ExportError(f"save_pretrained wrote {pickled or 'no safetensors'}; expected safetensors only")
        if not (tmp / "generation_config.json").is_file():
            GenerationConfig.from_model_config(model.config).save_pretrained(str(tmp))

        auto_map, code_files = write_remote_code(tmp, model)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["auto_map"] = auto_map
        if base_model:
            cfg["retrofit_base_model"] = base_model
        if license:
            cfg["retrofit_base_license"] = license
        cfg.pop("_name_or_path", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if source is not None:
            for name in EVAL_FILES:
                if (Path(source) / name).is_file():
                    if _readable_json(Path(source) / name):
                        shutil.copyfile(Path(source) / name, tmp / name)
                    else:
                        logger.warning("not copying %s: it is not valid JSON (a truncated write?)", Path(source) / name)
        card = render_model_card(
            model.config,
            parameter_report(model),
            base_model=base_model,
            license=license,
            eval_summary=eval_summary,
            repo_id=repo_id,
            remote_code_files=code_files,
            has_tokenizer=tokenizer is not None,
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
        write_marker(tmp, "retrofit export")
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    api: HfApi | None = None,
):
    """Upload an exported folder: ``create_repo(..., exist_ok=True)`` then ``upload_folder`` (without
    retrofit's local ``.retrofit-output`` marker).

    Returns:
        ``upload_folder``'s commit info.
    """
    api = api if api is not None else HfApi(token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        ignore_patterns=[MARKER],
        commit_message=commit_message or "Upload looped model exported with retrofit",
    )


def export(
    ckpt: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    push_to_hub_repo: str | None = None,
    private: bool = False,
    tokenizer: str | Path | None = None,
    base_model: str | None = None,
    license: str | None = None,
    token: str | None = None,
) -> Path:
    """Export the looped checkpoint folder ``ckpt`` to ``out`` (and optionally push it).

    Args:
        ckpt: ``save_pretrained`` output of a looped model, or a training output directory
            (its latest ``checkpoint-N`` is used when it has no top-level model).
        out: the folder to write (absent or empty, or ``overwrite=True``).
        push_to_hub_repo: a Hub repo id to upload the folder to.
        private: create the Hub repo private.
        tokenizer: where to take the tokenizer from when ``ckpt`` has none.
        base_model / license: card metadata overrides.
        token: Hub token (else the usual ``HF_TOKEN`` / login).

    Returns:
        ``out`` as a ``Path``.
    """
    source = resolve_checkpoint(ckpt)
    out = _check_target(Path(out), overwrite, [ckpt, source, tokenizer])  # before the (slow) load
    model, tok, folder = load_checkpoint(ckpt, tokenizer, folder=source)
    if tok is None:
        logger.warning("no tokenizer files in %s; exporting without a tokenizer (pass --tokenizer)", ckpt)
    export_model(
        model,
        out,
        tokenizer=tok,
        source=folder,
        overwrite=overwrite,
        base_model=base_model,
        license=license,
        repo_id=push_to_hub_repo,
    )
    if push_to_hub_repo:
        try:
            push_to_hub(out, push_to_hub_repo, private=private, token=token)
        except Exception as e:  # the export itself is complete: say so, and how to retry the upload
            raise ExportError(
                f"exported to {out}, but the upload to {push_to_hub_repo} failed ({type(e).__name__}: {e}); "
                f"retry with `hf upload {push_to_hub_repo} {out}` or rerun with --overwrite"
            ) from e
    return out


# ================================================================================================
# CLI
# ================================================================================================
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="looped checkpoint folder (save_pretrained output or a training output dir)")
    p.add_argument("--out", required=True, help="folder to write (must be empty unless --overwrite)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="also upload the folder to this Hub repo")
    p.add_argument("--private", action="store_true", help="create the Hub repo private (with --push-to-hub)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--tokenizer", default=None, help="take the tokenizer from here when CKPT has none")
    p.add_argument(
        "--base-model", default=None, help="card metadata: base model id (default: recorded by `retrofit convert`)"
    )
    p.add_argument("--license", default=None, help="card metadata: license (default: the base's, else 'other')")


def run(args) -> int:
    """Entry point of ``retrofit export``; user errors raise ``ExportError`` (one line via ``retrofit.cli``)."""
    if args.private and not args.push_to_hub:
        raise ExportError("--private only applies with --push-to-hub REPO_ID")
    try:
        out = export(
            args.ckpt,
            args.out,
            overwrite=args.overwrite,
            push_to_hub_repo=args.push_to_hub,
            private=args.private,
            tokenizer=args.tokenizer,
            base_model=args.base_model,
            license=args.license,
        )
    except BundleError as e:
        raise ExportError(f"cannot bundle the modeling code: {e}") from e
    print(f"exported to {out}" + (f" and pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0
