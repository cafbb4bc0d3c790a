"""Bounds and the remaining items of issue 10 (items 5 and 6): max_depth has an upper bound, depth
tensors must be integers, decoding memory is estimated (exactly, checked against the real cache)
before allocation, ``retrofit bench`` never runs code from the working directory, and
``recipes/fixed_loop.py``'s documented smoke command runs (periodic evaluation, no eval set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from sft_setup import sft_config

import retrofit
from retrofit import LoopConfig, LoopConfigError
from retrofit.cli import main
from retrofit.model.cache import DepthKVCache
from retrofit.model.config import MAX_DEPTH, DepthError, validate_depth
from retrofit.model.memory import (
    MemoryEstimateError,
    check_generation_memory,
    generation_bytes,
)
from retrofit.testing import char_tokenizer, tiny_base

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# max_depth and depth tensors
# ------------------------------------------------------------------------------------------------
def test_max_depth_has_an_upper_bound():
    assert LoopConfig(max_depth=MAX_DEPTH).max_depth == 64
    for bad in (MAX_DEPTH + 1, 1_000_000):
        with pytest.raises(LoopConfigError, match=rf"max_depth={bad} is above the limit of 64: .*memory and time grow"):
            LoopConfig(max_depth=bad)
    with pytest.raises(LoopConfigError, match="above the limit"):
        LoopConfig.from_dict({"max_depth": 1000})
    for bad in (2.0, True, "3"):
        with pytest.raises(LoopConfigError, match="max_depth must be an integer"):
            LoopConfig(max_depth=bad)


def test_depth_tensors_must_be_integers():
    D, B, T = 3, 2, 4
    with pytest.raises(DepthError, match="integer dtype .* got torch.float32"):
        validate_depth(torch.full((B, T), 1.7), B, T, D)  # used to become 1 silently
    with pytest.raises(DepthError, match="integer dtype"):
        validate_depth(torch.ones(B, T, dtype=torch.bool), B, T, D)
    with pytest.raises(DepthError, match=r"shape \[B, T\]"):
        validate_depth(torch.ones(B, T + 1, dtype=torch.long), B, T, D)
    with pytest.raises(DepthError, match="1..3"):
        validate_depth(torch.full((B, T), 4), B, T, D)
    with pytest.raises(DepthError, match="out of range"):
        validate_depth(0, B, T, D)
    with pytest.raises(DepthError, match="must be None, an int"):
        validate_depth(2.0, B, T, D)
    assert validate_depth(None, B, T, D) is None
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.int8, torch.int32, torch.int64, torch.uint8):
        d = torch.randint(1, D + 1, (B, T), generator=g).to(dtype)
        got = validate_depth(d, B, T, D)
        assert got.dtype == torch.long and torch.equal(got, d.long())
    assert torch.equal(validate_depth(2, B, T, D), torch.full((B, T), 2))


# ------------------------------------------------------------------------------------------------
# memory estimate, checked against the real depth-aware cache
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fixed", "tah2", "anira-o"])
@pytest.mark.parametrize("split", [{"prelude": 1, "core": 3}, {}])
def test_kv_estimate_equals_the_cache_at_full_depth(method, split):
    """Every token at depth D (the estimate's worst case): the estimate is the cache's exact size.

    A forced depth runs no decider (so TaH2 would read out no depth but its last); the decider methods
    reach depth D through their own decider instead, which starts deep (``deep_init_logit``)."""
    torch.manual_seed(0)
    extra = {"options": {"decider_arch": "ffn"}} if method == "tah2" else {}  # the "ffn" decider starts deep too
    loop = LoopConfig(max_depth=3, method=method, deep_init_logit=20.0, **extra, **split)
    m = retrofit.convert(tiny_base("llama"), loop).eval()
    ids = torch.randint(4, 104, (2, 9), generator=torch.Generator().manual_seed(0))
    P, N = 5, 4
    force = {"depth": 3} if method == "fixed" else {}
    cache = DepthKVCache(m.config)
    with torch.no_grad():
        m(ids[:, :P], cache=cache, **force)
        for t in range(P, P + N):
            m(ids[:, t : t + 1], cache=cache, **force)
    assert cache.executed_pairs() == 2 * (P + N) * 3  # every token ran depth D
    est = generation_bytes(m.config, 2, P, N)
    assert est["kv_cache"] == cache.nbytes()
    assert est["logits"] == 2 * P * m.config.vocab_size * 4 * (2 if method == "tah2" else 1)
    # the same formula on a base model: one K/V per layer and position
    base = tiny_base("llama")
    per = 2 * base.config.num_key_value_heads * (base.config.hidden_size // base.config.num_attention_heads) * 4
    assert generation_bytes(base.config, 1, 3, 2)["kv_cache"] == 5 * base.config.num_hidden_layers * per


def test_generation_that_cannot_fit_is_refused_before_allocating(monkeypatch, capsys):
    torch.manual_seed(0)
    m = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=3)).eval()
    est = check_generation_memory(m, 1, 10, 10, free=10**12)
    with pytest.raises(MemoryEstimateError, match=r"needs about .* more than the 1\.0 KiB free"):
        check_generation_memory(m, 1, 10, 10, free=1024)
    assert est["total"] > 1024
    import retrofit.model.memory as mem

    monkeypatch.setattr(mem, "free_memory", lambda device: 4096)
    assert main(["generate", "--model", "tiny-llama", "--prompt", "abc", "--max-new-tokens", "50"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: generating 50 tokens after a 3-token prompt") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# retrofit bench never runs code from the working directory
# ------------------------------------------------------------------------------------------------
def test_bench_never_runs_the_working_directorys_benchmarks(tmp_path, monkeypatch, capsys):
    import retrofit.cli.bench as cb

    sentinel = tmp_path / "executed"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "decode.py").write_text(f"open({str(sentinel)!r}, 'w').close()\ndef main(argv): pass\n")
    monkeypatch.chdir(tmp_path)
    # an installed wheel: the package sits in site-packages, next to no setup.cfg
    wheel = tmp_path / "site-packages" / "retrofit"
    wheel.mkdir(parents=True)
    assert cb.source_checkout(wheel) is None
    with pytest.raises(cb.BenchmarkNotFoundError, match="ship with the source repository only.*pip install -e"):
        cb.find_script("decode", package_dir=wheel)
    monkeypatch.setattr(cb, "source_checkout", lambda package_dir=None: None)
    assert main(["bench", "--quick"]) == 2
    assert "clone the retrofit repository" in capsys.readouterr().err
    assert not sentinel.exists()
    monkeypatch.undo()
    # a source checkout: its own benchmarks folder, wherever the command runs from
    assert cb.find_script("decode") == REPO / "benchmarks" / "decode.py"
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = something-else\n")
    assert cb.source_checkout(tmp_path / "retrofit") is None


# ------------------------------------------------------------------------------------------------
# periodic evaluation without an evaluation set (fixed_loop's documented smoke command)
# ------------------------------------------------------------------------------------------------
def test_eval_strategy_without_an_eval_set_turns_evaluation_off(tmp_path, caplog):
    from retrofit.training import (
        BadDataError,
        RetrofitSFTTrainer,
        format_sft_dataset,
    )

    torch.set_num_threads(1)
    ds, _ = format_sft_dataset(
        datasets.Dataset.from_list([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])
    )
    model = retrofit.convert(tiny_base("llama"), LoopConfig(max_depth=2, method="fixed"))
    kw = dict(max_steps=2, eval_strategy="steps", eval_steps=1)
    tr = RetrofitSFTTrainer(model, sft_config(tmp_path, **kw), train_dataset=ds, processing_class=char_tokenizer())
    assert "turning off periodic evaluation" in caplog.text
    tr.train()
    assert tr.state.global_step == 2 and not any("eval_loss" in h for h in tr.state.log_history)
    with pytest.raises(BadDataError, match="load_best_model_at_end needs an evaluation set"):
        RetrofitSFTTrainer(
            model,
            sft_config(
                tmp_path,
                **kw,
                load_best_model_at_end=True,
                save_strategy="steps",
                save_steps=1,
                metric_for_best_model="loss",
            ),
            train_dataset=ds,
            processing_class=char_tokenizer(),
        )


@pytest.mark.integration
def test_fixed_loop_documented_smoke_command_runs(tmp_path):
    """The command in recipes/fixed_loop.py's docstring, verbatim (plus one thread per process)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(6) for b in range(6))
    )
    doc = (REPO / "recipes" / "fixed_loop.py").read_text()
    assert "--model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/fixed" in doc
    out = tmp_path / "fixed"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "launch/cpu.yaml",
        "--num_cpu_threads_per_process",
        "1",
        "recipes/fixed_loop.py",
        "--model",
        "tiny-llama",
        "--data_file",
        str(rows),
        "--max_steps",
        "3",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "final" / "model.safetensors").is_file()
    assert json.loads((out / "data_report.json").read_text())["train_rows"]["kept"] == 36
