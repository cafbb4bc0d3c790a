"""Bundle retrofit's modeling code into flat remote-code files (``retrofit export``).

transformers copies remote-code files *flat* into its module cache (``HF_MODULES_CACHE``) and
finds the files to copy with a regular expression over ``from .name import …`` lines; it knows
no subpackages. retrofit's modeling code spans modules and a subpackage (``retrofit/halting``)
joined by relative imports. ``bundle_modules`` therefore walks the import graph with ``ast``,
starting from the modules that define the model and config classes (so whatever those import
— heads, halting methods, the depth loop and its backends, the depth-aware cache, generation, the
version check — is found, not listed by hand), and writes each module reached as one flat file
named after its dotted path without the ``model`` package (``retrofit.model.halting.tah2`` ->
``retrofit_halting_tah2.py``: the file names of exports made before the package existed), with its
package imports rewritten:

    from .halting.tah2 import TaH2            ->  from .retrofit_halting_tah2 import TaH2
    from ..config import LoopConfig           ->  from .retrofit_config import LoopConfig
    from .halting import tah2   (module)      ->  from . import retrofit_halting_tah2 as tah2
    import retrofit.model.heads as heads      ->  from . import retrofit_heads as heads

Only the modules actually imported are bundled: importing ``retrofit.model.halting.tah2`` does not
bring ``retrofit/model/halting/__init__.py`` along (Python would run it first; nothing in retrofit relies
on that side effect). A module-form import is invisible to transformers' file scanner, so such a file also gets an
``if False:`` block with a ``from .retrofit_x import __name__`` line per module (never executed;
only scanned). The package root (``retrofit/__init__.py``, which registers the Auto classes) is
never bundled: importing a name from it is an error that says which module to import from
instead. The TRL integration (``retrofit.model.trl_fused``) is left out: ``retrofit.model.modeling`` imports it
by name only, so neither the bundler nor transformers' scanner follows it, and the exported code
needs no TRL. The bundled ``retrofit_causal_lm.py`` runs its own version check of transformers
(``retrofit.model.versions``) when imported.

The ``auto_map`` points at a small generated entry file, ``modeling_looped.py`` (``ENTRY``): where
retrofit itself is installed (the version that exported the folder) it returns retrofit's own
classes, so ``trust_remote_code=True`` there gives one set of classes (``isinstance`` with
``retrofit.LoopedForCausalLM`` holds, and retrofit's trainers accept the model); elsewhere it
imports the bundled copy. The export checks its own result with transformers' scanner
(``get_relative_import_files``): the files transformers will copy must be exactly the bundle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "retrofit"
#: the subpackage every bundled module must lie in (what a looped checkpoint needs at inference)
MODEL_PACKAGE = "retrofit.model"
#: the generated entry module the exported ``auto_map`` points at
ENTRY = "modeling_looped"


class BundleError(RuntimeError):
    """The modeling code cannot be bundled into flat remote-code files (the message says why)."""


@dataclass
class _Module:
    name: str  # dotted, e.g. "retrofit.model.halting.tah2"
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package its relative imports resolve against."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def flat_name(module: str) -> str:
    """``retrofit.model.halting.tah2`` -> ``retrofit_halting_tah2`` (the bundled file's module name).

    The ``model`` package level is left out, so an export keeps the file names of exports made before
    ``retrofit/model`` existed (``retrofit_modeling.py``, ``retrofit_halting_tah2.py``, ...)."""
    if module.startswith(MODEL_PACKAGE + "."):
        module = PACKAGE + "." + module[len(MODEL_PACKAGE) + 1 :]
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


def _import_targets(
    node: ast.AST, mod: _Module, graph: _Graph
) -> list[tuple[str, list[tuple[str, str | None]], str]] | None:
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
        text = (
            text.rstrip("\n")
            + "\n\n\nif False:  # retrofit export: lets transformers' remote-code loader find these files\n"
        )
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
    return _bundle(entries, package_dir, package)[0]


def bundled_modules(
    entries: list[str], package_dir: str | Path | None = None, package: str = PACKAGE
) -> dict[str, str]:
    """``{file name: dotted module name}`` of what ``bundle_modules(entries, ...)`` writes."""
    return _bundle(entries, package_dir, package)[1]


def _bundle(entries, package_dir, package) -> tuple[dict[str, str], dict[str, str]]:
    """``({file name: source}, {file name: dotted module name})`` (``bundle_modules``)."""
    if package_dir is None:
        package_dir = Path(__file__).resolve().parent.parent
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
    return out, owner


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


def entry_module(names: list[str], module: str, version: str) -> str:
    """The source of ``ENTRY``: retrofit's own classes where that retrofit version is installed, else the
    bundled copy (``module``, a flat bundled module defining ``names``)."""
    listed = ", ".join(names)
    return f'''"""Entry point of this exported looped model (written by `retrofit export`; do not edit).

Where the retrofit package is installed (version {version}, which exported this folder), its own classes
are used: a model loaded with trust_remote_code=True is then an instance of retrofit's classes (one set
of classes for isinstance checks, retrofit's trainers and tools). Elsewhere the bundled copy of
retrofit's modeling code ({module}.py and its siblings) is used.
"""

try:
    import retrofit  # registers its classes with the Auto classes

    if retrofit.__version__ != {version!r}:
        import warnings

        warnings.warn(
            f"retrofit {{retrofit.__version__}} is installed but this folder was exported by {version}: using the "
            "bundled modeling code, whose classes are not retrofit's (isinstance checks against them fail)"
        )
        raise ImportError("another retrofit version")
    from retrofit.model.modeling import {listed}  # noqa: F401
except ImportError:
    from .{module} import {listed}  # noqa: F401
'''


def write_remote_code(folder: str | Path, model) -> tuple[dict[str, str], list[str]]:
    """Bundle the modeling code of ``model`` into ``folder``, with the ``ENTRY`` module.

    Returns:
        ``(auto_map, files)``: the ``config.json`` ``auto_map`` and the file names written.

    Raises:
        BundleError: bundling failed, or transformers would copy a different set of files than
            the bundle (its scanner is the ground truth for what a fresh process gets).
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    from .. import __version__

    folder = Path(folder)
    model_cls, config_cls = type(model), type(model.config)
    if model_cls.__module__ != config_cls.__module__:
        raise BundleError(
            f"the model and config classes live in different modules ({model_cls.__module__}, "
            f"{config_cls.__module__}); the entry module expects one"
        )
    source = model_cls.__module__
    if not source.startswith(PACKAGE + "."):
        raise BundleError(f"class defined outside {PACKAGE!r} ({source}); cannot bundle it")
    files, owner = _bundle([source], None, PACKAGE)
    outside = sorted(m for m in owner.values() if not m.startswith(MODEL_PACKAGE + "."))
    if outside:
        raise BundleError(f"the bundle reaches modules outside {MODEL_PACKAGE!r}: {outside}")
    files[ENTRY + ".py"] = entry_module([config_cls.__name__, model_cls.__name__], flat_name(source), __version__)
    for fname, text in files.items():
        (folder / fname).write_text(text, encoding="utf-8")
    auto_map = {
        "AutoConfig": f"{ENTRY}.{config_cls.__name__}",
        "AutoModelForCausalLM": f"{ENTRY}.{model_cls.__name__}",
    }
    entry_file = folder / (ENTRY + ".py")
    seen = {entry_file.name} | {Path(f).name for f in get_relative_import_files(str(entry_file))}
    missing = {f for f in seen if not (folder / f).is_file()}
    if missing:
        raise BundleError(f"transformers would look for {sorted(missing)}, which the bundle does not contain")
    if set(files) - seen:
        raise BundleError(f"transformers would not copy {sorted(set(files) - seen)} (an import its scanner cannot see)")
    return auto_map, sorted(files)
