"""Looped models in TRL's trainers (GRPO, DPO, SFT) and in ``transformers.pipeline``.

What TRL 1.16 does to a model: ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer`` all call
``trl.trainer.utils.add_fused_lm_head(model)``, which *replaces* ``model.forward`` with one that runs
only ``model.base_model`` and applies ``lm_head`` itself: for a looped model that would silently
train the plain base. ``LoopedForCausalLM`` intercepts the assignment and serves
``fused_lm_head=True`` from the real looped logits (``retrofit.model.modeling.fused_outputs_from_logits``),
and its configs expose ``auto_map`` (TRL reads it for a model given as a path). These tests check
that the heads get gradients in every trainer and that the fused outputs match TRL's own kernel.

The halting method's objective reaches every trainer through the model: with labels the forward
returns the weighted auxiliary loss in ``aux_loss`` (and adds it to ``loss``), and its config declares
``output_router_logits`` / ``router_aux_loss_coef`` so TRL adds ``aux_loss`` to what it optimizes, as
for a mixture-of-experts router loss. ``test_decider_gradient_is_trainer_loss_plus_weighted_aux``
checks, for TaH2 and ANIRA-E/O under ``transformers.Trainer``, ``SFTTrainer``, ``DPOTrainer`` and
``GRPOTrainer``, that the decider's gradient equals the gradient of the trainer's own loss plus the
auxiliary loss written out by hand (``references.py``).

GRPO samples completions and then scores their log-probs in train mode; TRL 1.16's regular
(non-vLLM) path even calls ``generate()`` with the model still in train mode, while evaluation and
``pipeline`` generate in eval mode. The policy that generated and the policy that is scored must be
the same function: TaH2 (threshold decisions in both modes) and fixed are
(``test_train_and_eval_forwards_agree``); ANIRA-E/O *sample* depths in train mode, so their scored
depths are a fresh sample, not the ones generation used — GRPO runs but is slightly off-policy;
prefer TaH2 or fixed for RL, or train ANIRA's decider with SFT first. Because retrofit's cached
decoding is inference-only, ``generate()`` in train mode decodes with a full forward per new token
(``test_train_mode_generation_decodes_like_eval``).

``pipeline`` generation runs with ``use_cache=False`` as well unless ``retrofit.model.generation`` (the
depth-aware cache) exists; then the cached and uncached outputs must agree.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from references import direct_kl_to_prior, hand_decider_loss_cfg

import retrofit
from retrofit import LoopConfig, convert
from retrofit.model.modeling import LOOPED_CLASSES, LoopedForCausalLM
from retrofit.model.trl_fused import fused_outputs_from_logits
from retrofit.testing import char_tokenizer, tiny_base

HAS_CACHE_GENERATION = importlib.util.find_spec("retrofit.model.generation") is not None
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
    """The library serves TRL's fused LM head and ``config.auto_map`` itself (``retrofit.model.modeling``)."""
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


@pytest.mark.parametrize("method", ["tah2", "fixed"])
def test_train_mode_generation_decodes_like_eval(method):
    """GRPO's call: ``generate(generation_config=GenerationConfig(use_cache=False, ...))`` on a model in
    train mode decodes with full forwards; for deterministic exit rules it gives eval mode's tokens."""
    from transformers import GenerationConfig

    m = randomize_heads(tiny_looped(method, max_depth=3))
    ids = torch.randint(4, 104, (2, 5), generator=torch.Generator().manual_seed(2))
    cfg = GenerationConfig(max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
    with torch.no_grad():
        trained = m.train().generate(ids, generation_config=cfg)
        evaluated = m.eval().generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert m.eval().training is False and trained.shape == (2, 10)
    assert torch.equal(trained, evaluated)


# ------------------------------------------------------------------------------------------------
# Trainers, 2 steps each
# ------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("method", ["tah2", "fixed"])
def test_grpo_trains_the_looped_model(tmp_path, looped_trl, method):
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    m = tiny_looped(method)
    before = snapshot(m)
    # GRPO's regular (non-vLLM) path calls generate() with the model in *train* mode; retrofit's
    # cached decoding is inference-only, so generation runs the full forward per step here
    args = GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        max_completion_length=4,
        use_vllm=False,
        generation_kwargs={"use_cache": False},
        **TRAIN_KW,
    )
    tr = GRPOTrainer(
        model=m, reward_funcs=reward_len, args=args, train_dataset=prompts_ds(), processing_class=char_tokenizer()
    )
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
    ds = Dataset.from_dict(
        {"prompt": ["ab", "cd", "ef", "gh"], "chosen": ["xy", "zz", "aa", "bb"], "rejected": ["qq", "rr", "ss", "tt"]}
    )
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
    """Plain ``trl.SFTTrainer`` (with the fix) trains on the model's own loss: the mixture NLL plus the
    decider loss, which TRL adds from ``aux_loss``."""
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
    # the loss TRL computes is the looped model's own loss on the completion, auxiliary loss included
    assert tr.aux_loss_enabled
    batch = next(iter(tr.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = tr.compute_loss(model, dict(batch))
        own = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"])
    assert own.aux_loss is not None and own.aux_loss > 0
    torch.testing.assert_close(trl_loss, own.loss, rtol=1e-5, atol=1e-5)
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
@pytest.mark.skipif(not HAS_CACHE_GENERATION, reason="retrofit.model.generation (depth-aware cache) not available yet")
def test_text_generation_pipeline_with_cache():
    from transformers import pipeline

    m = tiny_looped("tah2").eval()
    tok = char_tokenizer()
    pipe = pipeline("text-generation", model=m, tokenizer=tok)
    cached = pipe("hello", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    plain = pipe("hello", max_new_tokens=4, do_sample=False, use_cache=False)[0]["generated_text"]
    assert cached == plain


# ------------------------------------------------------------------------------------------------
# The method's objective in every trainer: decider gradient = trainer's loss + weighted aux loss
# ------------------------------------------------------------------------------------------------
def hand_aux(model, out, labels, attention_mask):
    """The method's weighted auxiliary loss, written out (``references.py``), from a forward's fields."""
    loop = model.loop
    opts = loop.method_options
    if loop.method == "tah2":
        l_d, n = hand_decider_loss_cfg(out.depth_nll, labels, out.halt_logits, opts)
        assert n > 0, "no decision was supervised"
        return opts.alpha_d * l_d
    kl = direct_kl_to_prior(out.depth_probs, opts.prior_base)
    real = torch.ones_like(kl, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return opts.gamma * kl[real].mean().float()


def _trainer(kind, method, tmp_path):
    """A trainer of ``kind`` on a fresh looped model; returns ``(trainer, model, inputs, forward_inputs,
    labels, attention_mask, set_aux, aux_scale)``: ``forward_inputs`` / ``labels`` reproduce the forward
    the trainer's ``compute_loss`` runs, ``set_aux(False)`` makes the trainer optimize without the
    auxiliary loss, ``aux_scale`` is the factor the trainer gives it (coefficient / accumulation)."""
    from datasets import Dataset

    torch.manual_seed(0)
    m = randomize_heads(tiny_looped(method, max_depth=3), seed=3)
    m.train()
    kw = dict(TRAIN_KW, output_dir=str(tmp_path), max_steps=1)
    tok = char_tokenizer()
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        g = torch.Generator().manual_seed(1)
        rows = []
        for _ in range(4):
            ids = torch.randint(4, 104, (10,), generator=g).tolist()
            rows.append({"input_ids": ids, "attention_mask": [1] * 10, "labels": [-100] * 4 + ids[4:]})
        targs = {k: v for k, v in kw.items() if k not in ("activation_checkpointing",)}
        tr = Trainer(model=m, args=TrainingArguments(**targs), train_dataset=Dataset.from_list(rows))
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
        fwd = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}

        def set_aux(on):
            m.config.output_router_logits = on

        return tr, m, inputs, fwd, inputs["labels"], inputs["attention_mask"], set_aux, m.config.router_aux_loss_coef
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        ds = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"], "completion": ["xyz", "zzq", "aab", "bbc"]})
        tr = SFTTrainer(model=m, args=SFTConfig(max_length=32, **kw), train_dataset=ds, processing_class=tok)
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
        fwd = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if inputs.get(k) is not None}
        labels = inputs["labels"]
    elif kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        ds = Dataset.from_dict(
            {
                "prompt": ["ab", "cd", "ef", "gh"],
                "chosen": ["xyz", "zzq", "aab", "bbc"],
                "rejected": ["qqr", "rrs", "sst", "ttu"],
            }
        )
        import copy

        ref = copy.deepcopy(m).eval()
        tr = DPOTrainer(
            model=m, ref_model=ref, args=DPOConfig(max_length=32, **kw), train_dataset=ds, processing_class=tok
        )
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
        fwd = {
            k: v for k, v in inputs.items() if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
        }
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    else:
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            num_generations=4,
            max_completion_length=4,
            use_vllm=False,
            beta=0.0,
            generation_kwargs={"use_cache": False},
            **kw,
        )
        tr = GRPOTrainer(model=m, reward_funcs=reward_len, args=args, train_dataset=prompts_ds(), processing_class=tok)
        tr.current_gradient_accumulation_steps = 1  # set by the training loop
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        fwd = {"input_ids": ids, "attention_mask": mask}
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, : -inputs["completion_ids"].shape[1]] = -100
    m.train()
    assert tr.aux_loss_enabled and tr.router_aux_loss_coef == 1.0

    def set_aux(on):
        tr.aux_loss_enabled = on

    return tr, m, inputs, fwd, labels, fwd.get("attention_mask"), set_aux, tr.router_aux_loss_coef


@pytest.mark.integration
@pytest.mark.parametrize("method", ["tah2", "anira-e", "anira-o"])
@pytest.mark.parametrize("kind", ["trainer", "sft", "dpo", "grpo"])
def test_decider_gradient_is_trainer_loss_plus_weighted_aux(tmp_path, looped_trl, kind, method):
    """∂(trainer loss)/∂decider = ∂(the trainer's loss without the auxiliary loss)/∂decider
    + coefficient × ∂(α_D · L_D or γ · L_C, written out by hand)/∂decider, on the very batch the trainer
    built. (The decider also moves through the output mixture / straight-through weights alone; the
    comparison shows the method's own loss is added, once.)"""
    tr, m, inputs, fwd, labels, mask, set_aux, scale = _trainer(kind, method, tmp_path)
    params = [p for n, p in m.named_parameters() if n.startswith("halting.")]

    def grads(fn):
        torch.manual_seed(123)  # ANIRA samples its depths in train mode: the same draws in every pass
        out = torch.autograd.grad(fn(), params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(out, params)]

    total = grads(lambda: tr.compute_loss(m, dict(inputs)))
    set_aux(False)
    plain = grads(lambda: tr.compute_loss(m, dict(inputs)))
    set_aux(True)
    by_hand = grads(lambda: hand_aux(m, m(**fwd, labels=labels), labels, mask))
    aux_norm = sum(float(g.abs().sum()) for g in by_hand)
    assert aux_norm > 1e-6, "the auxiliary loss does not reach the decider"
    assert sum(float((t - p).abs().sum()) for t, p in zip(total, plain)) > 0.1 * aux_norm * scale
    for t, p, a in zip(total, plain, by_hand):
        torch.testing.assert_close(t, p + scale * a, rtol=1e-4, atol=1e-6)
