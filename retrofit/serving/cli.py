"""``retrofit serve``: an OpenAI-compatible server with continuous depth-wise batching.

    retrofit serve smollm2                                   # the embedded default (a base model: depth 1)
    retrofit serve outputs/tah2_llama/final --port 8000      # a trained looped checkpoint
    retrofit serve hub_folder/ --exit kl --threshold 5e-4    # an export folder, training-free exits

``MODEL`` is anything ``retrofit.hub.loading.load_model`` accepts. A base (non-looped) model is served as a
depth-1 looped model over its whole stack, which computes exactly the base model (convert it first with
``retrofit convert`` to loop it). See docs/serving.md for client examples.
"""

from __future__ import annotations

import argparse
import logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="looped checkpoint folder, export folder, GGUF file, 'smollm2', 'tiny-llama', hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: MODEL)")
    p.add_argument("--max-batch", type=int, default=32, help="requests generated at once (default 32)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + answer (default: context, ≤ 2048)")
    p.add_argument("--kv-budget-mb", type=float, default=256.0, help="memory for K/V blocks in MiB (default 256)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default 16)")
    p.add_argument(
        "--core-block-size",
        type=int,
        default=1,
        help="(token, depth) entry slots per block of the core layers' KV (default 1)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--depth", type=int, default=None, help="default fixed depth k for every token")
    g.add_argument(
        "--exit",
        choices=["decider", "kl", "state"],
        default=None,
        help="default exit rule (requests may override it): the decider, or a training-free exit",
    )
    p.add_argument("--threshold", type=float, default=None, help="threshold of --exit kl/state")
    p.add_argument("--taps", action="store_true", help="TAPS step sizes by default")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def load_for_serving(spec: str):
    """``(looped model, tokenizer)`` for ``spec``; a base model becomes a depth-1 looped model (= the base)."""
    from ..hub.loading import load_model
    from ..model.config import LoopConfig
    from ..model.convert import convert
    from ..model.modeling import LoopedForCausalLM

    model, tok = load_model(spec)
    if not isinstance(model, LoopedForCausalLM):
        model = convert(model, LoopConfig(prelude=0, core=None, max_depth=1, method="fixed"))
    return model.eval(), tok


def run(args) -> int:
    import torch

    from .engine import Engine
    from .server import serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper()))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.exit in ("kl", "state") and args.threshold is None:
        raise SystemExit(f"--exit {args.exit} needs --threshold")
    default_exit = {}
    if args.depth is not None:
        default_exit["depth"] = args.depth
    if args.exit in ("kl", "state"):
        default_exit.update(exit_policy=args.exit, exit_threshold=args.threshold)
    if args.taps:
        default_exit["step_schedule"] = "taps"
    model, tok = load_for_serving(args.model)
    engine = Engine(
        model,
        tok,
        max_seqs=args.max_batch,
        max_model_len=args.max_model_len,
        kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
        block_size=args.block_size,
        core_block_size=args.core_block_size,
        default_exit=default_exit,
    )
    name = args.served_model_name or args.model
    logging.getLogger(__name__).info(
        "serving %s on http://%s:%d (max batch %d, max depth %d)",
        name,
        args.host,
        args.port,
        args.max_batch,
        model.loop.max_depth,
    )
    serve(engine, tok, name, host=args.host, port=args.port, log_level=args.log_level)
    return 0
