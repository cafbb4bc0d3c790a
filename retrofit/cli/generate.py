"""``retrofit generate``: stream an answer with per-token adaptive depth and show each token's exit depth.

    retrofit generate --model out/tah2-smollm2 --prompt "What is 17 * 23?" --chat --show-depths
    retrofit generate --model out/tah2-smollm2 --prompt "..." --exit kl --threshold 5e-4 --html depths.html
    retrofit generate --model out/tah2-smollm2 --prompt "..." --depth 1          # base-model compute

``--model`` is anything ``retrofit.hub.loading.load_model`` accepts (a saved looped folder, a GGUF file,
``tiny-llama`` …). A base (non-looped) model generates normally; every token then has depth 1.
With ``--show-depths`` each token is printed on a background coloured by its exit depth (the depth
of the step that produced it) as it streams, followed by the mean depth d̄ and the FLOPs relative to
the fixed-max-depth and base models; ``--html`` writes the same view to a file.

Bad input is one ``error:`` line (exit code 2): a model path that does not exist or a broken
model file (``retrofit.hub.loading``), an empty or non-UTF-8 prompt, a prompt that does not fit the
model's context with ``--max-new-tokens`` (``--truncate`` keeps its last tokens instead, and says
how many it dropped), or a request whose K/V cache cannot fit in memory (``retrofit.model.memory``).
"""

from __future__ import annotations

import argparse
import logging

from ..model.errors import RetrofitUserError

logger = logging.getLogger(__name__)


class GenerateError(RetrofitUserError, ValueError):
    """Bad options or prompt for ``retrofit generate``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="looped checkpoint folder, GGUF file, 'smollm2', 'tiny-llama', hub id"
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn with the tokenizer's chat template"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--depth", type=int, default=None, help="fixed depth k for every token (1 = base-model compute)")
    g.add_argument(
        "--exit",
        choices=["decider", "kl", "state"],
        default=None,
        help="exit rule: the model's learned decider (default), KL between successive depths' "
        "next-token distributions, or relative state change; kl/state need --threshold",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="threshold T of --exit kl/state (e.g. 5e-4 for kl, 0.05 for state)",
    )
    p.add_argument("--taps", action="store_true", help="TAPS step sizes in the core (retrofit.model.schedulers.taps)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --sample)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (with --sample)")
    p.add_argument("--seed", type=int, default=0, help="random seed (with --sample)")
    p.add_argument("--show-depths", action="store_true", help="colour each token by its exit depth; print d̄ and FLOPs")
    p.add_argument("--html", default=None, metavar="OUT", help="write the depth-coloured answer to this HTML file")
    p.add_argument(
        "--truncate",
        action="store_true",
        help="when the prompt plus --max-new-tokens exceeds the model's context, keep the prompt's last "
        "tokens (default: refuse with an error)",
    )


def check_prompt(prompt: str) -> str:
    """The prompt, or a ``GenerateError`` when it is empty or not valid UTF-8 (undecodable bytes in
    the command line arrive as lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = prompt[e.start]
        byte = f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"character {ch!r}"
        raise GenerateError(
            f"--prompt is not valid UTF-8 (undecodable {byte} at position {e.start}); pass UTF-8 text"
        ) from None
    if not prompt.strip():
        raise GenerateError("--prompt is empty; give the text to continue (or --chat to wrap it as a user turn)")
    return prompt


def fit_context(ids, context: int | None, new_tokens: int, truncate: bool):
    """Check that ``[1, P]`` prompt ids plus ``new_tokens`` fit ``context`` positions.

    Returns:
        ``(ids, dropped)``: the ids (the last ``context - new_tokens`` of them with ``truncate``) and
        how many leading tokens were dropped.

    Raises:
        GenerateError: the prompt is empty after tokenization, or it does not fit and not ``truncate``
            (or ``new_tokens`` alone fills the context).
    """
    P = ids.shape[1]
    if P == 0:
        raise GenerateError("--prompt encodes to no tokens; give some text the tokenizer knows")
    if context is None or P + new_tokens <= context:
        return ids, 0
    room = context - new_tokens
    if room < 1:
        raise GenerateError(
            f"--max-new-tokens {new_tokens} leaves no room for the prompt in the model's context of "
            f"{context} positions; "
            f"use at most {context - 1}"
        )
    if not truncate:
        raise GenerateError(
            f"the prompt is {P} tokens; with --max-new-tokens {new_tokens} it needs {P + new_tokens} "
            f"positions, but the "
            f"model's context is {context}; shorten the prompt, lower --max-new-tokens, or pass --truncate to keep "
            f"its last {room} tokens"
        )
    return ids[:, P - room :], P - room


class _DepthStreamer:
    """Prints each new token coloured by the depth of the step that produced it (batch of one;
    ``cache=None`` for a base model: depth 1).

    ``generate`` calls ``put`` with the prompt first, then once per new token, right after the step
    that produced it, so that step's depth is the cache's last recorded position.
    """

    def __init__(self, tokenizer, cache, max_depth: int, console):
        self.tok, self.cache, self.D, self.console = tokenizer, cache, max_depth, console
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        from ..evaluation.html import ansi_depth_text

        ids = value.reshape(-1).tolist()
        c = self.cache
        d = int(c.token_depths[0, c.length - 1]) if (c is not None and c.length) else 1
        text = self.tok.decode(ids, skip_special_tokens=True)
        if text:
            self.console.print(ansi_depth_text([text], [d], self.D), end="")

    def end(self):
        self.console.print()


def _token_strings(tok, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TextStreamer

    from ..hub.loading import load_model
    from ..model.modeling import LoopedForCausalLM

    if args.exit in ("kl", "state") and args.threshold is None:
        raise GenerateError(f"--exit {args.exit} needs --threshold T")
    if args.threshold is not None and args.exit not in ("kl", "state"):
        raise GenerateError("--threshold applies to --exit kl or --exit state only")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_prompt(args.prompt)

    model, tok = load_model(args.model)
    model.eval()
    looped = isinstance(model, LoopedForCausalLM)
    D = model.loop.max_depth if looped else 1
    gen_kw: dict = {}
    if looped:
        if args.depth is not None:
            if not 1 <= args.depth <= D:
                raise GenerateError(f"--depth must lie in 1..{D} (the model's max_depth), got {args.depth}")
            gen_kw["depth"] = args.depth
        elif args.exit in ("kl", "state"):
            gen_kw.update(exit_policy=args.exit, exit_threshold=args.threshold)
        if args.taps:
            gen_kw["step_schedule"] = "taps"
    elif args.depth not in (None, 1) or args.exit in ("kl", "state") or args.taps:
        raise GenerateError(
            f"{args.model} is a base (non-looped) model; --depth/--exit/--taps need a looped checkpoint "
            "(make one with `retrofit convert`)"
        )

    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise GenerateError("--chat needs a tokenizer with a chat template")
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False
        )
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    context = getattr(model.config, "max_position_embeddings", None)
    ids, dropped = fit_context(enc["input_ids"], context, args.max_new_tokens, args.truncate)
    if dropped:
        logger.warning("--truncate: dropped the first %d prompt tokens to fit the context of %d", dropped, context)
        print(f"(--truncate: dropped the first {dropped} of {enc['input_ids'].shape[1]} prompt tokens)")
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    enc = {k: v.to(model.device) for k, v in enc.items()}
    from ..model.memory import check_generation_memory

    check_generation_memory(
        model,
        1,
        ids.shape[1],
        args.max_new_tokens,
        readout=(model.halting.needs_depth_readout or args.exit == "kl") if looped else False,
    )
    sampling = (
        {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        if args.sample
        else {"do_sample": False}
    )
    if args.sample:
        torch.manual_seed(args.seed)

    cache = None
    if looped:
        from ..model.cache import DepthKVCache

        cache = DepthKVCache(model.config)
        gen_kw["cache"] = cache
    if args.show_depths:
        from rich.console import Console

        streamer = _DepthStreamer(tok, cache, D, Console(highlight=False, soft_wrap=True))
    else:
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            **sampling,
            **gen_kw,
        )
    P = enc["input_ids"].shape[1]
    new_ids = out.sequences[0, P:].tolist()
    if looped:
        depths = out.depths[0].tolist()
    else:
        depths = [1] * len(new_ids)
    keep = [i for i, d in enumerate(depths) if d > 0]
    tokens = _token_strings(tok, [new_ids[i] for i in keep])
    depths = [depths[i] for i in keep]

    if args.show_depths:
        mean = sum(depths) / len(depths) if depths else float("nan")
        line = f"mean depth d̄ = {mean:.2f} over {len(depths)} tokens (max depth D = {D})"
        if looped and depths:
            from ..model.flops import cost_report

            forced = args.depth is not None  # a forced depth runs no decider (retrofit.model.loop.ForcedExit)
            readout = (model.halting.needs_depth_readout and not forced) or args.exit == "kl"
            rep = cost_report(model, torch.tensor(depths), readout=readout, decider=not forced)
            line += (
                f"; FLOPs vs fixed depth {D}: {rep['flops_vs_fixed']:.3f}, vs base model: {rep['flops_vs_base']:.3f}"
            )
        print(line)
    if args.html:
        from ..evaluation.html import write_depth_html

        path = write_depth_html([{"tokens": tokens, "depths": depths, "title": args.prompt}], args.html, max_depth=D)
        print(f"wrote {path}")
    return 0
