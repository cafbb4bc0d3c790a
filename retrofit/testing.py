"""Tiny random models and a character tokenizer, built in code, for tests, benchmarks and dry runs.

Nothing here touches the network. ``tiny_base("llama")`` / ``tiny_base("qwen3")`` return a small
random ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``; ``char_tokenizer()`` returns a
``PreTrainedTokenizerFast`` over printable ASCII with a ChatML-style chat template that carries
``{% generation %}`` markers (TRL's ``assistant_only_loss`` needs them).
"""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list(string.printable)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (``vocab_size`` = 4 specials + 100 printable characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<unk>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


TINY_SHAPES = dict(
    vocab_size=len(SPECIAL_TOKENS) + len(CHARS),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)


def tiny_config(family: str = "llama", **overrides):
    fields = {**TINY_SHAPES, **overrides}
    if family == "llama":
        return LlamaConfig(**fields)
    if family == "qwen3":
        fields.setdefault("head_dim", 16)
        return Qwen3Config(**fields)
    raise ValueError(f"unknown tiny family {family!r}; allowed: 'llama', 'qwen3'")


def tiny_base(family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A tiny random base causal LM (eval mode, fp32)."""
    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (LlamaForCausalLM if family == "llama" else Qwen3ForCausalLM)(cfg)
    return model.eval()


def seeded_llama(seed: int = 0, attn_implementation: str | None = "sdpa", **config) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM(LlamaConfig(**config))`` drawn right after ``torch.manual_seed(seed)`` (the
    global generator, so what runs next draws on from there), in train mode: the benchmarks' models.
    ``attn_implementation=None`` leaves transformers' default."""
    cfg = LlamaConfig(**config)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def benchmark_llama(args, seed: int = 0) -> LlamaForCausalLM:
    """The decode and serve benchmarks' base model (``seeded_llama``, eval mode): the shape their flags give
    (``args.vocab``, ``hidden``, ``intermediate``, ``layers``, ``heads``, ``kv_heads``), untied embeddings,
    4,096 positions."""
    return seeded_llama(
        seed,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ).eval()


def fixed_and_mixed(base, decider_scale: float, seed: int = 1, **loop):
    """Two looped models on ``base``'s weights, in eval mode: ``fixed`` (every token at ``max_depth``) and
    ``mixed``, ANIRA-E whose halting weights are redrawn from N(0, ``decider_scale``²) (generator seeded with
    ``seed``), so a random decider gives every token a depth in 1..D from its embedding. ``loop``: the
    ``LoopConfig`` fields besides the method (``max_depth``, ``prelude``, ``core``)."""
    from .model.config import LoopConfig
    from .model.convert import convert

    fixed = convert(base, LoopConfig(method="fixed", **loop)).eval()
    mixed = convert(base, LoopConfig(method="anira-e", **loop)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mixed.halting.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * decider_scale)
    return fixed, mixed


@torch.no_grad()
def perturb_updater(model, std: float = 0.05, generator=None) -> None:
    """Make deeper depths compute something new at init: the residual updater's zero-initialized output layer
    ``w2`` gets N(0, ``std``²) entries (drawn from ``generator``, default the global RNG). The TaH2 release's
    updater (``SwiGLUUpdater``) already differs from the identity at init and is left as it is."""
    from .model.heads import Updater

    if isinstance(model.updater, Updater):
        model.updater.w2.weight.normal_(0.0, std, generator=generator)


def decider_score_layer(model) -> torch.nn.Linear:
    """The output (score) layer of a looped model's TaH2 decider: ``score`` of the ``"swiglu"`` decider,
    ``fc2`` of the ``"ffn"`` one. Tests and benchmarks redraw it to get a mix of exit depths."""
    from .model.heads import SwiGLUDecider

    decider = model.halting.decider
    return decider.score if isinstance(decider, SwiGLUDecider) else decider.fc2


@torch.no_grad()
def spread_decider(model, std: float | None = None, logit_std: float | None = None, generator=None) -> None:
    """Redraw the TaH2 decider's score layer so its decisions are mixed: weights ~ N(0, ``std``²), or with
    ``logit_std`` a std chosen so that the continue logits spread about that much
    (``logit_std / sqrt(fan_in)``); the bias (if any) is zeroed. A ``"swiglu"`` decider's inner layers are
    redrawn at unit gain too (``1 / sqrt(fan_in)``)."""
    from .model.heads import SwiGLUDecider

    decider = model.halting.decider
    if isinstance(decider, SwiGLUDecider):
        # at init its inner layers are small (std 0.02), so after norm_out every token points the same way:
        # redraw them at unit gain so the scores differ from token to token
        # (the input projection at equal gain per part, so a wide part such as 2,048 top-K probabilities of a
        # tiny vocabulary does not drown the hidden states)
        cols = [
            torch.randn(decider.input_proj.out_features, n, generator=generator) / (n * len(decider.parts)) ** 0.5
            for n in decider.parts
        ]
        decider.input_proj.weight.copy_(torch.cat(cols, dim=1).to(decider.input_proj.weight))
        for norm in (*decider.norms, decider.norm_out):
            norm.weight.fill_(1.0)
        for lin in (decider.gate_proj, decider.up_proj, decider.down_proj):
            w = torch.randn(lin.weight.shape, generator=generator) / lin.in_features**0.5
            lin.weight.copy_(w.to(lin.weight))
    layer = decider_score_layer(model)
    if logit_std is not None:
        std = logit_std / layer.in_features**0.5
    w = torch.randn(layer.weight.shape, generator=generator) * (1.0 if std is None else std)
    layer.weight.copy_(w.to(layer.weight))
    if layer.bias is not None:
        layer.bias.zero_()
