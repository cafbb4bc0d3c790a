"""Durable, validated checkpoints (issue 10, item 3).

Fault injection on real Trainer checkpoints: a 0-byte ``optimizer.pt``, a truncated
``model.safetensors``, a truncated ``trainer_state.json``, a corrupt ``scheduler.pt``, and a training
process killed (SIGKILL) in the middle of a save. Each time the broken checkpoint is skipped with a
warning naming why, and resuming falls back to the previous one and reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from sft_setup import LOGGED_RUN, addition_rows, sft_config

import retrofit
from retrofit.hub import atomic_io as A
from retrofit.testing import char_tokenizer, tiny_base
from retrofit.training import RetrofitSFTTrainer
from retrofit.training.checkpointing import (
    InvalidCheckpointError,
    atomic_dir,
    checkpoint_problems,
    last_checkpoint,
    safetensors_header,
    write_json_atomic,
)

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_trainer(out, max_steps=4, seed=0):
    torch.manual_seed(seed)
    model = retrofit.convert(tiny_base("llama", seed=seed), retrofit.LoopConfig(max_depth=2, method="fixed"))
    ds = addition_rows(8)
    run = dict(max_steps=max_steps, learning_rate=3e-3, lr_scheduler_type="linear", **LOGGED_RUN)
    args = sft_config(out, save_strategy="steps", save_steps=2, **run)
    return RetrofitSFTTrainer(model, args, train_dataset=ds, processing_class=char_tokenizer())


def losses(tr) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in tr.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 uninterrupted steps, checkpoints at 2 and 4; returns (folder, per-step losses)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    tr = make_trainer(out)
    tr.train()
    return out, losses(tr)


def copy_run(run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run[0], dst)
    return dst


# ------------------------------------------------------------------------------------------------
# fault injection, then resume
# ------------------------------------------------------------------------------------------------
def _zero_optimizer(c: Path):
    (c / "optimizer.pt").write_bytes(b"")


def _truncate_weights(c: Path):
    p = c / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _truncate_state(c: Path):
    p = c / "trainer_state.json"
    p.write_text(p.read_text()[:40])


def _corrupt_scheduler(c: Path):
    p = c / "scheduler.pt"
    b = bytearray(p.read_bytes())
    i = b.index(b"data.pkl") + 60  # inside the pickle's stored bytes
    b[i] ^= 0xFF
    p.write_bytes(bytes(b))


@pytest.mark.parametrize(
    "damage, why",
    [
        (_zero_optimizer, "optimizer.pt is empty (0 bytes)"),
        (_truncate_weights, "model.safetensors is truncated"),
        (_truncate_state, "trainer_state.json is not valid JSON"),
        (_corrupt_scheduler, "scheduler.pt is corrupt"),
    ],
)
def test_broken_last_checkpoint_is_skipped_and_resume_falls_back(run, tmp_path, caplog, damage, why):
    out = copy_run(run, tmp_path)
    damage(out / "checkpoint-4")
    problems = checkpoint_problems(out / "checkpoint-4")
    assert any(why in p for p in problems), problems
    assert checkpoint_problems(out / "checkpoint-2") == []
    with caplog.at_level(logging.WARNING, logger="retrofit.training.checkpointing"):
        assert last_checkpoint(out) == str(out / "checkpoint-2")
    assert any("skipping checkpoint" in r.message and why in r.message for r in caplog.records), caplog.text

    # an explicit broken path is a one-line error naming why and the valid alternative
    with pytest.raises(
        InvalidCheckpointError,
        match=f"cannot resume from .*checkpoint-4: .*{why.split()[0]}"
        ".*newest valid checkpoint next to it is .*checkpoint-2",
    ):
        make_trainer(out).train(resume_from_checkpoint=str(out / "checkpoint-4"))

    # resume_from_checkpoint=True falls back to checkpoint-2 and repeats steps 3-4 exactly
    tr = make_trainer(out, seed=1)  # another init: the weights must come from the checkpoint
    tr.train(resume_from_checkpoint=True)
    got, want = losses(tr), run[1]  # steps 1-2 come from checkpoint-2's history, 3-4 are recomputed
    assert sorted(got) == [1, 2, 3, 4]
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7), (s, got, want)
    assert checkpoint_problems(out / "checkpoint-4") == []  # rewritten whole


def test_no_valid_checkpoint_is_a_clear_error(run, tmp_path):
    out = copy_run(run, tmp_path)
    for c in ("checkpoint-2", "checkpoint-4"):
        _zero_optimizer(out / c)
    assert last_checkpoint(out) is None
    with pytest.raises(InvalidCheckpointError, match="no valid checkpoint-N folder to resume from"):
        make_trainer(out).train(resume_from_checkpoint=True)


@pytest.mark.integration
def test_kill_during_save_leaves_the_previous_checkpoint_valid(run, tmp_path):
    """A training process is SIGKILLed while writing checkpoint-4 (weights written, optimizer not yet)."""
    out = tmp_path / "killed"
    flag = tmp_path / "saving"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]  # this file, sft_setup
        from test_reliability_checkpoints import make_trainer
        tr = make_trainer({str(out)!r})
        orig = tr._save_optimizer_and_scheduler
        def slow(output_dir):
            if tr.state.global_step == 4:
                open({str(flag)!r}, "w").close()
                time.sleep(600)  # killed here, mid-save
            return orig(output_dir)
        tr._save_optimizer_and_scheduler = slow
        tr.train()
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not flag.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "the child never reached the save"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "checkpoint-4").exists()
    assert (out / ".staging-checkpoint-4" / "checkpoint-4" / "model.safetensors").is_file()  # the partial save
    assert last_checkpoint(out) == str(out / "checkpoint-2")
    tr = make_trainer(out, seed=1)  # clears the staging folder, resumes, repeats steps 3-4 exactly
    assert not (out / ".staging-checkpoint-4").exists()
    tr.train(resume_from_checkpoint=True)
    got = losses(tr)
    assert sorted(got) == [1, 2, 3, 4]
    for s in got:
        assert got[s] == pytest.approx(run[1][s], rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------
# durability: fsync every file, then rename, then fsync the directory
# ------------------------------------------------------------------------------------------------
def test_commit_fsyncs_files_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    events = []
    real_rename = os.rename
    monkeypatch.setattr(A, "fsync_file", lambda p: events.append(("file", Path(p).name)))
    monkeypatch.setattr(A, "_fsync_dir", lambda p: events.append(("dir", Path(p).name)))
    monkeypatch.setattr(
        A.os, "rename", lambda a, b: (events.append(("rename", Path(a).name, Path(b).name)), real_rename(a, b))
    )
    with atomic_dir(tmp_path / "final") as tmp:
        (tmp / "a.bin").write_bytes(b"1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.json").write_text("{}")
    names = [e[0] for e in events]
    rename = names.index("rename")
    assert {e[1] for e in events[:rename] if e[0] == "file"} == {"a.bin", "b.json"}
    assert ("dir", "sub") in events[:rename] and ("dir", ".staging-final") in events[:rename]
    assert events[rename] == ("rename", ".staging-final", "final")
    assert ("dir", tmp_path.name) in events[rename + 1 :]  # the rename itself made durable


def test_write_json_atomic_never_leaves_a_partial_file(tmp_path, monkeypatch):
    p = tmp_path / "final" / "retrofit_eval.json"
    write_json_atomic(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json_atomic(p, {"a": object()})  # unserializable: nothing written
    monkeypatch.setattr(A.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_json_atomic(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [q.name for q in p.parent.iterdir()] == ["retrofit_eval.json"]  # no temporary file left


# ------------------------------------------------------------------------------------------------
# safetensors validation against the file (brute force: the safetensors library itself)
# ------------------------------------------------------------------------------------------------
def test_safetensors_header_checks_agree_with_the_library(tmp_path):
    from safetensors.torch import load_file

    p = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3, 5), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.arange(6)}, str(p))
    good = p.read_bytes()
    assert set(safetensors_header(p)) >= {"a", "b", "c"}
    cases = {
        "empty": b"",
        "truncated": good[:-1],
        "header only": good[: 8 + int.from_bytes(good[:8], "little")],
        "trailing": good + b"\x00" * 4,
        "garbage": b"\xff" * 64,
        "bad json": good[:8] + b"[" + good[9:],
    }
    for data in cases.values():
        p.write_bytes(data)
        with pytest.raises(InvalidCheckpointError):
            safetensors_header(p)
        with pytest.raises(Exception):  # noqa: B017 (the library rejects what we reject)
            load_file(str(p))
    p.write_bytes(good)
    assert set(load_file(str(p))) == {"a", "b", "c"}


def test_a_truncated_eval_file_does_not_break_export(tmp_path, caplog):
    """final/retrofit_eval.json cut short (a non-atomic write interrupted): export warns and leaves it out."""
    from retrofit.hub.export import export

    torch.manual_seed(0)
    m = retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(max_depth=2))
    ckpt = tmp_path / "final"
    m.save_pretrained(ckpt)
    char_tokenizer().save_pretrained(ckpt)
    full = json.dumps({"models": {"looped": {"tasks": {"mano": {"levels": {"1": {"accuracy": 0.5, "n": 4}}}}}}})
    (ckpt / "retrofit_eval.json").write_text(full[: len(full) // 2])
    with caplog.at_level(logging.WARNING, logger="retrofit.hub.export"):
        out = export(ckpt, tmp_path / "exp")
    assert (out / "model.safetensors").is_file() and not (out / "retrofit_eval.json").exists()
    assert "retrofit_eval.json" in caplog.text and "not valid JSON" in caplog.text
    # written whole (write_json_atomic), the same file is used for the card and copied
    write_json_atomic(ckpt / "retrofit_eval.json", json.loads(full))
    out = export(ckpt, tmp_path / "exp2")
    assert json.loads((out / "retrofit_eval.json").read_text()) == json.loads(full)
