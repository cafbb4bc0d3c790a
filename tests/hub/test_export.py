"""``retrofit export``: bundling, fresh-process loading without retrofit, model card, atomicity, push."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import retrofit
from retrofit import LoopConfig, convert
from retrofit.hub.bundle import bundled_modules
from retrofit.hub.export import (
    BundleError,
    ExportError,
    bundle_modules,
    export,
    export_model,
    flat_name,
)
from retrofit.hub.model_card import split_front_matter
from retrofit.testing import char_tokenizer, spread_decider, tiny_base

REPO = Path(retrofit.__file__).resolve().parent.parent
HAS_CACHE_GENERATION = importlib.util.find_spec("retrofit.model.generation") is not None

# Run in a fresh interpreter (-I: no PYTHON* variables, no cwd on sys.path) with retrofit hidden: a
# meta-path finder refuses it (the editable install would otherwise still find it) and path entries
# holding it are dropped. Each folder is loaded with trust_remote_code=True; logits and depths of a
# fixed probe come back through a .pt file.
FRESH_LOADER = r"""
import importlib.abc, json, os, sys

class _HideRetrofit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "retrofit" or name.startswith("retrofit."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, _HideRetrofit())
sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "retrofit", "__init__.py"))]
try:
    import retrofit  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("retrofit is still importable")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

job = json.loads(sys.argv[1])
results = {}
for name, folder in job["folders"].items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.tensor(job["ids"])
    with torch.no_grad():
        out = model(ids)
    results[name] = {"logits": out.logits, "depths": out.depths, "module": type(model).__module__,
                     "config_module": type(model.config).__module__}
    if job.get("generate") == name:
        tok = AutoTokenizer.from_pretrained(folder)
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        for use_cache in job["use_cache"]:
            gen = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, use_cache=use_cache)
            results[name][f"generated_{use_cache}"] = gen
            text = pipe("ab", max_new_tokens=3, do_sample=False, use_cache=use_cache)[0]["generated_text"]
            results[name][f"pipeline_{use_cache}"] = text
assert not any(m == "retrofit" or m.startswith("retrofit.") for m in sys.modules), "retrofit was imported"
torch.save(results, job["out"])
"""


def run_fresh(
    folders: dict[str, Path],
    ids: torch.Tensor,
    tmp_path: Path,
    generate: str | None = None,
    use_cache: tuple[bool, ...] = (False,),
) -> dict:
    out = tmp_path / "fresh_results.pt"
    job = {
        "folders": {k: str(v) for k, v in folders.items()},
        "ids": ids.tolist(),
        "out": str(out),
        "generate": generate,
        "use_cache": use_cache,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        HF_HOME=str(tmp_path / "hf_home"),
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", FRESH_LOADER, json.dumps(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def randomized(model, seed: int = 1):
    """Give the heads random weights so depths vary per token and deeper iterations change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    if model.loop.method == "tah2":  # unit-gain decider layers: scores that differ from token to token
        spread_decider(model, logit_std=2.0, generator=g)
    return model.eval()


def looped(family="llama", method="tah2", seed=0, **kw):
    loop = LoopConfig(prelude=1, core=3, max_depth=3, method=method, **kw)
    return randomized(convert(tiny_base(family, seed=seed), loop), seed + 1)


PROBE = torch.randint(4, 104, (2, 12), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------------------------
# Bundling on a synthetic package (every import form), checked against the original package
# ------------------------------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


SYNTH = {
    "pkg/__init__.py": "raise RuntimeError('the package root must never be imported by bundled code')\n",
    "pkg/main.py": """
        from __future__ import annotations
        import math
        from .sub.alpha import A  # a comment that stays
        from .sub import beta, GAMMA as G
        from . import util as u
        import pkg.deep.leaf as leaf
        from .sub.alpha import (
            A2,
            A3 as A3x,
        )

        def lazy():
            from .late import LATE
            return LATE

        def value():
            return [A, A2, A3x, beta.B, G, u.U, leaf.LEAF, lazy(), math.floor(2.5)]
    """,
    "pkg/sub/__init__.py": "from .alpha import A\nfrom ..util import U\nGAMMA = 'gamma' + U\n",
    "pkg/sub/alpha.py": "A, A2, A3 = 'a', 'a2', 'a3'\n",
    "pkg/sub/beta.py": "from .alpha import A\nB = 'b' + A\n",
    "pkg/util.py": "U = 'u'\n",
    "pkg/deep/__init__.py": "",
    "pkg/deep/leaf.py": "from ..sub.beta import B\nLEAF = 'leaf' + B\n",
    "pkg/late.py": "LATE = 'late'\n",
    "pkg/unused.py": "NOT = 'bundled'\n",
}


def test_bundle_rewrites_every_import_form(tmp_path):
    from transformers.dynamic_module_utils import get_relative_import_files

    _write(tmp_path / "src", SYNTH)
    files = bundle_modules(["pkg.main"], package_dir=tmp_path / "src" / "pkg", package="pkg")
    assert set(files) == {
        "pkg_main.py",
        "pkg_sub.py",
        "pkg_sub_alpha.py",
        "pkg_sub_beta.py",
        "pkg_util.py",
        "pkg_deep_leaf.py",
        "pkg_late.py",
    }  # parents' __init__ only when imported themselves
    assert "from .pkg_sub_alpha import A  # a comment that stays" in files["pkg_main.py"]
    assert "from .pkg_util import U" in files["pkg_sub.py"]

    # the flat files, as transformers lays them out: one folder, imported as a package
    flat = tmp_path / "flat" / "bundled"
    flat.mkdir(parents=True)
    (flat / "__init__.py").write_text("")
    for name, text in files.items():
        (flat / name).write_text(text)
    # transformers' own scanner must find exactly the bundle
    seen = {Path(f).name for f in get_relative_import_files(str(flat / "pkg_main.py"))}
    assert seen | {"pkg_main.py"} == set(files)

    # reference: the original package (its root __init__ raises, so load main's closure by path)
    code = (
        "import sys, types, importlib\n"
        f"sys.path.insert(0, {str(tmp_path / 'flat')!r})\n"
        "print(importlib.import_module('bundled.pkg_main').value())\n"
    )
    got = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    ref_code = (
        "import sys, types\n"
        f"sys.path.insert(0, {str(tmp_path / 'src')!r})\n"
        f"m = types.ModuleType('pkg'); m.__path__ = [{str(tmp_path / 'src' / 'pkg')!r}]; sys.modules['pkg'] = m\n"
        "import pkg.main\nprint(pkg.main.value())\n"
    )
    ref = subprocess.run(
        [sys.executable, "-I", "-c", ref_code], capture_output=True, text=True, timeout=60, check=False
    )
    assert ref.returncode == 0, ref.stderr
    assert got.stdout == ref.stdout
    assert "'a'" in ref.stdout and "'leafba'" in ref.stdout


@pytest.mark.parametrize(
    "source, message",
    [
        ("import pkg.util\n", "binds the package name"),
        ("from . import THING\n", "package root"),
        ("from .missing import X\n", "cannot find module"),
    ],
)
def test_bundle_refuses_what_cannot_be_flat(tmp_path, source, message):
    _write(tmp_path, {"pkg/__init__.py": "THING = 1\n", "pkg/util.py": "U = 1\n", "pkg/main.py": source})
    with pytest.raises(BundleError, match=message):
        bundle_modules(["pkg.main"], package_dir=tmp_path / "pkg", package="pkg")


def test_bundled_code_needs_only_torch_transformers_and_hub(tmp_path):
    """transformers refuses remote code whose imports (anywhere outside try blocks) are not installed:
    the bundle must not pull in TRL, PEFT, matplotlib, … ."""
    from transformers.dynamic_module_utils import get_imports

    for fname, text in bundle_modules(["retrofit.model.modeling"]).items():
        (tmp_path / fname).write_text(text)
        extra = set(get_imports(tmp_path / fname)) - set(sys.stdlib_module_names) - ALLOWED_IMPORTS
        assert not extra, f"{fname} imports {sorted(extra)}"


# what exported code may import: torch, transformers and transformers' own hard requirements
ALLOWED_IMPORTS = {"torch", "transformers", "huggingface_hub", "packaging"}


def test_allowed_imports_are_transformers_requirements():
    from importlib.metadata import requires

    hard = {
        r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip().replace("-", "_")
        for r in requires("transformers")
        if "extra ==" not in r
    }
    assert ALLOWED_IMPORTS - {"torch", "transformers"} <= hard


def test_bundle_of_retrofit_follows_the_import_graph():
    files = bundle_modules(["retrofit.model.modeling"])
    # what modeling imports directly must be there, and each file's own package imports too
    for fname, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1
                target = (node.module or "") + ".py"
                if node.module:
                    assert target in files, f"{fname} imports {node.module}, not bundled"
                else:
                    assert all(a.name + ".py" in files for a in node.names)
    for m in (
        "modeling",
        "config",
        "heads",
        "attention",
        "families",
        "halting",
        "halting_tah2",
        "halting_anira",
        "loop",
        "backends",
        "outputs",
        "cache",
        "versions",
    ):
        assert f"retrofit_{m}.py" in files  # the file names of exports made before retrofit/model existed
    assert flat_name("retrofit") + ".py" not in files  # the root __init__ registers Auto classes
    assert flat_name("retrofit.model") + ".py" not in files  # nor does the model package's own __init__
    names = bundled_modules(["retrofit.model.modeling"])
    assert set(names) == set(files) and all(m.startswith("retrofit.model.") for m in names.values())
    assert "retrofit_export.py" not in files and "retrofit_loading.py" not in files
    # the TRL integration stays out: exported code neither imports nor mentions a TRL module
    assert "retrofit_trl_fused.py" not in files
    for fname, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                assert "trl" not in (node.module or "").split(".")[0].split("_"), (fname, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "trl" for a in node.names), fname


# ------------------------------------------------------------------------------------------------
# The exported folder
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two exports (llama/TaH2 with a tokenizer and an eval file; qwen3/ANIRA-O) and their models."""
    root = tmp_path_factory.mktemp("export")
    m1 = looped("llama", "tah2")
    m1.config.retrofit_base_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    m1.config.retrofit_base_license = "apache-2.0"
    ckpt = root / "ckpt_llama"
    m1.save_pretrained(ckpt)
    char_tokenizer().save_pretrained(ckpt)
    (ckpt / "retrofit_eval.json").write_text(
        json.dumps(
            {
                "models": {
                    "tah2": {
                        "tasks": {
                            "mano": {
                                "levels": {
                                    "1": {"accuracy": 0.5, "mean_depth": 1.5, "n": 10},
                                    "2": {"accuracy": 0.25, "mean_depth": 2.5, "n": 30},
                                }
                            }
                        }
                    }
                }
            }
        )
    )
    out1 = export(ckpt, root / "out_llama")
    m2 = looped("qwen3", "anira-o", seed=5)
    out2 = export_model(m2, root / "out_qwen3", tokenizer=char_tokenizer())
    return {"llama": (m1, out1), "qwen3": (m2, out2), "root": root}


def test_export_folder_contents(exported):
    m1, out = exported["llama"]
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "generation_config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle")) for n in names)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "modeling_looped.LoopedLlamaConfig",
        "AutoModelForCausalLM": "modeling_looped.LoopedLlamaForCausalLM",
    }
    assert cfg["loop"] == m1.config.loop_config.to_dict()
    for f in names:
        if f.endswith(".py"):
            text = (out / f).read_text()
            tree = ast.parse(text)
            # only the entry module names the retrofit package, and only inside its try block
            tried = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
            for node in ast.walk(tree):
                names_ = []
                if isinstance(node, ast.Import):
                    names_ = [a.name for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names_ = [node.module]
                if any(n.split(".")[0] == "retrofit" for n in names_):
                    assert f == "modeling_looped.py" and id(node) in tried, f
            assert "AutoConfig.register" not in text
    assert not [p for p in exported["root"].iterdir() if p.name.startswith(".")]  # no temp folders left


@pytest.mark.integration
def test_fresh_process_without_retrofit_matches(exported, tmp_path):
    """Issue 6: a fresh process with retrofit hidden loads both folders with trust_remote_code and
    computes the in-process model's logits and depths."""
    m1, out1 = exported["llama"]
    m2, out2 = exported["qwen3"]
    cache_modes = (False, True) if HAS_CACHE_GENERATION else (False,)
    res = run_fresh({"llama": out1, "qwen3": out2}, PROBE, tmp_path, generate="llama", use_cache=cache_modes)
    for name, model in (("llama", m1), ("qwen3", m2)):
        with torch.no_grad():
            ref = model(PROBE)
        assert res[name]["module"].startswith("transformers_modules.")
        assert res[name]["config_module"].startswith("transformers_modules.")
        torch.testing.assert_close(res[name]["logits"], ref.logits, rtol=0, atol=1e-5)
        assert torch.equal(res[name]["depths"], ref.depths)
    # the probe exercises adaptive depth (several exit depths), else depth handling is untested
    assert len(torch.unique(m1(PROBE).depths)) > 1
    # generate() and pipeline() work from remote code and match the in-process model
    from transformers import pipeline

    tok = char_tokenizer()
    pipe = pipeline("text-generation", model=m1, tokenizer=tok)
    for use_cache in cache_modes:
        ref_gen = m1.generate(PROBE[:1, :5], max_new_tokens=4, do_sample=False, use_cache=use_cache)
        assert torch.equal(res["llama"][f"generated_{use_cache}"], ref_gen)
        ref_text = pipe("ab", max_new_tokens=3, do_sample=False, use_cache=use_cache)[0]["generated_text"]
        assert res["llama"][f"pipeline_{use_cache}"] == ref_text


def test_loads_without_trust_remote_code_when_retrofit_is_installed(exported):
    from transformers import AutoModelForCausalLM

    for name in ("llama", "qwen3"):
        model, out = exported[name]
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(loaded) is type(model)  # the registered class, not remote code
        with torch.no_grad():
            torch.testing.assert_close(loaded(PROBE).logits, model(PROBE).logits, rtol=0, atol=0)
        # trust_remote_code=True next to an installed retrofit: transformers prefers the registered
        # classes, and the Auto registry still maps the model type to retrofit's classes afterwards
        again = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        assert type(again) is type(model)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        assert CONFIG_MAPPING[model.config.model_type] is type(model.config)


INSTALLED_LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

job = json.loads(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True).eval()  # retrofit not imported yet
import retrofit

assert type(model) is retrofit.LoopedLlamaForCausalLM, type(model)
assert isinstance(model, retrofit.LoopedForCausalLM) and isinstance(model.config, retrofit.LoopedLlamaConfig)
bundled = [m for m in sys.modules if m.startswith("transformers_modules") and "retrofit_" in m]
assert not bundled, "bundled copy imported"
with torch.no_grad():
    out = model(torch.tensor(job["ids"]))
model.save_pretrained(job["resave"])  # retrofit's classes stay out of remote-code saving
torch.save({"logits": out.logits, "depths": out.depths}, job["out"])
"""


@pytest.mark.integration
def test_trust_remote_code_where_retrofit_is_installed_gives_retrofits_classes(exported, tmp_path):
    """A fresh process with retrofit installed but not yet imported, loading with trust_remote_code=True:
    the entry module returns retrofit's own classes (one set of classes), not the bundled copy."""
    m1, out1 = exported["llama"]
    job = {"folder": str(out1), "ids": PROBE.tolist(), "out": str(tmp_path / "res.pt"), "resave": str(tmp_path / "re")}
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        HF_HOME=str(tmp_path / "hf_home"),
        PYTHONPATH=str(REPO),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INSTALLED_LOADER, json.dumps(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(tmp_path / "res.pt")
    with torch.no_grad():
        ref = m1(PROBE)
    torch.testing.assert_close(res["logits"], ref.logits, rtol=0, atol=1e-5)
    assert torch.equal(res["depths"], ref.depths)
    assert not list((tmp_path / "re").glob("*.py"))


VERSION_LOADER = (
    FRESH_LOADER.split("import torch\n", 1)[0]
    + r"""
import importlib.metadata as md
from transformers import AutoModelForCausalLM

real = md.version
md.version = lambda name: "6.0.0" if name == "transformers" else real(name)
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ImportError as e:
    print("REFUSED:", e)
"""
)


@pytest.mark.integration
def test_exported_code_carries_its_own_version_check(exported, tmp_path):
    _, out1 = exported["llama"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        HF_HOME=str(tmp_path / "hf_home"),
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", VERSION_LOADER, str(out1)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REFUSED:" in proc.stdout and "transformers 6.0.0 is installed" in proc.stdout, proc.stdout


def test_model_card(exported):
    m1, out = exported["llama"]
    meta, body = split_front_matter((out / "README.md").read_text())
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers"
    assert meta["tags"] == ["retrofit", "looped-transformer", "adaptive-depth", "tah2"]
    rep = retrofit.parameter_report(m1)
    assert f"{rep['heads']:,}" in body and f"{100 * rep['heads_share']:.2f}%" in body
    assert "| max depth D | 3 |" in body and "1 layer: 0" in body and "3 layers: 1–3" in body
    # d̄ over levels, weighted by n: (1.5*10 + 2.5*30)/40 = 2.25; accuracy (0.5*10 + 0.25*30)/40 = 31.2%
    assert "d̄ = **2.25**" in body and "| tah2 | mano | 31.2% | 2.25 | 40 |" in body
    assert (out / "retrofit_eval.json").is_file()
    # unknown provenance: documented default license, no base_model key
    meta2, body2 = split_front_matter((exported["qwen3"][1] / "README.md").read_text())
    assert "base_model" not in meta2 and meta2["license"] == "other" and "anira-o" in meta2["tags"]
    assert "Evaluation" not in body2


def test_card_from_trainer_eval_results(tmp_path):
    from retrofit.hub.model_card import read_eval_summary

    (tmp_path / "eval_results.json").write_text(json.dumps({"eval_loss": 1.25, "eval_mean_depth": 1.75, "epoch": 1}))
    s = read_eval_summary(tmp_path)
    assert s["mean_depth"] == 1.75 and s["metrics"]["eval_loss"] == 1.25
    (tmp_path / "eval_results.json").unlink()
    (tmp_path / "trainer_state.json").write_text(
        json.dumps(
            {
                "log_history": [
                    {"loss": 2.0, "mean_depth": 1.9, "step": 5},
                    {"eval_loss": 1.5, "eval_mean_depth": 1.6, "step": 5},
                    {"loss": 1.0, "step": 10},
                ]
            }
        )
    )
    s = read_eval_summary(tmp_path)
    assert s["mean_depth"] == 1.6 and s["metrics"] == {"eval_loss": 1.5, "eval_mean_depth": 1.6, "step": 5}
    (tmp_path / "retrofit_eval.json").write_text("{not json")
    with pytest.raises(ValueError, match="retrofit_eval.json"):
        read_eval_summary(tmp_path)


def test_training_output_dir_uses_latest_checkpoint(tmp_path):
    m = looped("llama", "fixed")
    run_dir = tmp_path / "run"
    for step in (2, 10):
        m.save_pretrained(run_dir / f"checkpoint-{step}")
    torch.save({"x": 1}, run_dir / "checkpoint-10" / "training_args.bin")  # a pickle the export must drop
    char_tokenizer().save_pretrained(run_dir)
    with torch.no_grad():
        m.updater.w2.weight.add_(1.0)  # checkpoint-10 differs from checkpoint-2
    m.save_pretrained(run_dir / "checkpoint-10")
    out = export(run_dir, tmp_path / "out")
    assert not list(out.glob("*.bin")) and (out / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.updater.w2.weight, m.updater.w2.weight)


def test_export_refuses_a_base_model(tmp_path):
    tiny_base("llama").save_pretrained(tmp_path / "base")
    with pytest.raises(ExportError, match="not a looped model"):
        export(tmp_path / "base", tmp_path / "out")
    with pytest.raises(ExportError, match="not a checkpoint folder"):
        export(tmp_path, tmp_path / "out2")


def test_refuses_non_empty_out_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    m = looped("llama", "tah2")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_model(m, out)
    assert (out / "keep.txt").read_text() == "precious"
    # --overwrite replaces only a folder retrofit wrote (retrofit.hub.output_paths): not this one
    with pytest.raises(ExportError, match="only an empty folder or one written by retrofit"):
        export_model(m, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    export_model(m, out)
    (out / "keep.txt").write_text("stale")
    export_model(m, out, overwrite=True)  # an earlier export: replaced as a whole
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_model(m, empty)  # an empty folder is fine without --overwrite


def test_failure_never_leaves_a_half_written_folder(tmp_path, monkeypatch):
    import retrofit.hub.export as ex

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    m = looped("llama", "tah2")
    monkeypatch.setattr(ex, "write_remote_code", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export_model(m, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("precious")
    (old / ".retrofit-output").write_text("{}")  # an earlier retrofit output: --overwrite may replace it
    with pytest.raises(RuntimeError, match="injected"):
        export_model(m, old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == [".retrofit-output", "keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no temp folder left behind

    # a failure at the very last step (the rename) also leaves the old folder intact
    monkeypatch.undo()
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old -> trash succeeded; tmp -> out fails
            raise OSError("injected rename failure")
        return real_replace(src, dst)

    monkeypatch.setattr(ex.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="injected rename"):
        export_model(m, old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == [".retrofit-output", "keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


class FakeHfApi:
    calls: list = []  # noqa: RUF012 (records calls across instances)

    def __init__(self, token=None):
        FakeHfApi.calls.append(("init", token))

    def create_repo(self, repo_id, **kw):
        FakeHfApi.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        FakeHfApi.calls.append(("upload_folder", kw))
        assert Path(kw["folder_path"], "model.safetensors").is_file()  # the folder is complete when uploaded
        return "commit"


def test_cli_export_push_to_hub_mocked(tmp_path, monkeypatch, capsys):
    import retrofit.hub.export as ex
    from retrofit.cli import main

    m = looped("llama", "tah2")
    m.save_pretrained(tmp_path / "ckpt")
    FakeHfApi.calls = []
    monkeypatch.setattr(ex, "HfApi", FakeHfApi)
    assert (
        main(
            [
                "export",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "out"),
                "--push-to-hub",
                "me/looped-tiny",
                "--private",
            ]
        )
        == 0
    )
    kinds = [c[0] for c in FakeHfApi.calls]
    assert kinds == ["init", "create_repo", "upload_folder"]
    assert FakeHfApi.calls[1][1] == "me/looped-tiny"
    assert FakeHfApi.calls[1][2]["private"] is True and FakeHfApi.calls[1][2]["exist_ok"] is True
    up = FakeHfApi.calls[2][1]
    assert up["repo_id"] == "me/looped-tiny" and Path(up["folder_path"]) == (tmp_path / "out").resolve()
    assert 'from_pretrained("me/looped-tiny", trust_remote_code=True)' in (tmp_path / "out" / "README.md").read_text()
    assert "pushed to me/looped-tiny" in capsys.readouterr().out
    # a failed upload names the complete local folder and how to retry
    monkeypatch.setattr(FakeHfApi, "upload_folder", lambda self, **kw: (_ for _ in ()).throw(ConnectionError("no hub")))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o_fail"), "--push-to-hub", "me/x"]) == 2
    assert re.search(
        r"^error: exported to .*o_fail, but the upload to me/x failed.*no hub", capsys.readouterr().err, re.M
    )
    assert (tmp_path / "o_fail" / "model.safetensors").is_file()
    # --private needs --push-to-hub; a second export without --overwrite is refused, clearly
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o2"), "--private"]) == 2
    assert "--private only applies" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
