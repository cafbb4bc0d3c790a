"""Search for a main-job configuration in which the looped model beats a same-budget plain fine-tune.

Each configuration trains, in one process, on the embedded SmolLM2-135M-Instruct:

- the looped arm (TaH2 by default),
- the SFT control: the same base, data, data order, steps, learning rate and seed, as a plain causal LM
  (trained once per distinct control setting and cached within the sweep),
- optionally the fixed-depth control (the looped model forced to max depth for every token),

and scores them on a *validation* split (rows disjoint from training and from the main job's test rows;
configurations are never chosen on test rows). Accuracy is greedy exact match computed from one
teacher-forced forward (a row is right iff every completion token, EOS included, is the argmax given the
gold prefix; decisions are causal, so this equals greedy decoding). Prints one JSON line per configuration
and writes a Markdown table.

    OMP_NUM_THREADS=2 python scripts/sweep_main_job.py --grid default --out docs/sweeps/main_job.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import set_seed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.tasks import build_splits
from retrofit import LoopConfig, convert
from retrofit.training import RetrofitSFTConfig, RetrofitSFTTrainer, format_sft_dataset


@dataclass
class Cfg:
    name: str = "base"
    task: str = "clrs_sorting"
    train_levels: tuple = (4, 5, 6)
    extrap_levels: tuple = (8,)
    n_train: int = 400
    n_valid: int = 60
    steps: int = 240
    batch: int = 8
    lr: float = 1e-4
    heads_lr_scale: float = 20.0
    decider_lr_scale: float | None = None  # None = heads_lr_scale
    prelude: int = 20
    core: int | None = 6
    max_depth: int = 2
    method: str = "tah2"
    attention: str | None = None
    deep_init_logit: float = 1.0
    updater_base: str = "input"  # "state": x_{d+1} = h_d + U(e, h_d)
    depth_warmup: int = 0  # (the 2026-12-01 rows) first N steps at forced max depth, the decider learning its labels
    depth_warmup_steps: int = 0  # RetrofitSFTConfig.depth_warmup_steps: deep supervision, no decider, first N steps
    threshold_warmup_steps: int = 0  # TaH2: τ ramps from 0 over N steps after the depth warm-up
    depth_schedule: str | None = None  # "STEP:DEPTH,..." depth curriculum
    # TaH2's decider and loss (LoopConfig / LossConfig); the defaults reproduce the 2026-12-01 rows
    decider_arch: str = "ffn"
    decider_top_k: int = 10
    mixture_output: bool = True
    dyn_pos_weight: bool = False
    cost_min: float = 0.0
    cost_max: float | None = None
    decider_loss_norm: str = "weights"
    bce_margin: float = 0.0
    # chosen before the release options existed; the study of issue 31 re-chooses them (docs/tah2.md)
    updater: str = "residual"
    decider_state: str = "core"
    decider_topk_grad: bool = False
    decider_width_rule: str = "quarter"
    decider_init: str = "normal"
    padding_stops: bool = False
    kappa_scope: str = "pooled"
    kappa_gather: bool = False
    decider_loss_scope: str = "local"
    gamma: float = 0.01  # ANIRA's KL weight
    prior_base: float = 2.0
    freeze_prelude: bool = True
    alpha_d: float = 0.05
    rho: float = 0.99
    lora_r: int = 16
    updater_hidden: int | None = None
    lora: bool = False
    lora_on_prelude: bool = False  # True = adapters on the frozen prelude too (the sweep's first LoRA row)
    seed: int = 0
    max_length: int = 96
    padding_free: bool = False  # the main job's preset trains padding-free (same loss, less compute)
    arms: tuple = ("looped", "sft")


_BASE = None


def base_model():
    global _BASE
    if _BASE is None:
        from retrofit.hub.loading import load_model

        _BASE = load_model("smollm2", dtype=torch.float32)
    m, tok = _BASE
    return copy.deepcopy(m), tok


def splits_for(c: Cfg):
    """Training rows and the validation rows (disjoint from train and from up to 100 test rows per level,
    so the main job's ``--n_eval`` <= 100 test rows were never scored here)."""
    sp = build_splits(
        c.task,
        n_train=c.n_train,
        n_eval=100,
        seed=c.seed,
        train_levels=list(c.train_levels),
        extrap_levels=list(c.extrap_levels),
        interp_levels=[],
        n_valid=c.n_valid,
    )
    return sp["train"], sp["valid"].select_columns(["prompt", "answer", "difficulty"])


def freeze(model, n_prelude: int):
    inner = model.model
    inner.embed_tokens.weight.requires_grad_(False)
    if model.lm_head.weight is not inner.embed_tokens.weight:
        model.lm_head.weight.requires_grad_(False)
    for layer in inner.layers[:n_prelude]:
        layer.requires_grad_(False)


def targs(c: Cfg, out: str) -> RetrofitSFTConfig:
    return RetrofitSFTConfig(
        output_dir=out,
        max_steps=c.steps,
        per_device_train_batch_size=c.batch,
        learning_rate=c.lr,
        heads_lr_scale=c.heads_lr_scale,
        decider_lr_scale=c.decider_lr_scale,
        padding_free=c.padding_free,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=c.seed,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        max_length=c.max_length,
        alpha_d=c.alpha_d,
        rho=c.rho,
        dyn_pos_weight=c.dyn_pos_weight,
        cost_min=c.cost_min,
        cost_max=float("inf") if c.cost_max is None else c.cost_max,
        decider_loss_norm=c.decider_loss_norm,
        bce_margin=c.bce_margin,
        gamma=c.gamma,
        prior_base=c.prior_base,
        depth_warmup_steps=c.depth_warmup_steps,
        threshold_warmup_steps=c.threshold_warmup_steps,
        depth_schedule=c.depth_schedule,
        train_sampling_strategy="sequential",
        activation_checkpointing=False,
        use_cpu=True,
        disable_tqdm=True,
        depth_histogram=False,
    )


def train_arm(c: Cfg, arm: str, train):
    set_seed(c.seed)
    base, tok = base_model()
    train = train.shuffle(seed=c.seed)  # one fixed order for every arm (sequential sampler)
    train_fmt, _ = format_sft_dataset(train, chat=False)
    if arm == "sft":
        loop = LoopConfig(prelude=0, core=None, max_depth=1, method="fixed")
    else:  # every LoopConfig field the Cfg names (split, method, decider, loss weights) comes from it
        loop = LoopConfig.from_fields(c, **({"method": "fixed"} if arm == "fixed" else {}))
    model = convert(base, loop)
    if arm != "sft" and c.updater_base == "state":
        import types

        upd = model.updater

        def fwd(self, e, h):
            z = torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1)
            return h + self.w2(self.act(self.w1(z)))

        upd.forward = types.MethodType(fwd, upd)
    if c.freeze_prelude:
        freeze(model, c.prelude)
    if c.lora:
        from retrofit.training import apply_lora

        # the SFT arm is converted with prelude 0: take the looped arms' prelude, so every arm adapts the same layers
        # (the first lora_on_prelude=False row, sort-lora-core, ran before this and adapted all layers of its SFT arm)
        n_layers = model.config.num_hidden_layers
        layers = list(range(c.prelude, n_layers)) if c.freeze_prelude and not c.lora_on_prelude else None
        model = apply_lora(model, r=c.lora_r, alpha=2 * c.lora_r, layers=layers)
    args = targs(c, f"/tmp/sweep/{c.name}-{arm}")
    trainer = RetrofitSFTTrainer(model, args, train_dataset=train_fmt, processing_class=tok)
    method = trainer._looped.halting
    info0 = {"trainable_M": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)}
    if arm == "looped" and c.depth_warmup > 0:
        orig = method.train_forward_kwargs

        def kw(cfg, step=0, _orig=orig):
            d = dict(_orig(cfg, step))
            if trainer.state.global_step < c.depth_warmup:
                d["depth"] = c.max_depth
            return d

        method.train_forward_kwargs = kw
    t0 = time.time()
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    info = {
        "train_s": round(time.time() - t0, 1),
        "final_loss": hist[-1]["loss"] if hist else None,
        "mean_depth_answer_last": hist[-1].get("mean_depth_answer") if hist else None,
        **info0,
    }
    if c.lora:
        model = model.merge_and_unload()
    model.eval()
    return model, tok, info


@torch.no_grad()
def _examples(tok, valid):
    fmt, _ = format_sft_dataset(valid, chat=False)
    eos = tok.eos_token
    exs = []
    for r in fmt:
        p_ids = tok(r["prompt"])["input_ids"]
        full = tok(r["prompt"] + r["completion"] + eos)["input_ids"]
        k = 0
        while k < min(len(p_ids), len(full)) and p_ids[k] == full[k]:
            k += 1
        exs.append((full, k))
    return exs


def _batches(tok, exs, batch):
    """Right-padded batches: ``(first row index, ids, mask, answer_steps [B, T] bool, chunk)``; the answer
    steps are the positions that produce an answer token (EOS included)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for i in range(0, len(exs), batch):
        chunk = exs[i : i + batch]
        T = max(len(f) for f, _ in chunk)
        ids = torch.full((len(chunk), T), pad)
        am = torch.zeros(len(chunk), T, dtype=torch.long)
        steps = torch.zeros(len(chunk), T, dtype=torch.bool)
        for j, (f, k) in enumerate(chunk):
            ids[j, : len(f)] = torch.tensor(f)
            am[j, : len(f)] = 1
            steps[j, k - 1 : len(f) - 1] = True
        yield i, ids, am, steps, chunk


@torch.no_grad()
def tf_eval(model, tok, valid, batch: int = 32, depth=None, policy=None, **kw):
    """Per row: exact (bool); per completion token: (row, depth, nll).

    ``policy(batch_index, answer_steps)`` -> an exit policy for that batch (random allocation); ``kw``: more
    forward arguments (``decider_threshold``)."""
    exs = _examples(tok, valid)
    exact, toks = [], []
    for n, (i, ids, am, steps, chunk) in enumerate(_batches(tok, exs, batch)):
        fkw = dict(kw)
        if depth is not None:
            fkw["depth"] = depth
        if policy is not None:
            fkw["exit_policy"] = policy(n, steps)
        out = model(input_ids=ids, attention_mask=am, use_cache=False, **fkw)
        logp = out.logits.float().log_softmax(-1)
        depths = out.depths if getattr(out, "depths", None) is not None else torch.ones_like(ids)
        for j, (f, k) in enumerate(chunk):
            pos = torch.arange(k - 1, len(f) - 1)
            tgt = torch.tensor(f[k:])
            pred = logp[j, pos].argmax(-1)
            exact.append(bool((pred == tgt).all()))
            nll = -logp[j, pos, tgt]
            for t in range(len(pos)):
                toks.append((i + j, int(depths[j, pos[t]]), float(nll[t])))
    return np.array(exact), toks


@torch.no_grad()
def gain_deciles(model, tok, valid, batch: int = 32) -> dict:
    """TaH2's own check of a decider: for every decision at an answer step, the realized gain of one more
    iteration (ℓ^(d) - ℓ^(d+1), the lookahead giving ℓ^(d*+1)) per decile of the continue probability."""
    exs = _examples(tok, valid)
    probs, gains = [], []
    method = model.loop.method
    for _, ids, am, steps, chunk in _batches(tok, exs, batch):
        labels = torch.where(F.pad(steps[:, :-1], (1, 0)), ids, torch.full_like(ids, -100))
        out = model(input_ids=ids, attention_mask=am, labels=labels, output_depth_losses=True)
        nll = out.depth_nll.double()  # [B, T, D]
        D = nll.shape[-1]
        for d in range(1, D):
            g = nll[..., d - 1] - nll[..., d]
            if method == "tah2":
                if out.halt_signals is None or out.halt_signals.shape[-1] < d:
                    continue
                c = out.halt_signals[..., d - 1]
            elif method == "anira-o":
                c = 1 - out.halt_signals[..., d - 1]
            else:  # anira-e: P(d* > d)
                c = 1 - out.depth_probs[..., :d].sum(-1)
            ok = steps & (out.depths >= d) & torch.isfinite(g)
            probs.append(c[ok].double())
            gains.append(g[ok])
    if not probs:
        return {}
    p, g = torch.cat(probs).numpy(), torch.cat(gains).numpy()
    order = np.argsort(p, kind="stable")
    parts = np.array_split(order, 10)
    table = [
        {"decile": i + 1, "n": len(ix), "mean_prob": float(p[ix].mean()), "mean_gain": float(g[ix].mean())}
        for i, ix in enumerate(parts)
        if len(ix)
    ]
    return {"table": table, "spearman": spearman([r["decile"] for r in table], [r["mean_gain"] for r in table])}


THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: the frontier placed by compute (retrofit/evaluation/calibrate.py): shares of the first decisions that stop
STOP_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)
#: ... and the shares at which random allocation at the same d̄ is drawn
RANDOM_AT_SHARES = (0.3, 0.5, 0.7)
#: the main job's operating point: the threshold calibrated on training rows (--calibrate_stop_share)
CALIBRATE_SHARE = 0.5
CALIBRATE_ROWS = 120


@torch.no_grad()
def first_decisions_valid(model, tok, valid, batch: int = 32) -> np.ndarray:
    """The continue probability after depth 1 at every answer step of the validation rows (this script's own
    tokenization), for placing the frontier by compute."""
    from retrofit.evaluation.frontier import continue_probabilities
    from retrofit.evaluation.models import model_info

    info = model_info(model)
    parts = []
    for _, ids, am, steps, _chunk in _batches(tok, _examples(tok, valid), batch):
        out = model(input_ids=ids, attention_mask=am, use_cache=False)
        parts.append(continue_probabilities(out, info)[..., 0][steps].double().numpy())
    return np.concatenate(parts)


def vs_random(model, tok, valid, ex, dbar, draws: int = 3, **kw) -> dict:
    """Random allocation of the answer steps at the decider's d̄ (``draws`` seeds), paired on the same rows."""
    from retrofit.model.halting.training_free import RandomContinue, continue_rate_for_mean_depth

    D = model.loop.max_depth
    q = continue_rate_for_mean_depth(min(max(dbar, 1.0), float(D)), D)
    rand = []
    for seed in range(draws):

        def pol(n, where, seed=seed):
            return RandomContinue(q, seed=1000 * seed + n, where=where)

        ex_r, toks_r = tf_eval(model, tok, valid, policy=pol, **kw)
        rand.append((ex_r, float(np.mean([t[1] for t in toks_r]))))
    b = np.mean([r[0] for r in rand], axis=0)
    diff = ex.astype(float) - b
    return {
        "rate": q,
        "decider_accuracy": float(ex.mean()),
        "decider_mean_depth": dbar,
        "random_accuracy": float(b.mean()),
        "random_mean_depth": float(np.mean([r[1] for r in rand])),
        "decider_minus_random": float(diff.mean()),
        "sign_flip_p": sign_flip_p(diff),
        "mcnemar_p_per_draw": [mcnemar_p(ex, r[0]) for r in rand],
    }


def frontier_by_compute(model, tok, valid, train, seed: int, draws: int = 3) -> dict:
    """The frontier at stop shares of the validation rows' first decisions (a description), random allocation
    at the same d̄ at ``RANDOM_AT_SHARES``, and the main job's operating point: the threshold calibrated on
    ``CALIBRATE_ROWS`` training rows at ``CALIBRATE_SHARE`` (never on validation rows), with its own random test."""
    from retrofit.evaluation.calibrate import calibrate_stop_share, threshold_for_stop_share
    from retrofit.model.flops import cost_report

    method = model.loop.method
    c1 = first_decisions_valid(model, tok, valid)
    out = {"points": [], "random": {}, "c1_quantiles": [float(x) for x in np.quantile(c1, [0, 0.1, 0.5, 0.9, 1])]}

    def point(ex, toks, **kw):
        d = np.array([t[1] for t in toks])
        fl = cost_report(model, torch.as_tensor(d))
        return {
            "accuracy": float(ex.mean()),
            "mean_depth": float(d.mean()),
            "flops": fl["flops"] / fl["n_tokens"],
            **kw,
        }

    for share in STOP_SHARES:
        tau = threshold_for_stop_share(c1, share, method)
        ex, toks = tf_eval(model, tok, valid, decider_threshold=tau)
        p = point(ex, toks, stop_share=share, threshold=tau)
        out["points"].append(p)
        if share in RANDOM_AT_SHARES:
            out["random"][str(share)] = vs_random(model, tok, valid, ex, p["mean_depth"], draws, decider_threshold=tau)
    if method in ("tah2", "anira-o"):
        rows = train.shuffle(seed=seed).select(range(min(CALIBRATE_ROWS, len(train))))
        rows = [{k: r[k] for k in ("prompt", "answer", "difficulty")} for r in rows]
        cal = calibrate_stop_share(model, tok, rows, CALIBRATE_SHARE, chat=False, progress=False)
        ex, toks = tf_eval(model, tok, valid)  # the model's own (calibrated) threshold
        p = point(ex, toks, **cal)
        p["random"] = vs_random(model, tok, valid, ex, p["mean_depth"], draws)
        out["calibrated"] = p
    return out


def frontier(model, tok, valid, draws: int = 3) -> dict:
    """The accuracy-compute frontier on the validation rows: the decider at each threshold, and random
    allocation of the answer steps at the decider's d̄ there (``draws`` seeds), paired on the same rows."""
    from retrofit.model.flops import cost_report

    D = model.loop.max_depth
    out = {"points": [], "random": []}
    for tau in THRESHOLDS:
        ex, toks = tf_eval(model, tok, valid, decider_threshold=tau)
        d = np.array([t[1] for t in toks])
        dbar = float(d.mean())
        fl = cost_report(model, torch.as_tensor(d))
        out["points"].append(
            {"threshold": tau, "accuracy": float(ex.mean()), "mean_depth": dbar, "flops": fl["flops"] / fl["n_tokens"]}
        )
        if tau != 0.5 or D == 1:
            continue
        out["random"] = {"threshold": tau, **vs_random(model, tok, valid, ex, dbar, draws)}
    return out


def sign_flip_p(diff: np.ndarray, n: int = 20000, seed: int = 0) -> float:
    """Two-sided Monte-Carlo randomization p-value of mean(diff) = 0 under sign flips of the paired rows."""
    diff = np.asarray(diff, float)
    nz = diff[diff != 0]
    if nz.size == 0:
        return 1.0
    rng = np.random.default_rng(seed)
    obs = abs(nz.sum())
    flips = rng.choice([-1.0, 1.0], size=(n, nz.size))
    return float(((np.abs(flips @ nz) >= obs - 1e-12).sum() + 1) / (n + 1))


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def mcnemar_p(x: np.ndarray, y: np.ndarray) -> float:
    b = int((x & ~y).sum())
    c = int((~x & y).sum())
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * p)


_CONTROL_CACHE: dict = {}
# the Cfg fields that determine the SFT control: configurations that agree on them share one trained control
_SFT_KEY_FIELDS = (
    "task",
    "train_levels",
    "extrap_levels",
    "n_train",
    "n_valid",
    "steps",
    "batch",
    "lr",
    "seed",
    "freeze_prelude",
    "prelude",
    "max_length",
    "lora",
    "lora_r",
    "lora_on_prelude",
    "padding_free",
)


def run(c: Cfg) -> dict:
    train, valid = splits_for(c)
    levels = np.array(valid["difficulty"])
    res = {"cfg": asdict(c), "arms": {}}
    evals = {}
    for arm in c.arms:
        key = None
        if arm == "sft":
            fields = set(_SFT_KEY_FIELDS)
            if c.lora and c.lora_on_prelude:  # adapters on every layer, base frozen: the loop split does not matter
                fields.discard("prelude")
            key = json.dumps({k: v for k, v in asdict(c).items() if k in fields}, sort_keys=True)
        if key is not None and key in _CONTROL_CACHE:
            evals[arm], res["arms"][arm] = _CONTROL_CACHE[key]
            continue
        model, tok, info = train_arm(c, arm, train)
        t0 = time.time()
        exact, toks = tf_eval(model, tok, valid)
        info["eval_s"] = round(time.time() - t0, 1)
        per_level = {int(lv): float(exact[levels == lv].mean()) for lv in sorted(set(levels.tolist()))}
        info["acc"] = per_level
        info["mean_acc"] = float(exact.mean())
        d_tok = np.array([t[1] for t in toks])
        info["dbar_answer"] = float(d_tok.mean())
        rows = np.array([t[0] for t in toks])
        dbar_row = np.array([d_tok[rows == r].mean() for r in range(len(exact))])
        info["dbar_level"] = {int(lv): float(dbar_row[levels == lv].mean()) for lv in sorted(set(levels.tolist()))}
        info["spearman_depth_level"] = spearman(dbar_row, levels)
        evals[arm] = (exact, toks)
        info["exact"] = "".join("1" if x else "0" for x in exact)
        info["tok_depth"] = "".join(str(t[1]) for t in toks)
        info["tok_nll"] = [round(t[2], 4) for t in toks]
        if arm != "sft":
            for dd in range(1, c.max_depth + 1):
                ex_d, toks_d = tf_eval(model, tok, valid, depth=dd)
                info[f"exact_d{dd}"] = "".join("1" if x else "0" for x in ex_d)
                info[f"tok_nll_d{dd}"] = [round(t[2], 4) for t in toks_d]
                info[f"acc_d{dd}"] = float(ex_d.mean())
            from retrofit.model.flops import cost_report

            info["flops_per_token"] = {
                dd: cost_report(model, torch.full((8,), dd), decider=False)["flops"] / 8
                for dd in range(1, c.max_depth + 1)
            }
        if arm == "looped" and c.method != "fixed" and c.max_depth > 1:
            t0 = time.time()
            info["frontier"] = frontier(model, tok, valid)
            info["gain_deciles"] = gain_deciles(model, tok, valid)
            info["frontier_by_compute"] = frontier_by_compute(model, tok, valid, train, c.seed)
            info["frontier_s"] = round(time.time() - t0, 1)
        res["arms"][arm] = info
        if key is not None:
            _CONTROL_CACHE[key] = (evals[arm], info)
        del model
    if "looped" in evals and "sft" in evals:
        x, y = evals["looped"][0], evals["sft"][0]
        res["looped_minus_sft"] = float(x.mean() - y.mean())
        res["mcnemar_p"] = mcnemar_p(x, y)
        d = [t[1] for t in evals["looped"][1]]
        nll_ctrl = [t[2] for t in evals["sft"][1]]
        if len(d) == len(nll_ctrl):
            res["spearman_depth_ctrl_nll"] = spearman(d, nll_ctrl)
    return res


GRIDS = {
    "probe": [Cfg(name="probe", steps=4, n_train=16, n_valid=4)],
    "default": [
        Cfg(name="sort-base"),
        Cfg(name="sort-warm120", depth_warmup=120),
    ],
}


def summarize(path: str) -> str:
    """A Markdown table of a sweep's JSON lines: one row per configuration (the looped arm against its SFT
    control; the frontier, random allocation and gain deciles where measured)."""

    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}"

    rows = [
        "| configuration | looped | SFT | diff (p) | d̄ | forced d=1 / 2 | fixed | τ sweep 0.1/0.3/0.5/0.7/0.9: acc @ d̄ "
        "| decider − random @ τ 0.5 (p) | stop share 0.1/0.3/0.5/0.7/0.9: acc @ d̄ | decider − random @ share "
        "0.3/0.5/0.7 (p) | calibrated on train (share 0.5): acc @ d̄, MFLOPs vs fixed-depth M, − random (p) "
        "| gain-decile ρ | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        arms = r["arms"]
        lo = arms.get("looped") or {}
        sft = arms.get("sft") or {}
        fx = arms.get("fixed") or {}
        fr = lo.get("frontier") or {}
        sweep = " / ".join(f"{pct(p['accuracy'])}@{p['mean_depth']:.2f}" for p in fr.get("points", []))
        rnd = fr.get("random") or {}
        rtxt = f"{100 * rnd['decider_minus_random']:+.1f} ({rnd['sign_flip_p']:.2g})" if rnd else "—"
        fc = lo.get("frontier_by_compute") or {}
        shares = " / ".join(f"{pct(p['accuracy'])}@{p['mean_depth']:.2f}" for p in fc.get("points", []))
        rs = fc.get("random") or {}
        rs_txt = " / ".join(f"{100 * v['decider_minus_random']:+.1f} ({v['sign_flip_p']:.2g})" for v in rs.values())
        cal = fc.get("calibrated")
        if cal:
            fpt = lo.get("flops_per_token") or {}
            full = fpt.get(str(r["cfg"]["max_depth"])) or fpt.get(r["cfg"]["max_depth"])
            ratio = f" = {cal['flops'] / full:.2f}×" if full else ""
            cr = cal["random"]
            cal_txt = (
                f"{pct(cal['accuracy'])}@{cal['mean_depth']:.2f}, {cal['flops'] / 1e6:.0f}{ratio}, "
                f"{100 * cr['decider_minus_random']:+.1f} ({cr['sign_flip_p']:.2g})"
            )
        else:
            cal_txt = "—"
        gd = (lo.get("gain_deciles") or {}).get("spearman")
        diff = r.get("looped_minus_sft")
        rows.append(
            f"| {r['cfg']['name']} | {pct(lo.get('mean_acc'))} | {pct(sft.get('mean_acc'))} | "
            + (f"{100 * diff:+.1f} ({r['mcnemar_p']:.2g})" if diff is not None else "—")
            + f" | {lo.get('dbar_answer', float('nan')):.2f} | {pct(lo.get('acc_d1'))} / {pct(lo.get('acc_d2'))} | "
            f"{pct(fx.get('mean_acc'))} | {sweep or '—'} | {rtxt} | {shares or '—'} | {rs_txt or '—'} | {cal_txt} | "
            f"{'—' if gd is None else f'{gd:+.2f}'} | "
            f"{lo.get('train_s', '—')} |"
        )
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="default", help=f"one of {sorted(GRIDS)} or a JSON list of Cfg overrides")
    p.add_argument("--out", default="outputs/sweep_main_job.jsonl")
    p.add_argument("--set", action="append", default=[], help="override KEY=JSON for every configuration")
    p.add_argument("--summarize", metavar="JSONL", help="print a Markdown table of a sweep's results and exit")
    a = p.parse_args(argv)
    if a.summarize:
        print(summarize(a.summarize))
        return
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    if a.grid in GRIDS:
        cfgs = GRIDS[a.grid]
    else:
        cfgs = [replace(Cfg(), **d) for d in json.loads(a.grid)]
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    cfgs = [replace(c, **{k: tuple(v) if isinstance(v, list) else v for k, v in over.items()}) for c in cfgs]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for c in cfgs:
        t0 = time.time()
        r = run(c)
        r["wall_s"] = round(time.time() - t0, 1)
        line = json.dumps(r)
        print(line, flush=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
