"""End-to-end: every recipe runs a few steps on a tiny random model through ``accelerate launch``
(``-m integration``). One recipe also runs on 2 CPU processes with DeepSpeed ZeRO-2, and the main
recipe is resumed from a checkpoint and must reproduce the uninterrupted loss trajectory.

Timing: ~20 s per launch on 2 idle cores. The first ZeRO-2 run on a fresh machine also
JIT-compiles DeepSpeed's shared-memory communication op once (~3 min, cached in
``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retrofit.training.checkpointing import assert_safetensors_only

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

# short sequences, a few steps, no evaluation: each run is seconds of training
COMMON = [
    "--per_device_train_batch_size",
    "4",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--eval_strategy",
    "no",
    "--max_length",
    "48",
    "--activation_checkpointing",
    "false",
    "--dataloader_num_workers",
    "0",
    "--disable_tqdm",
    "true",
    "--control",
    "",  # the main job's preset trains an SFT control and reports; tests/recipe/test_controls.py covers them
    "--report",
    "false",
]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    """Prompt/answer rows, plus one empty completion and one row too long for --max_length."""
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rows += [{"prompt": "1+1=", "answer": ""}, {"prompt": "9" * 80, "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def launch(config: str, recipe: str, args: list[str], extra_launch: list[str] = (), timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    # the recipe's own folder (recipes/) heads its sys.path, not the repository: without this a checkout other than
    # the installed one (a git worktree) would run the installed retrofit in the launched processes
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"launch/{config}",
        "--num_cpu_threads_per_process",
        "1",
        *extra_launch,
        f"recipes/{recipe}",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def logged(ckpt: Path) -> dict[int, dict]:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return {h["step"]: h for h in state["log_history"] if "loss" in h}


def check_run(out: Path, steps: int, adapter=False):
    final = out / "final"
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    assert (final / weights).exists(), sorted(p.name for p in final.iterdir())
    assert_safetensors_only(final)
    logs = logged(out / f"checkpoint-{steps}")
    assert sorted(logs) == list(range(1, steps + 1))
    for h in logs.values():
        assert torch.isfinite(torch.tensor(h["loss"]))
        assert h["mean_depth"] >= 1.0
    report = json.loads((out / "data_report.json").read_text())
    assert report["train_rows"]["empty_completion"] == 1
    assert report["train"]["too_long"] == 1
    return logs


def tah2_args(rows_file, out):
    # the preset loops SmolLM2's layers 20-25; the 6-layer tiny model gets a split that fits
    return [
        "--model",
        "tiny-llama",
        "--data_file",
        str(rows_file),
        "--output_dir",
        str(out),
        "--prelude",
        "1",
        "--core",
        "4",
        "--freeze_prelude",
        "true",
        "--lora",
        "false",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--save_total_limit",
        "3",
        "--learning_rate",
        "3e-3",
        *COMMON,
    ]


@pytest.fixture(scope="module")
def tah2_run(tmp_path_factory, rows_file):
    """The main recipe, 4 steps on one CPU process, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("tah2") / "run"
    launch("cpu.yaml", "tah2_llama.py", tah2_args(rows_file, out))
    return out


def test_tah2_llama_runs_and_resumes(tmp_path, rows_file, tah2_run):
    """Drop checkpoint-4 of the 4-step run, --resume from checkpoint-2: steps 3–4 repeat exactly."""
    full = check_run(tah2_run, 4)
    assert "decider_loss" in full[1] and "kappa" in full[1]
    out = tmp_path / "tah2"
    shutil.copytree(tah2_run, out)
    args = tah2_args(rows_file, out)
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "final")
    launch("cpu.yaml", "tah2_llama.py", [*args, "--resume", "true"])
    resumed = logged(out / "checkpoint-4")
    for step in (3, 4):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-5), (step, resumed, full)
    assert (out / "final" / "model.safetensors").exists()


def test_tah2_qwen3_lora_saves_adapter_and_merged_model(tmp_path, rows_file):
    out = tmp_path / "tah2q"
    launch(
        "cpu.yaml",
        "tah2_qwen3.py",
        [
            "--model",
            "tiny-qwen3",
            "--data_file",
            str(rows_file),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--save_steps",
            "3",
            "--lora",
            "true",
            "--lora_r",
            "4",
            "--learning_rate",
            "1e-2",
            *COMMON,
        ],
    )
    check_run(out, 3, adapter=True)
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    import retrofit
    from retrofit.testing import tiny_base

    loop = AutoConfig.from_pretrained(out / "final-merged").loop_config
    assert loop.method == "tah2" and loop.max_depth == 2
    adapter = PeftModel.from_pretrained(retrofit.convert(tiny_base("qwen3"), loop), out / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged").eval()
    ids = torch.randint(4, 104, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, m = adapter(input_ids=ids), merged(input_ids=ids)
    torch.testing.assert_close(m.logits, a.logits, atol=1e-5, rtol=1e-5)
    base = retrofit.convert(tiny_base("qwen3"), loop).eval()
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, a.logits, atol=1e-3)  # training changed it


def test_anira_llama_online(tmp_path, rows_file):
    out = tmp_path / "anira"
    launch(
        "cpu.yaml",
        "anira_llama.py",
        [
            "--model",
            "tiny-llama",
            "--method",
            "anira-o",
            "--prelude",
            "1",
            "--core",
            "4",
            "--max_depth",
            "3",
            "--data_file",
            str(rows_file),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--save_steps",
            "3",
            "--gamma",
            "0.1",
            "--depth_warmup_steps",  # the CPU preset trains every depth first for 80 steps; ANIRA from the start here
            "0",
            "--lora",  # the CPU preset trains LoRA adapters; full fine-tuning here
            "false",
            *COMMON,
        ],
    )
    logs = check_run(out, 3)
    assert "kl_prior" in logs[1] and "depth_frac_3" in logs[1]
    from transformers import AutoConfig

    loop = AutoConfig.from_pretrained(out / "final").loop_config
    assert (loop.method, loop.prelude, loop.core, loop.max_depth) == ("anira-o", 1, 4, 3)


def test_anira_fsdp2_two_cpu_processes(tmp_path, rows_file):
    """``launch/fsdp2.yaml`` on 2 CPU processes: FSDP2 for real (accelerate's CPU fallback to DDP is overridden by
    ``RetrofitSFTTrainer``, retrofit.training.fsdp2_cpu), with ANIRA-O, whose sampled depths differ from rank to rank:
    the recipe unrolls every depth (a rank that ran the core fewer times would leave the others' all-gathers
    waiting), saves FSDP checkpoints and gathers the final model. Parity with one process:
    tests/training/test_data_parallel.py."""
    out = tmp_path / "fsdp2"
    common = [a if a != "4" else "2" for a in COMMON]  # per-device batch 2
    args = [
        "--model",
        "tiny-llama",
        "--method",
        "anira-o",
        "--prelude",
        "1",
        "--core",
        "4",
        "--max_depth",
        "3",
        "--data_file",
        str(rows_file),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--save_steps",
        "3",
        "--depth_warmup_steps",
        "0",
        "--lora",
        "false",
        "--use_cpu",
        "true",
        *common,
    ]
    launch("fsdp2.yaml", "anira_llama.py", args, extra_launch=["--num_processes", "2", "--mixed_precision", "no"])
    check_run(out, 3)
    assert (out / "checkpoint-3" / "pytorch_model_fsdp.bin").exists()  # an FSDP checkpoint, not DDP's
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(out / "final").loop_config.fixed_graph is True
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # the gathered full state dict loads
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_ouro_llama_two_stages(tmp_path, rows_file):
    """Ouro's recipe: Stage I for 2 steps, then Stage II (the gate alone, ``--decider_phase_from 2``); its options
    are flags made from its Options dataclass and land in the checkpoint's ``loop.options``."""
    out = tmp_path / "ouro"
    launch(
        "cpu.yaml",
        "ouro_llama.py",
        [
            "--model",
            "tiny-llama",
            "--prelude",
            "0",
            "--core",
            "null",
            "--max_depth",
            "3",
            "--exit_q",
            "0.7",
            "--entropy_beta",
            "0.1",
            "--data_file",
            str(rows_file),
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--save_steps",
            "4",
            "--decider_phase_from",
            "2",
            "--freeze_prelude",
            "false",
            "--lora",
            "false",
            *COMMON,
        ],
    )
    logs = check_run(out, 4)
    assert logs[1]["mean_depth"] == 3.0 and "gate_loss" not in logs[1] and "gate_loss" in logs[3]
    from transformers import AutoConfig

    loop = AutoConfig.from_pretrained(out / "final").loop_config
    assert loop.method == "ouro" and loop.options["exit_q"] == 0.7 and loop.options["entropy_beta"] == 0.1


def test_fixed_loop_random_depth_truncated(tmp_path, rows_file):
    out = tmp_path / "fixed"
    launch(
        "cpu.yaml",
        "fixed_loop.py",
        [
            "--model",
            "tiny-llama",
            "--max_depth",
            "3",
            "--random_depth",
            "true",
            "--truncate_backprop",
            "1",
            "--data_file",
            str(rows_file),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--save_steps",
            "3",
            *COMMON,
        ],
    )
    logs = check_run(out, 3)
    assert all(h["mean_depth"] in (1.0, 2.0, 3.0) for h in logs.values())  # one depth per batch


def test_tah2_llama_zero2_two_cpu_processes(tmp_path, rows_file, tah2_run):
    """ZeRO-2 on 2 CPU processes × batch 2 sees the same 4 rows as 1 process × batch 4 at step 1."""
    out = tmp_path / "z2"
    common = [a if a != "4" else "2" for a in COMMON]  # per-device batch 2
    args = [
        "--model",
        "tiny-llama",
        "--data_file",
        str(rows_file),
        "--output_dir",
        str(out),
        "--prelude",
        "1",
        "--core",
        "4",
        "--freeze_prelude",
        "true",
        "--lora",
        "false",
        "--max_steps",
        "3",
        "--save_steps",
        "3",
        "--use_cpu",
        "true",
        *common,
    ]
    launch("zero2.yaml", "tah2_llama.py", args, extra_launch=["--num_processes", "2", "--mixed_precision", "no"])
    logs = check_run(out, 3)
    assert (out / "checkpoint-3" / "latest").exists()  # a DeepSpeed engine checkpoint
    # every rank must use the same parameters each step (ZeRO's bucketed reductions): the loop unrolls every depth
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "final").loop_config.fixed_graph is True
    one = logged(tah2_run / "checkpoint-2")  # same seed and data, before any update
    assert logs[1]["ntp_loss"] == pytest.approx(one[1]["ntp_loss"], rel=1e-4)


def test_zero3_sets_fixed_graph_and_gathers_the_final_model(tmp_path, rows_file):
    """ZeRO-3 on 2 CPU processes: the recipe detects stage 3 and unrolls a fixed graph."""
    out = tmp_path / "z3"
    common = [a if a != "4" else "2" for a in COMMON]
    args = [
        "--model",
        "tiny-llama",
        "--data_file",
        str(rows_file),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--use_cpu",
        "true",
        *common,
    ]
    launch("zero3.yaml", "fixed_loop.py", args, extra_launch=["--num_processes", "2", "--mixed_precision", "no"])
    check_run(out, 2)
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(out / "final").loop_config.fixed_graph is True
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # the gathered 16-bit save loads
    assert all(torch.isfinite(p).all() for p in model.parameters())
