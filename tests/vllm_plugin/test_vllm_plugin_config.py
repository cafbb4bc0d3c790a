"""The vLLM plugin reads checkpoints without retrofit's modeling code (retrofit/vllm_plugin/config.py keeps its own
copy of the format); these checks keep that copy in step with ``LoopConfig`` in the main environment, where vLLM
itself is not installed (tests_vllm/ runs the plugin for real)."""

from __future__ import annotations

import dataclasses

import pytest

import retrofit
from retrofit.model import config as C
from retrofit.model import registry
from retrofit.testing import tiny_base
from retrofit.vllm_plugin import config as P


def test_plugin_knows_every_loop_field_and_the_methods():
    fields = {f.name for f in dataclasses.fields(C.LoopConfig)}
    assert set(P.INFERENCE_FIELDS) | set(P.TRAINING_ONLY) == fields
    assert not set(P.INFERENCE_FIELDS) & set(P.TRAINING_ONLY)
    served = tuple(n for n in C.METHODS if registry.method_class(n).vllm_supported)
    assert P.METHODS == served  # the plugin's adapters are exactly the methods that declare vLLM support
    assert set(P.ATTENTION_MODES) == set(C.ATTENTION_MODES)
    assert P.DEFAULT_ATTENTION == {n: C.DEFAULT_ATTENTION[n] for n in served}


@pytest.mark.parametrize("arch, top_k", [("swiglu", 2048), ("ffn", 10), ("swiglu", 0)])
def test_plugin_reads_a_converted_config(arch, top_k):
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2", decider_arch=arch, decider_top_k=top_k))
    spec = P.loop_spec(m.config)
    assert (spec.decider_arch, spec.top_k, spec.decider_hidden) == (arch, top_k, m.halting.decider_hidden)


def test_plugin_reads_checkpoints_from_before_the_release_decider_as_ffn():
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(method="tah2"))
    m.config.loop = {k: v for k, v in m.config.loop.items() if k not in C.LEGACY_VALUES}
    assert P.loop_spec(m.config).decider_arch == C.LEGACY_VALUES["decider_arch"] == "ffn"
