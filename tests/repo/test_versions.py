"""Supported dependency versions: the early check on ``import retrofit`` and its bypass."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import retrofit
from retrofit.model import versions
from retrofit.model.versions import (
    SKIP_ENV,
    SUPPORTED,
    UnsupportedVersionError,
    check_versions,
    find_problems,
)

OK = {"transformers": "5.24.0", "trl": "1.16.0", "peft": "0.21.2"}


@pytest.fixture(autouse=True)
def no_skip(monkeypatch):
    monkeypatch.delenv(SKIP_ENV, raising=False)


def test_installed_versions_pass():
    assert check_versions() == []


@pytest.mark.parametrize(
    "package, version",
    [
        ("transformers", "4.57.1"),
        ("transformers", "6.0.0"),
        ("transformers", "6.0.0.dev0"),
        ("trl", "0.29.0"),
        ("trl", "2.0.0"),
        ("peft", "0.16.0"),
        ("peft", "1.0.0"),
        ("transformers", "not-a-version"),
    ],
)
def test_out_of_range_raises_with_a_clear_message(package, version):
    with pytest.raises(UnsupportedVersionError) as e:
        check_versions(versions={**OK, package: version})
    msg = str(e.value)
    lo, hi = SUPPORTED[package]
    assert f"{package} {version} is installed" in msg and f"{package}>={lo},<{hi}" in msg
    assert SKIP_ENV in msg and "pip install" in msg


@pytest.mark.parametrize(
    "package, version",
    [("transformers", "5.0.0rc1"), ("transformers", "5.99"), ("peft", "0.17.0"), ("trl", "1.0.0"), ("trl", None)],
)
def test_in_range_or_missing_passes(package, version):
    assert check_versions(versions={**OK, package: version}) == []


def test_warn_and_ignore_modes():
    bad = {**OK, "trl": "2.1.0"}
    with pytest.warns(UserWarning, match="trl 2.1.0"):
        assert [p.package for p in check_versions("warn", versions=bad)] == ["trl"]
    assert [p.package for p in check_versions("ignore", versions=bad)] == ["trl"]
    with pytest.raises(ValueError, match="action must be"):
        check_versions("explode")


def test_env_var_bypasses(monkeypatch):
    monkeypatch.setenv(SKIP_ENV, "1")
    assert check_versions(versions={**OK, "transformers": "4.0.0"}) == []


def test_check_reads_installed_versions(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda p: {**OK, "peft": "0.9.0"}[p])
    assert [p.package for p in find_problems()] == ["peft"]


def test_setup_cfg_declares_the_same_ranges():
    cfg = configparser.ConfigParser()
    cfg.read(Path(retrofit.__file__).resolve().parent.parent / "setup.cfg")
    reqs = {
        Requirement(line).name: Requirement(line)
        for line in cfg["options"]["install_requires"].split("\n")
        if line.strip()
    }
    for package, (lo, hi) in SUPPORTED.items():
        spec = reqs[package].specifier
        assert spec.contains(lo) and not spec.contains(hi), f"setup.cfg {package}{spec} vs versions.py {lo}..{hi}"
        assert {s.operator for s in spec} == {">=", "<"}


def test_import_fails_early_on_an_untested_major(tmp_path):
    """``import retrofit`` under a faked transformers 6 fails with the clear message; the env var bypasses."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda p: '6.0.0' if p == 'transformers' else real(p)\n"
        "import retrofit\n"
        "print('imported')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != SKIP_ENV}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False
    )
    assert r.returncode != 0 and "UnsupportedVersionError" in r.stderr
    assert "transformers 6.0.0 is installed, but retrofit supports transformers>=5.0,<6" in r.stderr
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, SKIP_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
