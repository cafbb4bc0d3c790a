"""``retrofit eval`` (the retrofit/evaluation/ package) and its per-token analyses (analysis.py).

Unit tests check each alignment and policy computation on constructed inputs (hand-worked or
against a slow reference); the end-to-end test runs the CLI on a tiny random looped checkpoint
and checks every artifact.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import scipy.stats
import torch
from tiny_looped import mixed_depth_looped

from retrofit.evaluation import analysis as A
from retrofit.evaluation import cli as C
from retrofit.evaluation import runner as R
from retrofit.evaluation.models import model_info, pad_id
from retrofit.evaluation.options import EvalOptions
from retrofit.evaluation.policies import engine_exit_policies
from retrofit.evaluation.rows import prepare
from retrofit.evaluation.teacher_forced import policy_pass, teacher_forced

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


_looped = mixed_depth_looped


@pytest.fixture(scope="module")
def looped():
    return _looped()


# ----------------------------------------------------------------------------------------------
# alignment
# ----------------------------------------------------------------------------------------------


def test_word_alignment_char_tokenizer(tok):
    ids, offsets = A.encode_with_offsets(tok, " a bc d")
    assert tok.convert_ids_to_tokens(ids) == [" ", "a", " ", "b", "c", " ", "d"]
    assert A.token_word_owner(" a bc d", offsets).tolist() == [-1, 0, -1, 1, 1, -1, 2]
    assert A.first_tokens_of_words(" a bc d", offsets).tolist() == [1, 3, 6]


def test_word_alignment_bpe_like_offsets():
    # "Ġab" "Ġc" "d" "Ġe": a leading space merged into the token, a word split in two
    text = " ab cd e"
    offsets = [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert A.token_word_owner(text, offsets).tolist() == [0, 1, 1, 2]
    assert A.first_tokens_of_words(text, offsets).tolist() == [0, 1, 3]
    # one token spanning two words: the second word has no token of its own
    assert A.first_tokens_of_words(" a b", [(0, 4)]).tolist() == [0, -1]
    # a token that starts inside word 0 and runs into word 1 belongs to word 0
    assert A.first_tokens_of_words("ab c", [(0, 1), (1, 3), (3, 4)]).tolist() == [0, 2]
    # special tokens (empty span) own nothing
    assert A.token_word_owner("a", [(0, 0), (0, 1)]).tolist() == [-1, 0]
    np.testing.assert_array_equal(A.word_values([5.0, 6.0, 7.0], [2, -1, 0]), [7.0, np.nan, 5.0])


class _SlowWordTokenizer:
    """A slow tokenizer (no offsets) that emits one token per whitespace+word piece."""

    is_fast = False

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=False):
        pieces = re.findall(r"\s*\S+|\s+", text)
        return {"input_ids": [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]}


def test_encode_with_offsets_slow_tokenizer_fallback():
    ids, offsets = A.encode_with_offsets(_SlowWordTokenizer(), " a b c")
    assert len(ids) == 3
    assert offsets == [(0, 2), (2, 4), (4, 6)]
    assert A.first_tokens_of_words(" a b c", offsets).tolist() == [0, 1, 2]


def test_answer_positions():
    assert A.answer_positions(5, 3, "predict").tolist() == [4, 5, 6]
    assert A.answer_positions(5, 3, "input").tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="allowed"):
        A.answer_positions(5, 3, "middle")


def _lano_rows(n=6):
    from data_prep.tasks import build_dataset

    return build_dataset("lano", [8, 10], n // 2, seed=3).to_list()


def test_lano_spearman_alignment_planted(tok):
    """Depth planted on each terminal's first token = its multiplications: Spearman must be exactly 1;
    whitespace tokens get junk depths that alignment must ignore."""
    opts = EvalOptions()
    rows = _lano_rows()
    examples = prepare(rows, tok, opts)
    word_depths, feats = [], []
    rng = np.random.default_rng(0)
    for e in examples:
        m = len(e.answer_ids)
        depth = rng.integers(50, 100, size=m).astype(float)  # junk on every token
        for w, k in enumerate(e.first_tok):
            depth[k] = e.features[w]["multiplications"]
        word_depths.append(A.word_values(depth, e.first_tok))
        feats.append(e.features)
        # char tokenizer: " a b c" -> the terminals sit at the odd token indices
        assert e.first_tok.tolist() == list(range(1, m, 2))
    out = A.lano_spearman(word_depths, feats)
    assert set(out) == set(A.LANO_PROXIES)
    assert out["multiplications"]["rho"] == pytest.approx(1.0)
    assert out["multiplications"]["n"] == sum(len(f) for f in feats)


def test_brevo_regression_alignment_planted(tok):
    """Depth = planted linear function of the features + per-N offset, on each node's first
    token; the N-controlled regression must recover the coefficients with R² = 1."""
    from data_prep.tasks import build_dataset

    rows = build_dataset("brevo", [6, 8, 10], 8, seed=0).to_list()
    examples = prepare(rows, tok, EvalOptions())
    coef = {"hub_out_degree": 0.3, "dfs_depth": -0.2, "frontier_size": 0.5, "newly_enabled": 0.1}
    word_depths = []
    for e in examples:
        depth = np.full(len(e.answer_ids), 99.0)
        for w, k in enumerate(e.first_tok):
            f = e.features[w]
            depth[k] = 1.0 + 0.05 * e.level + sum(c * f[name] for name, c in coef.items())
        word_depths.append(A.word_values(depth, e.first_tok))
    reg = A.brevo_regression(word_depths, [e.features for e in examples], [e.level for e in examples])
    for name, c in coef.items():
        assert reg["coefficients"][name] == pytest.approx(c, abs=1e-8)
    assert reg["r2"] == pytest.approx(1.0)
    assert reg["n_groups"] == 3


# ----------------------------------------------------------------------------------------------
# exit policies (hand-worked)
# ----------------------------------------------------------------------------------------------

# Planted next-token distributions of 3 tokens at depths 1..3 over a 3-word vocabulary.
_P = torch.tensor(
    [
        [[0.5, 0.25, 0.25], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]],  # depth 1
        [[0.5, 0.25, 0.25], [0.2, 0.6, 0.2], [0.7, 0.2, 0.1]],  # depth 2
        [[0.1, 0.8, 0.1], [0.2, 0.6, 0.2], [0.7, 0.2, 0.1]],  # depth 3
    ],
    dtype=torch.float64,
)  # [D, N, V]
_KL2 = [0.0, 0.4 * math.log(3), 0.7 * math.log(2.1) + 0.2 * math.log(0.6) + 0.1 * math.log(0.3)]


def test_kl_and_confidence_signals_hand_worked():
    logits = _P.log() + 5.0  # logits are defined up to a constant
    kl = A.kl_signals(logits)
    assert kl.shape == (3, 2)
    torch.testing.assert_close(kl[:, 0].double(), torch.tensor(_KL2, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        kl[:, 1].double(),
        torch.tensor(
            [0.1 * math.log(0.1 / 0.5) + 0.8 * math.log(0.8 / 0.25) + 0.1 * math.log(0.1 / 0.25), 0.0, 0.0],
            dtype=torch.float64,
        ),
        atol=1e-6,
        rtol=0,
    )
    conf = A.confidence_signals(logits)
    torch.testing.assert_close(
        conf.double(),
        torch.tensor([[0.5, 0.5, 0.8], [0.6, 0.6, 0.6], [1 / 3, 0.7, 0.7]], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


def test_exit_depths_and_policy_correct_hand_worked():
    kl = A.kl_signals(_P.log())
    gold = torch.tensor([1, 1, 0])
    per_depth = (_P.argmax(-1) == gold[None]).transpose(0, 1)  # [N, D]
    # argmax: token0 d1..3 = 0,0,1; token1 = 0,1,1; token2 = 0(tie → first),0,0
    assert per_depth.tolist() == [[False, False, True], [False, True, True], [True, True, True]]
    # τ = 0.1: token0 KL 0 at d2 -> 2; token1 0.44 at d2, 0 at d3 -> 3; token2 0.30, then 0 -> 3
    d = A.exit_depths(kl, 0.1, first_depth=2)
    assert d.tolist() == [2, 3, 3]
    assert A.policy_correct(per_depth, d).tolist() == [False, True, True]
    assert A.exit_depths(kl, 0.35, 2).tolist() == [2, 3, 2]
    assert A.exit_depths(kl, 0.5, 2).tolist() == [2, 2, 2]
    assert A.exit_depths(kl, 0.0, 2).tolist() == [3, 3, 3]  # nothing is < 0: all run to D
    conf = A.confidence_signals(_P.log())
    assert A.exit_depths(conf, 0.55, 1, rule="above").tolist() == [3, 1, 2]
    # calibration to equal compute: mean 2.0 needs τ just above KL(token1) = 0.4·ln 3
    tau, mean = A.calibrate_threshold(kl, 2, 2.0)
    assert mean == pytest.approx(2.0)
    assert 0.4 * math.log(3) < tau < 0.4 * math.log(3) + 1e-6
    tau, mean = A.calibrate_threshold(kl, 2, 1.0)  # unreachable: KL cannot stop before depth 2
    assert mean == pytest.approx(2.0)
    tau, mean = A.calibrate_threshold(conf, 1, 2.0, rule="above")
    assert mean == pytest.approx(2.0)
    assert A.exit_depths(conf, tau, 1, rule="above").mean() == pytest.approx(2.0)


def test_state_change_signals_hand_worked():
    h = torch.tensor([[[3.0, 4.0]], [[3.0, 4.0]], [[0.0, 4.0]]])  # [D=3, N=1, H=2]
    s = A.state_change_signals(h)
    torch.testing.assert_close(s, torch.tensor([[0.0, 3.0 / 5.0]]))


@pytest.mark.parametrize("rule", ["below", "above"])
def test_calibrate_threshold_vs_bruteforce(rule):
    rng = np.random.default_rng(0)
    for trial in range(5):
        sig = rng.integers(0, 6, size=(40, 3)).astype(np.float32) / 5  # many ties
        target = float(rng.uniform(1.0, 3.5))
        tau, mean = A.calibrate_threshold(sig, 1, target, rule)
        cands = [-np.inf, np.inf] + [float(v) + e for v in np.unique(sig) for e in (-1e-3, 0.0, 1e-3)]
        best = min(abs(A.exit_depths(sig, c, 1, rule).mean() - target) for c in cands)
        assert abs(mean - target) == pytest.approx(best)
        assert A.exit_depths(sig, tau, 1, rule).mean() == pytest.approx(mean)


# ----------------------------------------------------------------------------------------------
# model passes vs slow references
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["loop", "generate"])
def test_greedy_generate_batched_equals_one_by_one(looped, tok, backend):
    prompts = [tok(p)["input_ids"] for p in ["+ 1 2 =", "* + 3 4 5 =", "7 =", "- 9 * 2 2 ="]]
    batched = R.greedy_generate(looped, tok, prompts, 6, batch_size=4, backend=backend)
    depths_seen = set()
    for p, b in zip(prompts, batched):
        # reference: no padding, no batching, no cache, plain argmax loop
        ids = torch.tensor([p])
        gen = []
        for _ in range(6):
            with torch.no_grad():
                nxt = int(looped(ids).logits[0, -1].argmax())
            gen.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
            if nxt == tok.eos_token_id or "\n" in tok.decode([nxt]):
                break
        assert b["ids"] == gen
        with torch.no_grad():
            d = looped(ids).depths[0]
        # alignment "predict": token j's depth is that of the position before it
        assert b["depths"] == d[len(p) - 1 : len(p) - 1 + len(gen)].tolist()
        depths_seen.update(b["depths"])
    assert len(depths_seen) > 1, "the fixture model should produce mixed depths"
    forced = R.greedy_generate(looped, tok, prompts, 3, batch_size=2, depth=2, backend=backend)
    assert all(set(f["depths"]) == {2} for f in forced)


def test_generation_backends_agree(looped, tok):
    """The model's cached generate and the no-cache reference loop: same tokens and depths, under
    the decider, a forced depth and a training-free exit, and for a base model."""
    from retrofit.testing import tiny_base

    prompts = [tok(p)["input_ids"] for p in ["+ 1 2 =", "* + 3 4 5 =", "7 =", "- 9 * 2 2 =", "+ + 1 1 1 ="]]
    cases = [{}, {"depth": 1}, {"alignment": "input"}]
    assert "kl" in engine_exit_policies()
    cases.append({"exit_policy": "kl", "exit_threshold": 0.05})
    for kw in cases:
        a = R.greedy_generate(looped, tok, prompts, 8, batch_size=3, backend="loop", **kw)
        b = R.greedy_generate(looped, tok, prompts, 8, batch_size=3, backend="generate", **kw)
        assert a == b, kw
    base = tiny_base("llama")
    a = R.greedy_generate(base, tok, prompts, 8, batch_size=3, backend="loop")
    b = R.greedy_generate(base, tok, prompts, 8, batch_size=3, backend="generate")
    assert a == b


def test_teacher_forced_matches_unbatched_reference(looped, tok):
    from data_prep.tasks import build_dataset

    rows = build_dataset("mano", [2, 5], 2, seed=1).to_list()
    opts = EvalOptions(batch_size=4, progress=False, alignment="predict")
    examples = prepare(rows, tok, opts)
    info = model_info(looped)
    tf = teacher_forced(looped, info, examples, pad_id(tok), opts, "tf")
    tf_input = teacher_forced(
        looped, info, examples, pad_id(tok), EvalOptions(batch_size=3, progress=False), "tf", per_depth=False
    )
    D = info.max_depth
    for e, t in zip(examples, tf):
        ids = torch.tensor([e.prompt_ids + e.answer_ids])
        P, m = len(e.prompt_ids), len(e.answer_ids)
        gold = torch.tensor(e.answer_ids)
        with torch.no_grad():
            out = looped(ids)
            full = looped(ids, depth=D, output_depth_logits=True)
        pred = torch.arange(P - 1, P - 1 + m)
        np.testing.assert_array_equal(t["pred_depth"], out.depths[0, pred].numpy())
        np.testing.assert_array_equal(t["tok_depth"], out.depths[0, pred].numpy())  # alignment "predict"
        np.testing.assert_array_equal(tf_input[examples.index(e)]["tok_depth"], out.depths[0, pred + 1].numpy())
        exp = (out.depth_probs[0, pred] * torch.arange(1, D + 1)).sum(-1).double().numpy()
        np.testing.assert_allclose(t["tok_exp_depth"], exp, atol=1e-6)
        np.testing.assert_array_equal(t["correct"], (out.logits[0, pred].argmax(-1) == gold).numpy())
        z = full.depth_logits[:, 0, pred]  # [D, m, V]
        ref_nll = torch.stack([torch.nn.functional.cross_entropy(z[d], gold, reduction="none") for d in range(D)], 1)
        np.testing.assert_allclose(t["nll_d"], ref_nll.numpy(), atol=1e-4)
        np.testing.assert_array_equal(t["correct_d"], (z.argmax(-1) == gold).T.numpy())
        # slow KL reference, token by token
        for j in range(m):
            for d in range(1, D):
                p, q = z[d, j].softmax(-1), z[d - 1, j].softmax(-1)
                assert t["kl"][j, d - 1] == pytest.approx(float((p * (p / q).log()).sum()), abs=1e-5)
        assert t["state"].shape == (m, D - 1)


def test_exact_policy_pass_extremes_match_forced_depths(tok):
    """The engine's exact exit pass at the two extreme thresholds equals the forced-depth frame:
    τ → 0 runs every token to D, τ → ∞ stops every token at 2 (= forced depth 2)."""
    assert {"kl", "state"} <= set(engine_exit_policies())
    from data_prep.tasks import build_dataset

    model = _looped(method="fixed")
    rows = build_dataset("mano", [3], 3, seed=2).to_list()
    opts = EvalOptions(batch_size=2, progress=False)
    examples = prepare(rows, tok, opts)
    info = model_info(model)
    tf = teacher_forced(model, info, examples, pad_id(tok), opts, "tf")
    for tau, d in ((1e-30, 3), (1e30, 2)):
        exact = policy_pass(model, info, examples, pad_id(tok), opts, "kl", tau, "kl")
        for (depth, correct), t in zip(exact, tf):
            assert (depth == d).all()
            np.testing.assert_array_equal(correct, t["correct_d"][:, d - 1])


@pytest.mark.parametrize("method", ["fixed", "anira-e", "anira-o"])
def test_evaluate_task_every_method(method, tok):
    model = _looped(max_depth=2, method=method).train()
    res = R.evaluate_task(
        model, tok, "mano", levels=[2, 3], n=2, forced_generation=False, policy_generation=False, progress=False
    )
    assert model.training, "evaluate_task must restore the caller's train/eval mode"
    assert set(res["levels"]) == {2, 3}
    assert all(1.0 <= e["mean_depth"] <= 2.0 for e in res["levels"].values())
    assert ("decider" in res["exit_policies"]) == (method != "fixed")
    if method == "fixed":  # no decider: policies are calibrated to (1 + D) / 2
        assert res["exit_policies"]["confidence"]["target_mean_depth"] == 1.5
        assert all(e["mean_depth"] == 2.0 for e in res["levels"].values())


def test_chat_mode_uses_the_template(looped, tok):
    rows = [{"prompt": "+ 1 2 =", "answer": "3", "difficulty": 1, "task": "mano"}]
    ex = prepare(rows, tok, EvalOptions(chat=True))[0]
    assert tok.decode(ex.prompt_ids) == "<|im_start|>user\n+ 1 2 =<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ex.answer_ids) == "3"
    res = R.evaluate_task(looped, tok, "mano", rows=rows, chat=True, max_new_tokens=3, progress=False)
    assert res["levels"][1]["n"] == 1


def test_levels_arg_parsing():
    assert C._levels_arg(["3,4,8-10"], "--levels") == [3, 4, 8, 9, 10]
    assert C._levels_arg(["mano=3,4", "brevo=5-6"], "--levels") == {"mano": [3, 4], "brevo": [5, 6]}
    assert C._levels_arg(None, "--levels") is None
    with pytest.raises(ValueError, match="cannot parse"):
        C._levels_arg(["3,x"], "--levels")
    with pytest.raises(ValueError, match="either one list"):
        C._levels_arg(["3,4", "mano=5"], "--levels")


def test_task_rows_limit_spreads_over_levels():
    rows = R.task_rows("mano", [3, 4, 5, 6], n=10, seed=0, limit=6)
    assert len(rows) == 6
    assert sorted({r["difficulty"] for r in rows}) == [3, 4, 5, 6]
    rows = R.task_rows("mano", [3, 4, 5, 6, 7], n=10, seed=0, limit=3)
    assert [r["difficulty"] for r in rows] == [3, 5, 7]
    with pytest.raises(ValueError, match="outside the allowed range"):
        R.task_rows("lano", [2], n=1)


def test_cli_bad_input_is_a_clear_error(capsys):
    from retrofit.cli import main

    assert main(["eval", "--model", "tiny-llama", "--task", "nope", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "mano" in err


# ----------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, looped, tok):
    path = tmp_path_factory.mktemp("looped_ckpt")
    looped.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _png_ok(path):
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG"
        arr = np.asarray(im.convert("L"))
    assert arr.shape[0] > 100 and arr.shape[1] > 100
    assert arr.std() > 0, f"{path} is blank"


@pytest.mark.integration
def test_cli_end_to_end_writes_every_artifact(checkpoint, tmp_path, capsys):
    from retrofit.cli import main

    out = tmp_path / "eval"
    argv = [
        "eval",
        "--model",
        str(checkpoint),
        "--task",
        "mano,brevo",
        "--task",
        "lano",
        "--levels",
        "mano=3,4",
        "--levels",
        "brevo=4,6",
        "--levels",
        "lano=8,9",
        "--n",
        "3",
        "--limit",
        "4",
        "--out",
        str(out),
        "--quiet",
        "--name",
        "looped",
        "--compare",
        "tiny-llama=base",
        "tiny-qwen3=qwen",
        "--html-samples",
        "1",
        "--structure-strings",
        "gold",  # a random model generates no valid LANO/BREVO string
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "looped" in printed and "mano" in printed  # the summary table

    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"config", "models", "comparisons"}
    assert set(results["models"]) == {"looped", "base", "qwen"}
    assert results["config"]["token_difficulty_reference"] == "base"  # the first compared plain model
    n_tokens_html = 0
    for task in ("mano", "brevo", "lano"):
        t = results["models"]["looped"]["tasks"][task]
        assert t["max_depth"] == 3 and t["looped"] is True
        assert len(t["levels"]) == 2 and sum(e["n"] for e in t["levels"].values()) == 4
        for e in t["levels"].values():
            assert 0.0 <= e["accuracy"] <= 1.0
            assert 1.0 <= e["mean_depth"] <= 3.0
            assert e["saving"] == pytest.approx(e["mean_depth"] / 3)
            assert e["cost_exec"] == sum(e["depth_histogram"][d] * (d + 1) for d in range(3))
            assert e["split"] in ("train", "interp", "extrap")
        assert set(t["forced_depth_accuracy"]) == {"1", "2", "3"}
        assert set(t["exit_policies"]) >= {"decider", "kl", "state", "confidence"}
        for p in t["exit_policies"].values():
            assert 0.0 <= p["accuracy"] <= 1.0 and 1.0 <= p["mean_depth"] <= 3.0
            lo, hi = e["accuracy_ci"]
            assert 0.0 <= lo <= e["accuracy"] <= hi <= 1.0
            assert e["flops_per_token"] > 0 and e["layers_per_token"] >= 6.0
        assert {p["label"] for p in t["compute_points"]} >= {1, 2, 3, "adaptive"}
        # side-by-side comparisons: looped vs each other model on the same rows
        for other in ("base", "qwen"):
            comp = results["comparisons"][task][other]
            assert (comp["a"], comp["b"]) == ("looped", other)
            assert set(comp["levels"]) == set(t["levels"])
            for lvl, c in comp["levels"].items():
                assert c["n"] == t["levels"][lvl]["n"] == c["both_right"] + c["a_only"] + c["b_only"] + c["both_wrong"]
                assert c["accuracy_a"] == pytest.approx(t["levels"][lvl]["accuracy"])
                other_level = results["models"][other]["tasks"][task]["levels"][lvl]
                assert c["accuracy_b"] == pytest.approx(other_level["accuracy"])
                assert 0.0 < c["mcnemar_p"] <= 1.0 and 0.0 < c["bootstrap"]["p_value"] <= 1.0
            assert comp["all"]["n"] == 4
        td = t["token_difficulty"]
        assert td["reference"] == "base" and td["easy"]["n"] + td["hard"]["n"] == td["n_tokens"] > 0
        lc = t["loss_change"]
        assert lc["n"] > 0 and sum(lc["counts"]) == lc["n"]
        assert lc["share_unchanged"] + lc["share_worse"] + lc["share_improved"] == pytest.approx(1.0)
        base = results["models"]["base"]["tasks"][task]
        assert base["looped"] is False and "mean_depth" not in next(iter(base["levels"].values()))
        for model in results["models"].values():
            n_tokens_html += sum(len(s["tokens"]) for s in model["tasks"][task]["samples"])
        for suffix in (
            "depth_vs_difficulty",
            "accuracy_vs_difficulty",
            "accuracy_vs_compute",
            "loss_change",
            "depth_by_token_difficulty",
        ):
            _png_ok(out / f"{task}_{suffix}.png")
    lano = results["models"]["looped"]["tasks"]["lano"]["spearman"]
    assert set(lano) == set(A.LANO_PROXIES) | {"chart_edges"} and all(v["n"] > 0 for v in lano.values())
    for task in ("lano", "brevo"):
        st = results["models"]["looped"]["tasks"][task]["structure_strings"]
        assert st == {"strings": "gold", "rows": 4}
    assert results["config"]["held_out_levels"]["mano"] == [] and results["config"]["train_levels"]["lano"]
    reg = results["models"]["looped"]["tasks"]["brevo"]["regression"]
    assert set(reg) == {"exit_depth", "expected_depth"}
    assert set(reg["exit_depth"]["coefficients"]) == set(A.BREVO_FEATURES)

    html = (out / "samples.html").read_text()
    assert html.count('<span class="tok ') == n_tokens_html > 0
    report = (out / "report.md").read_text()
    for needle in (
        "## Task: mano",
        "### Exit policies",
        "### First-vs-last depth loss change",
        "Spearman",
        "R²",
        "mano_accuracy_vs_compute.png",
        "### Paired comparisons",
        "**looped vs qwen**",
        "McNemar p",
        "### Per-token depth vs difficulty",
        "MFLOPs/token (base)",
    ):
        assert needle in report


def test_evaluate_api_base_model_only(tmp_path, tok):
    """A base model: accuracy and layer counts, no depth plots; given rows are used as is."""
    from retrofit.testing import tiny_base

    rows = [
        {"prompt": "+ 1 2 =", "answer": "3", "difficulty": 1, "task": "mano"},
        {"prompt": "* + 1 2 3 =", "answer": "9", "difficulty": 2, "task": "mano"},
    ]
    res = R.evaluate(
        tiny_base("llama"), tok, "mano", out_dir=tmp_path, rows={"mano": rows}, progress=False, name="base"
    )
    t = res["models"]["base"]["tasks"]["mano"]
    assert [e["n"] for e in t["levels"].values()] == [1, 1]
    (point,) = t["compute_points"]
    assert (point["label"], point["layers_per_token"], point["accuracy"]) == ("plain", 6.0, t["overall"]["accuracy"])
    # 6 layers of q/o 64x64, k/v 64x32 (2 KV heads of 16), gate/up/down 64x128; LM head 104x64; 2 FLOPs per MAC
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert point["flops_per_token"] == 2.0 * (6 * per_layer + 104 * 64)
    assert (tmp_path / "mano_accuracy_vs_difficulty.png").exists()
    assert not (tmp_path / "mano_depth_vs_difficulty.png").exists()
    assert (tmp_path / "report.md").exists() and (tmp_path / "samples.html").exists()


def test_evaluate_several_models_token_difficulty_vs_bruteforce(looped, tok):
    """compare=[(name, model, tok), ...]: paired comparisons against each, and the per-token analysis
    equals one recomputed token by token (looped depth at the producing position vs the reference's
    unbatched teacher-forced loss)."""
    from retrofit.evaluation.token_difficulty import depth_vs_token_difficulty
    from retrofit.testing import tiny_base

    rows = R.task_rows("mano", [2, 4], n=3, seed=5)
    sft, base = tiny_base("llama", seed=1), tiny_base("llama", seed=2)
    res = R.evaluate(
        looped,
        tok,
        "mano",
        rows={"mano": rows},
        name="looped",
        compare=[("sft", sft, tok), ("base", base)],
        progress=False,
        forced_depths=False,
        exit_policies=False,
        bootstrap_samples=200,
    )
    assert list(res["models"]) == ["looped", "sft", "base"] and set(res["comparisons"]["mano"]) == {"sft", "base"}
    td = res["models"]["looped"]["tasks"]["mano"]["token_difficulty"]
    assert td["reference"] == "sft"
    depths, losses = [], []
    for r in rows:
        ex = prepare([r], tok, EvalOptions())[0]
        ids = torch.tensor([ex.prompt_ids + ex.answer_ids])
        P, m = len(ex.prompt_ids), len(ex.answer_ids)
        with torch.no_grad():
            d = looped(ids).depths[0, P - 1 : P - 1 + m]
            logp = sft(ids).logits[0, P - 1 : P - 1 + m].log_softmax(-1)
        nll = -logp[torch.arange(m), torch.tensor(ex.answer_ids)]
        keep = torch.as_tensor(ex.content)
        depths += d[keep].tolist()
        losses += nll[keep].tolist()
    ref = depth_vs_token_difficulty(depths, losses, max_depth=3)
    assert td["n_tokens"] == ref["n_tokens"] == len(depths)
    assert td["easy"]["depth_counts"] == ref["easy"]["depth_counts"]
    assert td["hard"]["depth_counts"] == ref["hard"]["depth_counts"]
    assert td["median_loss"] == pytest.approx(ref["median_loss"], abs=1e-5)
    # choosing the reference, and bad names
    res = R.evaluate(
        looped,
        tok,
        "mano",
        rows={"mano": rows[:2]},
        compare=[("sft", sft, tok), ("base", base, tok)],
        progress=False,
        forced_depths=False,
        exit_policies=False,
        difficulty_reference="base",
        bootstrap_samples=50,
    )
    assert res["models"]["model"]["tasks"]["mano"]["token_difficulty"]["reference"] == "base"
    with pytest.raises(ValueError, match="not a model of this run"):
        R.evaluate(looped, tok, "mano", rows={"mano": rows[:1]}, compare=[("sft", sft, tok)], difficulty_reference="x")
    with pytest.raises(ValueError, match="used more than once: sft"):
        R.evaluate(looped, tok, "mano", rows={"mano": rows[:1]}, compare=[("sft", sft, tok), ("sft", base, tok)])
    # the older single form: compare=(model, tokenizer) named compare_name
    res = R.evaluate(
        looped,
        tok,
        "mano",
        rows={"mano": rows[:2]},
        compare=(base, tok),
        compare_name="base",
        progress=False,
        forced_depths=False,
        exit_policies=False,
        bootstrap_samples=50,
    )
    assert list(res["models"]) == ["model", "base"] and list(res["comparisons"]["mano"]) == ["base"]


def test_eval_options_validation_and_overrides():
    from retrofit.evaluation.options import resolve_options

    for bad, match in (
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"alignment": "middle"}, "alignment must be one of"),
        ({"backend": "vllm"}, "backend must be one of"),
        ({"confidence": 1.5}, "confidence must be"),
        ({"max_new_tokens": -1}, "None \\(automatic\\) or a positive int"),
    ):
        with pytest.raises(ValueError, match=match):
            EvalOptions(**bad)
    opts = resolve_options(EvalOptions(batch_size=3), {"forced_generation": False, "chat": True})
    assert (opts.batch_size, opts.forced_depths, opts.chat) == (3, False, True)
    with pytest.raises(TypeError, match="unknown evaluation option 'bogus'; allowed: .*batch_size"):
        resolve_options(None, {"bogus": 1})
    assert C._compare_specs(["a/b=sft", "smollm2"], None) == [("a/b", "sft"), ("smollm2", "smollm2")]
    assert C._compare_specs(["x"], "base") == [("x", "base")]
    with pytest.raises(ValueError, match="single --compare"):
        C._compare_specs(["x", "y"], "base")


# ----------------------------------------------------------------------------------------------
# greedy exact match from one teacher-forced forward
# ----------------------------------------------------------------------------------------------


def _example(prompt_ids, answer_ids):
    from retrofit.evaluation.rows import Example

    m = len(answer_ids)
    return Example(
        row={"prompt": "", "answer": "", "difficulty": 1},
        level=1,
        prompt_ids=list(prompt_ids),
        answer_ids=list(answer_ids),
        segment="",
        owner=np.zeros(m, dtype=np.int64),
        first_tok=np.zeros(1, dtype=np.int64),
        features=None,
    )


@pytest.mark.parametrize("plain", [False, True])
def test_teacher_forced_argmax_equals_greedy_generation(tok, plain):
    """argmax_pass's row_correct == (real greedy generation emits exactly gold + a stop token), on rows
    where it holds and rows where it fails at every place it can fail, under the decider, a forced depth
    and the kl exit; step depths equal the generation's producing-step depths where it holds."""
    import random

    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.teacher_forced import argmax_pass
    from retrofit.testing import tiny_base

    model = tiny_base("llama", seed=3) if plain else _looped(seed=3)
    nl = tok.convert_tokens_to_ids("\n")
    with torch.no_grad():  # a stronger "\n" row in the (tied) LM head, so that greedy rows do stop
        model.lm_head.weight[nl] *= 12.0 if plain else 4.0
    is_stop = stop_rule(model, tok)
    rng = random.Random(0)
    prompts = [
        tok(
            " ".join(
                rng.choice("+-*") if rng.random() < 0.4 else str(rng.randrange(23)) for _ in range(rng.randint(2, 7))
            )
            + " ="
        )["input_ids"]
        for _ in range(24)
    ]
    info = model_info(model)
    cases = [{}] if plain else [{}, {"depth": 2}, {"exit_policy": "kl", "exit_threshold": 0.05}]
    max_new = 8
    for kw in cases:
        gens = R.greedy_generate(model, tok, prompts, max_new, batch_size=5, **kw)
        examples, expected, gen_of = [], [], []
        for p, g in zip(prompts, gens):
            ids = g["ids"]
            stopped = is_stop(ids[-1])
            golds = []
            if stopped and len(ids) > 1:
                gold = ids[:-1]
                golds += [
                    gold,
                    gold[:-1] or [ids[0] + 1],
                    gold + [ids[-1] + 1 if ids[-1] + 1 != nl else 5],
                    gold[:-1] + [(gold[-1] + 7) % 100 + 4],
                ]
            else:
                golds += [ids[:3], ids[:1]]
            for gold in golds:
                if not gold:
                    continue
                examples.append(_example(p, gold))
                m = len(gold)
                expected.append(ids[:m] == gold and len(ids) > m and is_stop(ids[m]))
                gen_of.append(g)
        got = argmax_pass(
            model, info, examples, pad_id(tok), EvalOptions(batch_size=4, progress=False), is_stop, max_new, "tf", **kw
        )
        assert [r["row_correct"] for r in got] == expected, kw
        assert sum(expected) >= 6 and len(expected) - sum(expected) >= 20, (
            "need rows where it holds and not",
            kw,
            sum(expected),
        )
        for r, ok, g in zip(got, expected, gen_of):
            if ok:
                assert r["step_depths"].tolist() == g["depths"], kw
        if kw.get("depth"):
            assert all(set(r["step_depths"].tolist()) == {2} for r in got)
    # a budget too small for answer + stop: never correct (greedy generation would be cut off)
    right = [e for e, ok in zip(examples, expected) if ok]
    short = argmax_pass(
        model,
        info,
        right,
        pad_id(tok),
        EvalOptions(progress=False),
        is_stop,
        min(len(e.answer_ids) for e in right),
        "tf",
    )
    assert not all(r["row_correct"] for r in short)


def test_evaluate_task_teacher_forced_accuracy(looped, tok):
    """accuracy="teacher_forced_argmax" in evaluate_task: the level accuracy is the argmax pass's,
    forced-depth accuracies come from forced-depth argmax passes, and no generation runs."""
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.stats import mcnemar_exact
    from retrofit.evaluation.teacher_forced import argmax_pass

    rows = R.task_rows("mano", [2, 3], n=3, seed=2)
    opts = EvalOptions(accuracy="teacher_forced_argmax", progress=False, batch_size=4)
    calls = []
    orig = type(looped).generate
    type(looped).generate = lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
    try:
        res = R.evaluate_task(looped, tok, "mano", rows=rows, options=opts, policy_generation=True)
    finally:
        type(looped).generate = orig
    assert not calls, "teacher_forced_argmax must not generate"
    examples = prepare(rows, tok, opts)
    max_new = max(len(e.answer_ids) for e in examples) + 2
    ref = argmax_pass(looped, model_info(looped), examples, pad_id(tok), opts, stop_rule(looped, tok), max_new, "tf")
    for lvl in (2, 3):
        ok = [r["row_correct"] for r, e in zip(ref, examples) if e.level == lvl]
        assert res["levels"][lvl]["accuracy"] == pytest.approx(np.mean(ok))
    for d in (1, 2, 3):
        forced = argmax_pass(
            looped, model_info(looped), examples, pad_id(tok), opts, stop_rule(looped, tok), max_new, "tf", depth=d
        )
        assert res["forced_depth_accuracy"][d] == pytest.approx(np.mean([r["row_correct"] for r in forced]))
        # the paired test of the adaptive exits vs this forced depth, from the two passes' rows
        a = np.array([r["row_correct"] for r in ref])
        b = np.array([r["row_correct"] for r in forced])
        got = res["adaptive_vs_forced"][d]
        assert (got["all"]["a_only"], got["all"]["b_only"]) == (int((a & ~b).sum()), int((~a & b).sum()))
        assert got["all"]["mcnemar_p"] == pytest.approx(mcnemar_exact(int((a & ~b).sum()), int((~a & b).sum())))
        lv3 = np.array([e.level == 3 for e in examples])
        assert got["levels"][3]["n"] == int(lv3.sum())
        assert got["levels"][3]["difference"] == pytest.approx(a[lv3].mean() - b[lv3].mean())
    assert "generation_accuracy" in res["exit_policies"]["kl"]


@pytest.mark.parametrize(
    "loop",
    [
        dict(method="tah2", max_depth=3, prelude=1, core=2),  # duo-causal, coda of 1 layer
        dict(method="anira-e", max_depth=3, prelude=1, core=2),  # same-depth attention
        dict(method="tah2", max_depth=2),  # whole-stack loop, no coda
    ],
)
@pytest.mark.parametrize("split", [False, True])
def test_forced_depths_from_one_forward_equal_separate_passes(tok, loop, split, monkeypatch):
    """forced_depths_argmax (one depth-D forward, every depth read out at the kept positions) gives, row by
    row, what argmax_pass with depth=d gives for every d: row correctness, token correctness, step depths;
    also when its memory budget splits every batch into one-row forwards (``split``)."""
    import retrofit
    import retrofit.evaluation.teacher_forced as TF

    if split:
        monkeypatch.setattr(TF, "_DEPTH_LOGITS_BUDGET", 1)
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.teacher_forced import argmax_pass, forced_depths_argmax
    from retrofit.testing import perturb_updater, tiny_base

    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = retrofit.convert(tiny_base("llama", seed=4), retrofit.LoopConfig(**loop)).eval()
        with torch.no_grad():
            perturb_updater(model, 0.5)  # depths really differ
    rows = R.task_rows("mano", [2, 3, 4], n=4, seed=5)
    opts = EvalOptions(accuracy="teacher_forced_argmax", progress=False, batch_size=5)
    examples = prepare(rows, tok, opts)
    info, is_stop = model_info(model), stop_rule(model, tok)
    max_new = max(len(e.answer_ids) for e in examples) + 2
    got = forced_depths_argmax(model, info, examples, pad_id(tok), opts, is_stop, max_new, "tf")
    assert sorted(got) == list(range(1, loop["max_depth"] + 1))
    differ = 0
    for d, res in got.items():
        ref = argmax_pass(model, info, examples, pad_id(tok), opts, is_stop, max_new, "tf", depth=d)
        for a, b in zip(res, ref):
            assert a["row_correct"] == b["row_correct"]
            assert a["token_correct"].tolist() == b["token_correct"].tolist()
            assert a["step_depths"].tolist() == b["step_depths"].tolist() == [d] * len(b["step_depths"])
        differ += any(
            x["token_correct"].tolist() != y["token_correct"].tolist() for x, y in zip(res, got[1])
        )  # depths disagree somewhere: a mix-up of depths would show
    assert differ >= 1


# ----------------------------------------------------------------------------------------------
# LANO / BREVO on the model's own strings
# ----------------------------------------------------------------------------------------------


def _gen(tok, text, stop="\n"):
    ids = tok(text + stop, add_special_tokens=False)["input_ids"]
    return {"ids": ids, "text": tok.decode(ids, skip_special_tokens=True), "depths": [1] * len(ids)}


def test_generated_examples_keep_the_valid_prefix(tok):
    from data_prep import brevo, lano
    from data_prep.tasks import build_dataset
    from retrofit.evaluation.decoding import stop_rule
    from retrofit.evaluation.structure import generated_examples

    is_stop = stop_rule(tiny_base_for_stop(), tok)
    rows = build_dataset("lano", [9, 10], 1, seed=2).to_list()
    exs = prepare(rows, tok, EvalOptions())
    w0, w1 = rows[0]["answer"].split(), rows[1]["answer"].split()
    gens = [_gen(tok, " " + " ".join(w0)), _gen(tok, " " + " ".join(w1[:4] + ["z"] + w1[5:]))]
    out, stats = generated_examples("lano", exs, gens, tok, is_stop)
    assert stats == {"rows": 2, "rows_used": 2, "words_generated": 19, "words_valid": 13, "rows_fully_valid": 1}
    assert out[0].features == lano.token_features(w0) and out[1].features == lano.token_features(w1[:4])
    for e, words in zip(out, (w0, w1[:4])):
        # each valid word's first token is that word's character, in the generated ids (stop token dropped)
        assert [tok.decode([e.answer_ids[k]]) for k in e.first_tok] == words
        assert not is_stop(e.answer_ids[-1])
    # BREVO: another valid order is analysed along that order; an invalid start gives nothing
    rows = [r for r in build_dataset("brevo", [6, 7, 8], 4, seed=1).to_list() if len(r["answer"].split()) >= 3]
    exs = prepare(rows, tok, EvalOptions())
    gens, orders = [], []
    for r in rows:
        edges, query = brevo.parse_prompt(r["prompt"])
        order = r["answer"].split()
        alt = next(
            (
                order[:i] + [order[i + 1], order[i]] + order[i + 2 :]
                for i in range(len(order) - 1)
                if brevo.is_valid_answer(edges, query, order[:i] + [order[i + 1], order[i]] + order[i + 2 :])
            ),
            order,
        )
        orders.append((edges, query, alt))
        gens.append(_gen(tok, " " + " ".join(alt)))
    gens.append(_gen(tok, " " + query))  # the query is not its own dependency
    out, stats = generated_examples("brevo", exs + exs[-1:], gens, tok, is_stop)
    assert stats["rows_used"] == len(rows) and stats["rows_fully_valid"] == len(rows)
    for e, (edges, query, alt) in zip(out, orders):
        assert e.features == brevo.order_features(edges, query, alt)


def tiny_base_for_stop():
    from retrofit.testing import tiny_base

    return tiny_base("llama")


def test_lano_spearman_on_generated_strings_vs_bruteforce(tok, monkeypatch):
    """The default LANO analysis: the model's own (here scripted) strings, their valid prefix, E[d] at
    each word's own position ("input"), pooled Spearman — recomputed by hand, unbatched."""
    import retrofit.evaluation.task_eval as TE
    from data_prep import lano
    from data_prep.tasks import build_dataset

    looped = _looped(seed=4)  # its expected depths vary on these rows

    rows = build_dataset("lano", [8, 10], 2, seed=6).to_list()
    scripted = []
    for r in rows:
        words = r["answer"].split()
        scripted.append(_gen(tok, " " + " ".join(words[:-2] + ["z"])))  # the last words go wrong

    def fake_generate(model, tokenizer, prompts, max_new, **kw):
        assert len(prompts) == len(scripted)
        return scripted

    monkeypatch.setattr(TE, "greedy_generate", fake_generate)
    res = R.evaluate_task(looped, tok, "lano", rows=rows, progress=False, forced_depths=False, exit_policies=False)
    assert res["structure_strings"]["words_valid"] == sum(len(r["answer"].split()) - 2 for r in rows)
    depths, feats = [], []
    for r, g in zip(rows, scripted):
        prompt_ids = tok(r["prompt"])["input_ids"]
        ids = g["ids"][:-1]  # without the stop token
        with torch.no_grad():
            out = looped(torch.tensor([prompt_ids + ids]))
        exp_depth = (out.depth_probs[0] * torch.arange(1, 4)).sum(-1)
        words = r["answer"].split()[:-2]
        text = tok.decode(ids)
        starts = [m.start() for m in re.finditer(r"\S+", text)][: len(words)]
        depths += [float(exp_depth[len(prompt_ids) + s]) for s in starts]  # char tokenizer: char i = token i
        feats += lano.token_features(words)
    for proxy in A.LANO_PROXIES:
        ref = scipy.stats.spearmanr(depths, [f[proxy] for f in feats]).statistic
        got = res["spearman"][proxy]["rho"]
        assert got == pytest.approx(ref, abs=1e-6) or (math.isnan(got) and math.isnan(ref)), proxy
        assert res["spearman"][proxy]["n"] == len(depths)
    assert np.std(depths) > 0.05 and not math.isnan(res["spearman"]["multiplications"]["rho"])


def test_splits_pool_training_and_held_out_levels(looped, tok):
    """``splits`` pools the rows of the training levels and of the other levels: accuracy = the share of
    right rows, counted by hand on planted answers, with the Wilson interval of that count."""
    from data_prep.common import first_line
    from retrofit.evaluation.decoding import greedy_generate
    from retrofit.evaluation.rows import task_rows
    from retrofit.evaluation.stats import wilson_interval

    rows = task_rows("mano", [1, 2, 3], n=2, seed=0)
    gens = greedy_generate(looped, tok, [e.prompt_ids for e in prepare(rows, tok, EvalOptions())], 6)
    planted = (0, 2, 3)  # one row of level 1 (training) and both rows of level 2 (held out)
    for i in planted:
        assert first_line(gens[i]["text"]).strip(), "the planted answer must hold a character"
        rows[i]["answer"] = first_line(gens[i]["text"]).strip()
    res = R.evaluate(
        looped,
        tok,
        "mano",
        rows={"mano": rows},
        train_levels=[1, 3],
        progress=False,
        forced_depths=False,
        exit_policies=False,
        max_new_tokens=6,
    )
    t = res["models"]["model"]["tasks"]["mano"]
    right = {i for i in range(len(rows)) if i in planted}  # a random model gets nothing else right
    assert sum(e["accuracy"] * e["n"] for e in t["levels"].values()) == pytest.approx(len(right))
    for name, levels in (("train", [1, 3]), ("held_out", [2])):
        s = t["splits"][name]
        idx = [i for i, r in enumerate(rows) if r["difficulty"] in levels]
        k = len(right.intersection(idx))
        assert s["levels"] == levels and s["n"] == len(idx)
        assert s["accuracy"] == pytest.approx(k / len(idx))
        assert s["accuracy_ci"] == pytest.approx(list(wilson_interval(k, len(idx), 0.95)))
    assert res["config"]["train_levels"] == {"mano": [1, 3]} and res["config"]["held_out_levels"] == {"mano": [2]}
