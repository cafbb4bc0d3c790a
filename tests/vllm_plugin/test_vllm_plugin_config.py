"""The vLLM plugin reads checkpoints without retrofit's modeling code (retrofit/vllm_plugin/config.py keeps its own
copy of the format); these checks keep that copy in step with ``LoopConfig`` in the main environment, where vLLM
itself is not installed (tests_vllm/ runs the plugin for real)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import retrofit
from retrofit.model import config as C
from retrofit.model import registry
from retrofit.testing import tiny_base
from retrofit.vllm_plugin import config as P


def test_plugin_knows_every_loop_field_and_the_methods():
    fields = {f.name for f in dataclasses.fields(C.LoopConfig)}
    known = set(P.INFERENCE_FIELDS) | set(P.TRAINING_ONLY)
    # beyond LoopConfig's fields: the methods' options as flat fields of checkpoints from before retrofit 0.4
    assert fields <= known and known - fields <= set(registry.option_fields()), known - fields
    assert not set(P.INFERENCE_FIELDS) & set(P.TRAINING_ONLY)
    served = tuple(n for n in C.METHODS if registry.method_class(n).vllm_supported)
    for n in served:  # every option of a served method is read or known to shape training only
        own = {f.name for f in dataclasses.fields(registry.method_class(n).Options)}
        plugin = set(P.SERVED_OPTIONS.get(n, ())) | set(P.TRAINING_ONLY_OPTIONS.get(n, ()))
        assert plugin == own, n
    assert P.METHODS == served  # the plugin's adapters are exactly the methods that declare vLLM support
    assert set(P.ATTENTION_MODES) == set(C.ATTENTION_MODES)
    assert P.DEFAULT_ATTENTION == {n: C.DEFAULT_ATTENTION[n] for n in served}


#: the updater and state the plugin rebuilds (``P.SERVED_VALUES``)
#: what a checkpoint written before the release options existed reads as (retrofit.model.config.LEGACY_VALUES)
SERVED = {"updater": "residual", "decider_state": "core"}


@pytest.mark.parametrize(
    "arch, top_k, rule",
    [("swiglu", 2048, "quarter"), ("ffn", 10, "quarter"), ("swiglu", 0, "release"), ("swiglu", None, "release")],
)
def test_plugin_reads_a_converted_config(arch, top_k, rule):
    loop = retrofit.LoopConfig(
        method="tah2", decider_width_rule=rule, options={"decider_arch": arch, "decider_top_k": top_k}, **SERVED
    )
    m = retrofit.convert(tiny_base("llama"), loop)
    spec = P.loop_spec(m.config)
    assert (spec.decider_arch, spec.top_k, spec.decider_hidden) == (arch, m.halting.top_k, m.halting.decider_hidden)
    assert spec.top_k == (m.config.hidden_size if top_k is None else top_k)


def test_plugin_reads_checkpoints_from_before_the_release_decider_as_ffn():
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2"))
    from retrofit.model.halting.tah2 import TaH2Options

    # a flat checkpoint from before the decider_arch field: no options, no decider_arch
    m.config.loop = {k: v for k, v in m.config.loop.items() if k not in C.LEGACY_VALUES and k != "options"}
    spec = P.loop_spec(m.config)
    assert spec.decider_arch == TaH2Options.LEGACY_VALUES["decider_arch"] == "ffn"


def test_plugin_reads_the_release_updater_and_state_and_refuses_unknown_values():
    """TaH2's defaults (the release's updater and final-norm state) are served: the spec says so (tests_vllm/ runs
    them against generate()); a value the plugin does not know gets one error naming the field, the value, what it
    serves and what to use instead; a checkpoint without the fields reads as before they existed."""
    shape = {"num_hidden_layers": 6, "hidden_size": 64}
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2"))
    spec = P.loop_spec(m.config)
    assert (spec.updater, spec.decider_state) == ("release", "final_norm")
    legacy = {k: v for k, v in m.config.loop.items() if k not in SERVED}
    spec = P.loop_spec(SimpleNamespace(**shape, loop=legacy))
    assert (spec.updater, spec.decider_state) == tuple(SERVED.values())
    for name in SERVED:
        with pytest.raises(P.LoopSpecError, match=rf"{name}='other'.*does not serve.*retrofit serve"):
            P.loop_spec(SimpleNamespace(**shape, loop={**m.config.loop, name: "other"}))
    for method in ("anira-e", "anira-o", "fixed"):
        assert P.loop_spec(retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method=method)).config)


def test_plugin_reads_the_output_mixture_from_the_options_or_the_flat_field():
    """``mixture_output`` is a TaH2 option (``config.loop["options"]``); a checkpoint from before the nesting has it
    as a flat field; an option the plugin does not know is one clear error."""
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2", options={"mixture_output": False}))
    assert m.config.loop["options"]["mixture_output"] is False and "mixture_output" not in m.config.loop
    assert P.loop_spec(m.config).mixture_output is False
    assert P.loop_spec(retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2")).config).mixture_output
    flat = {k: v for k, v in m.config.loop.items() if k != "options"}
    shape = {"num_hidden_layers": 6, "hidden_size": 64}
    assert (
        P.loop_spec(SimpleNamespace(**shape, loop={**flat, "mixture_output": False, "alpha_d": 0.05})).mixture_output
        is False
    )
    with pytest.raises(P.LoopSpecError, match=r"tah2 options this plugin does not know: \['new_knob'\]"):
        P.loop_spec(SimpleNamespace(**shape, loop={**m.config.loop, "options": {"new_knob": 1}}))


def test_plugin_reads_the_decider_thresholds_from_the_options_or_the_flat_fields():
    """TaH2's ``exit_threshold`` and ANIRA-O's ``halt_threshold`` are method options; older checkpoints store them
    flat. The plugin serves the calibrated value either way (a default 0.5 would silently serve another model)."""
    shape = {"num_hidden_layers": 6, "hidden_size": 64}
    for method, name in (("tah2", "exit_threshold"), ("anira-o", "halt_threshold")):
        m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method=method, options={name: 0.27}))
        assert getattr(P.loop_spec(m.config), name) == 0.27
        flat = {k: v for k, v in m.config.loop.items() if k != "options"}
        assert getattr(P.loop_spec(SimpleNamespace(**shape, loop={**flat, name: 0.31})), name) == 0.31
