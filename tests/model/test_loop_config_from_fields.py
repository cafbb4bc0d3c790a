"""``LoopConfig.from_fields``: the one place a ``LoopConfig`` is built from flags (recipe, ``retrofit convert``,
``retrofit params``), so a new ``LoopConfig`` field flows from a flag of the same name without edits."""

from __future__ import annotations

import argparse
import dataclasses

from retrofit.model.config import LoopConfig
from retrofit.training.model_setup import LoopArgs

#: a value other than the default for each LoopConfig field LoopArgs has (and that the validation accepts)
OTHER = {
    "prelude": 1,
    "core": 3,
    "max_depth": 4,
    "method": "anira-o",
    "attention": "duo-causal",
    "exit_threshold": 0.3,
    "decider_top_k": 7,
    "decider_arch": "ffn",
    "decider_init_std": 0.02,
    "train_decisions": "sample",
    "mixture_output": False,
    "halt_threshold": 0.4,
    "gumbel_tau": 0.5,
    "updater_hidden": 33,
    "decider_hidden": 9,
    "deep_init_logit": 1.5,
    # None = the method's default; anira-o's are residual / core / False / quarter / normal / False
    "updater": "release",
    "decider_state": "final_norm",
    "decider_topk_grad": True,
    "decider_width_rule": "release",
    "decider_init": "torch",
    "padding_stops": True,
    "fixed_graph": True,
    # the loss weights and switches (LossConfig's, which LoopConfig inherits)
    "alpha_d": 0.1,
    "rho": 0.9,
    "decider_weighting": "uniform",
    "gamma": 0.02,
    "prior_base": 1.5,
    "dyn_pos_weight": False,
    "pos_weight": 2.0,
    "cost_min": 1e-5,
    "cost_max": 2.0,
    "decider_loss_norm": "weights",
    "bce_margin": 0.1,
    "kappa_scope": "pooled",
    "kappa_gather": False,
    "decider_loss_scope": "local",
}


def test_loop_args_copy_every_loop_config_field_they_have():
    shared = {f.name for f in dataclasses.fields(LoopArgs)} & {f.name for f in dataclasses.fields(LoopConfig)}
    assert shared == set(OTHER), "give OTHER a non-default value for the new shared field"
    loop = LoopArgs(**OTHER).loop_config()
    assert {k: getattr(loop, k) for k in OTHER} == OTHER
    assert LoopArgs(**OTHER).loop_config(fixed_graph=True, method="fixed").fixed_graph is True
    assert LoopArgs().loop_config() == LoopConfig()


def test_a_new_field_flows_through_without_edits():
    Wider = dataclasses.make_dataclass("Wider", [("new_knob", int, 0)], bases=(LoopConfig,))
    assert Wider.from_fields(argparse.Namespace(new_knob=5, max_depth=3, unrelated="x")).new_knob == 5
    assert Wider.from_fields({"new_knob": 6}).new_knob == 6
    assert Wider.from_fields({"max_depth": 3}, new_knob=7).new_knob == 7


def test_retrofit_convert_flags_build_the_loop_config():
    from retrofit.cli.convert import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        "--model tiny-llama --out x --prelude 1 --core 2 --max-depth 3 --method anira-e --attention duo-causal "
        "--updater-hidden 16 --decider-hidden 8".split()
    )
    assert LoopConfig.from_fields(args) == LoopConfig(
        prelude=1, core=2, max_depth=3, method="anira-e", attention="duo-causal", updater_hidden=16, decider_hidden=8
    )
    release = p.parse_args(
        "--model tiny-llama --out x --updater release --decider-state final_norm --decider-width-rule release "
        "--decider-top-k 5 --decider-topk-grad false --decider-init normal --padding-stops true --method fixed".split()
    )
    assert LoopConfig.from_fields(release) == LoopConfig(
        method="fixed",
        updater="release",
        decider_state="final_norm",
        decider_width_rule="release",
        decider_top_k=5,
        decider_topk_grad=False,
        decider_init="normal",
        padding_stops=True,
    )
    # unset, they are the method's own defaults
    assert LoopConfig.from_fields(p.parse_args("--model m --out x".split())).updater == "release"
    assert LoopConfig.from_fields(p.parse_args("--model m --out x --method fixed".split())).updater == "residual"
