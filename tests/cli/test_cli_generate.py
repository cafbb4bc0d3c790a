"""``retrofit generate`` on a tiny looped checkpoint saved to disk."""

from __future__ import annotations

import re

import pytest
import torch

from retrofit import LoopConfig, convert
from retrofit.cli import main
from retrofit.testing import char_tokenizer, tiny_base


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("looped")
    model = convert(tiny_base("llama"), LoopConfig(prelude=1, core=3, max_depth=3, method="tah2"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder, model.eval()


def test_streams_the_answer_and_matches_generate(checkpoint, capsys):
    folder, model = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "hello", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    tok = char_tokenizer()
    enc = tok("hello", return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert printed.strip() == tok.decode(ref[0, 5:], skip_special_tokens=True).strip()


def test_show_depths_and_html(checkpoint, capsys, tmp_path):
    folder, model = checkpoint
    out = tmp_path / "view" / "depths.html"
    rc = main(
        [
            "generate",
            "--model",
            str(folder),
            "--prompt",
            "hello",
            "--max-new-tokens",
            "10",
            "--chat",
            "--show-depths",
            "--html",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    m = re.search(r"mean depth d̄ = ([0-9.]+) over (\d+) tokens \(max depth D = 3\)", printed)
    assert m, printed
    tok = char_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    ref = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    d = ref.depths[0][ref.depths[0] > 0].float()
    assert float(m.group(1)) == pytest.approx(d.mean().item(), abs=0.005) and int(m.group(2)) == d.numel()
    assert "FLOPs vs fixed depth 3" in printed
    html = out.read_text()
    assert html.count('class="tok d') == d.numel()


@pytest.mark.parametrize(
    "args",
    [
        ["--depth", "2"],
        ["--exit", "kl", "--threshold", "0.05"],
        ["--exit", "state", "--threshold", "0.2", "--taps"],
        ["--sample", "--seed", "1"],
    ],
)
def test_exit_options(checkpoint, capsys, args):
    folder, _ = checkpoint
    rc = main(["generate", "--model", str(folder), "--prompt", "ab", "--max-new-tokens", "4", "--show-depths", *args])
    assert rc == 0
    printed = capsys.readouterr().out
    if args[:2] == ["--depth", "2"]:
        assert "mean depth d̄ = 2.00" in printed


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--exit", "kl"], "needs --threshold"),
        (["--threshold", "0.1"], "applies to --exit kl"),
        (["--depth", "7"], "must lie in 1..3"),
    ],
)
def test_bad_options(checkpoint, capsys, args, msg):
    folder, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "ab", *args]) == 2
    assert msg in capsys.readouterr().err


def test_depth_and_exit_are_exclusive(checkpoint):
    folder, _ = checkpoint
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--prompt", "ab", "--depth", "1", "--exit", "kl"])


def test_base_model_generates_at_depth_one(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "ab", "--max-new-tokens", "3", "--show-depths"]) == 0
    assert "mean depth d̄ = 1.00 over 3 tokens (max depth D = 1)" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny-llama", "--prompt", "ab", "--depth", "2"]) == 2


def test_bench_runs_the_decode_benchmark(tmp_path, capsys):
    """``retrofit bench`` on a toy shape: the JSON has the four figures (their values are not tested)."""
    import json

    out = tmp_path / "bench.json"
    tiny = (
        "--layers 2 --batch 2 --new-tokens 3 --repeats 1 --large-batch 0 --vocab 200 --hidden 64 "
        "--intermediate 128 --heads 4 --kv-heads 2 --prompt 3"
    )
    assert main(["bench", "--out", str(out), "--args", tiny]) == 0
    r = json.loads(out.read_text())
    assert {"fixed_depth", "mixed_depth", "depth1_vs_base"} <= set(r["decode"])
    assert r["decode"]["depth1_vs_base"]["same_tokens"] is True
    assert r["kv_bytes"]["core_bytes_ratio"] == pytest.approx(r["kv_bytes"]["executed_share"])
