"""``retrofit convert``: a base checkpoint -> an untrained looped checkpoint (identity at init).

    retrofit convert --model smollm2 --prelude 2 --core 4 --max-depth 3 --method tah2 --out looped/
    retrofit convert --model Qwen/Qwen3-1.7B-Base --prelude 4 --core 8 --max-depth 3 --method anira-o --out looped/

``--model`` takes what ``retrofit.hub.loading.load_model`` takes: ``smollm2`` (the embedded
SmolLM2-135M-Instruct GGUF), ``tiny-llama`` / ``tiny-qwen3``, a ``.gguf`` path, a local folder or a
hub id. The output folder (``save_pretrained`` of ``retrofit.convert(base, LoopConfig(...))`` plus
the tokenizer) is what the training recipes and ``retrofit export`` take as input.

The base model's id and license are recorded in the looped config (``retrofit_base_model``,
``retrofit_base_license``) so that the model card written by ``retrofit export`` after training can
carry them: a hub id is recorded as is; a local folder contributes its ``README.md`` front matter
(``license``) and, when it looks like a hub id, its config's ``_name_or_path``; a GGUF file its
``general.license`` and ``general.base_model.0.repo_url``. ``--base-model`` / ``--license``
override.

Before writing, the conversion is checked: with every token forced to exit at depth 1 the looped
model's logits must equal the base model's on a short probe (``--no-check`` skips it).

``--out`` may not be, contain or lie inside ``--model``; ``--overwrite`` replaces only a folder
that retrofit wrote (``retrofit.hub.output_paths``: the folder gets a ``.retrofit-output`` marker). Bad
input (a missing or truncated model file, an invalid loop spec…) is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import shutil
import tempfile
import typing
from pathlib import Path

import torch

from ..model import registry
from ..model.config import (
    LoopConfig,
)
from ..model.errors import RetrofitUserError, boolean_flag
from ..training.model_setup import IdentityCheckError, identity_check  # noqa: F401 (IdentityCheckError: its old path)

logger = logging.getLogger(__name__)

# specs of retrofit.hub.loading whose upstream identity is known
KNOWN_BASES = {"smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvertError(RetrofitUserError, ValueError):
    """The conversion's input or options are unusable (the message says why)."""


def looks_like_hub_id(s: str | None) -> bool:
    return bool(s) and bool(_HUB_ID.match(s)) and not Path(s).exists()


def base_provenance(spec: str, base_model) -> tuple[str | None, str | None]:
    """``(base model id, license)`` of a ``--model`` spec, each None when unknown."""
    from ..hub.model_card import card_metadata

    if spec in KNOWN_BASES:
        return KNOWN_BASES[spec]
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_provenance(path)
    if path.is_dir():
        meta = card_metadata(path)
        name = getattr(base_model.config, "_name_or_path", None) or getattr(base_model, "name_or_path", None)
        return (name if looks_like_hub_id(name) else None), _license(meta)
    if looks_like_hub_id(spec):
        meta = {}
        try:  # the card is in the hub cache when the weights are; never downloads in offline mode
            from huggingface_hub import try_to_load_from_cache

            from ..hub.model_card import split_front_matter

            cached = try_to_load_from_cache(spec, "README.md")
            if isinstance(cached, str):
                meta = split_front_matter(Path(cached).read_text(encoding="utf-8", errors="replace"))[0]
        except Exception:  # noqa: BLE001 (provenance is best effort; the conversion must not fail on it)
            meta = {}
        return spec, _license(meta)
    return None, None


def _license(meta: dict) -> str | None:
    lic = meta.get("license")
    return lic if isinstance(lic, str) and lic else None


def _gguf_provenance(path: Path) -> tuple[str | None, str | None]:
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
    except Exception as e:  # noqa: BLE001 (unreadable metadata: no provenance; the load reports real errors)
        logger.warning("could not read GGUF metadata of %s: %s", path, e)
        return None, None

    def get(key):
        f = fields.get(key)
        try:
            return f.contents() if f is not None else None
        except Exception:  # noqa: BLE001 (a malformed field is just unknown)
            return None

    url = get("general.base_model.0.repo_url") or get("general.repo_url")
    base = None
    if isinstance(url, str) and "huggingface.co/" in url:
        cand = url.split("huggingface.co/", 1)[1].strip("/")
        base = cand if _HUB_ID.match(cand) else None
    lic = get("general.license")
    return base, (lic if isinstance(lic, str) and lic else None)


def convert_to_folder(
    model: str,
    out: str | Path,
    loop: LoopConfig,
    *,
    overwrite: bool = False,
    dtype: str = "auto",
    base_model: str | None = None,
    license: str | None = None,
    check: bool = True,
) -> Path:
    """Load ``model``, convert it with ``loop`` and write the looped checkpoint + tokenizer to ``out``.

    Returns:
        ``out`` as a ``Path``. The folder appears complete or not at all (written to a temporary
        folder next to it, then renamed).
    """
    from ..hub.export import _check_target, _swap_into_place
    from ..hub.loading import load_model
    from ..hub.output_paths import write_marker
    from ..model.convert import convert
    from ..model.modeling import LoopedForCausalLM

    out = _check_target(Path(out), overwrite, [model])
    if dtype not in DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    base, tok = load_model(model, dtype=DTYPES[dtype])
    if isinstance(base, LoopedForCausalLM):
        raise ConvertError(f"{model} is already a looped checkpoint; convert its base model instead")
    loop.layer_ranges(base.config.num_hidden_layers)  # clear error before any work
    rec_base, rec_license = base_provenance(model, base)
    looped = convert(base, loop)
    if check:
        err = identity_check(looped, base, atol=1e-4)  # a random probe; raises IdentityCheckError
        logger.info("identity at init: max |looped(depth=1) - base| = %.3g", err)
    if base_model or rec_base:
        looped.config.retrofit_base_model = base_model or rec_base
    if license or rec_license:
        looped.config.retrofit_base_license = license or rec_license

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        looped.save_pretrained(str(tmp))
        if tok is not None:
            tok.save_pretrained(str(tmp))
        write_marker(tmp, "retrofit convert")
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="base model: smollm2 | tiny-llama | tiny-qwen3 | path/to/model.gguf | local folder | hub id",
    )
    for name, kind, default, help_ in loop_flags():  # every LoopConfig field, declared once there
        kw = {"choices": registry.names()} if name == "method" else {}
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=help_, **kw)
    for name, (f, owners) in registry.option_fields().items():  # each method's own options, declared once there
        hint = typing.get_type_hints(registry.method_class(owners[0]).Options)[name]
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=_scalar(hint),
            default=None,
            help=f"{' / '.join(owners)}: {f.metadata.get('help') or 'a method option'} (default: the method's)",
        )
    p.add_argument("--out", required=True, help="folder to write (must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (only one that retrofit wrote)")
    p.add_argument(
        "--dtype", default="auto", choices=list(DTYPES), help="load dtype (GGUF files dequantize to float32)"
    )
    p.add_argument("--base-model", default=None, help="record this base model id for the model card")
    p.add_argument("--license", default=None, help="record this license for the model card")
    p.add_argument("--no-check", action="store_true", help="skip the identity-at-init check")


def _scalar(hint):
    """The argparse ``type`` of a ``LoopConfig`` field's hint (``int | None`` -> ``int``; bools take true/false)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = args[0]
    if kind is bool:
        return boolean_flag
    return kind if kind in (int, float, str) else str


def loop_flags() -> list[tuple[str, object, object, str]]:
    """``(name, argparse type, default, help)`` of every ``LoopConfig`` field but ``options``/``extra``: the flags
    of ``retrofit convert``, made from ``LoopConfig`` (its defaults and help)."""
    hints = typing.get_type_hints(LoopConfig)
    out = []
    for f in dataclasses.fields(LoopConfig):
        if f.name in ("options", "extra"):
            continue
        out.append((f.name, _scalar(hints[f.name]), f.default, f.metadata.get("help", "")))
    return out


def run(args) -> int:
    """Entry point of ``retrofit convert``; bad input raises a ``RetrofitUserError`` (one line via ``retrofit.cli``)."""
    from ..model.families import UnsupportedArchitectureError

    try:
        loop = LoopConfig.from_fields(args)  # every flag named like a LoopConfig field
        out = convert_to_folder(
            args.model,
            args.out,
            loop,
            overwrite=args.overwrite,
            dtype=args.dtype,
            base_model=args.base_model,
            license=args.license,
            check=not args.no_check,
        )
    except (UnsupportedArchitectureError, TypeError) as e:  # not a Llama / Qwen3 causal LM
        raise ConvertError(str(e)) from e
    print(f"wrote the looped checkpoint to {out}")
    return 0
