"""``LoopConfig.from_fields``: the one place a ``LoopConfig`` is built from flags (recipe, ``retrofit convert``,
``retrofit params``), so a new ``LoopConfig`` field flows from a flag of the same name without edits."""

from __future__ import annotations

import argparse
import dataclasses

from retrofit.model.config import LoopConfig
from retrofit.training.model_setup import LoopArgs, loop_args_class

#: a value other than the default for each of the methods' own options (their ``Options`` dataclasses), by method
OTHER_OPTIONS = {
    "tah2": {
        "alpha_d": 0.1,
        "rho": 0.9,
        "decider_weighting": "uniform",
        "dyn_pos_weight": False,
        "pos_weight": 2.0,
        "cost_min": 1e-5,
        "cost_max": 2.0,
        "decider_loss_norm": "weights",
        "bce_margin": 0.1,
        "kappa_scope": "pooled",
        "kappa_gather": False,
        "decider_loss_scope": "local",
        "mixture_output": False,
        "train_decisions": "sample",
        "exit_threshold": 0.3,
        "decider_top_k": 7,
        "decider_arch": "ffn",
        "decider_init_std": 0.02,
        "decider_topk_grad": False,
        "decider_init": "normal",
    },
    "anira-e": {"gamma": 0.02, "prior_base": 1.5, "gumbel_tau": 0.5},
    "anira-o": {"gamma": 0.02, "prior_base": 1.5, "halt_threshold": 0.4},
    "ouro": {"exit_q": 0.7, "entropy_beta": 0.1, "gate_k": 20.0, "gate_gamma": 0.01},
}

#: a value other than the default for each LoopConfig field LoopArgs has (and that the validation accepts)
OTHER = {
    "prelude": 1,
    "core": 3,
    "max_depth": 4,
    "method": "anira-o",
    "attention": "duo-causal",
    "updater_hidden": 33,
    "decider_hidden": 9,
    "deep_init_logit": 1.5,
    # None = the method's default; anira-o's are residual / core / False / quarter / normal / False
    "updater": "release",
    "decider_state": "final_norm",
    "decider_width_rule": "release",
    "padding_stops": True,
    "fixed_graph": True,
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
        "--decider-top-k 5 --decider-topk-grad false --decider-init normal --padding-stops true".split()
    )
    assert LoopConfig.from_fields(release) == LoopConfig(
        method="tah2",
        updater="release",
        decider_state="final_norm",
        decider_width_rule="release",
        padding_stops=True,
        options={"decider_top_k": 5, "decider_topk_grad": False, "decider_init": "normal"},
    )
    # unset, they are the method's own defaults
    assert LoopConfig.from_fields(p.parse_args("--model m --out x".split())).updater == "release"
    assert LoopConfig.from_fields(p.parse_args("--model m --out x --method fixed".split())).updater == "residual"


def test_method_option_flags_flow_into_options():
    """Each method's options get one flag each (``loop_args_class``), defaulting to the method's own value, and land
    in ``LoopConfig.options``; a flag of another method's option is an error, and a control arm drops them."""
    import pytest

    from retrofit.model import registry
    from retrofit.model.config import LoopConfigError

    Args = loop_args_class()
    for method, other in OTHER_OPTIONS.items():
        assert set(other) == {f.name for f in dataclasses.fields(registry.method_class(method).Options)}, method
        loop = Args(method=method, **other).loop_config()
        assert loop.options == other and loop.method_options == registry.method_class(method).Options(**other)
        assert Args(method=method).loop_config().options == dataclasses.asdict(registry.method_class(method).Options())
        assert Args(method=method, **other).loop_config(method="fixed").options == {}  # the control arm's
    with pytest.raises(LoopConfigError, match="alpha_d is an option of method tah2, not of 'anira-e'"):
        Args(method="anira-e", alpha_d=0.1).loop_config()
    with pytest.raises(LoopConfigError, match="gumbel_tau is an option of method anira-e, not of 'anira-o'"):
        Args(method="anira-o", gumbel_tau=0.5).loop_config()


def test_retrofit_convert_has_the_method_option_flags():
    from retrofit.cli.convert import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args("--model m --out x --kappa-scope pooled --alpha-d 0.2 --mixture-output false".split())
    loop = LoopConfig.from_fields(args)
    assert (loop.method_options.kappa_scope, loop.method_options.alpha_d, loop.method_options.mixture_output) == (
        "pooled",
        0.2,
        False,
    )
    args = p.parse_args("--model m --out x --method anira-e --gamma 0.3 --gumbel-tau 0.7".split())
    assert LoopConfig.from_fields(args).options == {"gamma": 0.3, "prior_base": 2.0, "gumbel_tau": 0.7}
