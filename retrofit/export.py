"""``retrofit export``: a looped checkpoint as a self-contained Hugging Face folder (and Hub repo).

    retrofit export CKPT --out DIR [--push-to-hub REPO_ID] [--private] [--overwrite]

The folder holds ``model.safetensors`` (no pickle), ``config.json`` with an ``auto_map``, the
modeling code, tokenizer files, ``generation_config.json`` and a model card (``README.md``,
``retrofit.model_card``). It loads

- anywhere: ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` in a process
  where retrofit is not installed (the code ships in the folder);
- with retrofit installed: ``AutoModelForCausalLM.from_pretrained(DIR)`` (``import retrofit``
  registers the classes; transformers prefers registered classes unless
  ``trust_remote_code=True`` is passed).

Bundling the modeling code
--------------------------
transformers copies remote-code files *flat* into its module cache (``HF_MODULES_CACHE``) and
finds the files to copy with a regular expression over ``from .name import …`` lines; it knows
no subpackages. retrofit's modeling code spans modules and a subpackage (``retrofit/halting``)
joined by relative imports. ``bundle_modules`` therefore walks the import graph with ``ast``,
starting from the modules that define the model and config classes (so whatever those import
— heads, halting methods, the depth-aware cache, generation — is found, not listed by hand), and
writes each module reached as one flat file named after its dotted path
(``retrofit.halting.tah2`` -> ``retrofit_halting_tah2.py``), with its package imports rewritten:

    from .halting.tah2 import TaH2          ->  from .retrofit_halting_tah2 import TaH2
    from ..config import LoopConfig         ->  from .retrofit_config import LoopConfig
    from .halting import tah2   (module)    ->  from . import retrofit_halting_tah2 as tah2
    import retrofit.heads as heads          ->  from . import retrofit_heads as heads

Only the modules actually imported are bundled: importing ``retrofit.halting.tah2`` does not
bring ``retrofit/halting/__init__.py`` along (Python would run it first; nothing in retrofit relies
on that side effect). A module-form import is invisible to transformers' file scanner, so such a file also gets an
``if False:`` block with a ``from .retrofit_x import __name__`` line per module (never executed;
only scanned). The package root (``retrofit/__init__.py``, which registers the Auto classes) is
never bundled: importing a name from it is an error that says which module to import from
instead. The export checks its own result with transformers' scanner
(``get_relative_import_files``): the files transformers will copy must be exactly the bundle.

Atomicity and safety
--------------------
Everything is written into a temporary folder next to ``--out`` and renamed into place at the
end; a failure removes the temporary folder and leaves ``--out`` as it was. ``--out`` may not be,
contain or lie inside the checkpoint (nor be or contain its training run folder), and a non-empty
``--out`` is replaced only with ``--overwrite`` and only when retrofit wrote it (its
``.retrofit-output`` marker, ``retrofit.output_paths``). The checkpoint's weights are checked
(safetensors headers and sizes) before loading, and an unreadable evaluation file is left out of
the card with a warning.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from .errors import RetrofitUserError
from .output_paths import MARKER, OutputTargetError, check_output_folder, write_marker

logger = logging.getLogger(__name__)

PACKAGE = "retrofit"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "vocab.txt",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class BundleError(RuntimeError):
    """The modeling code cannot be bundled into flat remote-code files (the message says why)."""


class ExportError(RetrofitUserError, RuntimeError):
    """The checkpoint cannot be exported (the message says why and what to do)."""


# ================================================================================================
# Bundling the modeling code
# ================================================================================================
@dataclass
class _Module:
    name: str  # dotted, e.g. "retrofit.halting.tah2"
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package its relative imports resolve against."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def flat_name(module: str) -> str:
    """``retrofit.halting.tah2`` -> ``retrofit_halting_tah2`` (the bundled file's module name)."""
    return module.replace(".", "_")


class _Graph:
    """Locates the modules of one package on disk (no imports executed)."""

    def __init__(self, package_dir: Path, package: str):
        self.dir = Path(package_dir)
        self.package = package

    def find(self, name: str) -> _Module | None:
        if name != self.package and not name.startswith(self.package + "."):
            return None
        rel = name.split(".")[1:]
        base = self.dir.joinpath(*rel)
        if (base / "__init__.py").is_file():
            return _Module(name, base / "__init__.py", True)
        if base.with_suffix(".py").is_file() and rel:
            return _Module(name, base.with_suffix(".py"), False)
        return None

    def in_package(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")


def _resolve(node: ast.ImportFrom, mod: _Module) -> str:
    if node.level == 0:
        return node.module
    parts = mod.package.split(".")
    if node.level - 1 >= len(parts):
        raise BundleError(f"{mod.path}: relative import beyond the top-level package (line {node.lineno})")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _import_targets(node: ast.AST, mod: _Module, graph: _Graph) -> list[tuple[str, list[tuple[str, str | None]], str]] | None:
    """How an import statement maps onto bundled modules.

    Returns None when the statement imports nothing of the package; else a list of
    ``(kind, payload, target_module)`` where kind is ``"names"`` (``from target import a as b``,
    payload = [(a, b)]) or ``"module"`` (bind the module object, payload = [(alias, None)]).
    """
    out = []
    if isinstance(node, ast.ImportFrom):
        target = _resolve(node, mod)
        if not graph.in_package(target):
            return None
        if graph.find(target) is None:
            raise BundleError(f"{mod.path}:{node.lineno}: cannot find module {target!r} in {graph.dir}")
        plain = []
        for alias in node.names:
            if alias.name == "*":
                plain.append(("*", None))
                continue
            sub = graph.find(f"{target}.{alias.name}")
            if sub is not None:
                out.append(("module", [(alias.asname or alias.name, None)], sub.name))
            else:
                plain.append((alias.name, alias.asname))
        if plain:
            if target == graph.package:
                names = ", ".join(n for n, _ in plain)
                raise BundleError(
                    f"{mod.path}:{node.lineno} imports {names} from the package root {graph.package!r}, whose "
                    f"__init__ registers the Auto classes and cannot ship as remote code; import from the "
                    f"module that defines it (e.g. `from .config import LoopConfig`)"
                )
            out.insert(0, ("names", plain, target))
        return out
    if isinstance(node, ast.Import):
        ours = [a for a in node.names if graph.in_package(a.name)]
        if not ours:
            return None
        if len(ours) != len(node.names):
            raise BundleError(f"{mod.path}:{node.lineno}: split `import` of {graph.package} and other packages")
        for alias in ours:
            if alias.asname is None:
                raise BundleError(
                    f"{mod.path}:{node.lineno}: `import {alias.name}` binds the package name {graph.package!r}, "
                    "which does not exist in the exported folder; use a relative import or `import ... as name`"
                )
            if graph.find(alias.name) is None or alias.name == graph.package:
                raise BundleError(f"{mod.path}:{node.lineno}: cannot bundle `import {alias.name} as {alias.asname}`")
            out.append(("module", [(alias.asname, None)], alias.name))
        return out
    return None


def _render(kind: str, payload, target: str) -> str:
    flat = flat_name(target)
    if kind == "module":
        return f"from . import {flat} as {payload[0][0]}"
    names = ", ".join(n if a is None else f"{n} as {a}" for n, a in payload)
    return f"from .{flat} import {names}"


def _rewrite(mod: _Module, graph: _Graph) -> tuple[str, set[str]]:
    """Rewrite one module's package imports; returns ``(new source, modules it needs)``."""
    src = mod.path.read_bytes()
    tree = ast.parse(src, filename=str(mod.path))
    lines = src.splitlines(keepends=True)
    edits = []
    needs: set[str] = set()
    module_form: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = _import_targets(node, mod, graph)
        if targets is None:
            continue
        stmts = []
        for kind, payload, target in targets:
            needs.add(target)
            if kind == "module":
                module_form.add(target)
            stmts.append(_render(kind, payload, target))
        edits.append((node, stmts))
    # bottom-up, so earlier positions stay valid; ast offsets are UTF-8 byte offsets
    for node, stmts in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        prefix, suffix = first[: node.col_offset], last[node.end_col_offset :]
        if prefix.strip():
            raise BundleError(f"{mod.path}:{node.lineno}: put this import on its own line (it follows other code)")
        indent = prefix.decode()
        body = ("\n" + indent).join(stmts)
        lines[node.lineno - 1 : node.end_lineno] = [(indent + body).encode() + suffix]
    text = b"".join(lines).decode("utf-8")
    if module_form:
        # module-object imports are invisible to transformers' `from .x import` scanner: list them
        # in a block that is scanned but never executed, so the files get copied
        text = text.rstrip("\n") + "\n\n\nif False:  # retrofit export: lets transformers' remote-code loader find these files\n"
        text += "".join(f"    from .{flat_name(t)} import __name__  # noqa: F401\n" for t in sorted(module_form))
    src_rel = mod.path.relative_to(graph.dir.parent).as_posix()
    header = (
        f"# Bundled by `retrofit export` from {src_rel}: a flat copy whose package imports are rewritten\n"
        "# to sibling files, because transformers copies remote code without subfolders. Do not edit.\n"
    )
    return header + text, needs


def bundle_modules(entries: list[str], package_dir: str | Path | None = None, package: str = PACKAGE) -> dict[str, str]:
    """Flat remote-code files for ``entries`` and every package module they import, transitively.

    Args:
        entries: dotted module names to start from (those defining the exported classes).
        package_dir: the package's folder; defaults to the installed ``retrofit``.
        package: the package's top-level name.

    Returns:
        ``{file name: source}``, e.g. ``{"retrofit_modeling.py": ..., "retrofit_halting_tah2.py": ...}``.

    Raises:
        BundleError: an import cannot be expressed in flat files (the message names the line).
    """
    if package_dir is None:
        package_dir = Path(__file__).resolve().parent
    graph = _Graph(Path(package_dir), package)
    todo = list(entries)
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    while todo:
        name = todo.pop()
        fname = flat_name(name) + ".py"
        if fname in out:
            if owner[fname] != name:
                raise BundleError(f"modules {owner[fname]!r} and {name!r} would both be bundled as {fname}")
            continue
        mod = graph.find(name)
        if mod is None:
            raise BundleError(f"cannot find module {name!r} under {graph.dir}")
        if name == package:
            raise BundleError(f"the package root {package!r} cannot be bundled (its __init__ registers Auto classes)")
        out[fname], needs = _rewrite(mod, graph)
        owner[fname] = name
        todo.extend(sorted(needs))
    for fname, text in out.items():
        _check_no_package_imports(fname, text, package)
    return out


def _check_no_package_imports(fname: str, text: str, package: str) -> None:
    for node in ast.walk(ast.parse(text)):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        for m in mods:
            if m == package or m.startswith(package + "."):
                raise BundleError(f"{fname}:{node.lineno} still imports {m!r} after bundling")


def write_remote_code(folder: str | Path, model) -> tuple[dict[str, str], list[str]]:
    """Bundle the modeling code of ``model`` into ``folder``.

    Returns:
        ``(auto_map, files)``: the ``config.json`` ``auto_map`` and the file names written.

    Raises:
        BundleError: bundling failed, or transformers would copy a different set of files than
            the bundle (its scanner is the ground truth for what a fresh process gets).
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    folder = Path(folder)
    model_cls, config_cls = type(model), type(model.config)
    entries = sorted({model_cls.__module__, config_cls.__module__})
    for m in entries:
        if not m.startswith(PACKAGE + "."):
            raise BundleError(f"class defined outside {PACKAGE!r} ({m}); cannot bundle it")
    files = bundle_modules(entries)
    for fname, text in files.items():
        (folder / fname).write_text(text, encoding="utf-8")
    auto_map = {
        "AutoConfig": f"{flat_name(config_cls.__module__)}.{config_cls.__name__}",
        "AutoModelForCausalLM": f"{flat_name(model_cls.__module__)}.{model_cls.__name__}",
    }
    expected = set(files)
    for entry in entries:
        entry_file = folder / (flat_name(entry) + ".py")
        seen = {entry_file.name} | {Path(f).name for f in get_relative_import_files(str(entry_file))}
        missing = {f for f in seen if not (folder / f).is_file()}
        if missing:
            raise BundleError(f"transformers would look for {sorted(missing)}, which the bundle does not contain")
        expected -= seen
    if expected:
        raise BundleError(f"transformers would not copy {sorted(expected)} (an import its scanner cannot see)")
    return auto_map, sorted(files)


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
    subs = [(int(m.group(1)), p) for p in ckpt.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / "config.json").is_file()]
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


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def load_checkpoint(ckpt: str | Path, tokenizer: str | Path | None = None, *, folder: Path | None = None):
    """Load a looped checkpoint folder -> ``(model, tokenizer or None, folder)``.

    The weights are checked first (``retrofit.checkpointing.validate_weights``), so a truncated or
    corrupt ``model.safetensors`` is a one-line ``InvalidCheckpointError``, not a loader traceback.
    ``folder``: ``resolve_checkpoint(ckpt)`` when the caller already has it.
    """
    from transformers import AutoModelForCausalLM

    import retrofit  # noqa: F401  (registers the looped classes)

    from .checkpointing import validate_weights
    from .loading import load_tokenizer
    from .modeling import LoopedForCausalLM

    folder = resolve_checkpoint(ckpt) if folder is None else Path(folder)
    if not validate_weights(folder):
        raise ExportError(f"{folder} holds no model.safetensors (nor an index of shards); retrofit exports safetensors checkpoints")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    if not isinstance(model, LoopedForCausalLM):
        raise ExportError(
            f"{folder} holds a {type(model).__name__}, not a looped model; convert it first: "
            f"`retrofit convert --model {folder} --out LOOPED_DIR ...`"
        )
    tok_src = tokenizer if tokenizer is not None else (folder if _has_tokenizer(folder) else (Path(ckpt) if _has_tokenizer(Path(ckpt)) else None))
    tok = load_tokenizer(str(tok_src)) if tok_src is not None else None
    return model.eval(), tok, folder


# ================================================================================================
# Export
# ================================================================================================
def _check_target(out: Path, overwrite: bool, inputs=()) -> Path:
    """``retrofit.output_paths.check_output_folder`` as an ``ExportError``: ``out`` may not overlap ``inputs``,
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
    from .checkpointing import _fsync_dir, fsync_tree

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

    from .heads import parameter_report
    from .model_card import (
        EVAL_FILES,
        card_metadata,
        render_model_card,
    )
    from .modeling import LoopedForCausalLM

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


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str | None = None, api: HfApi | None = None):
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
    export_model(model, out, tokenizer=tok, source=folder, overwrite=overwrite, base_model=base_model,
                 license=license, repo_id=push_to_hub_repo)
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
    p.add_argument("--base-model", default=None, help="card metadata: base model id (default: recorded by `retrofit convert`)")
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
