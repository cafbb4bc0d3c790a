"""How ``RetrofitSFTTrainer.compute_loss`` scales a method's auxiliary loss (``HaltingMethod.aux_loss_normalization``,
``retrofit.model.halting.base.AUX_LOSS_NORMALIZATIONS``), checked with gradient accumulation in one process: the
trainer treats accumulation steps and data-parallel processes alike (each micro-batch's loss is divided by the
accumulation steps, or multiplied by the processes, and the gradients summed, or averaged), and
``tests/training/test_data_parallel.py`` runs the processes.

The method is TaH2 with every batch-level statistic switched off (ρ = 1, uniform weights, a static ``pos_weight``),
so each decision's BCE is the same whichever micro-batch holds it: its decider loss is then a plain mean over the
micro-batch's labelled tokens (``"micro_batch"``). Multiplied by ``n_local / num_items_in_batch`` it becomes the
micro-batch's sum over the step's labelled tokens (``"num_items_in_batch"``), which is how TaH2's release normalizes
it. SGD, so that a mis-scaled gradient shows in the weights (AdamW's first step is nearly scale-free).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from sft_setup import LOGGED_RUN, sft_config

import retrofit
from retrofit.model.halting.base import AuxLoss
from retrofit.model.halting.tah2 import next_token_mask
from retrofit.testing import char_tokenizer, spread_decider, tiny_base
from retrofit.training import RetrofitSFTTrainer, format_sft_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

#: a κ-free TaH2: no decision's label, weight or pos_weight depends on the rest of its batch
KAPPA_FREE = dict(rho=1.0, decider_weighting="uniform", dyn_pos_weight=False, alpha_d=1.0)


def model(per_item: bool = False, declared: str | None = None):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cfg = retrofit.LoopConfig(method="tah2", max_depth=3, prelude=1, core=4, decider_top_k=8, **KAPPA_FREE)
        m = retrofit.convert(tiny_base("llama", seed=0), cfg)
    with torch.no_grad():
        spread_decider(m, logit_std=2.0, generator=torch.Generator().manual_seed(1))
    if per_item:  # the decider loss as the micro-batch's sum over the step's labelled tokens
        halting, seen = m.halting, {}
        m.register_forward_pre_hook(lambda mod, a, kw: seen.update(n=kw.get("num_items_in_batch")), with_kwargs=True)
        mean_loss = halting.loss

        def loss(outputs, labels, cfg, attention_mask=None):
            aux = mean_loss(outputs, labels, cfg, attention_mask)
            return AuxLoss(aux.loss * next_token_mask(labels).sum() / seen["n"], aux.metrics)

        halting.loss = loss
    if declared is not None:
        m.halting.aux_loss_normalization = declared
    return m.train()


def rows(equal: bool) -> list[dict]:
    """4 rows; ``equal``: every row has as many labelled tokens, else the second pair has longer answers."""
    if equal:
        return [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in (1, 2, 3, 4)]
    return [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}] + [
        {"prompt": "7*8=", "answer": "56 is the product"},
        {"prompt": "9*9=", "answer": "81 is the product"},
    ]


def step(tmp_path, m, data, batch: int, accumulation: int):
    """One SGD step over the 4 rows, as ``batch`` × ``accumulation`` micro-batches (no shuffling: the same order)."""
    train, _ = format_sft_dataset(datasets.Dataset.from_list(data))
    args = sft_config(
        tmp_path,
        **LOGGED_RUN,
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
    )
    trainer = RetrofitSFTTrainer(m, args, train_dataset=train, processing_class=char_tokenizer())
    trainer.train()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, trainer.state.log_history[0]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_per_item_aux_loss_is_scaled_like_the_next_token_loss(tmp_path):
    """Declared ``"num_items_in_batch"``: 2 micro-batches of 2 rows give the full batch's step (the decider gets
    its whole gradient), whatever the rows' lengths; declared as a mean instead, the same loss is divided by the
    accumulation steps and the decider's step is off."""
    data = rows(equal=False)
    full, log_full = step(tmp_path / "full", model(per_item=True, declared="num_items_in_batch"), data, 4, 1)
    acc, log_acc = step(tmp_path / "acc", model(per_item=True, declared="num_items_in_batch"), data, 2, 2)
    assert max_diff(acc, full) <= 1e-6
    assert log_acc["loss"] == pytest.approx(log_full["loss"], rel=1e-6)
    # the logged aux_loss, like ntp_loss, is each micro-batch's per-token value, averaged over the micro-batches
    assert log_acc["aux_loss"] == pytest.approx(log_full["aux_loss"], rel=0.1)
    wrong, _ = step(tmp_path / "wrong", model(per_item=True, declared="micro_batch"), data, 2, 2)
    assert max_diff(wrong, full) > 1e-4


def test_a_per_micro_batch_mean_is_averaged_over_micro_batches(tmp_path):
    """The default (``"micro_batch"``, every method today): each micro-batch's own mean, divided by the accumulation
    steps: the full batch's step exactly when the micro-batches hold as many labelled tokens, and not otherwise (a
    method that must be exact there normalizes by ``num_items_in_batch`` and declares it)."""
    for equal in (True, False):
        data = rows(equal)
        full, _ = step(tmp_path / f"full{equal}", model(), data, 4, 1)
        acc, _ = step(tmp_path / f"acc{equal}", model(), data, 2, 2)
        if equal:
            assert max_diff(acc, full) <= 1e-6
        else:
            assert max_diff(acc, full) > 1e-4


def test_an_unknown_normalization_is_refused(tmp_path):
    with pytest.raises(ValueError, match="aux_loss_normalization"):
        step(tmp_path, model(declared="per_token"), rows(equal=True), 4, 1)
