"""The tiny random looped model the evaluation tests share: its exit depths and per-depth outputs vary from
token to token, so exits, frontiers and calibration have something to tell apart."""

from __future__ import annotations

import torch

#: the evaluation's equivalences are checked on the "ffn" decider (10 probability features), whose random
#: draws below give the tests' prompts mixed depths (only TaH2 reads these fields); the residual updater and the
#: core state were chosen before the TaH2 release's options existed, and keep those draws
FFN = {
    "decider_arch": "ffn",
    "decider_top_k": 10,
    "updater": "residual",
    "decider_state": "core",
    "padding_stops": False,
}


def mixed_depth_looped(max_depth=3, method="tah2", seed=1, spread_anira=False, **loop):
    """A seeded tiny Llama looped with ``LoopConfig(max_depth, method, **FFN, **loop)``, in eval mode.

    The updater's output layer is redrawn at std 0.5 and TaH2's decider spread (``spread_decider``, std 1) so
    depths vary; ``spread_anira`` redraws the ANIRA decider's last weight at std 2 so its probabilities vary.
    """
    import retrofit
    from retrofit.testing import spread_decider, tiny_base

    with torch.random.fork_rng():  # the heads' init draws from the global RNG, whose seed differs per process
        torch.manual_seed(seed)
        cfg = retrofit.LoopConfig.from_fields(dict(max_depth=max_depth, method=method, **FFN, **loop), strict=False)
        m = retrofit.convert(tiny_base("llama"), cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.updater.w2.weight.copy_(torch.randn(m.updater.w2.weight.shape, generator=g) * 0.5)
        if method == "tah2":
            spread_decider(m, std=1.0, generator=g)
        elif spread_anira and method.startswith("anira"):
            last = [p for n, p in m.halting.decider.named_parameters() if n.endswith("weight")][-1]
            last.copy_(torch.randn(last.shape, generator=g) * 2.0)
    return m
