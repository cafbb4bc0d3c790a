"""Data-parallel parity (``-m integration``): the same global batch on 2 CPU processes under DDP, FSDP2 and DeepSpeed
ZeRO-3 gives the same losses, TaH2 cutoffs κ and label counts, and (within a measured tolerance) the same weights as
one process; and resuming from ``checkpoint-2`` in a fresh launch reproduces the uninterrupted run under each engine.

The runs come from ``tests/dp_harness.py`` (its docstring: what it trains, how each engine is launched, what it
records), five launches per module, each started the first time a test needs it:

- one process, every method (the reference);
- ``torchrun --standalone --nproc_per_node 2 … --engine ddp,fsdp2``: DDP, then FSDP2 (accelerate driven into its
  FSDP2 path on the CPU, ``retrofit.training.fsdp2_cpu``), every method;
- ``accelerate launch --config_file launch/zero3.yaml --num_processes 2 …``: ZeRO-3, every method;
- the same two 2-process launches again, resuming TaH2 (M = 3) and Ouro from their ``checkpoint-2``.

Methods: the fixed loop (the control: no halting decision, so any difference is the harness's or the engine's),
TaH2 with M = 2 and M = 3, Ouro (Stage I: its loss is normalized by ``num_items_in_batch``). Three AdamW steps at
lr 1e-3, 4 rows per step (2 per process), rows of different lengths.

Tolerances, measured (2 CPU processes vs 1, torch 2.13 CPU, gloo) and set a few times above:

- the loss at step 0: relative 1e-6 (measured ≤ 1.1e-7 for every method and engine; TaH2's next-token part
  1.3e-7);
- every step's logged loss, next-token loss, auxiliary loss and gradient norm: relative 1e-5 (measured ≤ 1.1e-7 for
  the fixed loop and Ouro);
- κ: relative 1e-4 against the one-process κ, on every rank (measured 1.6e-5: the gains are differences of per-token
  losses, each off by ~1e-7 relative); label counts: exact;
- the final weights: max |Δ| ≤ 5e-6 over every parameter (measured 8.3e-7 for the fixed loop under each engine,
  ≤ 8.9e-7 for Ouro: float reassociation of the reductions, after AdamW's first steps);
- resume: measured bitwise equal (losses, records and weights) under every engine; checked with the same
  tolerances.

TaH2 gathers κ's inputs over the ranks (``LoopConfig.kappa_gather``) and divides its decider loss by the global
``num_items_in_batch`` (``decider_loss_scope="global"``), as the authors' release does; before it did (κ per
process and micro-batch, the loss over the process's own labelled tokens) these tests measured a step-0 κ of
0.0143 and 0.0021 on the two ranks against 0.0021 on one process, and weights 4.4e-3 (M = 2) / 3.1e-3 (M = 3) apart.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import dp_harness as H
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.data_parallel]

ENGINES = ("ddp", "fsdp2", "zero3")
METHODS = tuple(H.METHODS)  # fixed, tah2_m2, tah2_m3, ouro
RESUMED = ("tah2_m3", "ouro")

LOSS_STEP0_RTOL = 1e-6
STEP_RTOL = 1e-5
KAPPA_RTOL = 1e-4
WEIGHTS_ATOL = 5e-6
#: TaH2's decider weights: AdamW divides each gradient by its own running RMS, so a decider gradient that is tiny
#: carries its float noise (the ranks' per-token losses differ from one process's in the 7th digit) into the update
#: at the learning rate's scale (measured 5.7e-6 to 7.2e-6 after 3 steps, against 4.4e-3 before κ was gathered)
WEIGHTS_ATOL_TAH2 = 2e-5

#: (accelerator type, the trained model's wrapper, an FSDP2 module, LoopConfig.fixed_graph) per engine
ENGINE_TYPES = {
    "ddp": ("DistributedType.MULTI_CPU", "DistributedDataParallel", False, False),
    "fsdp2": ("DistributedType.FSDP", "FSDPLoopedLlamaForCausalLM", True, True),
    "zero3": ("DistributedType.DEEPSPEED", "DeepSpeedEngine", False, True),
}


def cases(methods=METHODS, engines=ENGINES):
    return [pytest.param(e, m, id=f"{e}-{m}") for e in engines for m in methods]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(prefix: list[str], args: list[str], timeout: int = 600) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),  # the subprocesses import this checkout's retrofit
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [*prefix, "tests/dp_harness.py", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    )


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def zero3_launch() -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "launch/zero3.yaml",
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--num_cpu_threads_per_process",
        "1",
        "--main_process_port",
        str(_free_port()),
    ]


class Runs:
    """The module's launches, each run once, the first time a test asks for one of its engines."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[str, BaseException | None] = {}

    def _ensure(self, key: str, launch) -> None:
        if key not in self.done:
            try:
                launch()
                self.done[key] = None
            except BaseException as err:  # noqa: BLE001  (re-raised for every test that needs this launch)
                self.done[key] = err
        if self.done[key] is not None:
            raise self.done[key]

    def reference(self, method: str) -> dict:
        self._ensure("none", lambda: _launch([sys.executable], ["--out", str(self.root / "straight")]))
        return H.load(self.root / "straight", "none", method)

    def run(self, engine: str, method: str) -> dict:
        if engine == "zero3":
            args = ["--engine", "zero3", "--out", str(self.root / "straight")]
            self._ensure("zero3", lambda: _launch(zero3_launch(), args))
        else:
            args = ["--engine", "ddp,fsdp2", "--out", str(self.root / "straight")]
            self._ensure("torchrun", lambda: _launch(torchrun(), args))
        return H.load(self.root / "straight", engine, method)

    def resumed(self, engine: str, method: str) -> dict:
        self.run(engine, method)  # the checkpoint to resume from
        out = ["--out", str(self.root / "resumed"), "--resume_from", str(self.root / "straight")]
        methods = ["--methods", ",".join(RESUMED)]
        if engine == "zero3":
            self._ensure("zero3_resumed", lambda: _launch(zero3_launch(), ["--engine", "zero3", *out, *methods]))
        else:
            self._ensure("torchrun_resumed", lambda: _launch(torchrun(), ["--engine", "ddp,fsdp2", *out, *methods]))
        return H.load(self.root / "resumed", engine, method)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("dp"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ------------------------------------------------------------------------------------------------
# 2 processes vs 1
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, method", cases())
def test_same_rows_and_first_step_next_token_loss(runs, engine, method):
    """The engine is the one named (DDP / FSDP2 / ZeRO-3 on 2 processes, the loop's depth fixed under the sharded
    two); every step the two ranks together hold the one process's rows, in its order; at step 0 (same weights) the
    next-token loss summed over ranks equals one process's, and TaH2's decisions (which do not read κ) are the same."""
    ref, run = runs.reference(method), runs.run(engine, method)
    # the engine that ran is the one named: DDP's wrapper, FSDP2's sharded module, DeepSpeed's engine
    assert (run["world_size"], ref["world_size"]) == (2, 1)
    assert (run["distributed_type"], run["wrapped"], run["fsdp_module"], run["fixed_graph"]) == ENGINE_TYPES[engine]
    a, b = H.global_steps(run), H.global_steps(ref)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in b:
        assert a[step]["rows"] == b[step]["rows"], step
        assert len(run["records"][step]["ranks"]) == 2
    assert _rel(a[0]["ntp"], b[0]["ntp"]) <= LOSS_STEP0_RTOL, (a[0]["ntp"], b[0]["ntp"])
    if "decisions" in b[0]:
        assert a[0]["decisions"] == b[0]["decisions"] > 0


@pytest.mark.parametrize("engine, method", cases())
def test_zero3_padding_was_poisoned(runs, engine, method):
    """The harness's NaN in ZeRO-3's shard padding (``dp_harness._poison_zero3_padding``) reached a shard: Ouro's
    1-element gate bias pads rank 1's shard; the other methods' parameters all have even sizes; the other engines
    have no shards. The run trained and saved ``checkpoint-2`` anyway (every other test here reads it)."""
    padded = sum(runs.run(engine, method)["poisoned_padding"])
    assert padded == (1 if (engine, method) == ("zero3", "ouro") else 0)


@pytest.mark.parametrize("engine, method", cases())
def test_first_step_loss(runs, engine, method):
    """The logged loss at step 0 (next-token + the method's auxiliary loss). TaH2's auxiliary loss reads κ."""
    ref, run = H.logged(runs.reference(method)), H.logged(runs.run(engine, method))
    assert _rel(run[0]["loss"], ref[0]["loss"]) <= LOSS_STEP0_RTOL, (run[0]["loss"], ref[0]["loss"])


@pytest.mark.parametrize("engine, method", cases())
def test_every_step_losses(runs, engine, method):
    """Every step's logged loss and gradient norm, next-token loss and auxiliary loss."""
    d = H.differences(runs.run(engine, method), runs.reference(method))
    worst = {k: d[k] for k in ("loss", "ntp", "aux", "grad_norm") if k in d}
    assert max(worst.values()) <= STEP_RTOL, worst


@pytest.mark.parametrize("engine, method", cases(methods=("tah2_m2", "tah2_m3")))
def test_every_step_kappa_and_labels(runs, engine, method):
    """Every rank's κ is the whole batch's; the "continue" labels and the decisions, summed over ranks, are the
    one process's."""
    a, b = H.global_steps(runs.run(engine, method)), H.global_steps(runs.reference(method))
    for step in b:
        (kappa,) = b[step]["kappa"]
        assert all(_rel(k, kappa) <= KAPPA_RTOL for k in a[step]["kappa"]), (step, a[step]["kappa"], kappa)
        assert (a[step]["positives"], a[step]["decisions"]) == (b[step]["positives"], b[step]["decisions"]), step


@pytest.mark.parametrize("engine, method", cases())
def test_final_weights(runs, engine, method):
    """The full state dict after 3 steps (gathered under FSDP2 / ZeRO-3) against one process's."""
    d = H.differences(runs.run(engine, method), runs.reference(method))
    assert d["weights"] <= (WEIGHTS_ATOL_TAH2 if method.startswith("tah2") else WEIGHTS_ATOL), d


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, method", cases(methods=RESUMED))
def test_resume_reproduces_the_uninterrupted_run(runs, engine, method):
    """3 steps straight vs 2 steps, then a fresh launch resuming from ``checkpoint-2`` (weights, optimizer,
    scheduler, RNG; under ZeRO-3 the DeepSpeed engine checkpoint, under FSDP2 accelerate's): step 3 sees the same
    rows and gives the same losses (and κ, label counts) on every rank, and the same final weights."""
    straight, resumed = runs.run(engine, method), runs.resumed(engine, method)
    assert resumed["resumed_from"].endswith(f"{engine}/{method}/run/checkpoint-2")
    assert [r["step"] for r in resumed["records"]] == [2]
    a, b = H.global_steps(resumed)[2], H.global_steps(straight)[2]
    assert a["rows"] == b["rows"]
    for ra, rb in zip(resumed["records"][0]["ranks"], straight["records"][2]["ranks"]):
        for key in ("ntp", "loss"):
            assert _rel(ra[key], rb[key]) <= STEP_RTOL, (key, ra[key], rb[key])
        for key in ("kappa", "decisions", "positives"):
            if key in rb["metrics"]:
                assert ra["metrics"][key] == pytest.approx(rb["metrics"][key], rel=KAPPA_RTOL), key
    la, lb = H.logged(resumed), H.logged(straight)
    assert sorted(la) == sorted(lb) == [0, 1, 2]
    assert all(_rel(la[s]["loss"], lb[s]["loss"]) <= STEP_RTOL for s in la), (la, lb)
    d = H.differences(resumed, straight)
    assert d["weights"] <= WEIGHTS_ATOL, d
