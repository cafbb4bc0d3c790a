"""The test tree must not shadow a dependency: pytest puts ``tests/`` on ``sys.path``, so a folder named
like a package (a ``tests/vllm/`` once did this) makes ``find_spec("vllm")`` succeed and TRL's GRPO import
fail with "Invalid version: 'N/A'"."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_folder_shadows_an_importable_package():
    for entry in TESTS.iterdir():
        if entry.is_dir() and not entry.name.startswith((".", "_")):
            spec = importlib.util.find_spec(entry.name)
            origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
            assert not (origin and str(origin).startswith(str(TESTS))), f"tests/{entry.name} shadows a package"


def test_vllm_is_not_found_inside_the_repository():
    spec = importlib.util.find_spec("vllm")
    locations = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
    repo = TESTS.parent
    assert not any(loc and str(loc).startswith(str(repo)) for loc in locations), locations
