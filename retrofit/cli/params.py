"""``retrofit params``: the heads' parameter share at real model shapes, on the meta device.

No weights are downloaded: the configs of the real checkpoints are written out here (their public
``config.json`` values), the models are built on the ``meta`` device and counted.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ..model import registry
from ..model.config import LoopConfig
from ..model.convert import convert
from ..model.heads import parameter_report

# Public config.json values of the real checkpoints (only the fields that set parameter counts).
REAL_SHAPES: dict[str, tuple[type, type, dict]] = {
    "Qwen/Qwen3-1.7B-Base": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    "Qwen/Qwen3-4B-Base": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    "Qwen/Qwen3-8B-Base": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "meta-llama/Llama-3.2-1B": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
    "HuggingFaceTB/SmolLM2-135M": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
}


def meta_report(name: str, loop: LoopConfig) -> dict:
    """Build ``name`` on the meta device, convert it with ``loop`` and count parameters."""
    cfg_cls, lm_cls, fields = REAL_SHAPES[name]
    with torch.device("meta"):
        base = lm_cls(cfg_cls(**fields))
        looped = convert(base, loop)
    return parameter_report(looped)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="*", default=list(REAL_SHAPES), help="which real shapes to report")
    p.add_argument("--methods", nargs="*", default=list(registry.names()), choices=registry.names())
    p.add_argument("--max-depth", type=int, default=4)
    p.add_argument("--prelude", type=int, default=0)
    p.add_argument("--core", type=int, default=None)


def run(args) -> int:
    rows = []
    for name in args.models:
        for method in args.methods:
            r = meta_report(name, LoopConfig.from_fields(args, method=method))
            rows.append({"model": name, "method": method, **r})
    print(json.dumps(rows, indent=2))
    return 0
