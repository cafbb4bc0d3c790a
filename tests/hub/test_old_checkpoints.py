"""Checkpoints saved before the methods' settings were nested (``tests/hub/old_checkpoints/``, written by retrofit at
d627f1c) load with their settings moved into ``config.loop["options"]`` and compute what they computed then: the
same exit depths, loss, auxiliary loss (which reads the moved loss weights), logits and greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import retrofit  # noqa: F401  (registers the looped classes with the Auto API)

HERE = Path(__file__).parent / "old_checkpoints"

#: the settings each was written with (make.py), now options of its method
OPTIONS = {
    "tah2": {"alpha_d": 0.2, "rho": 0.9, "kappa_scope": "pooled", "exit_threshold": 0.45, "cost_min": 1e-5},
    "anira-o": {"gamma": 0.3, "prior_base": 1.5, "halt_threshold": 0.4},
}


def _check(model, ref):
    ids = torch.tensor(ref["input_ids"])
    with torch.no_grad():
        out = model(ids, labels=ids)
        gen = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False)
    assert out.depths.tolist() == ref["depths"]
    # float32 reductions run in another order on another CPU: the CI machine's aux loss was 2.5e-6 apart (relative)
    # from the one that wrote the reference; a moved loss weight read wrongly changes it by tens of percent
    assert float(out.loss) == pytest.approx(ref["loss"], rel=1e-5)
    assert float(out.aux_loss) == pytest.approx(ref["aux_loss"], rel=2e-5)
    assert float(out.logits.double().sum()) == pytest.approx(ref["logits_sum"], rel=1e-6, abs=1e-3)
    assert gen.tolist() == ref["generated"]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_an_old_checkpoint_computes_what_it_computed(name, tmp_path):
    folder = HERE / name
    stored = json.loads((folder / "config.json").read_text())["loop"]
    assert stored["options"] == {} and stored[next(iter(OPTIONS[name]))] is not None  # the flat layout
    ref = json.loads((folder / "reference.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert {k: model.loop.options[k] for k in OPTIONS[name]} == OPTIONS[name]
    assert "gumbel_tau" not in model.loop.options  # another method's setting: dropped
    assert "alpha_d" not in model.config.loop and model.config.loop["options"] == model.loop.options  # stored nested
    _check(model, ref)
    # saved again, it is in the nested layout and still computes the same
    model.save_pretrained(tmp_path)
    again = json.loads((tmp_path / "config.json").read_text())["loop"]
    assert not set(again) & {"alpha_d", "gamma", "exit_threshold", "halt_threshold", "mixture_output"}
    assert {k: again["options"][k] for k in OPTIONS[name]} == OPTIONS[name]
    _check(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ref)


def test_calibrating_an_old_checkpoint_leaves_no_stale_flat_threshold(tmp_path):
    """The model stores an old checkpoint's settings nested, so setting its threshold (into ``options``) and saving
    gives one value, which a reload uses."""
    model = AutoModelForCausalLM.from_pretrained(HERE / "tah2").eval()
    model.set_decider_threshold(0.7)
    model.save_pretrained(tmp_path)
    loop = json.loads((tmp_path / "config.json").read_text())["loop"]
    assert loop["options"]["exit_threshold"] == 0.7 and "exit_threshold" not in loop
    assert AutoModelForCausalLM.from_pretrained(tmp_path).loop.method_options.exit_threshold == 0.7
