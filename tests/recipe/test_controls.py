"""Control arms (``retrofit.recipe.controls``): the same budget as the looped arm, in the same run.

A control is only fair if it sees the same rows in the same order for the same steps with the same
learning rate. These tests train a tiny looped arm and its controls in process and compare the batches each
trainer's ``compute_loss`` received, and check what each control saves.
"""

from __future__ import annotations

import copy

import pytest
import torch
from sft_setup import addition_rows, sft_config
from transformers import LlamaForCausalLM

from retrofit.model.config import LoopConfig
from retrofit.model.convert import base_model_of, convert
from retrofit.model.modeling import LoopedForCausalLM
from retrofit.recipe import LoopArgs, train_and_save
from retrofit.testing import char_tokenizer, tiny_base
from retrofit.training import RetrofitSFTTrainer


@pytest.fixture()
def seen_batches(monkeypatch):
    """Every batch any RetrofitSFTTrainer computes a loss on, per output_dir, in order."""
    seen: dict[str, list[torch.Tensor]] = {}
    original = RetrofitSFTTrainer.compute_loss

    def spy(self, model, inputs, *a, **kw):
        seen.setdefault(self.args.output_dir, []).append(inputs["input_ids"].detach().clone())
        return original(self, model, inputs, *a, **kw)

    monkeypatch.setattr(RetrofitSFTTrainer, "compute_loss", spy)
    return seen


def _rows(n=24):
    return addition_rows(6, n, chat=False)


def _args(out, **kw):
    # activation_checkpointing=None: TRL's default (on)
    kw = {"max_steps": 3, "learning_rate": 1e-3, "logging_steps": 1, "dataloader_num_workers": 0, "seed": 7, **kw}
    return sft_config(out, activation_checkpointing=None, **kw)


@pytest.mark.parametrize("control", ["sft", "fixed"])
def test_control_sees_the_same_batches_in_the_same_order(tmp_path, seen_batches, control):
    from retrofit.recipe.controls import train_control

    tok = char_tokenizer()
    base = tiny_base("llama")
    largs = LoopArgs(model="tiny-llama", prelude=1, core=3, max_depth=2, method="tah2", freeze_prelude=True)
    train = _rows()
    torch.manual_seed(7)
    looped = convert(copy.deepcopy(base).train(), largs.loop_config())
    from retrofit.recipe import prepare_model

    looped = prepare_model(looped, largs)
    targs = _args(tmp_path / "run")
    trainer, _ = train_and_save(looped, tok, targs, train, None, resume=False, lora=False, out=tmp_path / "run")
    trained = train_control(control, base, tok, targs, largs, train, tmp_path / "run")

    looped_batches = seen_batches[str(tmp_path / "run")]
    control_batches = seen_batches[str(tmp_path / "run" / f"control-{control}")]
    assert len(looped_batches) == len(control_batches) == 3
    for a, b in zip(looped_batches, control_batches):
        assert torch.equal(a, b)
    # same number of optimizer steps, same learning-rate schedule
    lr = lambda hist: [h["learning_rate"] for h in hist if "learning_rate" in h]  # noqa: E731
    assert lr(trained.log_history) == lr(trainer.state.log_history)
    # the untouched base was copied, not trained
    assert torch.equal(base.model.layers[2].mlp.up_proj.weight, tiny_base("llama").model.layers[2].mlp.up_proj.weight)

    saved = trained.path
    if control == "sft":
        assert isinstance(trained.model, LlamaForCausalLM)
        reloaded = LlamaForCausalLM.from_pretrained(saved)
    else:
        assert isinstance(trained.model, LoopedForCausalLM) and trained.model.loop.method == "fixed"
        assert trained.model.loop.max_depth == 2
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(saved)
    ids = tok("1+2=", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained.model(ids).logits)
    # frozen parts stayed frozen in the control too
    frozen = base_model_of(trained.model) if control == "fixed" else trained.model
    torch.testing.assert_close(frozen.model.embed_tokens.weight, base.model.embed_tokens.weight)


def test_sft_control_changes_the_model_and_is_plain_at_depth_one(tmp_path):
    """The SFT arm is the base function (depth 1, no decider): its first loss equals the base model's."""
    from retrofit.recipe.controls import control_loop_config

    largs = LoopArgs(model="tiny-llama", prelude=1, core=3, max_depth=3, method="tah2")
    cfg = control_loop_config("sft", largs)
    assert isinstance(cfg, LoopConfig) and cfg.max_depth == 1 and cfg.method == "fixed"
    base = tiny_base("llama")
    ids = torch.randint(4, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(convert(copy.deepcopy(base), cfg)(ids).logits, base(ids).logits)
    with pytest.raises(ValueError, match="allowed: sft, fixed"):
        control_loop_config("bogus", largs)
