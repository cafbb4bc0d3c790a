"""lm-evaluation-harness integration (retrofit/lm_eval/).

The adapter is checked against slow references (one unpadded forward per request, a token-by-token
greedy loop, retrofit eval's own decoder); the task folders against retrofit eval's rows and budget;
and lm-eval's own command line, run offline on a tiny looped checkpoint, against ``retrofit eval``
(``retrofit.evaluation.evaluate``) on the same rows: accuracy per level and per task, d̄ of the
generated tokens, FLOPs per token and each generated text.
"""

from __future__ import annotations

import glob
import json
import socket

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tiny_looped import mixed_depth_looped

from data_prep.common import first_line
from data_prep.tasks import get_task
from retrofit.evaluation.decoding import greedy_generate
from retrofit.evaluation.options import EvalOptions
from retrofit.evaluation.rows import prepare, task_rows
from retrofit.lm_eval.model import RetrofitLM
from retrofit.lm_eval.tasks import DEFAULT_TASKS, process_results, write_tasks

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


_looped = mixed_depth_looped


@pytest.fixture(scope="module")
def looped():
    return _looped()


POLICIES = {
    "decider": ({}, {}),
    "kl": ({"exit_policy": "kl", "threshold": 0.05}, {"exit_policy": "kl", "exit_threshold": 0.05}),
    "state": ({"exit_policy": "state", "threshold": 0.5}, {"exit_policy": "state", "exit_threshold": 0.5}),
    "depth": ({"exit_policy": "depth", "depth": 2}, {"depth": 2}),
    "decider+taps": ({"step_schedule": "taps"}, {"step_schedule": "taps"}),
}


def _req(kind, args, task):
    return Instance(kind, {}, args, 0, (task, 0, 1))


@torch.no_grad()
def _ref_loglikelihood(model, ids: list[int], n_cont: int, kw: dict):
    """One unpadded forward over ``ids[:-1]``: (sum log p of the last ``n_cont`` ids, greedy, their depths)."""
    out = model(input_ids=torch.tensor([ids[:-1]]), use_cache=False, **kw)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    pos = range(len(ids) - 1 - n_cont, len(ids) - 1)
    score = sum(float(logp[p, ids[p + 1]]) for p in pos)
    greedy = all(int(logp[p].argmax()) == ids[p + 1] for p in pos)
    depths = out.depths[0].tolist() if hasattr(out, "depths") and out.depths is not None else [1] * (len(ids) - 1)
    return score, greedy, [depths[p] for p in pos], depths


# ----------------------------------------------------------------------------------------------
# the adapter against slow references
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_loglikelihood_equals_one_unpadded_forward_per_request(looped, tok, policy):
    lm_kw, fwd_kw = POLICIES[policy]
    lm = RetrofitLM(pretrained=looped, tokenizer=tok, batch_size=3, **lm_kw)
    pairs = [("+ 3 4 =", " 7"), ("ab", "cde"), ("hello world, this is longer", " foo"), ("x", " 12345"), ("", "zq")]
    reqs = [_req("loglikelihood", p, f"t{i}") for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs)
    for i, ((ctx, cont), (score, greedy)) in enumerate(zip(pairs, got)):
        if ctx:
            ctx_ids = tok(ctx)["input_ids"]
            ids = tok(ctx + cont)["input_ids"]
        else:  # an empty context is conditioned on the prefix token (lm-eval's rule)
            ctx_ids = [lm.prefix_token_id]
            ids = ctx_ids + tok(cont, add_special_tokens=False)["input_ids"]
        n = len(ids) - len(ctx_ids)
        ref, ref_greedy, ref_answer, ref_all = _ref_loglikelihood(looped, ids, n, fwd_kw)
        assert score == pytest.approx(ref, abs=1e-4), (policy, i)
        assert greedy == ref_greedy
        # the meter holds this request's exit depths: the scored positions and every position run
        assert lm.meter.depths("answer", f"t{i}").tolist() == ref_answer, (policy, i)
        assert lm.meter.depths("all", f"t{i}").tolist() == ref_all, (policy, i)
    if policy == "depth":
        assert set(lm.meter.depths("all").tolist()) == {2}


def test_loglikelihood_plain_model(tok):
    from retrofit.testing import tiny_base

    base = tiny_base("llama")
    lm = RetrofitLM(pretrained=base, tokenizer=tok, batch_size=2)
    pairs = [("+ 3 4 =", " 7"), ("abc", "de")]
    got = lm.loglikelihood([_req("loglikelihood", p, "t") for p in pairs])
    for (ctx, cont), (score, _) in zip(pairs, got):
        ids = tok(ctx + cont)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(base(input_ids=torch.tensor([ids[:-1]])).logits[0].float(), -1)
        ref = sum(float(logp[p - 1, ids[p]]) for p in range(len(tok(ctx)["input_ids"]), len(ids)))
        assert score == pytest.approx(ref, abs=1e-4)
    rep = lm.report()["tasks"]["t"]
    assert rep["answer_tokens"] == {**rep["answer_tokens"], "n_tokens": 4, "mean_depth": 1.0, "layers_per_token": 6.0}
    linear = sum(m.weight.numel() for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert rep["answer_tokens"]["flops_per_token"] == 2.0 * (linear + base.lm_head.weight.numel())


@pytest.mark.parametrize("max_length", [8, 512])
def test_loglikelihood_rolling_sums_lm_eval_windows(looped, tok, max_length):
    lm = RetrofitLM(pretrained=looped, tokenizer=tok, batch_size=4, max_length=max_length)
    texts = ["the quick brown fox jumps", "ab"]
    got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (t,), "r") for t in texts])
    for text, total in zip(texts, got):
        tokens = tok(text, add_special_tokens=False)["input_ids"]
        ref = 0.0
        windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, lm.prefix_token_id, max_length, 1)))
        assert (len(windows) > 1) == (max_length == 8 and len(tokens) > 8)
        for ctx, cont in windows:
            ref += _ref_loglikelihood(looped, ctx + cont, len(cont), {})[0]
        assert total == pytest.approx(ref, abs=1e-4)
    # every text token is predicted exactly once
    assert lm.report()["tasks"]["r"]["answer_tokens"]["n_tokens"] == sum(len(t) for t in texts)


@pytest.mark.parametrize("policy", ["decider", "kl", "depth"])
def test_generate_until_newline_equals_retrofit_eval_decoding(looped, tok, policy):
    """``until: ["\\n"]`` is retrofit eval's stop rule: the same text before the newline, the same depths."""
    lm_kw, gen_kw = POLICIES[policy]
    lm = RetrofitLM(pretrained=looped, tokenizer=tok, batch_size=3, **lm_kw)
    prompts = ["+ 3 4 =", "ab", "hello world", "x", "* 2 - 5 1 ="]
    reqs = [_req("generate_until", (p, {"until": ["\n"], "max_gen_toks": 7}), f"g{i}") for i, p in enumerate(prompts)]
    got = lm.generate_until(reqs)
    ref = greedy_generate(looped, tok, [tok(p)["input_ids"] for p in prompts], 7, batch_size=3, **gen_kw)
    for i, (text, r) in enumerate(zip(got, ref)):
        assert text == r["text"].split("\n")[0]
        assert lm.meter.depths("answer", f"g{i}").tolist() == r["depths"], (policy, i)
        # every position run: the prompt and the positions that produced a generated token but the last
        assert lm.meter.depths("all", f"g{i}").size == len(tok(prompts[i])["input_ids"]) - 1 + len(r["ids"])


@torch.no_grad()
def _ref_greedy_loop(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding without cache or batching: one full forward per new token."""
    ids = list(ids)
    out = []
    for _ in range(n):
        t = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


def test_generate_until_stop_string_and_budget(looped, tok):
    """A multi-character stop string ends the row on the token that completes it; the text is cut before it."""
    prompts = ["hello world", "ab"]
    refs = [_ref_greedy_loop(looped, tok(p)["input_ids"], 9) for p in prompts]
    texts = [tok.decode(r, skip_special_tokens=True) for r in refs]
    stop = texts[0][3:5]  # occurs in row 0's greedy text; maybe in row 1's too
    lm = RetrofitLM(pretrained=looped, tokenizer=tok, batch_size=2)
    got = lm.generate_until(
        [_req("generate_until", (p, {"until": [stop], "max_gen_toks": 9}), f"s{i}") for i, p in enumerate(prompts)]
    )
    for i, (text, ref_text, ref_ids) in enumerate(zip(got, texts, refs)):
        assert text == ref_text.split(stop)[0]
        n_ref = next((k + 1 for k in range(len(ref_ids)) if stop in tok.decode(ref_ids[: k + 1])), len(ref_ids))
        assert lm.meter.depths("answer", f"s{i}").size == n_ref
    assert lm.meter.depths("answer", "s0").size <= 5  # the stop string ended row 0 early


def test_prompt_tokens_are_retrofit_evals_raw_and_chat(looped):
    """Raw prompts and lm-eval's --apply_chat_template give retrofit eval's prompt ids (and --chat's)."""
    from tokenizers.processors import TemplateProcessing

    from retrofit.testing import char_tokenizer

    tok = char_tokenizer()  # this one adds BOS, as Llama tokenizers do
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", tok.bos_token_id)]
    )
    rows = task_rows("mano", [2], n=2, seed=0)
    lm = RetrofitLM(pretrained=looped, tokenizer=tok)
    for r, e in zip(rows, prepare(rows, tok, EvalOptions())):
        assert lm.tok_encode(r["prompt"]) == e.prompt_ids
        assert e.prompt_ids[0] == tok.bos_token_id and e.prompt_ids[1] != tok.bos_token_id
    for r, e in zip(rows, prepare(rows, tok, EvalOptions(chat=True))):
        text = lm.apply_chat_template([{"role": "user", "content": r["prompt"]}])
        assert lm.tok_encode(text) == e.prompt_ids
        assert tok.decode(e.prompt_ids).startswith("<|im_start|>user")  # one BOS, from the template


def test_model_arguments_are_checked(looped, tok):
    from retrofit.testing import tiny_base

    ok = RetrofitLM(pretrained=looped, tokenizer=tok, depth=3)
    assert (ok.exit_policy, ok.depth) == ("depth", 3)
    bad = [
        ({"exit_policy": "fast"}, "exit_policy must be one of decider, kl, state, depth"),
        ({"exit_policy": "kl"}, "needs threshold=T with T > 0"),
        ({"exit_policy": "state", "threshold": 0.0}, "needs threshold=T with T > 0"),
        ({"exit_policy": "kl", "threshold": 0.1, "depth": 2}, "depth= goes with exit_policy=depth"),
        ({"threshold": 0.1}, "threshold= goes with exit_policy=kl or state"),
        ({"exit_policy": "depth", "depth": 4}, r"depth=K with K in 1\.\.3"),
        ({"exit_policy": "depth"}, r"depth=K with K in 1\.\.3"),
        ({"batch_size": "0"}, "batch_size must be a positive int or 'auto'"),
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"max_gen_toks": 0}, "max_gen_toks must be a positive int"),
        ({"temperature": 1.0}, r"unknown retrofit model_args \['temperature'\]"),
        ({"step_schedule": "fast"}, "unknown step_schedule 'fast'; allowed: unit, taps"),
        ({"max_length": 1}, "max_length must be an int >= 2"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            RetrofitLM(pretrained=looped, tokenizer=tok, **kw)
    with pytest.raises(ValueError, match="needs a looped checkpoint"):
        RetrofitLM(pretrained=tiny_base("llama"), tokenizer=tok, exit_policy="kl", threshold=0.1)
    with pytest.raises(ValueError, match="pass tokenizer="):
        RetrofitLM(pretrained=looped)
    assert RetrofitLM(pretrained=looped, tokenizer=tok, batch_size="auto:4").batch_size == 8


# ----------------------------------------------------------------------------------------------
# task folders
# ----------------------------------------------------------------------------------------------


def test_process_results_is_the_data_prep_scorer():
    """The lm-eval tasks score with the data_prep task's ``score`` — the function retrofit eval uses."""
    for name in DEFAULT_TASKS:
        task = get_task(name)
        for row in task_rows(task, [task.default_levels[0]], n=2, seed=3):
            preds = [" " + row["answer"], row["answer"] + "\nnext line", "0 " + row["answer"], "", "zz"]
            for p in preds:
                want = float(task.score(p, row["answer"], prompt=row["prompt"]))
                assert process_results(row, [p]) == {"acc": want}, (name, p)
            assert process_results(row, [" " + row["answer"]])["acc"] == 1.0, name


def test_write_tasks_command_writes_retrofit_eval_rows(tmp_path, tok):
    from lm_eval.tasks import TaskManager

    from retrofit.cli import main

    out = tmp_path / "tasks"
    args = [
        "lm-eval",
        "write-tasks",
        "--out",
        str(out),
        "--tasks",
        "mano,gsm",
        "--levels",
        "mano=1,2",
        "--levels",
        "gsm=0",
        "--n",
        "3",
        "--seed",
        "5",
    ]
    assert main(args) == 0
    manifest = json.loads((out / "retrofit_tasks.json").read_text())
    assert manifest["tasks"]["mano"]["tasks"] == ["retrofit_mano_L1", "retrofit_mano_L2"]
    for name, levels in (("mano", [1, 2]), ("gsm", [0])):
        expected = task_rows(name, levels, n=3, seed=5)  # retrofit eval --task NAME --levels ... --n 3 --seed 5
        written = [json.loads(line) for lv in levels for line in (out / "data" / f"{name}_L{lv}.jsonl").open()]
        assert written == expected
        # the default budget is retrofit eval's (longest gold answer in tokens + 2) for this tokenizer
        examples = prepare(expected, tok, EvalOptions())
        assert manifest["tasks"][name]["max_gen_toks"] == max(len(e.answer_ids) for e in examples) + 2
    tm = TaskManager(include_path=str(out), include_defaults=False)
    assert {"retrofit_mano", "retrofit_mano_ll", "retrofit_gsm", "retrofit_gsm_L0", "retrofit_mano_L2_ll"} <= set(
        tm.all_tasks
    )
    loaded = tm.load(["retrofit_mano_L2_ll"])["tasks"]
    doc = next(iter(next(iter(loaded.values())).test_docs()))
    assert next(iter(loaded.values())).doc_to_target(doc) == " " + doc["answer"]  # the separator is scored
    # writing the task again with other levels leaves no stale level behind
    assert main(["lm-eval", "write-tasks", "--out", str(out), "--tasks", "mano", "--levels", "3", "--n", "2"]) == 0
    assert sorted(p.name for p in out.glob("retrofit_mano_L*.yaml")) == [
        "retrofit_mano_L3.yaml",
        "retrofit_mano_L3_ll.yaml",
    ]
    assert "gsm" in json.loads((out / "retrofit_tasks.json").read_text())["tasks"]
    assert main(["lm-eval", "write-tasks", "--out", str(out), "--tasks", "nope"]) == 2


# ----------------------------------------------------------------------------------------------
# lm-eval's command line against retrofit eval
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network (a connection attempt fails the test), a private datasets cache, and lm-eval's task
    index without its ~14,700 built-in tasks (indexing them takes 30-100 s on 2 cores; the run only
    needs --include_path)."""
    import datasets
    import lm_eval.tasks

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            kwargs["include_defaults"] = False
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)


def _lm_eval(tmp_path, name, ckpt, folder, tasks, model_args=""):
    """``retrofit lm-eval --model retrofit ...`` in this process; returns lm-eval's results and samples."""
    from retrofit.cli import main

    out = tmp_path / name
    argv = [
        "lm-eval",
        "--model",
        "retrofit",
        "--model_args",
        f"pretrained={ckpt}{model_args}",
        "--include_path",
        str(folder),
        "--tasks",
        tasks,
        "--batch_size",
        "8",
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    assert main(argv) == 0
    (results_file,) = glob.glob(str(out / "*" / "results_*.json"))
    samples = {}
    for f in glob.glob(str(out / "*" / "samples_*.jsonl")):
        with open(f) as fh:
            rows = sorted((json.loads(line) for line in fh), key=lambda r: r["doc_id"])
        samples[rows[0]["doc"]["task"], rows[0]["doc"]["difficulty"], "_ll_" in f] = rows
    with open(results_file) as fh:
        return json.load(fh), samples


@pytest.mark.integration
def test_lm_eval_command_line_equals_retrofit_eval(tmp_path, looped, tok, offline, capsys):
    """lm-eval's accuracy per level and per task equals retrofit eval's on the same rows (same greedy
    decoding, same stop rule, same scorer), and so do d̄ of the generated tokens and each text."""
    from retrofit.evaluation import evaluate
    from retrofit.model.flops import cost_report

    ckpt = tmp_path / "ckpt"
    looped.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    B = 6  # generation budget of both runs
    # A random model answers nothing right; plant its own greedy first line as the gold answer of some
    # rows so accuracy is strictly between 0 and 1 and differs between levels (3/4 at L1, 1/4 at L2).
    mano = task_rows("mano", [1, 2], n=4, seed=0)
    gens = greedy_generate(looped, tok, [tok(r["prompt"])["input_ids"] for r in mano], B, batch_size=8)
    for i in (0, 1, 2, 4):
        assert first_line(gens[i]["text"]), "the planted answer must hold a character"
        mano[i]["answer"] = first_line(gens[i]["text"])
    chain = task_rows("rg_chain_sum", [2], n=3, seed=0)
    folder = tmp_path / "tasks"
    write_tasks(folder, ["mano", "rg_chain_sum"], rows={"mano": mano, "rg_chain_sum": chain}, max_gen_toks=B)

    opts = EvalOptions(max_new_tokens=B, batch_size=8, exit_policies=False, progress=False)
    ours = evaluate(looped, tok, ["mano", "rg_chain_sum"], rows={"mano": mano, "rg_chain_sum": chain}, options=opts)
    ours = ours["models"]["model"]["tasks"]

    res, samples = _lm_eval(tmp_path, "decider", ckpt, folder, "retrofit_mano,retrofit_rg_chain_sum,retrofit_mano_ll")
    printed = capsys.readouterr().out
    acc = {k: v["acc,none"] for k, v in {**res["results"], **res.get("groups", {})}.items()}
    assert acc["retrofit_mano_L1"] == ours["mano"]["levels"][1]["accuracy"] == 0.75
    assert acc["retrofit_mano_L2"] == ours["mano"]["levels"][2]["accuracy"] == 0.25
    assert acc["retrofit_mano"] == pytest.approx(ours["mano"]["overall"]["accuracy"]) == 0.5
    assert acc["retrofit_rg_chain_sum_L2"] == ours["rg_chain_sum"]["overall"]["accuracy"]
    # every generated text is retrofit eval's greedy generation, cut at the newline
    for r, g, s in zip(mano, gens, samples["mano", 1, False] + samples["mano", 2, False]):
        assert s["doc"]["prompt"] == r["prompt"]
        assert s["filtered_resps"] == [g["text"].split("\n")[0]]
    # d̄ and FLOPs per generated token next to the metrics (results JSON and the printed table)
    rep = res["config"]["retrofit"]
    assert rep["model"]["exit_policy"] == "decider" and rep["model"]["max_depth"] == 3
    for lv, idx in ((1, range(4)), (2, range(4, 8))):
        a = rep["tasks"][f"retrofit_mano_L{lv}"]["answer_tokens"]
        assert a["mean_depth"] == pytest.approx(ours["mano"]["levels"][lv]["gen_mean_depth"], abs=1e-12)
        depths = torch.tensor([d for i in idx for d in gens[i]["depths"]])
        assert a["n_tokens"] == depths.numel()
        assert a["flops_per_token"] == pytest.approx(cost_report(looped, depths)["flops"] / depths.numel())
    assert "retrofit_mano_L1" in printed and "d̄ answer" in printed
    # the loglikelihood variant: acc = the gold " " + answer is the greedy continuation at every token
    greedy = [
        _ref_loglikelihood(looped, tok(r["prompt"] + " " + r["answer"])["input_ids"], 1 + len(r["answer"]), {})[1]
        for r in mano
    ]
    assert acc["retrofit_mano_ll"] == pytest.approx(np.mean(greedy))
    assert rep["tasks"]["retrofit_mano_L1_ll"]["answer_tokens"]["n_tokens"] == sum(
        1 + len(r["answer"]) for r in mano[:4]
    )

    # an exit policy from --model_args: every token at depth 2 = retrofit eval's forced-depth-2 accuracy
    res2, _ = _lm_eval(tmp_path, "depth2", ckpt, folder, "retrofit_mano", ",exit_policy=depth,depth=2")
    assert res2["groups"]["retrofit_mano"]["acc,none"] == pytest.approx(ours["mano"]["forced_depth_accuracy"][2])
    for lv in (1, 2):
        assert res2["results"][f"retrofit_mano_L{lv}"]["acc,none"] == ours["mano"]["levels"][lv]["forced_accuracy"][2]
        assert res2["config"]["retrofit"]["tasks"][f"retrofit_mano_L{lv}"]["answer_tokens"]["mean_depth"] == 2.0


def test_lm_eval_help_and_registration():
    from lm_eval.api.registry import get_model

    from retrofit.lm_eval import register
    from retrofit.lm_eval.cli import USAGE, main

    register()
    register()  # idempotent
    assert get_model("retrofit") is RetrofitLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still there
    assert main(["--help"]) == 0 and "write-tasks" in USAGE
