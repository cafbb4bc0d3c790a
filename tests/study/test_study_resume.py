"""``retrofit study`` on a tiny study (tiny-llama, 3 optimizer steps per trial; 2 learning rates x 3 arms, then
2 seeds x 3 arms: 12 trials): it runs, it resumes after a failure mid-trial and after a killed process with the
same study.json, it resumes from the result JSONs alone, and its numbers are the engine's and the statistics'
(docs/study.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from retrofit.study import runner as R
from retrofit.study.env import cpu_id
from retrofit.study.trial import bits, run_trial

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

REPO = Path(__file__).resolve().parents[2]

PRESET = """\
model: tiny-llama
prelude: 1
core: 4
max_depth: 2
method: tah2
decider_arch: ffn
decider_top_k: 10
freeze_prelude: true
lora: false
task: mano
train_levels: "1,2"
extrap_levels: "3"
interp_levels: ""
n_train: 8
n_eval: 3
n_valid: 3
chat: "false"
max_length: 32
max_steps: 3
per_device_train_batch_size: 4
logging_steps: 1
heads_lr_scale: 5
activation_checkpointing: false
dataloader_num_workers: 0
identity_check: false
"""

STUDY = """\
name: tiny
preset: tiny_preset.yaml
threads: 1
keep_models: {keep}
tuning: {{seed: 0, learning_rates: [1.0e-3, 3.0e-3]}}
testing:
  seeds: [1, 2]
  eval: {{frontier_stop_shares: [0.5], frontier_random_draws: 2, frontier_rows_per_level: 2, bootstrap_samples: 200}}
arms:
  sft: {{kind: sft}}
  fixed: {{kind: fixed}}
  tah2: {{kind: looped}}
"""
N_TRIALS = 12


def write_study(folder: Path, keep: bool = False, study: str = STUDY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_preset.yaml").write_text(PRESET)
    path = folder / "tiny.yaml"
    path.write_text(study.format(keep=str(keep).lower()))
    return path


class Counting:
    """``run_trial`` that counts its calls and, from call ``fail_at`` on, dies half-way: after the trial's folder
    holds a partial result (as a kill during training leaves it)."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, cfg, trial, folder, progress=True):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "checkpoint-1").mkdir(exist_ok=True)
            raise KeyboardInterrupt(f"killed during {trial.id}")
        return run_trial(cfg, trial, folder, progress=progress)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted study: its folder and its study.json text."""
    root = tmp_path_factory.mktemp("reference")
    cfg = write_study(root / "cfg")
    counting = Counting()
    R.run_study(cfg, root / "out", progress=False, runner=counting)
    assert counting.calls == N_TRIALS
    text = (root / "out" / "study.json").read_text()
    return root / "out", text, json.loads(text)


def _results(out: Path) -> dict[str, dict]:
    from retrofit.hub.atomic_io import read_json

    return {p.parent.name: read_json(p) for p in sorted((out / "trials").glob("*/result.json"))}


def test_a_tiny_study_runs_and_writes_its_files(reference):
    out, text, study = reference
    for name in ("study.json", "study.md", "study.png", "timings.json"):
        assert (out / name).stat().st_size > 0, name
    assert len(_results(out)) == N_TRIALS
    assert str(out) not in text and "wall_s" not in text and "train_s" not in text  # no paths, no times
    assert set(study["tuning"]["arms"]) == {"sft", "fixed", "tah2"}
    for arm, a in study["tuning"]["arms"].items():
        assert [t["lr"] for t in a["trials"]] == [1e-3, 3e-3] and a["chosen_lr"] in (1e-3, 3e-3)
    assert study["testing"]["seeds"] == [1, 2]
    effects = {(e["effect"], e["a"], e["b"]) for e in study["effects"]}
    assert effects >= {
        ("vs_tuned_sft", "tah2", "sft"),
        ("vs_tuned_sft", "fixed", "sft"),
        ("adaptive_vs_fixed", "tah2", "fixed"),
        ("adaptive_vs_fixed_at_equal_flops", "tah2", "fixed"),
        ("decider_vs_random", "tah2", "random"),
        ("decider_vs_oracle", "tah2", "oracle"),
        ("depth_vs_level", "tah2", "level"),
        ("depth_vs_token_loss", "tah2", "sft"),
    }
    assert {k.split(":")[0] for k in study["claims"]} == {
        "beats_tuned_sft",
        "adaptive_not_worse_than_fixed_at_equal_flops",
        "decider_beats_random",
        "depth_follows_difficulty",
    }
    assert len(study["warnings"]) == 2  # 2 learning rates, 2 seeds: a smoke test, and study.md says so
    md = (out / "study.md").read_text()
    assert "a smoke test, not a tuned study" in md and "resamples seeds and rows" in md
    policies = {g["policy"] for g in study["frontier"]["tah2"]}
    assert policies == {"decider", "random", "oracle", "ceiling", "forced"}
    for g in study["frontier"]["tah2"]:
        assert len(g["per_seed"]) == 2 and g["flops_per_token"]["mean"] > 0
    env = study["environment"]
    assert env["cpus"] and env["torch"] and env["threads_per_trial"] == [1]
    assert env.get("cpu_ids") == ([cpu_id()] if cpu_id() else None)


def test_the_cpu_id_names_family_model_stepping_and_isa():
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\n"
    amd += "stepping\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nvendor_id\t: Other\n"
    assert cpu_id(amd) == "AuthenticAMD family 23 model 49 stepping 0, AVX2"
    assert cpu_id(amd.replace("avx2", "avx2 avx512f avx512bw")).endswith(", AVX-512")
    assert cpu_id("processor\t: 0\nmodel name\t: a phone\n") is None  # no family: nothing to say


def test_tuning_and_testing_rows_are_disjoint_and_test_runs_use_the_chosen_rate(reference):
    out, _, study = reference
    res = _results(out)
    tune = {k: r for k, r in res.items() if k.startswith("tune-")}
    test = {k: r for k, r in res.items() if k.startswith("test-")}
    assert {r["rows"]["split"] for r in tune.values()} == {"valid"}
    assert {r["rows"]["split"] for r in test.values()} == {"test"}
    assert {r["rows"]["answers"] for r in tune.values()}.isdisjoint({r["rows"]["answers"] for r in test.values()})
    assert len({r["rows"]["answers"] for r in test.values()}) == 1  # every arm and seed on the same test rows
    for k, r in test.items():
        assert r["trial"]["lr"] == study["tuning"]["arms"][r["trial"]["arm"]]["chosen_lr"]
        assert r["seed"] in (1, 2) and "frontier" in r and ("depth" in r["tokens"]) == (r["trial"]["kind"] != "sft")


def test_the_effects_are_the_statistics_of_the_result_jsons(reference):
    """Brute force from the result JSONs: per seed the McNemar counts and differences, across seeds the mean, and
    the per-example Spearman equal to the engine's own figure."""
    from retrofit.evaluation.stats import mcnemar_exact, spearman

    out, _, study = reference
    res = _results(out)

    def test_result(arm, seed):
        return next(
            r for r in res.values() if r["trial"]["phase"] == "test" and r["trial"]["arm"] == arm and r["seed"] == seed
        )

    for e in study["effects"]:
        if e["effect"] == "vs_tuned_sft":
            diffs = []
            for p in e["per_seed"]:
                a, b = bits(test_result(e["a"], p["seed"])["correct"]), bits(test_result(e["b"], p["seed"])["correct"])
                assert (p["a_only"], p["b_only"]) == (int((a & ~b).sum()), int((~a & b).sum()))
                assert p["mcnemar_p"] == mcnemar_exact(p["a_only"], p["b_only"])
                assert p["difference"] == pytest.approx(a.mean() - b.mean())
                diffs.append(a.mean() - b.mean())
            assert e["across_seeds"]["estimate"] == pytest.approx(np.mean(diffs))
            assert e["across_seeds"]["signs"] == [int(np.sign(d)) for d in diffs]
        if e["effect"] == "depth_vs_level":
            for p in e["per_seed"]:
                r = test_result(e["a"], p["seed"])
                d = [np.mean([int(c) for c in x]) for x in r["tokens"]["depth"]]
                engine = r["depth_difficulty_spearman"]
                ours = spearman(r["rows"]["levels"], d)
                assert (engine is None and ours != ours) or engine == pytest.approx(ours)
                assert (p["spearman"] is None and ours != ours) or p["spearman"] == pytest.approx(ours)


def test_resume_after_a_failure_mid_trial_gives_the_same_study_json(reference, tmp_path):
    _, text, _ = reference
    cfg = write_study(tmp_path / "cfg")
    dying = Counting(fail_at=6)
    with pytest.raises(KeyboardInterrupt, match="killed during"):
        R.run_study(cfg, tmp_path / "out", progress=False, runner=dying)
    assert len(_results(tmp_path / "out")) == 5 and not (tmp_path / "out" / "study.json").exists()
    again = Counting()
    R.run_study(cfg, tmp_path / "out", progress=False, runner=again)
    assert again.calls == N_TRIALS - 5  # the partial trial runs again from the start, the finished ones do not
    assert (tmp_path / "out" / "study.json").read_text() == text


def test_resume_from_the_result_jsons_alone(reference, tmp_path):
    """A study with its checkpoints (keep_models: true) copied as its result JSONs only: nothing trains, and the
    same study.json; the kept test checkpoint re-evaluated by the engine gives the result's row outcomes."""
    import torch
    from transformers import AutoModelForCausalLM

    from retrofit.evaluation.options import EvalOptions
    from retrofit.evaluation.task_eval import evaluate_task_arrays
    from retrofit.recipe.data import task_splits
    from retrofit.recipe.main_job import test_rows
    from retrofit.study.config import load_study
    from retrofit.study.trial import parse_trial_args
    from retrofit.testing import char_tokenizer

    _, text, study = reference
    kept = tmp_path / "kept"
    R.run_study(write_study(tmp_path / "cfg-keep", keep=True), kept, progress=False)
    assert (kept / "study.json").read_text() == text  # keeping the models changes no number
    lr = study["tuning"]["arms"]["sft"]["chosen_lr"]
    folder = kept / "trials" / f"test-sft-lr{lr:.3g}-s2"
    assert (folder / "control-sft" / "final" / "model.safetensors").exists()
    # the result JSON is the engine's: the saved SFT model evaluated again on the test rows
    cfg = load_study(tmp_path / "cfg-keep" / "tiny.yaml")
    script, _, _ = parse_trial_args(cfg.arm("sft"), lr, 2, folder)
    rows, train_levels = test_rows(script, task_splits(script))
    model = AutoModelForCausalLM.from_pretrained(folder / "control-sft" / "final").eval()
    opts = EvalOptions(**cfg.test_eval, progress=False)
    with torch.no_grad():
        _, arrays = evaluate_task_arrays(
            model, char_tokenizer(), "mano", rows=rows, train_levels=train_levels, options=opts
        )
    assert "".join("1" if c else "0" for c in arrays.correct) == _results(kept)[folder.name]["correct"]

    alone = tmp_path / "alone"
    for p in kept.glob("trials/*/result.json"):
        (alone / p.parent.relative_to(kept)).mkdir(parents=True)
        shutil.copy(p, alone / p.relative_to(kept))
    never = Counting(fail_at=1)
    R.run_study(write_study(tmp_path / "cfg"), alone, progress=False, runner=never)
    assert never.calls == 0 and (alone / "study.json").read_text() == text


def test_a_changed_config_stops_instead_of_mixing_results(reference, tmp_path):
    from retrofit.model.errors import RetrofitUserError

    out, text, _ = reference
    copy = tmp_path / "out"
    shutil.copytree(out / "trials", copy / "trials")
    cfg = write_study(tmp_path / "cfg")  # the same study file ...
    (tmp_path / "cfg" / "tiny_preset.yaml").write_text("# a comment changes no setting\n" + PRESET)
    R.run_study(cfg, copy, progress=False, runner=Counting(fail_at=1))
    assert (copy / "study.json").read_text() == text
    # ... nor does a preset value every trial overrides (the learning rate: the main job may change its own)
    (tmp_path / "cfg" / "tiny_preset.yaml").write_text(PRESET + "learning_rate: 0.5\nseed: 7\n")
    R.run_study(cfg, copy, progress=False, runner=Counting(fail_at=1))
    assert (copy / "study.json").read_text() == text
    (tmp_path / "cfg" / "tiny_preset.yaml").write_text(PRESET.replace("heads_lr_scale: 5", "heads_lr_scale: 6"))
    with pytest.raises(RetrofitUserError, match="holds a result of other settings"):
        R.run_study(cfg, copy, progress=False, runner=Counting(fail_at=1))  # ... over a changed preset


@pytest.mark.integration
def test_a_killed_process_resumes_with_two_jobs_to_the_same_study_json(reference, tmp_path):
    """``retrofit study --jobs 2`` in a subprocess, killed once a few trials are done; the same command again
    finishes the study with the same study.json as the uninterrupted in-process run (the thread count is the
    config's, so two one-thread workers give the numbers of one sequential run)."""
    _, text, _ = reference
    cfg = write_study(tmp_path / "cfg")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "retrofit.cli", "study", str(cfg), "--out", str(out), "--jobs", "2", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 300
    while len(list(out.glob("trials/*/result.json"))) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the study and its workers, mid-trial
    proc.wait(timeout=60)
    done = len(list(out.glob("trials/*/result.json")))
    assert 3 <= done < N_TRIALS and not (out / "study.json").exists()
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "study.json").read_text() == text
    # --quiet with workers: the claims on stdout, the config's warnings on stderr, and none of the libraries' chatter
    # (progress bars, the trainer's printed logs, DeepSpeed's CPU fallback warning: trial.quiet_libraries)
    claims = again.stdout.splitlines()
    assert claims and all(line.startswith(("[met] ", "[NOT met] ")) for line in claims), again.stdout[-2000:]
    assert again.stderr.splitlines() == [
        "tiny.yaml: 2 learning rate(s) per arm (< 3): a smoke test, not a tuned study",
        "tiny.yaml: 2 test seed(s) (< 3): the across-seed intervals are not a result",
    ], again.stderr[-2000:]


def test_finished_only_reports_the_whole_seeds_that_have_finished(reference, tmp_path):
    """``--finished-only`` runs nothing: with every trial there it writes the study's own study.json; with the last
    seed missing for one arm it reports the first seed alone, says so, and gives that seed's figures; without the
    tuning it refuses."""
    from retrofit.model.errors import RetrofitUserError

    out, text, study = reference
    cfg = write_study(tmp_path / "cfg")
    whole = tmp_path / "whole"
    shutil.copytree(out / "trials", whole / "trials")
    R.report_finished(cfg, whole)
    assert (whole / "study.json").read_text() == text

    part = tmp_path / "part"
    shutil.copytree(out / "trials", part / "trials")
    lr = study["tuning"]["arms"]["tah2"]["chosen_lr"]
    shutil.rmtree(part / "trials" / f"test-tah2-lr{lr:.3g}-s2")
    got = R.report_finished(cfg, part)
    assert got["testing"]["seeds"] == [1] and any("partial" in w for w in got["warnings"])
    assert "partial" in (part / "study.md").read_text()
    for arm, a in got["testing"]["arms"].items():
        assert a["per_seed"] == study["testing"]["arms"][arm]["per_seed"][:1]

    (none := tmp_path / "none").mkdir()
    with pytest.raises(RetrofitUserError, match="needs every tuning trial finished"):
        R.report_finished(cfg, none)


def test_the_readme_block_is_written_between_its_markers_from_the_study(reference, tmp_path, capsys):
    """``--readme FILE``: the tables between the two markers are ``readme_markdown`` of the study it wrote (paths
    relative to the README), the text around them untouched; a README without the markers is refused and left as
    it was; the study's own markers (``readme_markers``), where a README has them, are written instead."""
    from retrofit.cli import main
    from retrofit.study.report import README_BEGIN, README_END, readme_markdown, readme_markers

    out, text, study = reference
    cfg = write_study(tmp_path / "cfg")
    shutil.copytree(out / "trials", tmp_path / "res" / "trials")
    readme = tmp_path / "README.md"
    readme.write_text(f"# intro\n\n{README_BEGIN}\nold tables\n{README_END}\n\n**What it shows.** kept\n")
    assert main(["study", str(cfg), "--out", str(tmp_path / "res"), "--finished-only", "--readme", str(readme)]) == 0
    got = readme.read_text()
    block = readme_markdown(study, "cfg/tiny.yaml", "res")
    assert got == f"# intro\n\n{README_BEGIN}\n{block}\n{README_END}\n\n**What it shows.** kept\n"
    assert "| vs_tuned_sft | fixed vs sft |" in block and "(res/study.png)" in block and "old tables" not in got

    bare = tmp_path / "bare.md"
    bare.write_text("# no markers\n")
    capsys.readouterr()
    assert main(["study", str(cfg), "--out", str(tmp_path / "res"), "--finished-only", "--readme", str(bare)]) == 2
    assert "needs the lines <!-- study:begin -->" in capsys.readouterr().err and bare.read_text() == "# no markers\n"

    # a README showing two studies: the study's own markers win over the default study's, which stay as they were
    begin, end = readme_markers(study["name"])
    two = tmp_path / "two.md"
    two.write_text(f"{README_BEGIN}\ndefault\n{README_END}\n\n{begin}\nold\n{end}\n")
    assert main(["study", str(cfg), "--out", str(tmp_path / "res"), "--finished-only", "--readme", str(two)]) == 0
    block = readme_markdown(study, "cfg/tiny.yaml", "res")
    assert two.read_text() == f"{README_BEGIN}\ndefault\n{README_END}\n\n{begin}\n{block}\n{end}\n"


def test_a_part_run_first_is_resumed_into_the_whole_study(reference, tmp_path):
    """``--arms sft,tah2 --seeds 1`` runs those arms' tuning and seed 1 only, and its report says what it leaves
    out; the whole study after it, into the same folder, needs only the rest and writes the uninterrupted
    study.json."""
    out, text, study = reference
    cfg = write_study(tmp_path / "cfg")
    first = Counting()
    part = R.run_study(cfg, tmp_path / "out", progress=False, runner=first, arms=["sft", "tah2"], seeds=[1])
    assert first.calls == 2 * 2 + 2
    assert any("leaves out arm(s) fixed and test seed(s) 2" in w for w in part["warnings"])
    assert "leaves out arm(s) fixed" in (tmp_path / "out" / "study.md").read_text()
    for arm in ("sft", "tah2"):
        assert part["testing"]["arms"][arm]["per_seed"] == study["testing"]["arms"][arm]["per_seed"][:1]
    # the rest: the uninterrupted study's own trials (running them again would give these bytes: the resume tests)
    todo = sorted(set(_results(out)) - set(_results(tmp_path / "out")))
    assert len(todo) == N_TRIALS - first.calls
    for trial in todo:
        shutil.copytree(out / "trials" / trial, tmp_path / "out" / "trials" / trial)
    R.run_study(cfg, tmp_path / "out", progress=False, runner=Counting(fail_at=1))
    assert (tmp_path / "out" / "study.json").read_text() == text


def test_a_second_tuning_seed_runs_only_its_trials_and_chooses_by_the_mean(reference, tmp_path):
    """The reference study's trials plus a second tuning seed: the study runs the new seed's tuning trials (and a
    test trial only where the choice moved), and each arm's choice is the rate with the best mean validation
    accuracy over the two seeds' result JSONs (brute force; ties as the rule: lower mean loss, smaller rate)."""
    out, _, _ = reference
    cfg = write_study(tmp_path / "cfg", study=STUDY.replace("{{seed: 0,", "{{seeds: [0, 5],"))
    shutil.copytree(out / "trials", tmp_path / "out" / "trials")
    counting = Counting()
    study = R.run_study(cfg, tmp_path / "out", progress=False, runner=counting, arms=["sft"], seeds=[1])
    res = _results(tmp_path / "out")
    assert {k for k in res if k.endswith("-s5")} == {"tune-sft-lr0.001-s5", "tune-sft-lr0.003-s5"}
    t = study["tuning"]
    assert t["seeds"] == [0, 5] and "seed" not in t
    mean = {
        lr: (
            np.mean([res[f"tune-sft-lr{lr:.3g}-s{s}"]["accuracy"] for s in (0, 5)]),
            np.mean([res[f"tune-sft-lr{lr:.3g}-s{s}"]["mean_token_nll"] for s in (0, 5)]),
        )
        for lr in (1e-3, 3e-3)
    }
    best = min(mean, key=lambda lr: (-mean[lr][0], mean[lr][1], lr))
    assert t["arms"]["sft"]["chosen_lr"] == best and study["testing"]["arms"]["sft"]["lr"] == best
    moved = best != reference[2]["tuning"]["arms"]["sft"]["chosen_lr"]
    assert counting.calls == 2 + moved  # the seed-0 trials and the test trial at an unchanged rate were reused
    md = (tmp_path / "out" / "study.md").read_text()
    assert "seeds 0, 5 (each rate: the mean over them)" in md


def test_a_study_reuses_the_trials_of_another_folder_with_the_same_key(reference, tmp_path):
    """A study file's ``reuse: [FOLDER]``: the trials that folder holds with this study's keys count as done and
    nothing is copied; one whose key differs there is run here; study.json is the reference's plus the list of
    what it read where; ``--dry-run`` says where each trial is; ``--no-reuse`` runs everything; a folder that is not
    a study's is an error naming the key."""
    from retrofit.model.errors import RetrofitUserError

    out, text, study = reference
    other = tmp_path / "other"
    shutil.copytree(out / "trials", other / "trials")
    lr = study["tuning"]["arms"]["fixed"]["chosen_lr"]
    changed = f"test-fixed-lr{lr:.3g}-s1"
    r = json.loads((other / "trials" / changed / "result.json").read_text())
    (other / "trials" / changed / "result.json").write_text(json.dumps({**r, "key": "another setting"}))
    cfg = write_study(tmp_path / "cfg", study=STUDY + "reuse: [../other]\n")
    here = tmp_path / "here"

    rows = dict(R.plan(cfg, here))
    assert rows[changed] == "to run" and sum(s == "done in other" for s in rows.values()) == N_TRIALS - 1
    assert set(dict(R.plan(cfg, here, reuse=False)).values()) <= {"to run", "after its tuning"}

    counting = Counting()
    got = R.run_study(cfg, here, progress=False, runner=counting)
    assert counting.calls == 1 and [p.parent.name for p in here.glob("trials/*/result.json")] == [changed]
    reused = got["reused"]
    assert list(reused) == ["other"] and sorted(reused["other"] + [changed]) == sorted(_results(out))
    written = json.loads((here / "study.json").read_text())
    assert written.pop("reused") == reused and written == study  # the same figures
    assert "11 from `other`" in (here / "study.md").read_text()
    # the trial that ran here is this folder's from now on; the report of the finished trials agrees
    assert R.report_finished(cfg, here)["reused"] == reused

    (tmp_path / "cfg" / "tiny.yaml").write_text(STUDY.format(keep="false") + "reuse: [../nowhere]\n")
    with pytest.raises(RetrofitUserError, match="reuse: .*nowhere is not a study folder"):
        R.plan(cfg, here)
    assert "after its tuning" in dict(R.plan(cfg, here, reuse=False)).values()  # --no-reuse never looks there
    (tmp_path / "cfg" / "tiny.yaml").write_text(STUDY.format(keep="false") + "reuse: ../other\n")
    with pytest.raises(RetrofitUserError, match="reuse must be a list of study folders"):
        R.plan(cfg, here)
