"""The NaN/inf stop works for every method (issue 10, item 2).

An absurd learning rate from step 3 on makes the update of step 3 diverge. Two cases per method:

- a checkpoint is due at step 3: it must not be written (its weights would be NaN/inf), and the
  error names checkpoint-2;
- no checkpoint is due at step 3: the forward of step 4 is non-finite. TaH2 used to crash there
  inside its decider BCE ("all elements of input should be between 0 and 1"); now every method stops
  with ``NonFiniteLossError`` naming checkpoint-2, the last checkpoint whose weights are finite.

Tiny models, a few steps each.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from sft_setup import LOGGED_RUN, addition_rows, sft_config
from transformers import TrainerCallback

import retrofit
from retrofit.testing import char_tokenizer, tiny_base
from retrofit.training import (
    NonFiniteLossError,
    RetrofitSFTTrainer,
)
from retrofit.training.checkpointing import (
    last_finite_checkpoint,
    list_checkpoints,
    weights_are_finite,
)
from retrofit.training.nan_guard import local_values

METHODS = ["tah2", "anira-e", "anira-o", "fixed"]


pytestmark = pytest.mark.usefixtures("one_thread")


class AbsurdLRFrom(TrainerCallback):
    """From optimizer step ``step`` on, every update uses learning rate 1e38 (the issue's "absurd learning rate")."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, optimizer=None, **kw):
        if state.global_step + 1 >= self.step:
            for g in optimizer.param_groups:
                g["lr"] = 1e38


def trainer(tmp_path, method, save_steps, callbacks=(), max_steps=6):
    loop = {"prelude": 1, "core": 4} if method.startswith("anira") else {}
    torch.manual_seed(0)
    model = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=2, method=method, **loop))
    ds = addition_rows(8)
    run = dict(max_steps=max_steps, learning_rate=1e-3, lr_scheduler_type="constant", **LOGGED_RUN)
    args = sft_config(tmp_path, save_strategy="steps", save_steps=save_steps, **run)
    return RetrofitSFTTrainer(
        model, args, train_dataset=ds, processing_class=char_tokenizer(), callbacks=list(callbacks)
    )


def all_written_checkpoints_are_finite(tmp_path):
    for ckpt in list_checkpoints(tmp_path):
        w = load_file(str(ckpt / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in w.values()), ckpt


@pytest.mark.parametrize("method", METHODS)
def test_divergence_at_a_save_step_writes_no_checkpoint(tmp_path, method):
    tr = trainer(tmp_path, method, save_steps=1, callbacks=[AbsurdLRFrom(3)])
    with pytest.raises(NonFiniteLossError) as e:
        tr.train()
    msg = str(e.value)
    assert "not writing checkpoint-3" in msg, msg
    assert re.search(r"Last checkpoint with finite weights: \S*checkpoint-2\b", msg), msg
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-1"]
    assert not any(p.name.startswith(".staging") for p in tmp_path.iterdir())
    all_written_checkpoints_are_finite(tmp_path)


@pytest.mark.parametrize("method", METHODS)
def test_divergence_between_saves_stops_before_the_aux_loss(tmp_path, method):
    """The update of step 3 diverges; step 4's forward is NaN. TaH2 used to raise inside the BCE."""
    tr = trainer(tmp_path, method, save_steps=2, callbacks=[AbsurdLRFrom(3)])
    with pytest.raises(NonFiniteLossError) as e:
        tr.train()
    msg = str(e.value)
    assert "non-finite training loss at step 4" in msg, msg
    assert "already non-finite: the update of step 3 diverged" in msg, msg
    assert re.search(r"Last checkpoint with finite weights: \S*checkpoint-2\b", msg), msg
    assert "\n" not in msg
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    all_written_checkpoints_are_finite(tmp_path)


def test_nan_in_the_decider_is_caught_before_its_bce(tmp_path):
    """mixture_output=False: a NaN decider leaves the next-token loss finite, but its BCE would raise."""
    torch.manual_seed(0)
    model = retrofit.convert(
        tiny_base("llama"), retrofit.LoopConfig(max_depth=2, method="tah2", options={"mixture_output": False})
    )
    with torch.no_grad():
        for p in model.halting.parameters():
            p.fill_(float("nan"))
    ds = addition_rows(8)
    args = sft_config(tmp_path, max_steps=2)
    tr = RetrofitSFTTrainer(model, args, train_dataset=ds, processing_class=char_tokenizer())
    with pytest.raises(
        NonFiniteLossError, match=r"step 1\b.*non-finite halting signals.*parameters are already non-finite"
    ):
        tr.train()


def test_the_named_checkpoint_is_the_last_with_finite_weights(tmp_path):
    """A non-finite checkpoint on disk (written by an older version) is skipped when naming the last good one."""
    tr = trainer(tmp_path, "fixed", save_steps=1, max_steps=3)
    tr.train()
    assert last_finite_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")
    from safetensors.torch import save_file

    w = load_file(str(tmp_path / "checkpoint-3" / "model.safetensors"))
    w[next(iter(w))][0] = float("inf")
    save_file(w, str(tmp_path / "checkpoint-3" / "model.safetensors"), metadata={"format": "pt"})
    assert weights_are_finite(tmp_path / "checkpoint-3") is False
    assert last_finite_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")


def test_the_final_model_is_not_written_with_nan_weights(tmp_path):
    tr = trainer(tmp_path, "fixed", save_steps=10, max_steps=1)
    tr.train()
    with torch.no_grad():
        next(tr.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteLossError, match="parameters became non-finite.*not writing .*final"):
        tr.save_model_atomic(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists()


@pytest.mark.parametrize("rank, held", [(0, [0.0, 1.0]), (1, [2.0, 3.0]), (2, [4.0]), (3, [])])
def test_zero3_shard_padding_is_not_a_weight(rank, held):
    """ZeRO-3 shards a 5-element parameter over 4 ranks in shards of ceil(5/4) = 2, padded to 8: rank 2's second
    element and rank 3's whole shard are padding DeepSpeed never writes (it may read NaN). ``local_values`` is the
    parameter's elements each rank holds, and the NaN guard checks only those."""
    size, world = 2, 4
    padded = torch.cat([torch.arange(5.0), torch.full((size * world - 5,), float("nan"))])
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor, p.ds_numel, p.ds_zero_partition_rank = padded[rank * size : (rank + 1) * size].clone(), 5, rank
    assert local_values(p).tolist() == held
    assert bool(torch.isfinite(p.ds_tensor).all()) == (rank < 2)
    plain = torch.nn.Parameter(torch.ones(2))
    assert local_values(plain) is plain
