"""Bad input ends in one line naming the input and the fix, exit code 2, no traceback (issue 10, item 4).

The issue's table, row by row: ``retrofit generate`` / ``convert`` / ``export`` / ``eval`` with
broken models and prompts, every malformed ``--data_file`` and every bad ``LoopConfig`` in the
recipes. In-process through ``retrofit.cli.main`` / ``retrofit.model.errors.run_cli`` (the same code the
console script and the recipes' ``__main__`` run); a few subprocess checks (``-m integration``) show
the real process: exit code, no traceback, the traceback with ``RETROFIT_DEBUG=1``, and a recipe
under ``accelerate launch``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import retrofit
from retrofit.cli import main
from retrofit.model.errors import RetrofitUserError, format_error, run_cli
from retrofit.testing import char_tokenizer, tiny_base

REPO = Path(__file__).resolve().parents[2]


def one_error_line(err: str) -> str:
    """The single ``error:`` line of ``err``; fails on a traceback or several error lines."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    import gguf

    w = gguf.GGUFWriter(str(d / "tiny.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    good = (d / "tiny.gguf").read_bytes()
    (d / "truncated.gguf").write_bytes(good[: len(good) - 100])
    (d / "random.gguf").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    torch.manual_seed(0)
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(prelude=1, core=3, max_depth=2))
    m.save_pretrained(d / "no_tokenizer")
    m.save_pretrained(d / "corrupt")
    char_tokenizer().save_pretrained(d / "corrupt")
    st = d / "corrupt" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    return d


def cli(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    return one_error_line(captured.err)


CLI_CASES = [
    # (id, argv with {d} = the files folder, what the line must say)
    (
        "generate-missing-model",
        ["generate", "--model", "{d}/nope/model", "--prompt", "hi"],
        "model not found: {d}/nope/model",
    ),
    ("generate-random-gguf", ["generate", "--model", "{d}/random.gguf", "--prompt", "hi"], "is not a GGUF file"),
    (
        "generate-truncated-gguf",
        ["generate", "--model", "{d}/truncated.gguf", "--prompt", "hi"],
        "truncated.gguf is truncated: its tensors need",
    ),
    ("generate-empty-prompt", ["generate", "--model", "tiny-llama", "--prompt", ""], "--prompt is empty"),
    ("generate-blank-prompt", ["generate", "--model", "tiny-llama", "--prompt", "  \n "], "--prompt is empty"),
    (
        "generate-non-utf8-prompt",
        ["generate", "--model", "tiny-llama", "--prompt", "ab\udcffc"],
        "not valid UTF-8 (undecodable byte 0xff at position 2)",
    ),
    (
        "generate-too-long-prompt",
        ["generate", "--model", "tiny-llama", "--prompt", "x" * 600],
        "the model's context is 512",
    ),
    (
        "generate-corrupt-safetensors",
        ["generate", "--model", "{d}/corrupt", "--prompt", "hi"],
        "model.safetensors is truncated",
    ),
    ("convert-missing-model", ["convert", "--model", "{d}/missing", "--out", "{d}/o1"], "model not found"),
    ("convert-truncated-gguf", ["convert", "--model", "{d}/truncated.gguf", "--out", "{d}/o2"], "is truncated"),
    ("convert-random-gguf", ["convert", "--model", "{d}/random.gguf", "--out", "{d}/o3"], "is not a GGUF file"),
    (
        "convert-max-depth",
        ["convert", "--model", "tiny-llama", "--max-depth", "1000000", "--out", "{d}/o4"],
        "above the limit of 64",
    ),
    ("export-corrupt-safetensors", ["export", "{d}/corrupt", "--out", "{d}/o5"], "model.safetensors is truncated"),
    ("export-missing", ["export", "{d}/nope", "--out", "{d}/o6"], "checkpoint folder not found"),
    (
        "eval-no-tokenizer",
        ["eval", "--model", "{d}/no_tokenizer", "--out", "{d}/o7", "--n", "1"],
        "has no tokenizer files",
    ),
    ("eval-corrupt-safetensors", ["eval", "--model", "{d}/corrupt", "--out", "{d}/o8", "--n", "1"], "is truncated"),
    (
        "generate-zero-new-tokens",
        ["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0"],
        "--max-new-tokens must be >= 1",
    ),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(files, capsys, argv, needle):
    argv = [a.replace("{d}", str(files)) for a in argv]
    line = cli(capsys, argv)
    assert needle.replace("{d}", str(files)) in line, line
    assert not any(Path(a).exists() for a in argv if "/o" in a and a.startswith(str(files) + "/o"))  # nothing written


def test_no_tokenizer_names_the_real_cause(files, capsys):
    line = cli(capsys, ["eval", "--model", str(files / "no_tokenizer"), "--out", str(files / "ev"), "--n", "1"])
    assert "sentencepiece" not in line and "tokenizer.save_pretrained" in line


def test_truncate_flag_keeps_the_prompt_tail(capsys):
    assert (
        main(["generate", "--model", "tiny-llama", "--prompt", "x" * 600, "--max-new-tokens", "2", "--truncate"]) == 0
    )
    assert "dropped the first 90 of 600 prompt tokens" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# recipes: every malformed --data_file and every bad LoopConfig
# ------------------------------------------------------------------------------------------------
def recipe(name):
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", REPO / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tah2():
    return recipe("tah2_llama")


TINY = [
    "--model",
    "tiny-llama",
    "--prelude",
    "1",
    "--core",
    "4",
    "--report",
    "false",
    "--control",
    "",
    "--lora",
    "false",
    "--report_to",
    "none",
    "--max_steps",
    "1",
    "--per_device_train_batch_size",
    "2",
    "--activation_checkpointing",
    "false",
]

DATA_FILES = [
    ("malformed.json", b'[{"prompt": "1+1=", "answer": "2"},', "invalid JSON"),
    ("malformed.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "malformed.jsonl:2: invalid JSON"),
    ("latin1.jsonl", '{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    (
        "mixed.jsonl",
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4}\n',
        "field 'answer' is a number here but a string in line 1",
    ),
    ("arrays.json", b'[["1+1=", "2"], ["2+2=", "4"]]', "a row must be a JSON object"),
    ("arrays.jsonl", b'["1+1=", "2"]\n', "arrays.jsonl:1: a row must be a JSON object"),
    ("empty.jsonl", b"", "no rows (the file is empty)"),
    ("no_columns.jsonl", b'{"question": "1+1=", "reply": "2"}\n', "lacks column(s)"),
    ("missing.jsonl", None, "no such file"),
]


@pytest.mark.parametrize("name, data, needle", DATA_FILES, ids=[d[0] for d in DATA_FILES])
def test_recipe_bad_data_file_is_one_line(tah2, tmp_path, capsys, name, data, needle):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    rc = run_cli(tah2.main, [*TINY, "--data_file", str(path), "--output_dir", str(tmp_path / "out")])
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert needle in line and line.startswith("error: "), line


LOOP_CASES = [
    (["--max_depth", "0"], "max_depth must be an integer >= 1"),
    (["--max_depth", "1000000"], "max_depth=1000000 is above the limit of 64"),
    (["--prelude", "40"], "prelude=40 leaves no layer to loop"),
    (["--prelude", "2", "--core", "9"], "exceeds the model's 6 layers"),
    (["--core", "0"], "core must be None"),
    (["--exit_threshold", "1.5"], "exit_threshold must be a number strictly between 0 and 1"),
    (["--train_decisions", "coin"], "tah2 options: train_decisions must be one of threshold, sample"),
    (["--decider_top_k", "-1"], "decider_top_k must be None (the hidden size) or an integer >= 0"),
    (["--updater_hidden", "-4"], "updater_hidden must be None or a positive integer"),
    (["--kappa_scope", "global"], "kappa_scope must be one of per-boundary, pooled"),
    (["--decider_loss_scope", "rank"], "decider_loss_scope must be one of global, local"),
]


@pytest.mark.parametrize("extra, needle", LOOP_CASES, ids=[" ".join(c[0]) for c in LOOP_CASES])
def test_recipe_bad_loop_config_is_one_line(tah2, tmp_path, capsys, extra, needle):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    rc = run_cli(tah2.main, [*TINY, "--data_file", str(rows), "--output_dir", str(tmp_path / "out"), *extra])
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert needle in line, line
    assert not (tmp_path / "out" / "final").exists()


def test_recipe_bad_config_file_is_one_line(tah2, tmp_path, capsys):
    """A preset that is missing or is not YAML ends in one line with the file and the place, before anything runs."""
    bad = tmp_path / "preset.yaml"
    bad.write_text("learning_rate: 1.0e-3\nnote: two stages: then the decider\n")
    for argv, needle in (
        (["--config", str(bad)], f"--config {bad} is not valid YAML at line 2, column 17: mapping values"),
        ([f"--config={tmp_path / 'none.yaml'}"], f"--config {tmp_path / 'none.yaml'} does not exist"),
    ):
        rc = run_cli(tah2.main, [*argv, "--output_dir", str(tmp_path / "out")])
        assert rc == 2
        line = one_error_line(capsys.readouterr().err)
        assert needle in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, extra, needle",
    [
        ("anira_llama", ["--method", "anira-x"], "--method must be anira-e or anira-o, got 'anira-x'"),
        (
            "anira_llama",
            ["--method", "anira-o", "--halt_threshold", "0"],
            "halt_threshold must be a number strictly between 0 and 1",
        ),
        ("anira_llama", ["--halt_threshold", "0.3"], "halt_threshold is an option of method anira-o, not of 'anira-e'"),
        ("fixed_loop", ["--max_depth", "65"], "above the limit of 64"),
        ("tah2_qwen3", ["--max_depth", "-1"], "max_depth must be an integer >= 1"),
    ],
)
def test_other_recipes_report_bad_loop_configs_the_same_way(tmp_path, capsys, name, extra, needle):
    mod = recipe(name)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    model = "tiny-qwen3" if "qwen3" in name else "tiny-llama"
    rc = run_cli(
        mod.main,
        [
            "--model",
            model,
            "--prelude",
            "1",
            "--core",
            "4",
            "--data_file",
            str(rows),
            "--output_dir",
            str(tmp_path / "o"),
            "--report_to",
            "none",
            *extra,
        ],
    )
    assert rc == 2
    assert needle in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------
# run_cli itself
# ------------------------------------------------------------------------------------------------
def test_run_cli_contract(capsys, monkeypatch):
    class Bad(RetrofitUserError):
        pass

    def raises(exc):
        def f():
            raise exc

        return f

    assert run_cli(lambda: None) == 0 and run_cli(lambda: 3) == 3
    assert run_cli(raises(Bad("the thing\nis   wrong"))) == 2
    assert capsys.readouterr().err == "error: the thing is wrong\n"
    assert run_cli(raises(SystemExit("error: old style message"))) == 2
    assert capsys.readouterr().err == "error: old style message\n"
    with pytest.raises(SystemExit) as e:  # argparse's own exits pass through
        run_cli(raises(SystemExit(2)))
    assert e.value.code == 2
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(raises(KeyError("bug")))
    monkeypatch.setenv("RETROFIT_DEBUG", "1")
    assert run_cli(raises(Bad("shown with its traceback"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("error: shown with its traceback\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert format_error(Bad("x")) == "[rank 1] error: x"


# ------------------------------------------------------------------------------------------------
# real processes
# ------------------------------------------------------------------------------------------------
def _env(**kw):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("RETROFIT_DEBUG", None)
    env.update(kw)
    return env


@pytest.mark.integration
def test_the_retrofit_command_exits_2_without_a_traceback(files):
    cmd = [sys.executable, "-m", "retrofit.cli", "generate", "--model", str(files / "nope"), "--prompt", b"caf\xe9"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, timeout=300, check=False)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert one_error_line(err) == err.rstrip("\n").splitlines()[-1]
    assert "--prompt is not valid UTF-8 (undecodable byte 0xe9 at position 3)" in err  # checked before the model
    debug = subprocess.run(cmd, cwd=REPO, env=_env(RETROFIT_DEBUG="1"), capture_output=True, timeout=300, check=False)
    derr = debug.stderr.decode("utf-8", "replace")
    assert debug.returncode == 2 and "Traceback" in derr and derr.rstrip("\n").splitlines()[-1].startswith("error: ")


@pytest.mark.integration
def test_a_recipe_exits_2_without_a_traceback_directly_and_under_accelerate(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3, ')
    args = [*TINY, "--data_file", str(bad), "--output_dir", str(tmp_path / "o")]
    direct = subprocess.run(
        [sys.executable, "recipes/tah2_llama.py", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert direct.returncode == 2, direct.stderr[-3000:]
    line = one_error_line(direct.stderr)
    assert line == direct.stderr.rstrip("\n").splitlines()[-1] and "bad.jsonl:2: invalid JSON" in line
    # accelerate's single-process launcher reports a failed child itself: a CalledProcessError
    # traceback, or with -q/--quiet nothing more and exit 1 (retrofit.model.errors explains)
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "-q",
            "--config_file",
            "launch/cpu.yaml",
            "--num_cpu_threads_per_process",
            "1",
            "recipes/tah2_llama.py",
            *args,
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert launched.returncode != 0
    assert one_error_line(launched.stderr) == line
