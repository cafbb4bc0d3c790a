"""A halting method is one module and one registry entry (docs/architecture.md, "adding a method"): nothing outside
``retrofit/model/halting/`` (and the vLLM plugin's per-method adapters) branches on a method's name, and what the
rest of retrofit does for a method follows the method's own declarations (checked on Ouro, the method added last,
by changing a declaration and watching the consumer follow)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import retrofit
from retrofit import LoopConfig
from retrofit.model import registry
from retrofit.testing import tiny_base

REPO = Path(__file__).resolve().parents[2]
#: where a method's name may be compared with: its own modules, and the vLLM plugin's adapters (which read
#: checkpoints without retrofit.model)
ALLOWED = ("retrofit/model/halting/", "retrofit/vllm_plugin/")


def _names_compared_with_a_method(tree: ast.AST, source: str) -> list[tuple[int, str]]:
    """``x == "tah2"``, ``x in ("anira-e", ...)``, ``{"tah2": ...}`` where ``x`` mentions a method: the shapes of a
    branch on a method's name."""
    methods = set(registry.names())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = []
            for c in [node.left, *node.comparators]:
                if isinstance(c, ast.Constant) and c.value in methods:
                    consts.append(c.value)
                if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                    consts += [e.value for e in c.elts if isinstance(e, ast.Constant) and e.value in methods]
            text = ast.get_source_segment(source, node) or ""
            if consts and "method" in text:
                hits.append((node.lineno, text))
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len(set(keys) & methods) >= 2:  # a per-method table
                hits.append((node.lineno, f"dict keyed by {sorted(set(keys) & methods)}"))
    return hits


def test_no_branch_on_a_method_name_outside_the_methods():
    found = []
    for path in sorted((REPO / "retrofit").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(ALLOWED):
            continue
        source = path.read_text()
        found += [f"{rel}:{line}: {text}" for line, text in _names_compared_with_a_method(ast.parse(source), source)]
    assert not found, "per-method decisions belong to the method (HaltingMethod's declarations):\n" + "\n".join(found)


def test_the_scan_finds_a_branch():
    src = 'if loop.method == "tah2":\n    pass\nTABLE = {"tah2": 1, "anira-e": 2}\nif name == "fixed": pass\n'
    hits = _names_compared_with_a_method(ast.parse(src), src)
    assert [h[0] for h in hits] == [1, 3]  # the control-arm name "fixed" (no "method" in it) is not a method branch


def test_the_registry_lists_every_builtin_and_refuses_unknown_names():
    assert registry.names()[:5] == ("tah2", "anira-e", "anira-o", "fixed", "ouro")
    assert retrofit.METHODS == registry.names()
    with pytest.raises(retrofit.LoopConfigError, match="unknown method 'pondernet'; allowed: tah2, anira-e"):
        LoopConfig(method="pondernet")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(type("Other", (registry.method_class("tah2"),), {"name": "ouro"}))


@pytest.fixture
def ouro():
    return retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=3, method="ouro")).eval()


def test_flops_follow_the_methods_decider_runs(ouro, monkeypatch):
    from retrofit.model.flops import cost_report

    depths = torch.tensor([[1, 2, 3, 3]])
    with_gate = cost_report(ouro, depths)["flops"]
    monkeypatch.setattr(type(ouro.halting), "decider_runs", None)
    without = cost_report(ouro, depths)["flops"]
    gate = 2 * ouro.config.hidden_size  # one H -> 1 linear layer, 2 FLOPs per weight
    # the gate runs after each executed step but the last: min(d, D - 1) = 1, 2, 2, 2 times
    assert with_gate - without == pytest.approx(gate * (1 + 2 + 2 + 2))


def test_calibration_and_the_frontier_follow_the_methods_threshold(ouro, monkeypatch):
    from retrofit.evaluation.calibrate import threshold_for_stop_share
    from retrofit.evaluation.frontier import own_threshold
    from retrofit.evaluation.models import model_info

    c = [0.2, 0.4, 0.6, 0.8]
    halt_mass = threshold_for_stop_share(c, 0.5, "ouro")  # continue iff c > 1 - q: q = 1 - 0.5
    assert halt_mass == pytest.approx(0.5)
    monkeypatch.setattr(type(ouro.halting), "threshold_rule", "continue_at_or_above")
    assert threshold_for_stop_share([0.2, 0.4, 0.9, 0.95], 0.5, "ouro") == pytest.approx(0.65)
    assert own_threshold(ouro, model_info(ouro)) == 0.5  # Ouro's exit_q, an option
    monkeypatch.undo()


def test_write_threshold_writes_the_methods_option(ouro, tmp_path):
    from retrofit.evaluation.calibrate import write_threshold

    ouro.save_pretrained(tmp_path)
    assert write_threshold(tmp_path, "exit_q", 0.8)
    loaded = retrofit.LoopedLlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.loop.method_options.exit_q == 0.8
    with pytest.raises(ValueError, match="keeps its threshold in 'exit_q'"):
        write_threshold(tmp_path, "exit_threshold", 0.3)


def test_the_model_card_and_the_vllm_message_come_from_the_method(ouro, monkeypatch):
    from retrofit.hub.model_card import render_model_card
    from retrofit.vllm_plugin import config as P

    def render_card(m):
        return render_model_card(m.config, retrofit.parameter_report(m))

    card = render_card(ouro)
    assert registry.method_class("ouro").description in card
    assert "| exit q | 0.5 |" in card and "| entropy β (Stage I) | 0.05 |" in card
    monkeypatch.setattr(type(ouro.halting), "card_rows", classmethod(lambda cls, loop: [("gate", "linear")]))
    assert "| gate | linear |" in render_card(ouro)
    with pytest.raises(P.LoopSpecError, match="method 'ouro' is not served by the vLLM plugin"):
        P.loop_spec(ouro.config)


def test_memory_follows_the_methods_readout(ouro, monkeypatch):
    from retrofit.model.memory import generation_bytes

    base = generation_bytes(ouro.config, batch=1, prompt_len=8, new_tokens=8)
    monkeypatch.setattr(type(ouro.halting), "reads_every_depth", classmethod(lambda cls, loop: True))
    assert generation_bytes(ouro.config, batch=1, prompt_len=8, new_tokens=8)["logits"] > base["logits"]


def test_each_method_setting_is_declared_once():
    """A method's own settings are the fields of its ``Options`` (in its module): none is also a ``LoopConfig``
    field, two methods that share an option name declare it with the same type and default, and every option has
    help (its flags are made from it)."""
    import dataclasses
    import typing

    from retrofit.model.config import LoopConfig

    loop_fields = {f.name for f in dataclasses.fields(LoopConfig)}
    seen = {}
    for name in registry.names():
        opts = registry.method_class(name).Options
        hints = typing.get_type_hints(opts)
        for f in dataclasses.fields(opts):
            assert f.name not in loop_fields, f"{name}'s option {f.name} is also a LoopConfig field"
            assert f.metadata.get("help"), f"{name}'s option {f.name} has no help"
            decl = (hints[f.name], f.default)
            assert seen.setdefault(f.name, decl) == decl, f"option {f.name} is declared twice, differently"
    assert {"alpha_d", "kappa_scope", "mixture_output", "gamma", "gumbel_tau", "exit_q"} <= set(seen)
