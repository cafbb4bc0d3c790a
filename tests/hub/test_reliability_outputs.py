"""Outputs never overlap inputs, and --overwrite never deletes what retrofit did not write (issue 10, item 1).

Every data-loss case of the issue is replayed and the source is checked byte for byte afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from sft_setup import sft_config

import retrofit
from retrofit.cli import main
from retrofit.hub.export import ExportError, export_model, push_to_hub
from retrofit.hub.output_paths import (
    MARKER,
    OutputTargetError,
    check_output_folder,
    relation,
    run_folder_of,
    written_by_retrofit,
)
from retrofit.testing import char_tokenizer, tiny_base


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> sha256 (the folder's exact contents)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def looped():
    torch.manual_seed(0)
    return retrofit.convert(tiny_base("llama"), retrofit.LoopConfig(prelude=1, core=3, max_depth=2, method="tah2"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run folder as the recipes leave it: checkpoint-50/, final/, runs/, data_report.json."""
    run = tmp_path_factory.mktemp("outputs") / "tah2_llama"
    m, tok = looped(), char_tokenizer()
    for name in ("checkpoint-50", "final"):
        m.save_pretrained(run / name)
        tok.save_pretrained(run / name)
    (run / "checkpoint-50" / "trainer_state.json").write_text(json.dumps({"global_step": 50}))
    (run / "runs").mkdir()
    (run / "runs" / "events.out.tfevents.1").write_bytes(b"\x00tensorboard")
    (run / "data_report.json").write_text("{}")
    return run


def refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------
# the data-loss cases, through the CLI
# ------------------------------------------------------------------------------------------------
def test_export_out_is_the_run_folder_with_overwrite(run_dir, capsys):
    """The issue: `export run/final --out run --overwrite` deleted the whole run and exited 0."""
    before = snapshot(run_dir)
    refused(
        capsys,
        ["export", str(run_dir / "final"), "--out", str(run_dir), "--overwrite"],
        "the training run folder",
        str(run_dir / "export"),
    )
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("out", ["final", "final/sub", "final/../final", "."])
def test_export_out_is_or_is_inside_the_checkpoint(run_dir, capsys, out):
    before = snapshot(run_dir)
    target = os.path.join(str(run_dir), out)
    line = refused(capsys, ["export", str(run_dir / "final"), "--out", target, "--overwrite"], str(run_dir))
    assert any(w in line for w in ("is the input", "lies inside the input", "the training run folder"))
    assert snapshot(run_dir) == before


def test_export_from_the_run_folder_protects_every_checkpoint(run_dir, capsys):
    """CKPT = the run folder (its latest checkpoint is exported): --out may not be anything in it."""
    before = snapshot(run_dir)
    refused(
        capsys,
        ["export", str(run_dir), "--out", str(run_dir / "checkpoint-50"), "--overwrite"],
        "lies inside the input",
    )
    assert snapshot(run_dir) == before


def test_overwrite_never_replaces_a_folder_retrofit_did_not_write(run_dir, tmp_path, capsys):
    """A sibling of the source (another checkpoint) is not an input, but it is not ours to delete."""
    work = tmp_path / "run"
    import shutil

    shutil.copytree(run_dir, work)
    before = snapshot(work)
    refused(
        capsys,
        ["export", str(work / "final"), "--out", str(work / "checkpoint-50"), "--overwrite"],
        "only an empty folder or one written by retrofit",
        MARKER,
    )
    refused(capsys, ["export", str(work / "final"), "--out", str(work / "runs"), "--overwrite"], "holds other files")
    assert snapshot(work) == before
    # a new folder inside the run (the main job's own layout) is fine, and so is replacing it later
    assert main(["export", str(work / "final"), "--out", str(work / "export")]) == 0
    assert (work / "export" / MARKER).is_file() and written_by_retrofit(work / "export")
    first = snapshot(work / "export")
    assert main(["export", str(work / "final"), "--out", str(work / "export"), "--overwrite"]) == 0
    assert set(snapshot(work / "export")) == set(first)
    assert {k: v for k, v in snapshot(work).items() if not k.startswith("export/")} == before


def test_convert_out_is_the_model(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_base("llama").save_pretrained(base)
    char_tokenizer().save_pretrained(base)
    before = snapshot(base)
    refused(capsys, ["convert", "--model", str(base), "--out", str(base), "--overwrite"], "is the input")
    refused(capsys, ["convert", "--model", str(base), "--out", str(tmp_path), "--overwrite"], "contains the input")
    refused(capsys, ["convert", "--model", str(base), "--out", str(base / "looped")], "lies inside the input")
    assert snapshot(base) == before
    assert main(["convert", "--model", str(base), "--out", str(tmp_path / "looped")]) == 0
    assert snapshot(base) == before


def test_eval_and_generate_outputs_may_not_land_in_the_model(run_dir, capsys):
    before = snapshot(run_dir)
    refused(
        capsys, ["eval", "--model", str(run_dir / "final"), "--out", str(run_dir / "final"), "--n", "1"], "is the input"
    )
    refused(
        capsys,
        [
            "generate",
            "--model",
            str(run_dir / "final"),
            "--prompt",
            "ab",
            "--html",
            str(run_dir / "final" / "config.json"),
        ],
        "lies inside the input",
    )
    assert snapshot(run_dir) == before


# ------------------------------------------------------------------------------------------------
# the library functions
# ------------------------------------------------------------------------------------------------
def test_relation_resolves_symlinks_and_dots(tmp_path):
    src = tmp_path / "a" / "ckpt"
    src.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert relation(tmp_path / "link" / "ckpt", src) == "is"
    assert relation(tmp_path / "link", src) == "contains"
    assert relation(src / ".." / "ckpt" / "x", src) == "lies inside"
    assert relation(tmp_path / "a" / "ckpt2", src) is None  # a shared prefix is not containment
    assert run_folder_of(src) is None
    (tmp_path / "a" / "checkpoint-3").mkdir()
    assert run_folder_of(src) == (tmp_path / "a").resolve()
    assert run_folder_of(tmp_path / "b" / "final") == (tmp_path / "b").resolve()


def test_export_model_checks_its_source_too(run_dir):
    m = looped()
    before = snapshot(run_dir)
    with pytest.raises(ExportError, match="the training run folder"):
        export_model(m, run_dir, source=run_dir / "final", overwrite=True)
    assert snapshot(run_dir) == before


def test_written_by_retrofit_recognises_exports_made_before_the_marker(tmp_path):
    m = looped()
    export_model(m, tmp_path / "exp")
    assert written_by_retrofit(tmp_path / "exp")
    (tmp_path / "exp" / MARKER).unlink()
    assert written_by_retrofit(tmp_path / "exp")  # bundled retrofit_*.py + auto_map
    check_output_folder(tmp_path / "exp", overwrite=True)
    (tmp_path / "exp" / "config.json").write_text("{}")
    assert not written_by_retrofit(tmp_path / "exp")
    with pytest.raises(OutputTargetError, match="only an empty folder"):
        check_output_folder(tmp_path / "exp", overwrite=True)
    m.save_pretrained(tmp_path / "plain")  # save_pretrained output is not a retrofit-written folder
    assert not written_by_retrofit(tmp_path / "plain")


def test_push_leaves_the_marker_out(tmp_path):
    calls = {}

    class Api:
        def create_repo(self, *a, **k):
            pass

        def upload_folder(self, **kw):
            calls.update(kw)

    export_model(looped(), tmp_path / "exp")
    push_to_hub(tmp_path / "exp", "me/x", api=Api())
    assert MARKER in calls["ignore_patterns"]


def test_training_output_dir_may_not_contain_the_model_folder(tmp_path):
    """A run writing into (or around) the folder its model came from would rotate or replace it."""
    import datasets

    from retrofit.training import (
        RetrofitSFTTrainer,
        format_sft_dataset,
    )

    src = tmp_path / "models" / "looped"
    looped().save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    before = snapshot(src)
    from retrofit.hub.loading import load_model

    model, tok = load_model(str(src))
    ds, _ = format_sft_dataset(datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}] * 8))
    for out in (tmp_path / "models", src, src / "run"):
        args = sft_config(out, max_steps=1)
        tr = RetrofitSFTTrainer(model, args, train_dataset=ds, processing_class=tok)
        with pytest.raises(OutputTargetError, match="--output_dir .* the model folder"):
            tr.train()
    assert snapshot(src) == before
