"""Tiny looped checkpoints for the vLLM tests and benchmark, with heads perturbed so exits are mixed.

Built through retrofit's public API (``convert``, ``save_pretrained``) and the checkpoint's weight
names only. Head dimension 32: vLLM's CPU attention kernel supports 32, 64, 80, … (not the unit
tests' 16).
"""

from __future__ import annotations

from pathlib import Path

import torch

#: the loop fields the checkpoints pin: what the plugin serves, and the head shapes and init of before the TaH2
#: release's options existed
PLUGIN_LOOP = {
    "updater": "residual",
    "decider_state": "core",
    "decider_top_k": 2048,
    "decider_width_rule": "quarter",
    "decider_init": "normal",
}

SHAPES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build_checkpoint(
    folder: str | Path,
    family: str,
    method: str,
    attention: str | None = None,
    *,
    prelude: int = 1,
    core: int | None = 3,
    max_depth: int = 3,
    seed: int = 0,
    decider_std: float = 1.0,
    updater_std: float = 0.05,
    release: bool = False,
):
    """Convert a tiny random base, perturb its heads, ``save_pretrained`` it (with a tokenizer) into ``folder``.

    Perturbation (all from ``seed``): the updater's zero-initialized output ``updater.w2`` gets
    N(0, ``updater_std``) entries, so deeper depths compute something new; the decider's output layer
    ``halting.decider.fc2`` gets N(0, ``decider_std``) weights and a zero bias, so its decisions vary
    by token instead of the deep-start constant. ``release=True``: the method's own defaults (TaH2: the
    release's updater, final-norm state and decider shapes) instead of ``PLUGIN_LOOP``; the release decider's
    score layer is redrawn at unit gain per input so that exits mix (``retrofit.testing.spread_decider``).

    Returns:
        the looped model (eval mode), as saved.
    """
    import retrofit
    from retrofit.testing import char_tokenizer, tiny_base

    extra = {"head_dim": 32} if family == "qwen3" else {}
    base = tiny_base(family, seed=seed, **SHAPES, **extra)
    # the head shapes and init these checkpoints had before the TaH2 release's options existed, unless release
    # (decider_top_k and decider_init are TaH2's options: the other methods drop them)
    loop = retrofit.LoopConfig.from_fields(
        dict(
            prelude=prelude,
            core=core,
            max_depth=max_depth,
            method=method,
            attention=attention,
            **({} if release else PLUGIN_LOOP),
        ),
        strict=False,
    )
    with torch.random.fork_rng():  # the heads' own initialization draws from the global RNG: pin it
        torch.manual_seed(seed)
        model = retrofit.convert(base, loop).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "updater.w2.weight":
                p.copy_(torch.randn(p.shape, generator=g) * updater_std)
            elif name == "halting.decider.fc2.weight":
                p.copy_(torch.randn(p.shape, generator=g) * decider_std)
            elif name == "halting.decider.fc2.bias":
                p.zero_()
        if release and method == "tah2":
            from retrofit.testing import spread_decider

            spread_decider(model, logit_std=decider_std * 2.0, generator=g)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, depth: int | None = None):
    """``model.generate`` greedy, one prompt at a time.

    Returns:
        ``(tokens, logprobs, depths)``: per prompt the new token ids, each one's log-probability under
        the model's logits, and the exit depth of every position fed (prompt and generated).
    """
    toks, lps, depths = [], [], []
    for p in prompts:
        ids = torch.tensor([p])
        kw = {} if depth is None else {"depth": depth}
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
            **kw,
        )
        new = out.sequences[0, ids.shape[1] :].tolist()
        lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)]
        toks.append(new)
        lps.append(lp)
        depths.append(out.past_key_values.token_depths[0].tolist())
    return toks, lps, depths
