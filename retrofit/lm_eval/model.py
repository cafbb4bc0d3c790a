"""``RetrofitLM``: lm-eval's ``retrofit`` model — a looped checkpoint evaluated with its exit policy.

Model arguments (``--model_args key=value,...``):

* ``pretrained``: what ``retrofit.hub.loading.load_model`` takes — a checkpoint folder (looped or plain),
  a ``.gguf`` file, ``smollm2``, ``tiny-llama`` — or, from Python, a model object (then pass
  ``tokenizer``).
* ``exit_policy``: who decides each token's exit depth — ``decider`` (the model's halting method, the
  default), ``kl`` or ``state`` (training-free exits, with ``threshold``), ``depth`` (every token
  runs ``depth`` core iterations). A plain (non-looped) model takes only ``decider`` and runs at
  its one depth.
* ``threshold``, ``depth``, ``step_schedule`` (``unit`` or ``taps``): as ``retrofit generate``.
* ``batch_size`` (``auto`` = 8), ``device``, ``dtype`` (``float32`` default), ``max_length``
  (default the model's ``max_position_embeddings``), ``max_gen_toks`` (generation budget when a
  task sets none, default 256).

Requests, as ``retrofit eval`` runs them (:mod:`retrofit.evaluation`):

* Text is tokenized with the tokenizer's special tokens (``retrofit eval``'s raw prompt); with
  ``--apply_chat_template`` the templated text is tokenized without them (``retrofit eval --chat``).
* ``loglikelihood``: one full forward per batch (left padding, explicit positions, no KV cache) over
  context + continuation; the log-probabilities of the continuation tokens are summed and
  ``is_greedy`` says whether each is the argmax. ``loglikelihood_rolling`` splits a text into
  lm-eval's rolling windows of ``max_length`` tokens after the prefix token (BOS, else EOS).
* ``generate_until``: the model's own ``generate`` (depth-aware KV cache), prompts sorted by length
  and left-padded in batches as ``retrofit.evaluation.decoding.greedy_generate`` does. A row stops
  at the first token that is an end-of-sequence id or that completes one of the task's ``until``
  strings; the returned text (special tokens skipped) is cut at the first ``until`` string. With
  ``until: ["\\n"]`` this is ``retrofit eval``'s stop rule, so both give the same text before the
  newline.

Depth and compute per task (``answer_tokens``, ``all_tokens``: d̄, FLOPs per token, vs fixed and vs base) are
counted by :class:`~.depth_meter.DepthMeter` (what is counted: :mod:`.depth_meter`); they land in lm-eval's
results JSON under ``config.retrofit`` (lm-eval calls :meth:`RetrofitLM.get_model_info` after the run) and
``retrofit lm-eval`` prints them after lm-eval's table.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from retrofit.evaluation.decoding import stop_ids
from retrofit.evaluation.models import forward, model_info, pad_id, pad_left
from retrofit.evaluation.options import DEFAULT_BATCH_SIZE

from .depth_meter import DepthMeter
from .model_args import DTYPES, EXIT_POLICIES, check_batch_size, check_policy, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["EXIT_POLICIES", "DepthMeter", "RetrofitLM", "last_report"]

_LAST_REPORT: dict[str, Any] | None = None


def last_report() -> dict[str, Any] | None:
    """The depth/FLOPs report of the last :class:`RetrofitLM` whose ``get_model_info`` ran (None before)."""
    return _LAST_REPORT


class RetrofitLM(TemplateLM):
    """lm-eval model for looped (and plain) causal LMs; arguments and semantics in the module docstring."""

    backend = "causal"

    def __init__(
        self,
        pretrained: Any = None,
        tokenizer: Any = None,
        exit_policy: str | None = None,
        threshold: float | None = None,
        depth: int | None = None,
        step_schedule: str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str | None = "float32",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        **unknown,
    ):
        super().__init__()
        if unknown:
            allowed = (
                "pretrained, tokenizer, exit_policy, threshold, depth, step_schedule, batch_size, device, dtype, "
                "max_length, max_gen_toks"
            )
            raise ValueError(f"unknown retrofit model_args {sorted(unknown)}; allowed: {allowed}")
        if pretrained is None:
            raise ValueError("the retrofit model needs pretrained=DIR (a checkpoint folder, a .gguf file or smollm2)")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes device=cuda:0 unless told otherwise
            logger.warning("device=%s but CUDA is not available: running on the CPU", device)
            device = "cpu"
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is not None and dtype not in DTYPES and dtype != "auto":
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
        torch_dtype = DTYPES.get(dtype) if dtype not in (None, "auto") else None
        if isinstance(pretrained, str):
            from retrofit.hub.loading import load_model

            self.pretrained = pretrained
            model, tok = load_model(pretrained, dtype=torch_dtype)
            if tokenizer is not None:
                tok = load_tokenizer(tokenizer)
        else:
            if tokenizer is None:
                raise ValueError("pass tokenizer= with a model object as pretrained=")
            self.pretrained = type(pretrained).__name__
            model, tok = pretrained, load_tokenizer(tokenizer)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.model = model.to(dev).eval()
        self.tokenizer = tok
        self._device = dev
        self.info = model_info(self.model)
        self.exit_policy, self.threshold, self.depth = check_policy(
            self.info, f"{self.pretrained} is a plain {type(self.model).__name__}", exit_policy, threshold, depth
        )
        if step_schedule is not None:
            if not self.info.looped:
                raise ValueError(f"step_schedule= needs a looped checkpoint; {self.pretrained} is a plain model")
            from retrofit.model.schedulers import build_step_schedule

            build_step_schedule(step_schedule)  # raises with the allowed names
        self.step_schedule = step_schedule
        self.batch_size = check_batch_size(batch_size)
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2
        ):
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        self._max_length = max_length
        if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks must be a positive int, got {max_gen_toks!r}")
        self.max_gen_toks = max_gen_toks
        self.meter = DepthMeter()
        self._chat = False  # set once lm-eval applies the chat template (then text carries the specials)

    # --- arguments (checked in .model_args) --------------------------------------------------------

    def _policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the looped forward / generate for this exit policy (none for a plain model)."""
        if not self.info.looped:
            return {}
        kw: dict[str, Any] = {}
        if self.exit_policy in ("kl", "state"):
            kw.update(exit_policy=self.exit_policy, exit_threshold=self.threshold)
        elif self.exit_policy == "depth":
            kw["depth"] = self.depth
        if self.step_schedule is not None:
            kw["step_schedule"] = self.step_schedule
        return kw

    # --- lm-eval's model interface ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length is not None:
            return self._max_length
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return int(getattr(cfg, "max_position_embeddings", 2048))

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("--apply_chat_template needs a tokenizer with a chat template; this one has none")
        self._chat = True
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            # retrofit eval: raw prompts get the tokenizer's special tokens, chat-templated text already has them
            bos = self.tokenizer.bos_token
            add_special_tokens = not (self._chat or (bos and string.startswith(bos)))
        return list(self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"])

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        """Called by lm-eval after the run: the model, its exit policy and the depth/FLOPs report."""
        global _LAST_REPORT
        _LAST_REPORT = self.report()
        return {"retrofit": _LAST_REPORT}

    def report(self) -> dict[str, Any]:
        """Per task and in total: request counts and d̄ / FLOPs of answer and all tokens (module docstring)."""
        info = self.info
        readout = True if self.exit_policy == "kl" else None  # the kl exit reads out every executed depth
        out: dict[str, Any] = {
            "model": {
                "pretrained": self.pretrained,
                "class": type(self.model).__name__,
                "looped": info.looped,
                "method": info.method,
                "max_depth": info.max_depth,
                "layers": {"total": info.n_layers, "prelude": info.prelude, "core": info.core, "coda": info.coda},
                "exit_policy": self.exit_policy,
                "threshold": self.threshold,
                "depth": self.depth,
                "step_schedule": self.step_schedule,
            },
        }
        return {**out, **self.meter.report(self.model, info, readout)}

    # --- loglikelihood ----------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        new_reqs = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                ctx = [self.prefix_token_id] if self.prefix_token_id != cont[0] else cont[:1]
                cont = cont if self.prefix_token_id != cont[0] else cont[1:]
            else:
                ctx, cont = self._encode_pair(context, continuation)
            new_reqs.append(((context, continuation), ctx, cont))
        return self._loglikelihood_tokens(
            new_reqs, tasks=[r.task_name for r in requests], kind="loglikelihood", disable_tqdm=disable_tqdm
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner, tasks = [], [], []
        for i, req in enumerate(requests):
            (string,) = req.args
            tokens = self.tok_encode(string, add_special_tokens=False)
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
                tasks.append(req.task_name)
        scores = self._loglikelihood_tokens(
            windows, tasks=tasks, kind="loglikelihood_rolling", disable_tqdm=disable_tqdm, cache=False
        )
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        tasks: Sequence[str | None] | None = None,
        kind: str = "loglikelihood",
        disable_tqdm: bool = False,
        cache: bool = True,
        **kwargs,
    ) -> list[tuple[float, bool]]:
        """Sum of continuation log-probabilities and greedy flag per ``(key, context ids, continuation ids)``.

        Each sequence is ``(context + continuation)[-(max_length + 1):]``, fed without its last token;
        batches are left-padded with explicit positions (:func:`retrofit.evaluation.models.forward`).
        """
        tasks = list(tasks) if tasks is not None else [None] * len(requests)
        inputs, targets = [], []
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("a loglikelihood request has an empty continuation")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            targets.append(whole[-len(cont) :] if len(cont) < len(whole) else whole[1:])
        order = sorted(range(len(requests)), key=lambda i: (-len(inputs[i]), i))
        pad = pad_id(self.tokenizer)
        kw = self._policy_kwargs()
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for chunk in tqdm(chunks, disable=disable_tqdm, desc=f"retrofit {kind}", leave=False):
            ids, mask = pad_left([inputs[i] for i in chunk], pad, self._device)
            K = max(len(targets[i]) for i in chunk)
            out = forward(self.model, self.info, ids, mask, logits_to_keep=K, **kw)
            logp = torch.log_softmax(out.logits.float(), dim=-1)  # [B, K, V]
            T = ids.shape[1]
            for r, i in enumerate(chunk):
                tgt = torch.as_tensor(targets[i], device=logp.device)
                n = len(targets[i])
                lp = logp[r, K - n :]  # [n, V] the positions that predict the continuation
                score = float(lp.gather(-1, tgt[:, None]).sum())
                greedy = bool((lp.argmax(-1) == tgt).all())
                results[i] = (score, greedy)
                if self.info.looped:
                    d = out.depths[r].cpu().numpy()
                    self.meter.add(tasks[i], kind, d[T - n :], d[T - len(inputs[i]) :])
                else:
                    self.meter.add(tasks[i], kind, np.ones(n), np.ones(len(inputs[i])))
                if cache and requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (score, greedy))
        return results  # type: ignore[return-value]

    # --- generation -------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="retrofit generate_until", leave=False)
        for idx in groups.values():
            gen_kwargs = dict(requests[idx[0]].args[1] or {})
            texts = self._generate(
                [requests[i].args[0] for i in idx], gen_kwargs, [requests[i].task_name for i in idx], bar
            )
            for i, text in zip(idx, texts):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.close()
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate(self, contexts: list[str], gen_kwargs: dict, tasks: list[str | None], bar) -> list[str]:
        """Generate for contexts that share ``gen_kwargs``; returns the texts cut at the ``until`` strings."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        until = [s for s in kwargs.pop("until") if s]
        max_new = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        if do_sample:
            kwargs["temperature"] = temperature
        else:  # greedy, as retrofit eval decodes: no sampling settings reach generate
            kwargs.update(temperature=None, top_p=None, top_k=None)
            kwargs.pop("min_p", None)
        stops = stop_ids(self.model, self.tokenizer)
        tok = self.tokenizer

        def stopped(g: list[int]) -> bool:
            """The row's generated ids ``g`` end with an EOS id or complete an ``until`` string."""
            if g and g[-1] in stops:
                return True
            if not until:
                return False
            text = tok.decode(g, skip_special_tokens=False)
            return any(s in text for s in until)

        class _Until(StoppingCriteria):
            def __init__(self, P: int):
                self.P = P
                self.done: set[int] = set()

            def __call__(self, input_ids, scores, **kw):
                out = []
                for r, row in enumerate(input_ids[:, self.P :].tolist()):
                    if r not in self.done and stopped(row):
                        self.done.add(r)
                    out.append(r in self.done)
                return torch.tensor(out, dtype=torch.bool, device=input_ids.device)

        prompts = [self.tok_encode(c) for c in contexts]
        room = max(1, self.max_length - max_new)
        prompts = [p[-room:] for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))  # as greedy_generate
        pad = pad_id(tok)
        kw = self._policy_kwargs()
        texts: list[str | None] = [None] * len(prompts)
        for s in range(0, len(order), self.batch_size):
            chunk = order[s : s + self.batch_size]
            ids, mask = pad_left([prompts[i] for i in chunk], pad, self._device)
            P = ids.shape[1]
            extra: dict[str, Any] = {}
            cache = None
            if self.info.looped:
                from retrofit.model.cache import DepthKVCache

                cache = DepthKVCache(self.model.config)
                extra = {"cache": cache, **kw}
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=do_sample,
                num_beams=1,
                pad_token_id=pad,
                eos_token_id=sorted(stops) if stops else None,
                stopping_criteria=StoppingCriteriaList([_Until(P)]),
                return_dict_in_generate=True,
                **kwargs,
                **extra,
            )
            for r, i in enumerate(chunk):
                g: list[int] = []
                for t in out.sequences[r, P:].tolist():
                    g.append(int(t))
                    if stopped(g):
                        break
                n_prompt = len(prompts[i])
                if self.info.looped:
                    d = cache.token_depths[r].cpu().numpy()
                    # position P - 1 + j produced generated token j; the prompt occupies [P - n_prompt, P)
                    self.meter.add(
                        tasks[i], "generate_until", d[P - 1 : P - 1 + len(g)], d[P - n_prompt : P - 1 + len(g)]
                    )
                else:
                    self.meter.add(tasks[i], "generate_until", np.ones(len(g)), np.ones(n_prompt - 1 + len(g)))
                texts[i] = postprocess_generated_text(tok.decode(g, skip_special_tokens=True), until, None)
            bar.update(len(chunk))
        return texts  # type: ignore[return-value]
