"""The tiny looped models and the kernel spy the attention-path tests share (``tests/model/test_long_context.py``,
``tests/model/test_determinism.py``): a prelude 1 / core 3 split with GQA, a perturbed updater and mixed exits."""

from __future__ import annotations

import torch

import retrofit
import retrofit.model.depth_attention as da
from retrofit import LoopConfig
from retrofit.testing import perturb_updater, spread_decider, tiny_base


def attention_looped(method, attention, max_depth=3, family="llama", impl="sdpa", seed=3, train=True):
    """A seeded tiny looped model on ``impl`` whose depths mix (TaH2's decider spread, ANIRA-E's redrawn)."""
    torch.manual_seed(seed)
    model = retrofit.convert(
        tiny_base(family, seed=seed, attn_implementation=impl),
        LoopConfig(prelude=1, core=3, max_depth=max_depth, method=method, attention=attention),
    )
    with torch.no_grad():  # a non-trivial updater and mixed exits
        perturb_updater(model, 0.05)
        if method == "tah2":
            spread_decider(model, logit_std=2.0)
        if method == "anira-e":
            for p in model.halting.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 3.0 / p.shape[1] ** 0.5)
    return model.train(train)


def kernels_used(model, batch, **kw) -> set[str]:
    """The ``DepthMask`` kernels a forward (no gradient, ``da.settings(**kw)``) runs at depths >= 2."""
    used, attend = set(), da.DepthMask.attend

    def spy(self, *a, **k):
        used.add(self.kernel)
        return attend(self, *a, **k)

    da.DepthMask.attend = spy
    try:
        with torch.no_grad(), da.settings(**kw):
            model(**batch)
    finally:
        da.DepthMask.attend = attend
    return used
