"""LoRA on looped models: adapters on the backbone, updater and decider trained fully
(``modules_to_save``); adapters save, reload and merge with identical logits."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from sft_setup import addition_rows, sft_config

import retrofit
from retrofit.testing import char_tokenizer, spread_decider, tiny_base
from retrofit.training import LORA_TARGETS, RetrofitSFTTrainer, apply_lora
from retrofit.training.checkpointing import assert_safetensors_only

pytestmark = pytest.mark.usefixtures("one_thread")


def looped(family="llama", method="tah2", seed=0):
    torch.manual_seed(seed)  # the heads' init draws from the global RNG
    kw = dict(prelude=1, core=4) if method.startswith("anira") else {}
    m = retrofit.convert(tiny_base(family, seed=seed), retrofit.LoopConfig(max_depth=2, method=method, **kw))
    if method == "tah2":  # mixed exits, so the updater runs (the release's init sends every token one way)
        spread_decider(m, logit_std=2.0, generator=torch.Generator().manual_seed(seed))
    return m


def ids_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, 104, (2, 10), generator=g)


def perturb_adapters(peft_model, seed=0):
    """LoRA B starts at zero (a no-op adapter); give every trainable tensor a visible value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_lora_trains_adapters_and_heads_only(family):
    model = apply_lora(looped(family), r=4, alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    for n in trainable:
        assert "lora_" in n or ".modules_to_save." in n, n
    assert any(".updater.modules_to_save." in n for n in trainable)
    assert any(".halting.modules_to_save." in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and any("down_proj.lora_B" in n for n in trainable)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("embed_tokens" in n for n in frozen) and any("original_module" in n for n in frozen)

    # the forward uses the trainable copies of the heads: their gradients are non-zero
    model.train()
    ids = ids_batch()
    out = model(input_ids=ids, labels=ids)
    aux = model.get_base_model().halting.loss(out, ids, model.get_base_model().loop.method_options)
    torch.testing.assert_close(out.aux_loss, aux.loss)  # the forward's loss already holds the decider loss
    out.loss.backward()
    heads = [p for n, p in model.named_parameters() if ".modules_to_save." in n]
    assert all(p.grad is not None for p in heads) and sum(p.grad.abs().sum() for p in heads) > 0
    originals = [p for n, p in model.named_parameters() if "original_module" in n]
    assert all(p.grad is None for p in originals)


def test_unknown_model_type_needs_explicit_targets():
    model = looped()
    model.config.model_type = "looped_mystery"
    with pytest.raises(ValueError, match="no default LoRA targets"):
        apply_lora(model)
    assert apply_lora(model, targets=["q_proj"]).peft_config["default"].target_modules == {"q_proj"}
    assert set(LORA_TARGETS) == {"looped_llama", "looped_qwen3"}


@pytest.mark.parametrize("method", ["tah2", "anira-o"])
def test_adapter_save_reload_and_merge_give_identical_logits(tmp_path, method):
    model = apply_lora(looped("llama", method), r=4, alpha=8)
    perturb_adapters(model)
    model.eval()
    ids = ids_batch()
    with torch.no_grad():
        ref = model(input_ids=ids)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert_safetensors_only(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(looped("llama", method), tmp_path / "adapter").eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids)
    torch.testing.assert_close(again.logits, ref.logits)
    assert torch.equal(again.depths, ref.depths)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged, retrofit.LoopedForCausalLM)
    with torch.no_grad():
        m = merged(input_ids=ids)
    torch.testing.assert_close(m.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(m.depths, ref.depths)
    # a merged model is a plain looped checkpoint
    merged.save_pretrained(tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_lora_through_the_trainer_saves_adapter_checkpoints(tmp_path):

    ds = addition_rows(6)
    model = apply_lora(looped(), r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = sft_config(tmp_path, max_steps=2, learning_rate=1e-2, save_strategy="steps", save_steps=2)
    tr = RetrofitSFTTrainer(model, args, train_dataset=ds, processing_class=char_tokenizer())
    tr.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("lora_B" in n for n in changed)
    assert any(".updater.modules_to_save." in n for n in changed)
    assert any(".halting.modules_to_save." in n for n in changed)
    assert not any("original_module" in n or "embed_tokens" in n for n in changed)
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").exists()
    assert_safetensors_only(ckpt)
    model.eval()
    ids = ids_batch()
    reloaded = PeftModel.from_pretrained(looped(), ckpt).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("after_prelude", [True, False])
def test_lora_after_a_frozen_prelude_takes_no_backward_through_it(after_prelude):
    """With --freeze_prelude --lora --lora_layers after_prelude, adapters sit on the core and coda only, so
    nothing before the core needs a gradient: the prelude's outputs do not require grad (no backward through
    it). With --lora_layers all (the default), every layer gets adapters and the prelude's do train."""
    from retrofit.recipe import LoopArgs, prepare_model

    layers = "after_prelude" if after_prelude else "all"
    args = LoopArgs(prelude=2, core=2, max_depth=2, freeze_prelude=True, lora=True, lora_r=4, lora_layers=layers)
    torch.manual_seed(0)
    model = prepare_model(retrofit.convert(tiny_base("llama", seed=0), args.loop_config()), args)
    n_layers = model.config.num_hidden_layers
    adapted = {int(n.split("layers.")[1].split(".")[0]) for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == (set(range(2, n_layers)) if after_prelude else set(range(n_layers)))
    needs_grad = []
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o: needs_grad.append((o[0] if isinstance(o, tuple) else o).requires_grad)
        )
        for layer in model.get_base_model().prelude_layers
    ]
    model.train()
    ids = ids_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    assert needs_grad and all(g is not after_prelude for g in needs_grad)
    with pytest.raises(ValueError, match="lora_layers must be 'all' or 'after_prelude'; got 'prelude'"):
        LoopArgs(lora_layers="prelude")
