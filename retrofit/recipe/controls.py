"""Control arms: what a looped model must beat, trained on the same budget in the same run.

A looped model is worth its extra machinery only if it beats what the same budget buys without it.
``train_control`` trains, from the same untouched pretrained base, on the same formatted rows, in the
same order (the trainer's seeded sampler, ``RetrofitSFTConfig.seed``), for the same steps with the same
learning rate, schedule, batch size and frozen parameters:

- ``"sft"``: the base as a plain causal LM. It trains through the looped wrapper with
  ``max_depth=1`` and the ``fixed`` method — a function identical to the base model's
  (``tests/model/test_modeling.py`` proves identity at depth 1) with no decider and no depth loss — so that
  data preparation, the length filter, the collator and the sampler are exactly those of the looped
  arm. It is saved as the plain base class (``control-sft/final``: ``LlamaForCausalLM`` /
  ``Qwen3ForCausalLM``), so nothing of retrofit is needed to load it.
- ``"fixed"``: the looped model with the same loop shape, forced to ``max_depth`` for every token
  (the ``fixed`` method: no decider): the same extra compute as the looped arm's deepest tokens, spent
  on every token. It isolates what the *adaptive* depth adds over looping as such.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class TrainedControl:
    """A trained control arm.

    Attributes:
        name: ``"sft"`` or ``"fixed"``.
        model: the trained model in eval mode (plain base class for ``sft``, looped for ``fixed``).
        path: where it was saved.
        log_history: the trainer's log history (loss per logging step).
    """

    name: str
    model: torch.nn.Module
    path: Path
    log_history: list


def control_loop_config(name: str, loop_args):
    """The ``LoopConfig`` of a control arm, from the looped arm's ``LoopArgs``."""
    if name == "sft":
        # one depth = the base model's function; the loop split only says what freeze_prelude freezes
        return loop_args.loop_config(max_depth=1, method="fixed", attention=None)
    if name == "fixed":
        return loop_args.loop_config(method="fixed", attention=None)
    raise ValueError(f"unknown control {name!r}; allowed: sft, fixed")


def train_control(
    name: str, pristine_base, tokenizer, train_args, loop_args, train_dataset, out: Path
) -> TrainedControl:
    """Train one control arm (see the module docstring) and save it under ``out/control-<name>/``.

    Args:
        name: ``"sft"`` or ``"fixed"``.
        pristine_base: the untouched pretrained base model (it is copied, not trained).
        tokenizer: the looped arm's tokenizer.
        train_args: the looped arm's ``RetrofitSFTConfig`` (copied with a new ``output_dir``).
        loop_args: the looped arm's ``LoopArgs`` (loop split, freezing, LoRA).
        train_dataset: the looped arm's formatted training rows.
        out: the run folder.
    """
    from transformers import set_seed

    from ..model.convert import base_model_of, convert
    from ..training.model_setup import prepare_model
    from ..training.trainer import RetrofitSFTTrainer

    folder = out / f"control-{name}"
    args = replace(train_args, output_dir=str(folder), resume_from_checkpoint=None)
    if name == "sft":
        args = replace(args, random_depth=False, truncate_backprop=None)
    set_seed(args.seed)  # the sampler's seed is torch's initial seed: the same as the looped arm's
    model = convert(copy.deepcopy(pristine_base).train(), control_loop_config(name, loop_args))
    model = prepare_model(model, loop_args)
    logger.info("training control arm %r into %s", name, folder)
    trainer = RetrofitSFTTrainer(model, args, train_dataset=train_dataset, processing_class=tokenizer)
    trainer.train()
    trained = trainer.accelerator.unwrap_model(trainer.model)
    if loop_args.lora:
        trained = trained.merge_and_unload()
    if name == "sft":
        trained = base_model_of(trained)
    trained.eval()
    from ..hub.atomic_io import atomic_dir

    with atomic_dir(folder / "final") as tmp:
        trained.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return TrainedControl(name=name, model=trained, path=folder / "final", log_history=list(trainer.state.log_history))
