"""``padding_free=True`` (TRL's flag): each batch's rows concatenated into one row, sequences kept apart by
position-id resets, so no compute goes to padding. The looped model builds its block-diagonal masks from the
position ids (``retrofit.model.attention.base_visibility``), so a padding-free step must give the loss, the
auxiliary loss and every gradient of the padded step on the same rows. The main job's preset turns it on
(a fifth of its padded batch was padding).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from sft_setup import sft_config

from retrofit.model.config import LoopConfig
from retrofit.model.convert import convert
from retrofit.testing import char_tokenizer, perturb_updater, spread_decider, tiny_base
from retrofit.training import RetrofitSFTTrainer, format_sft_dataset


def _rows():
    # answers and prompts of different lengths: the padded batch has real padding
    rows = [
        {"prompt": f"{a}*{b}+{a}=", "answer": str(a * b + a) * (1 + (a + b) % 3)} for a in range(7) for b in range(5)
    ]
    return format_sft_dataset(datasets.Dataset.from_list(rows), chat=False)[0]


def _model(loop: dict):
    torch.manual_seed(3)
    model = convert(tiny_base("llama", seed=3), LoopConfig(**loop)).train()
    with torch.no_grad():  # a non-trivial updater and, for TaH2, mixed exits
        perturb_updater(model, 0.05)
        if loop["method"] == "tah2":
            spread_decider(model, logit_std=2.0)
    return model


def _first_batch_loss(tmp_path, loop, padding_free):
    model = _model(loop)
    args = sft_config(
        tmp_path / f"pf{padding_free}",
        max_steps=1,
        per_device_train_batch_size=6,
        max_length=48,
        activation_checkpointing=None,  # TRL's default (on)
        seed=11,
        padding_free=padding_free,
    )
    trainer = RetrofitSFTTrainer(model, args, train_dataset=_rows(), processing_class=char_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); compute_loss reads it
    n_items = (batch["labels"][..., 1:] != -100).sum()
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=n_items)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return batch, loss.detach(), grads, trainer


@pytest.mark.parametrize(
    "loop",
    [
        dict(method="tah2", max_depth=3, prelude=1, core=2),  # coda of 1 layer, mixed exits
        dict(method="fixed", max_depth=2, prelude=1, core=3),  # the fixed-depth control
        dict(method="fixed", max_depth=1, prelude=1, core=3),  # the SFT control
    ],
)
def test_padding_free_step_equals_the_padded_step(tmp_path, loop):
    padded, loss_p, grads_p, _ = _first_batch_loss(tmp_path, loop, False)
    packed, loss_f, grads_f, trainer = _first_batch_loss(tmp_path, loop, True)
    # the same rows, in the same order: the packed row is the padded rows' real tokens end to end
    mask = padded["attention_mask"].bool()
    assert bool((~mask).any()), "the padded batch should contain padding"
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert torch.equal(packed["input_ids"][0], padded["input_ids"][mask])
    assert int((packed["position_ids"][0] == 0).sum()) == padded["input_ids"].shape[0]
    torch.testing.assert_close(loss_f, loss_p, atol=1e-6, rtol=1e-5)
    assert grads_p.keys() == grads_f.keys() and grads_p
    for n in grads_p:
        torch.testing.assert_close(grads_f[n], grads_p[n], atol=1e-6, rtol=1e-4, msg=n)
    if loop["method"] == "tah2":
        aux = trainer._metrics["train"]
        assert aux, "the trainer records the TaH2 metrics of the packed step"
