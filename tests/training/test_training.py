"""RetrofitSFTTrainer: the real looped forward, auxiliary losses, metrics, bad data, NaN guard,
atomic checkpoints and resume (CPU, tiny models, a few steps each)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from references import direct_kl_to_prior, hand_decider_loss, next_token_ce
from sft_setup import LOGGED_RUN, sft_config
from transformers import TrainerCallback

import retrofit
from retrofit.testing import char_tokenizer, perturb_updater, tiny_base
from retrofit.training import (
    BadDataError,
    NonFiniteLossError,
    RetrofitSFTConfig,
    RetrofitSFTTrainer,
    format_sft_dataset,
)
from retrofit.training.checkpointing import (
    assert_safetensors_only,
    atomic_dir,
    commit,
    is_complete_checkpoint,
    last_checkpoint,
    remove_stale_staging,
    staging_path,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(n=48):
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)][:n]


def make_dataset(n=48, chat=False):
    ds, _ = format_sft_dataset(datasets.Dataset.from_list(rows(n)), chat=chat)
    return ds


def make_model(method="tah2", max_depth=2, seed=0, **loop):
    if method.startswith("anira"):
        loop = {"prelude": 1, "core": 4, **loop}
    torch.manual_seed(seed)  # the heads' init draws from the global RNG
    return retrofit.convert(
        tiny_base("llama", seed=seed), retrofit.LoopConfig.from_fields(dict(max_depth=max_depth, method=method, **loop))
    )


def make_args(tmp_path, **kw):
    return sft_config(
        tmp_path, **{"max_steps": 3, "learning_rate": 1e-3, **LOGGED_RUN, "lr_scheduler_type": "constant", **kw}
    )


def make_trainer(tmp_path, method="tah2", train=None, model=None, callbacks=None, eval_dataset=None, **kw):
    model = model if model is not None else make_model(method)
    return RetrofitSFTTrainer(
        model,
        make_args(tmp_path, **kw),
        train_dataset=train if train is not None else make_dataset(),
        eval_dataset=eval_dataset,
        processing_class=char_tokenizer(),
        callbacks=callbacks,
    )


def step_losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    args = RetrofitSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert args.bf16 is False  # TRL's default (True) is turned off on CPU
    assert args.ddp_find_unused_parameters is True
    for bad, match in [
        (dict(truncate_backprop=0), "truncate_backprop"),
        (dict(random_depth_mean=0.5), "random_depth_mean"),
    ]:
        with pytest.raises(ValueError, match=match):
            RetrofitSFTConfig(output_dir=str(tmp_path), use_cpu=True, **bad)
    # the loss weights are the model's, declared once (LoopConfig): not a trainer field
    with pytest.raises(TypeError, match="rho"):
        RetrofitSFTConfig(output_dir=str(tmp_path), use_cpu=True, rho=1.0)


def test_every_setting_is_declared_once():
    """The recipes' loop flags are made from ``LoopConfig`` (same names, types, defaults, help); the trainer's config
    shares no name with them, so no copy carries another default and nothing is written back into the model."""
    import typing

    from retrofit.model.config import LoopConfig
    from retrofit.training.model_setup import LoopArgs, ModelArgs

    loop = {f.name: f for f in dataclasses.fields(LoopConfig) if f.name not in ("options", "extra")}
    args = {
        f.name: f for f in dataclasses.fields(LoopArgs) if f.name not in {g.name for g in dataclasses.fields(ModelArgs)}
    }
    assert set(args) == set(loop)
    hints_loop, hints_args = typing.get_type_hints(LoopConfig), typing.get_type_hints(LoopArgs)
    for name, f in loop.items():
        assert args[name].default == f.default and args[name].metadata["help"] == f.metadata["help"], name
        assert hints_args[name] == hints_loop[name], name
        assert f.metadata["help"], f"LoopConfig.{name} has no help"
    trainer_fields = {f.name for f in dataclasses.fields(RetrofitSFTConfig)}
    assert not (trainer_fields & set(loop)), trainer_fields & set(loop)
    # each method's own options: one flag each, its help the option's own, default None (= the method's default);
    # neither LoopConfig nor the trainer declares them again
    from retrofit.model import registry
    from retrofit.training.model_setup import loop_args_class

    flags = {f.name: f for f in dataclasses.fields(loop_args_class())}
    for name, (f, owners) in registry.option_fields().items():
        assert flags[name].default is None and flags[name].metadata["help"].endswith(f.metadata["help"]), name
        assert name not in loop and name not in trainer_fields, name
        assert flags[name].metadata["help"].startswith(" / ".join(owners) + ": "), name


# ------------------------------------------------------------------------------------------------
# bad data
# ------------------------------------------------------------------------------------------------
def test_format_sft_dataset_reports_and_skips_bad_rows():
    raw = datasets.Dataset.from_list(
        [
            {"prompt": "1+1=", "answer": "2"},
            {"prompt": "2+2=", "answer": ""},
            {"prompt": "3+3=", "answer": "   "},
            {"prompt": None, "answer": "6"},
            {"prompt": "4+4=", "answer": "8"},
        ]
    )
    ds, report = format_sft_dataset(raw)
    assert report == {"rows": 5, "kept": 2, "empty_completion": 2, "malformed": 1}
    # a task row's answer follows its prompt after the separator retrofit eval scores (TRL joins prompt + completion)
    assert ds["prompt"] == ["1+1=", "4+4="] and ds["completion"] == [" 2", " 8"]
    assert "answer" not in ds.column_names
    assert format_sft_dataset(raw, answer_sep="")[0]["completion"] == ["2", "8"]
    chat, _ = format_sft_dataset(raw, chat=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": "1+1="}]
    assert chat[0]["completion"] == [{"role": "assistant", "content": "2"}]
    # a completion column is the user's own text: verbatim
    verbatim, _ = format_sft_dataset(datasets.Dataset.from_list([{"prompt": "Q:", "completion": "a"}]))
    assert verbatim["completion"] == ["a"]


def test_sft_text_is_the_text_retrofit_eval_scores():
    """The training text (TRL: prompt + completion) of a task row equals retrofit eval's prompt + answer segment,
    token for token, in raw and chat mode."""
    from data_prep.tasks import build_dataset
    from retrofit.evaluation.options import EvalOptions
    from retrofit.evaluation.rows import prepare
    from retrofit.testing import char_tokenizer

    tok = char_tokenizer()
    rows = build_dataset("mano", [2], 3, seed=0).to_list() + build_dataset("brevo", [4], 3, seed=0).to_list()
    ds, _ = format_sft_dataset(datasets.Dataset.from_list(rows))
    for ex, r in zip(prepare(rows, tok, EvalOptions()), ds):
        assert r["prompt"] + r["completion"] == r["prompt"] + ex.segment
        full = tok(r["prompt"] + r["completion"])["input_ids"]
        assert full == ex.prompt_ids + ex.answer_ids


def test_format_sft_dataset_errors():
    with pytest.raises(BadDataError, match=r"lacks column\(s\) \['prompt'\].*completion"):
        format_sft_dataset(datasets.Dataset.from_list([{"question": "q", "answer": "a"}]))
    with pytest.raises(BadDataError, match="answer"):
        format_sft_dataset(datasets.Dataset.from_list([{"prompt": "q", "text": "a"}]))
    with pytest.raises(BadDataError, match="no usable row"):
        format_sft_dataset(datasets.Dataset.from_list([{"prompt": "q", "completion": ""}]))


def test_trainer_skips_rows_longer_than_max_length(tmp_path):
    raw = rows(12) + [{"prompt": "9" * 40, "answer": "1"}, {"prompt": "1+2=", "answer": "3" * 50}]
    ds, _ = format_sft_dataset(datasets.Dataset.from_list(raw))
    tr = make_trainer(tmp_path, train=ds, max_steps=1)
    assert tr.data_report["train"] == {"rows": 14, "kept": 12, "too_long": 2, "no_trainable_token": 0}
    assert max(len(x) for x in tr.train_dataset["input_ids"]) <= 32
    tr.train()
    with pytest.raises(BadDataError, match="max_length"):
        make_trainer(tmp_path, train=ds.select([12, 13]), max_steps=1)


def test_trainer_rejects_a_plain_model(tmp_path):
    with pytest.raises(TypeError, match="looped"):
        make_trainer(tmp_path, model=tiny_base("llama"))
    with pytest.raises(TypeError, match="RetrofitSFTConfig"):
        from trl import SFTConfig

        RetrofitSFTTrainer(
            make_model(), SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False), train_dataset=make_dataset()
        )


# ------------------------------------------------------------------------------------------------
# the loss is the looped model's
# ------------------------------------------------------------------------------------------------
def _one_batch(trainer):
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(batch)


def test_compute_loss_runs_the_looped_forward_plus_aux(tmp_path):
    tr = make_trainer(tmp_path, "tah2")
    model = tr.model.train()
    perturb_updater(model, 0.5)  # a residual updater reproduces depth 1 at init: make depth 2 differ
    inputs = _one_batch(tr)
    loss = tr.compute_loss(model, dict(inputs))
    ref = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"])
    l_d, n = hand_decider_loss(ref.depth_nll, inputs["labels"], ref.halt_logits)
    assert n > 0
    expected = next_token_ce(ref.logits, inputs["labels"]) + 0.05 * l_d
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(ref.loss, expected, atol=1e-6)  # the model's own loss holds the same (no double count)


@pytest.mark.parametrize("method", ["anira-e", "anira-o", "fixed"])
def test_compute_loss_other_methods(tmp_path, method):
    tr = make_trainer(tmp_path, model=make_model(method, **({} if method == "fixed" else {"gamma": 0.5})))
    model = tr.model.eval()  # eval: no sampling, so a second forward reproduces the first
    if method != "fixed":
        assert model.loop.method_options.gamma == 0.5  # the model's own weight (the trainer has none)
    inputs = _one_batch(tr)
    with torch.no_grad():
        loss = tr.compute_loss(model, dict(inputs))
        ref = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"])
    expected = next_token_ce(ref.logits, inputs["labels"])
    if method != "fixed":
        kl = direct_kl_to_prior(ref.depth_probs, 2.0)[inputs["attention_mask"].bool()].mean()
        expected = expected + 0.5 * kl.float()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert (ref.aux_loss is None) == (method == "fixed")


def test_loss_weights_live_in_the_model_config(tmp_path):
    """The trainer uses the model's LoopConfig weights, and writes nothing into the model's config: the saved
    checkpoint records what the model was built with; a bad weight fails where it is declared."""
    model = make_model("tah2", alpha_d=0.07, rho=1.0)
    before = dict(model.config.loop)
    tr = make_trainer(tmp_path, model=model)
    opts = tr.model.loop.method_options
    assert (opts.alpha_d, opts.rho) == (0.07, 1.0) and dict(tr.model.config.loop) == before
    tr.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["loop"]["options"]["alpha_d"] == 0.07 and saved["loop"]["options"]["rho"] == 1.0
    assert "alpha_d" not in saved["loop"]  # declared once: in the method's options
    with pytest.raises(ValueError, match="rho"):
        make_model("tah2", rho=2.0)


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------
def test_metrics_are_logged_to_tensorboard(tmp_path):
    tr = make_trainer(
        tmp_path,
        "tah2",
        max_steps=2,
        report_to="tensorboard",
        eval_dataset=make_dataset(8),
        eval_strategy="steps",
        eval_steps=2,
    )
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    for key in (
        "ntp_loss",
        "aux_loss",
        "mean_depth",
        "mean_depth_answer",
        "depth_frac_1",
        "depth_frac_2",
        "decider_loss",
        "kappa",
        "continue_label_rate",
        "mean_token_accuracy",
    ):
        assert key in logs[0], key
    for h in logs:
        assert h["depth_frac_1"] + h["depth_frac_2"] == pytest.approx(1.0)
        assert 1.0 <= h["mean_depth"] <= 2.0
        assert h["mean_depth"] == pytest.approx(h["depth_frac_1"] + 2 * h["depth_frac_2"], abs=1e-5)
        assert h["loss"] == pytest.approx(h["ntp_loss"] + h["aux_loss"], rel=1e-4)
    ev = [h for h in tr.state.log_history if "eval_loss" in h][0]
    assert "eval_mean_depth" in ev and "eval_decider_loss" in ev

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(Path(tmp_path).rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert {"train/mean_depth", "train/decider_loss", "train/depth_frac_2"} <= set(acc.Tags()["scalars"])
    assert "train/depth_histogram" in acc.Tags()["histograms"]
    h = acc.Histograms("train/depth_histogram")[-1].histogram_value
    assert sum(h.bucket) == h.num > 0


# ------------------------------------------------------------------------------------------------
# invariants
# ------------------------------------------------------------------------------------------------
def test_gradient_accumulation_matches_a_big_batch(tmp_path):
    """batch 4 × accumulation 1 = batch 1 × accumulation 4 (token-weighted NLL, fixed method)."""
    params = []
    for bs, ga in [(4, 1), (1, 4)]:
        tr = make_trainer(
            tmp_path / f"{bs}x{ga}",
            "fixed",
            max_steps=1,
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            learning_rate=1e-2,
            optim="sgd",
            max_grad_norm=0,
        )
        tr.train()
        params.append(torch.cat([p.detach().flatten() for p in tr.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6)


def test_decider_gradients_of_a_batch_equal_its_accumulated_halves(tmp_path):
    """Batch 4 × 1 step = batch 2 × 2 accumulation steps for the decider's gradients (one process), under the
    TaH2 release's normalizer: the decider loss divided by the global ``num_items_in_batch`` and scaled like the LM
    loss. Its labels and weights are made independent of the batch (ρ = 1 keeps every positive gain: "continue"
    iff δ > 0; uniform weights; a static pos_weight). The rows have different numbers of labelled tokens, so the
    per-micro-batch normalizer (``decider_loss_scope="local"``) breaks the invariant."""
    from retrofit.testing import spread_decider

    tr = make_trainer(tmp_path, model=make_model("tah2", rho=1.0, decider_weighting="uniform", dyn_pos_weight=False))
    model = tr.model.train()
    spread_decider(model, logit_std=2.0, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(4, 104, (4, 12), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    for i, prompt in enumerate([2, 7, 3, 9]):
        labels[i, :prompt] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    n_items = (labels[:, 1:] != -100).sum()
    params = [p for n, p in model.named_parameters() if n.startswith("halting.")]

    def grads(micro_batches):
        tr.current_gradient_accumulation_steps = len(micro_batches)
        model.zero_grad()
        for b in micro_batches:
            tr.compute_loss(model, dict(b), num_items_in_batch=n_items).backward()
        return torch.cat([p.grad.flatten() for p in params])

    assert model.halting.aux_loss_per_item(model.loop.method_options)
    one, two = grads([batch]), grads(halves)
    assert one.abs().max() > 0
    torch.testing.assert_close(two, one, atol=1e-7, rtol=1e-5)
    model.config.loop = {
        **model.config.loop,
        "options": {**model.config.loop["options"], "decider_loss_scope": "local"},
    }
    assert (grads(halves) - grads([batch])).abs().max() > 1e-6


@pytest.mark.parametrize("decay_norms", [True, False])
def test_decay_norms_puts_norm_weights_in_the_decayed_group(tmp_path, decay_norms):
    """``decay_norms`` (the TaH2 release): weight decay on every parameter but biases, norm weights included;
    off: transformers' rule (no decay on biases and on the norms it knows by name: the backbone's; the heads'
    ``norm_e`` & co. are not among them). ANIRA-O's decider has biases; the head groups of a ``heads_lr_scale``
    keep their decay."""
    trainer = make_trainer(tmp_path, "anira-o", weight_decay=0.01, decay_norms=decay_norms, heads_lr_scale=3.0)
    opt = trainer.create_optimizer()
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    named = dict(trainer.model.named_parameters())
    norms = [n for n in named if "norm" in n and n.startswith("model.")]
    biases = [n for n in named if n.endswith(".bias")]
    matrices = [n for n, p in named.items() if p.dim() == 2]
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= set(norms)
    assert biases and {n.split(".")[0] for n in biases} == {"halting"}
    assert {wd[id(named[n])] for n in norms} == {0.01 if decay_norms else 0.0}
    assert wd[id(named["updater.norm_e.weight"])] == 0.01
    assert {wd[id(named[n])] for n in biases} == {0.0}
    assert {wd[id(named[n])] for n in matrices} == {0.01}


def test_random_depth_and_truncated_backprop_reach_the_forward(tmp_path):
    tr = make_trainer(tmp_path, "fixed", max_steps=8, random_depth=True, random_depth_mean=2.0, truncate_backprop=1)
    calls = []
    orig = tr.model.forward

    def spy(*a, **kw):
        calls.append((kw.get("depth"), kw.get("backprop_depth")))
        return orig(*a, **kw)

    tr.model.forward = spy
    tr.train()
    depths = [c[0] for c in calls]
    assert all(b == 1 for _, b in calls)
    assert set(depths) <= {1, 2} and len(set(depths)) == 2
    logged = [h["mean_depth"] for h in tr.state.log_history if "loss" in h]
    assert logged == [float(d) for d in depths]


# ------------------------------------------------------------------------------------------------
# NaN guard
# ------------------------------------------------------------------------------------------------
class _PoisonAt(TrainerCallback):
    """Sets a weight to NaN right before optimizer step ``step`` runs."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.updater.norm_e.weight[0] = float("nan")


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    tr = make_trainer(tmp_path, "tah2", max_steps=5, save_strategy="steps", save_steps=1, callbacks=[_PoisonAt(3)])
    with pytest.raises(NonFiniteLossError, match=r"step 3\b.*checkpoint-2"):
        tr.train()
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert not (tmp_path / "checkpoint-3").exists()
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


# ------------------------------------------------------------------------------------------------
# atomic checkpoints
# ------------------------------------------------------------------------------------------------
def test_commit_and_atomic_dir(tmp_path):
    final = tmp_path / "final"
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("1")
        assert not final.exists()
    assert (final / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a.txt").write_text("2")
            raise RuntimeError("disk full")
    assert (final / "a.txt").read_text() == "1"  # the old version survives a failed save
    assert not staging_path(final).exists()
    with atomic_dir(final) as tmp:
        (tmp / "b.txt").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    with pytest.raises(FileNotFoundError):
        commit(tmp_path / "nope", final)


def test_last_checkpoint_ignores_staging_and_incomplete(tmp_path):
    from safetensors.torch import save_file

    for step, complete in [(2, True), (5, False)]:
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:  # last_checkpoint also validates what it finds (tests/training/test_reliability_checkpoints.py)
            (d / "trainer_state.json").write_text('{"global_step": 2}')
            save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    (tmp_path / ".staging-checkpoint-9" / "checkpoint-9").mkdir(parents=True)
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert not is_complete_checkpoint(tmp_path / "checkpoint-5")
    assert remove_stale_staging(tmp_path) == [str(tmp_path / ".staging-checkpoint-9")]
    assert last_checkpoint(tmp_path / "missing") is None


def test_interrupted_save_leaves_no_valid_checkpoint(tmp_path, monkeypatch):
    tr = make_trainer(tmp_path, "fixed", max_steps=4, save_strategy="steps", save_steps=2)
    orig = tr._save_optimizer_and_scheduler

    def crash(output_dir):
        if tr.state.global_step == 4:
            raise OSError("simulated crash mid-save")  # model weights are already written
        return orig(output_dir)

    monkeypatch.setattr(tr, "_save_optimizer_and_scheduler", crash)
    with pytest.raises(OSError, match="mid-save"):
        tr.train()
    assert not (tmp_path / "checkpoint-4").exists()
    staged = tmp_path / ".staging-checkpoint-4" / "checkpoint-4"
    assert (staged / "model.safetensors").exists()  # the partial save is only in the staging folder
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert is_complete_checkpoint(tmp_path / "checkpoint-2")
    assert_safetensors_only(tmp_path / "checkpoint-2")
    # the next trainer in this folder clears the leftovers
    make_trainer(tmp_path, "fixed", max_steps=1)
    assert not (tmp_path / ".staging-checkpoint-4").exists()


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------
class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("method", ["tah2", "anira-o"])
def test_resume_gives_the_same_loss_trajectory(tmp_path, method):
    """6 uninterrupted steps = 3 steps, stop, resume from checkpoint-3 in a fresh trainer, 3 more."""
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3, learning_rate=3e-3, lr_scheduler_type="linear")
    full = make_trainer(tmp_path / "full", method, **kw)
    full.train()
    a = step_losses(full)

    first = make_trainer(tmp_path / "split", method, callbacks=[_StopAt(3)], **kw)
    first.train()
    ckpt = last_checkpoint(tmp_path / "split")
    assert ckpt == str(tmp_path / "split" / "checkpoint-3")
    second = make_trainer(tmp_path / "split", method, model=make_model(method, seed=1), **kw)  # other init: must load
    second.train(resume_from_checkpoint=ckpt)
    b = {**step_losses(first), **step_losses(second)}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-6), (s, a, b)
    state = json.loads((tmp_path / "split" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert_safetensors_only(tmp_path / "split" / "checkpoint-6")
    assert math.isfinite(a[6])


def test_eval_mode_loss_includes_the_decider_loss(tmp_path):
    tr = make_trainer(tmp_path, "tah2", max_steps=1)
    raw = rows(8) + [{"prompt": "7" * 60, "answer": "1"}]
    ds, _ = format_sft_dataset(datasets.Dataset.from_list(raw))
    metrics = tr.evaluate(ds)
    assert tr.data_report["eval"] == {"rows": 9, "kept": 8, "too_long": 1, "no_trainable_token": 0}
    assert "eval_decider_loss" in metrics and math.isfinite(metrics["eval_loss"])
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_ntp_loss"] + metrics["eval_aux_loss"], rel=1e-4)


def test_heads_get_their_own_learning_rate(tmp_path):
    trainer = make_trainer(tmp_path, heads_lr_scale=10.0)
    opt = trainer.create_optimizer()
    model = trainer.model
    head_ids = {id(p) for n, p in model.named_parameters() if n.startswith(("updater.", "halting."))}
    lrs = {}
    for g in opt.param_groups:
        for p in g["params"]:
            lrs[id(p)] = g["lr"]
    assert head_ids and all(lrs[i] == trainer.args.learning_rate * 10.0 for i in head_ids)
    others = [lrs[id(p)] for n, p in model.named_parameters() if p.requires_grad and id(p) not in head_ids]
    assert others and all(lr == trainer.args.learning_rate for lr in others)
    assert sum(len(g["params"]) for g in opt.param_groups) == sum(1 for p in model.parameters() if p.requires_grad)
    # one scale, one set of groups: the updater and the decider share them (the layout older checkpoints saved)
    name = {id(p): n for n, p in model.named_parameters()}
    kinds = [{name[id(p)].split(".")[0] for p in g["params"]} for g in opt.param_groups]
    assert {"updater", "halting"} in kinds


def test_decider_gets_its_own_learning_rate(tmp_path):
    trainer = make_trainer(tmp_path, "tah2", heads_lr_scale=10.0, decider_lr_scale=3.0)
    opt = trainer.create_optimizer()
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    lr = trainer.args.learning_rate
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    want = {
        n: lr * 10.0 if n.startswith("updater.") else lr * 3.0 if n.startswith("halting.") else lr for n, _ in named
    }
    assert {n: lrs[id(p)] for n, p in named} == pytest.approx(want)
    assert any(n.startswith("halting.") for n, _ in named) and any(n.startswith("updater.") for n, _ in named)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)
    with pytest.raises(ValueError, match="decider_lr_scale must be a positive number"):
        make_trainer(tmp_path, "tah2", decider_lr_scale=0.0)


def test_run_folder_card_is_retrofits(tmp_path):
    """The README.md TRL writes next to checkpoints is retrofit's card, not "a fine-tuned version of [None]"."""
    from retrofit.hub.model_card import split_front_matter

    model = make_model("tah2")
    model.config.retrofit_base_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tr = make_trainer(tmp_path, model=model, max_steps=1, save_strategy="steps", save_steps=1)
    tr.train()
    assert (tmp_path / "checkpoint-1").is_dir()
    meta, body = split_front_matter((tmp_path / "README.md").read_text())
    assert "[None]" not in body and "fine-tuned version" not in body
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "tah2" in meta["tags"]
    assert "| max depth D | 2 |" in body and "retrofit export" in body
