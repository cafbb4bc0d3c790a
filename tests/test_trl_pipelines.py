"""Looped models in TRL's trainers (GRPO, DPO, SFT) and in ``transformers.pipeline``.

What TRL 1.16 does to a model: ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer`` all call
``trl.trainer.utils.add_fused_lm_head(model)``, which *replaces* ``model.forward`` with one that runs
only ``model.base_model`` and applies ``lm_head`` itself: for a looped model that would silently
train the plain base. ``LoopedForCausalLM`` intercepts the assignment and serves
``fused_lm_head=True`` from the real looped logits (``retrofit.modeling.fused_outputs_from_logits``),
and its configs expose ``auto_map`` (TRL reads it for a model given as a path). These tests check
that the heads get gradients in every trainer and that the fused outputs match TRL's own kernel.

GRPO samples completions and then scores their log-probs in train mode; TRL 1.16's regular
(non-vLLM) path even calls ``generate()`` with the model still in train mode, while evaluation and
``pipeline`` generate in eval mode. The policy that generated and the policy that is scored must be
the same function: TaH2 (threshold decisions in both modes) and fixed are
(``test_train_and_eval_forwards_agree``); ANIRA-E/O *sample* depths in train mode, so their scored
depths are a fresh sample, not the ones generation used — GRPO runs but is slightly off-policy;
prefer TaH2 or fixed for RL, or train ANIRA's decider with SFT first. Because retrofit's cached
decoding (``retrofit.generation``) is inference-only, ``generate()`` in train mode decodes with a
full forward per new token.

``pipeline`` generation runs with ``use_cache=False`` as well unless ``retrofit.generation`` (the
depth-aware cache) exists; then the cached and uncached outputs must agree.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import retrofit
from retrofit import LoopConfig, convert
from retrofit.modeling import LOOPED_CLASSES, LoopedForCausalLM
from retrofit.trl_fused import fused_outputs_from_logits
from retrofit.testing import char_tokenizer, tiny_base

HAS_CACHE_GENERATION = importlib.util.find_spec("retrofit.generation") is not None
TRAIN_KW = {
    "per_device_train_batch_size": 4,
    "max_steps": 2,
    "learning_rate": 1e-2,
    "bf16": False,
    "use_cpu": True,
    "report_to": "none",
    "logging_steps": 1,
    "save_strategy": "no",
    "activation_checkpointing": False,  # TRL defaults to on; the tiny runs do not need it
    "dataloader_num_workers": 0,
}


@pytest.fixture
def looped_trl():
    """The library serves TRL's fused LM head and ``config.auto_map`` itself (``retrofit.modeling``)."""
    assert LoopedForCausalLM._serves_trl_fused_head
    assert all(hasattr(cfg_cls, "auto_map") for cfg_cls, _ in LOOPED_CLASSES.values())
    yield


# ------------------------------------------------------------------------------------------------
def tiny_looped(method="tah2", seed=0, max_depth=2):
    m = convert(tiny_base("llama", seed=seed), LoopConfig(prelude=1, core=3, max_depth=max_depth, method=method))
    return m.train()


def randomize_heads(model, seed=1):
    """Random head weights: tokens exit at different depths and deeper iterations change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*model.updater.parameters(), *model.halting.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def heads_changed(names):
    return sorted(n for n in names if n.startswith(("updater.", "halting.")))


def gen_kwargs():
    return {} if HAS_CACHE_GENERATION else {"use_cache": False}


def train_mode_generate_bug() -> str | None:
    """GRPO calls ``generate(generation_config=GenerationConfig(use_cache=False, ...))`` on a model in
    train mode. Returns the error that call raises, or None when it works."""
    from transformers import GenerationConfig

    m = tiny_looped("fixed")
    try:
        m.generate(IDS_PROBE, generation_config=GenerationConfig(max_new_tokens=1, do_sample=False, use_cache=False))
    except RuntimeError as e:
        return str(e)
    return None


IDS_PROBE = torch.tensor([[5, 6, 7]])


def prompts_ds(n=4):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{chr(97 + i)}{chr(98 + i)}" for i in range(n)]})


def reward_len(completions, **kw):
    # different completions must get different rewards, or GRPO's advantages are zero
    return [float(len(c)) + c.count("a") + 0.1 * sum(map(ord, c)) % 3 for c in completions]


# ------------------------------------------------------------------------------------------------
def test_fused_outputs_match_trl_kernel_on_a_plain_model():
    """Brute-force check of ``fused_outputs_from_logits`` against TRL's fused LM head on a base model."""
    from trl.trainer.utils import add_fused_lm_head

    base = tiny_base("llama")
    ids = torch.randint(4, 104, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    with torch.no_grad():
        logits = base(ids).logits
        ours = fused_outputs_from_logits(logits, labels, temperature=0.7, outputs=outputs)
        add_fused_lm_head(base, temperature=0.7, outputs=outputs)
        ref = base(ids, labels=labels, fused_lm_head=True)
    for k in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs", "loss"):
        torch.testing.assert_close(getattr(ours, k), getattr(ref, k).float(), rtol=1e-4, atol=1e-4, msg=k)
    assert torch.equal(ours.is_top1.bool(), ref.is_top1.bool()) and torch.equal(ours.label_mask, ref.label_mask)



def test_fix_scores_the_looped_model(looped_trl):
    from trl.trainer.utils import add_fused_lm_head

    m = randomize_heads(tiny_looped(max_depth=3)).eval()
    ids = torch.randint(4, 104, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = fused_outputs_from_logits(m(ids).logits, ids, temperature=0.5, outputs=("log_probs", "entropy"))
        add_fused_lm_head(m, temperature=0.5, outputs=("log_probs", "entropy"))
        got = m(ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(got.log_probs, ref.log_probs)
    torch.testing.assert_close(got.entropy, ref.entropy)
    assert got.is_top1 is None  # only the requested fields, as TRL's head


@pytest.mark.parametrize("method", ["tah2", "fixed"])
def test_train_and_eval_forwards_agree(method):
    """GRPO samples in eval mode and scores in train mode: for TaH2 and fixed both forwards agree."""
    m = randomize_heads(tiny_looped(method, max_depth=3))
    ids = torch.randint(4, 104, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ev = m.eval()(ids)
        tr = m.train()(ids)
    assert torch.equal(ev.depths, tr.depths)
    torch.testing.assert_close(tr.logits, ev.logits, rtol=1e-5, atol=1e-5)
    if method == "tah2":
        assert len(torch.unique(ev.depths)) > 1  # the check covers mixed depths


# ------------------------------------------------------------------------------------------------
# Trainers, 2 steps each
# ------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("method", ["tah2", "fixed"])
def test_grpo_trains_the_looped_model(tmp_path, looped_trl, method):
    from trl import GRPOConfig, GRPOTrainer

    bug = train_mode_generate_bug()
    if bug:
        pytest.xfail(f"retrofit.generation: GRPO cannot generate: {bug}")
    torch.manual_seed(0)
    m = tiny_looped(method)
    before = snapshot(m)
    # GRPO's regular (non-vLLM) path calls generate() with the model in *train* mode; retrofit's
    # cached decoding is inference-only, so generation runs the full forward per step here
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=4, max_completion_length=4, use_vllm=False,
                      generation_kwargs={"use_cache": False}, **TRAIN_KW)
    tr = GRPOTrainer(model=m, reward_funcs=reward_len, args=args, train_dataset=prompts_ds(), processing_class=char_tokenizer())
    out = tr.train()
    assert torch.isfinite(torch.tensor(out.training_loss))
    names = changed(m, before)
    assert "model.layers.2.mlp.down_proj.weight" in names  # a core layer
    assert heads_changed(names), "the updater/decider got no gradient: the loop was bypassed"


@pytest.mark.integration
def test_dpo_trains_the_looped_model_from_a_path(tmp_path, looped_trl):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    src = tmp_path / "looped"
    tiny_looped("tah2").save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    ds = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"], "chosen": ["xy", "zz", "aa", "bb"],
                            "rejected": ["qq", "rr", "ss", "tt"]})
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_length=32, **TRAIN_KW)
    tr = DPOTrainer(model=str(src), args=args, train_dataset=ds, processing_class=char_tokenizer())
    assert isinstance(tr.model, retrofit.LoopedLlamaForCausalLM)
    before, ref_before = snapshot(tr.model), snapshot(tr.ref_model)
    out = tr.train()
    assert torch.isfinite(torch.tensor(out.training_loss))
    names = changed(tr.model, before)
    assert heads_changed(names) and "model.layers.2.mlp.down_proj.weight" in names
    assert not changed(tr.ref_model, ref_before)


@pytest.mark.integration
@pytest.mark.parametrize("as_path", [False, True], ids=["instance", "path"])
def test_sft_trains_the_looped_model(tmp_path, looped_trl, as_path):
    """Plain ``trl.SFTTrainer`` (with the fix) trains on the mixture NLL — the model's own loss,
    without the halting methods' auxiliary losses (those need ``retrofit.training.RetrofitSFTTrainer``)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    m = tiny_looped("tah2")
    if as_path:
        m.save_pretrained(tmp_path / "looped")
        char_tokenizer().save_pretrained(tmp_path / "looped")
        model_arg = str(tmp_path / "looped")
    else:
        model_arg = m
    ds = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"], "completion": ["xy", "zz", "aa", "bb"]})
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=32, **TRAIN_KW)
    tr = SFTTrainer(model=model_arg, args=args, train_dataset=ds, processing_class=char_tokenizer())
    model = tr.model
    assert isinstance(model, retrofit.LoopedLlamaForCausalLM)
    # the loss TRL computes is the looped model's own next-token loss on the completion
    batch = next(iter(tr.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = tr.compute_loss(model, dict(batch))
        own = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    labels=batch["labels"]).loss
    torch.testing.assert_close(trl_loss, own, rtol=1e-5, atol=1e-5)
    before = snapshot(model)
    out = tr.train()
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert heads_changed(changed(model, before))


# ------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_text_generation_pipeline():
    from transformers import pipeline

    m = tiny_looped("tah2").eval()
    tok = char_tokenizer()
    pipe = pipeline("text-generation", model=m, tokenizer=tok)
    out = pipe("hello", max_new_tokens=4, do_sample=False, **gen_kwargs())[0]["generated_text"]
    ids = tok("hello", return_tensors="pt").input_ids
    ref = m.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert out == tok.decode(ref[0], skip_special_tokens=True)
    # greedy decoding without a cache is the brute-force reference: argmax of the full forward each step
    seq = ids
    for _ in range(4):
        with torch.no_grad():
            nxt = m(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], -1)
    assert torch.equal(seq, ref)


@pytest.mark.integration
@pytest.mark.skipif(not HAS_CACHE_GENERATION, reason="retrofit.generation (depth-aware cache) not available yet")
def test_text_generation_pipeline_with_cache():
    from transformers import pipeline

    m = tiny_looped("tah2").eval()
    tok = char_tokenizer()
    pipe = pipeline("text-generation", model=m, tokenizer=tok)
    cached = pipe("hello", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    plain = pipe("hello", max_new_tokens=4, do_sample=False, use_cache=False)[0]["generated_text"]
    assert cached == plain
