"""The test tree must not shadow a dependency or a real package: pytest puts ``tests/`` (and, in its default
"prepend" import mode, the folder of every test file) on ``sys.path``, so a test folder named like a package
(a ``tests/vllm/`` once did this) makes ``find_spec("vllm")`` succeed and TRL's GRPO import fail with
"Invalid version: 'N/A'". A folder named after the part of ``retrofit`` it tests (``tests/model/``) is fine
as long as nothing outside the test tree has that name; ``tests/lm_eval/`` or ``tests/data_prep/`` is not."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]


def _inside(location, folder):
    """Whether ``location`` (a path; ``""`` is the working directory, as in ``sys.path``) is ``folder`` or below it."""
    p = Path(location or ".").resolve()
    return p == folder or folder in p.parents


def shadowing_folders(tests, search_path=None):
    """The subfolders of ``tests`` whose name is also importable from outside ``tests``: ``{name: location}``.

    Each name is looked up with ``PathFinder`` on ``search_path`` (default ``sys.path``) less ``tests`` and its
    subfolders, then with the other finders on ``sys.meta_path`` (built-in modules, editable installs); a spec
    that lies inside ``tests`` (pytest's assertion rewriter searches all of ``sys.path``) is the tree itself."""
    tests = Path(tests).resolve()
    path = [p for p in (sys.path if search_path is None else search_path) if not _inside(p, tests)]
    finders = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder and hasattr(f, "find_spec")]
    found = {}
    for entry in sorted(tests.iterdir()):
        name = entry.name
        if not entry.is_dir() or not name.isidentifier() or name == "__pycache__":
            continue
        specs = [importlib.machinery.PathFinder.find_spec(name, path), *(f.find_spec(name, None) for f in finders)]
        for spec in filter(None, specs):
            locations = [loc for loc in (spec.origin, *(spec.submodule_search_locations or [])) if loc]
            outside = [loc for loc in locations if loc in ("built-in", "frozen") or not _inside(loc, tests)]
            if outside or not locations:
                found[name] = outside[0] if outside else spec.name
                break
    return found


def test_no_test_folder_shadows_an_importable_package():
    assert shadowing_folders(TESTS) == {}


def test_a_folder_named_like_a_package_is_flagged(tmp_path):
    tests = tmp_path / "tests"
    for name in ("torch", "data_prep", "model", "__pycache__", ".hidden"):
        (tests / name).mkdir(parents=True)
    (tests / "model" / "test_x.py").write_text("")
    repo = TESTS.parent
    # the temporary tree is on the path as pytest would put it (the real one is not: its folders are named alike);
    # only the installed and the repository's names count
    outside = [p for p in sys.path if not _inside(p, TESTS)]
    found = shadowing_folders(tests, [str(tests), str(tests / "model"), str(repo), *outside])
    assert sorted(found) == ["data_prep", "torch"], found
    assert Path(found["torch"]).resolve().parent == Path(torch.__file__).resolve().parent


def test_vllm_is_not_found_inside_the_repository():
    spec = importlib.util.find_spec("vllm")
    locations = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
    repo = TESTS.parent
    assert not any(loc and str(loc).startswith(str(repo)) for loc in locations), locations
