"""Write tiny checkpoints with retrofit at d627f1c (flat method settings) and what they compute."""

import json
import sys
from pathlib import Path

import torch

import retrofit
from retrofit.testing import spread_decider, tiny_base

out = Path(sys.argv[1])
cases = {
    "tah2": dict(
        method="tah2",
        max_depth=3,
        prelude=1,
        core=1,
        decider_top_k=8,
        alpha_d=0.2,
        rho=0.9,
        kappa_scope="pooled",
        exit_threshold=0.45,
        mixture_output=True,
        cost_min=1e-5,
    ),
    "anira-o": dict(method="anira-o", max_depth=3, prelude=1, core=1, gamma=0.3, prior_base=1.5, halt_threshold=0.4),
}
ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(5))
for name, kw in cases.items():
    torch.manual_seed(0)
    m = retrofit.convert(
        tiny_base(
            "llama",
            seed=1,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        retrofit.LoopConfig(**kw),
    ).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pn, p in m.named_parameters():
            if "updater" in pn or "halting" in pn:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if name == "tah2":
        spread_decider(m, logit_std=2.0, generator=g)
    else:  # halting logits around 0, so the threshold decides
        with torch.no_grad():
            m.halting.decider.fc2.bias.zero_()
            m.halting.decider.fc2.weight.copy_(torch.randn(m.halting.decider.fc2.weight.shape, generator=g) * 2.0)
    folder = out / name
    m.save_pretrained(folder)
    with torch.no_grad():
        fwd = m(ids, labels=ids)
        gen = m.generate(ids[:, :6], max_new_tokens=8, do_sample=False)
    ref = {
        "input_ids": ids.tolist(),
        "depths": fwd.depths.tolist(),
        "loss": float(fwd.loss),
        "aux_loss": None if fwd.aux_loss is None else float(fwd.aux_loss),
        "logits_sum": float(fwd.logits.double().sum()),
        "generated": gen.tolist(),
    }
    (folder / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(name, json.loads((folder / "config.json").read_text())["loop"].keys().__len__(), ref["aux_loss"])
